"""Activation offload to a DiskStore on the CPU: peak RSS and step time against plain PyTorch and
against checkpointing, on a transformer whose saved activations are most of its training memory.

Pre-norm transformer blocks (``--layers`` x d=512, 8 heads, SDPA attention, 4x MLP) on a
``[4, 512, 512]`` batch; a step is forward, backward and an SGD step. Variants, each run in a
fresh process and interleaved run by run:

- ``plain``: PyTorch as is;
- ``checkpoint``: every block under non-reentrant ``torch.utils.checkpoint``;
- ``offload``: ``hr.offload_activations(store=hr.DiskStore(tmp), prefetch=64 MiB)`` around
  forward and backward;
- ``ckpt+offload``: both (only the blocks' inputs are saved, and they go to disk);
- ``offload-keep``: ``offload`` with ``HEADROOM_TRIM_HEAP=0``: the same transfers, but freed
  host memory is not given back to the OS (no ``madvise``, no heap trim). It saves little
  resident memory; its time against ``offload`` is what giving the pages back costs, and its
  time against plain what the stash itself (I/O threads, bookkeeping) costs.

Each child reports its peak RSS over the steps above its RSS before the model existed (VmHWM,
reset when the steps start), the median step time and the forward/backward split, and (offload)
the bytes written to the store per step. The parent also measures the store's bandwidth (write
and read of 256 MiB through a DiskStore) and compares the offloaded step with what overlap can
at best give: ``max(forward, bytes / write bandwidth) + max(backward, bytes / read bandwidth)``
with plain's forward and backward times from the same repeat.

Times of processes run one after the other swing with the load of a shared machine, so the
times are also measured in one process (``--rounds``): the four variants interleaved step by
step, each round in a rotated order, reported as the median of per-round ratios to plain (wall
and CPU time), and the offloaded step against the overlap bound of the same round's plain step.

    .venv/bin/python benchmarks/activation_offload.py             # ~7 min on 2 cores
    .venv/bin/python benchmarks/activation_offload.py --quick     # 1 repeat, 3 steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "activation_offload.json"
VARIANTS = ("plain", "checkpoint", "offload", "ckpt+offload", "offload-keep")

PRELUDE = r"""
import json, os, statistics, sys, time, warnings
warnings.simplefilter("ignore")

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
import headroom as hr
torch.set_num_threads(int(__import__("os").environ["BENCH_THREADS"]))
variant, layers, steps, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
prefetch = int(sys.argv[5])
fixed = rss("VmRSS")

class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

torch.manual_seed(0)
blocks = nn.ModuleList(Block(512, 8) for _ in range(layers))
opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
x = torch.randn(4, 512, 512)
store = hr.DiskStore(root) if "offload" in variant or variant == "paired" else None

ckpt = variant in ("checkpoint", "ckpt+offload")

def forward():
    h = x
    for b in blocks:
        h = checkpoint(b, h, use_reentrant=False) if ckpt else b(h)
    return h.square().mean()

def step():
    t0 = time.perf_counter()
    loss = forward()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, time.perf_counter() - t0

"""

CHILD = PRELUDE + r"""
open("/proc/self/clear_refs", "w").write("5")
times, written = [], []
for i in range(steps):
    w0 = store.stats()["bytes_written"] if store is not None else 0
    if store is not None:
        with hr.offload_activations(store=store, prefetch=prefetch):
            times.append(step())
    else:
        times.append(step())
    if store is not None:
        written.append(store.stats()["bytes_written"] - w0)
peak = rss("VmHWM")
later = times[1:] or times
print(json.dumps({
    "fixed": fixed, "peak_rss": peak, "above_fixed": peak - fixed,
    "first_step_s": times[0][2],
    "step_s": statistics.median(t[2] for t in later),
    "forward_s": statistics.median(t[0] for t in later),
    "backward_s": statistics.median(t[1] for t in later),
    "bytes_offloaded": statistics.median(written) if written else 0,
    "params": sum(p.numel() * 4 for p in blocks.parameters()),
}))
"""

# All four variants in one process, interleaved step by step (a rotated order each round):
# per-round ratios to plain cancel the load of a shared machine, which separate processes run
# minutes apart do not.
PAIRED = PRELUDE + r"""
def run(v):
    global ckpt
    ckpt = v in ("checkpoint", "ckpt+offload")
    # Read at every give-back, so it can change between steps of one process.
    os.environ["HEADROOM_TRIM_HEAP"] = "0" if v == "offload-keep" else "1"
    c0 = time.process_time()
    if "offload" in v:
        with hr.offload_activations(store=store, prefetch=prefetch):
            f, b, w = step()
    else:
        f, b, w = step()
    return {"step_s": w, "forward_s": f, "backward_s": b, "cpu_s": time.process_time() - c0}

names = ("plain", "checkpoint", "offload", "ckpt+offload", "offload-keep")
for v in names:  # one untimed step each
    run(v)
rounds = {v: [] for v in names}
for i in range(steps):
    k = i % len(names)
    for v in names[k:] + names[:k]:
        w0 = store.stats()["bytes_written"]
        rounds[v].append(run(v) | {"bytes_offloaded": store.stats()["bytes_written"] - w0})
print(json.dumps(rounds))
"""

BANDWIDTH = r"""
import json, sys, time, torch
import headroom as hr
s = hr.DiskStore(sys.argv[1])
t = torch.randn(64 << 20)  # 256 MiB
h = s.alloc("x", t.shape, t.dtype, zero=False)
s.write(h, t).result()  # files exist, as for a stash after its first step
w, r = [], []
for _ in range(3):
    t0 = time.perf_counter(); s.write(h, t).result(); w.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); s.read(h, out=t).result(); r.append(time.perf_counter() - t0)
print(json.dumps({"write_Bps": t.nbytes / min(w), "read_Bps": t.nbytes / min(r)}))
"""


THREADS = 2  # intra-op threads of the compute (--threads)


def _child(code: str, *args: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), BENCH_THREADS=str(THREADS),
               **(env_extra or {}))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env=env, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2,
                    help="intra-op threads of the compute (the store's threads come on top)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=64 << 20,
                    help="offload_activations' prefetch window in bytes (default 64 MiB)")
    ap.add_argument("--rounds", type=int, default=9,
                    help="rounds of the in-process interleaved timing (default 9)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    global THREADS
    THREADS = args.threads
    if args.quick:
        args.repeats, args.steps, args.rounds = 1, 3, 2
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    bandwidth = []
    bounds = []
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=os.environ.get("HEADROOM_BENCH_DIR")) as tmp:
            bandwidth.append(_child(BANDWIDTH, str(Path(tmp) / "bw")))
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            rep_res = {}
            for v in order:
                rep_res[v] = res = _child(
                    CHILD, v, str(args.layers), str(args.steps),
                    str(Path(tmp) / v.replace("+", "_")), str(args.prefetch),
                    env_extra={"HEADROOM_TRIM_HEAP": "0" if v == "offload-keep" else "1"})
                runs[v].append(res)
                print(f"repeat {rep} {v:13s} peak RSS above start {res['above_fixed'] / 2**20:7.0f}"
                      f" MiB  step {res['step_s']:.3f} s (fwd {res['forward_s']:.3f}, bwd"
                      f" {res['backward_s']:.3f})  offloaded {res['bytes_offloaded'] / 2**20:.0f}"
                      " MiB", flush=True)
            bw = bandwidth[-1]
            n = rep_res["offload"]["bytes_offloaded"]
            p = rep_res["plain"]
            best = max(p["forward_s"], n / bw["write_Bps"]) + max(p["backward_s"],
                                                                  n / bw["read_Bps"])
            bounds.append({"bound_s": best, "ratio": rep_res["offload"]["step_s"] / best,
                           "vs_plain": rep_res["offload"]["step_s"] / p["step_s"],
                           "keep_ratio": rep_res["offload-keep"]["step_s"] / best})

    def med(v, k):
        return statistics.median(r[k] for r in runs[v])

    summary = {}
    for v in VARIANTS:
        summary[v] = {
            "peak_rss_above_start": med(v, "above_fixed"),
            "step_s": med(v, "step_s"),
            "first_step_s": med(v, "first_step_s"),
            "forward_s": med(v, "forward_s"),
            "backward_s": med(v, "backward_s"),
            "bytes_offloaded": med(v, "bytes_offloaded"),
            "rss_vs_plain": statistics.median(
                a["above_fixed"] / b["above_fixed"]
                for a, b in zip(runs[v], runs["plain"], strict=True)),
            "time_vs_plain": statistics.median(
                a["step_s"] / b["step_s"] for a, b in zip(runs[v], runs["plain"], strict=True)),
        }
    summary["offload"]["vs_overlap_bound"] = statistics.median(b["ratio"] for b in bounds)
    summary["offload-keep"]["vs_overlap_bound"] = statistics.median(
        b["keep_ratio"] for b in bounds)
    with tempfile.TemporaryDirectory(dir=os.environ.get("HEADROOM_BENCH_DIR")) as tmp:
        paired_bw = _child(BANDWIDTH, str(Path(tmp) / "bw"))
        paired = _child(PAIRED, "paired", str(args.layers), str(args.rounds),
                        str(Path(tmp) / "paired"), str(args.prefetch))
    plain = paired["plain"]
    paired_summary = {}
    for v in VARIANTS:
        paired_summary[v] = {
            k: statistics.median(a[k] / b[k] for a, b in zip(paired[v], plain, strict=True))
            for k in ("step_s", "cpu_s")}
    paired_bounds = [
        max(p["forward_s"], o["bytes_offloaded"] / paired_bw["write_Bps"])
        + max(p["backward_s"], o["bytes_offloaded"] / paired_bw["read_Bps"])
        for p, o in zip(plain, paired["offload"], strict=True)]
    for v in ("offload", "offload-keep"):
        paired_summary[v]["vs_overlap_bound"] = statistics.median(
            o["step_s"] / b for o, b in zip(paired[v], paired_bounds, strict=True))
    print()
    print(f"{'variant':14s}{'peak RSS above start':>22s}{'x plain':>9s}{'step s':>9s}"
          f"{'x plain':>9s}")
    for v in VARIANTS:
        s = summary[v]
        print(f"{v:14s}{s['peak_rss_above_start'] / 2**20:18.0f} MiB{s['rss_vs_plain']:9.2f}"
              f"{s['step_s']:9.3f}{s['time_vs_plain']:9.2f}")
    bw = {k: statistics.median(b[k] for b in bandwidth) for k in ("write_Bps", "read_Bps")}
    print(f"store bandwidth: write {bw['write_Bps'] / 1e9:.2f} GB/s, read"
          f" {bw['read_Bps'] / 1e9:.2f} GB/s; offloaded step / overlap bound ="
          f" {summary['offload']['vs_overlap_bound']:.2f} (median of {len(bounds)}); pages"
          f" kept: {summary['offload-keep']['vs_overlap_bound']:.2f}")
    print(f"in one process, interleaved ({args.rounds} rounds; median of per-round ratios to"
          " plain, wall / CPU):")
    for v in VARIANTS[1:]:
        ps = paired_summary[v]
        print(f"  {v:14s}{ps['step_s']:7.3f} / {ps['cpu_s']:.3f}")
    print(f"  offloaded step / overlap bound = {paired_summary['offload']['vs_overlap_bound']:.3f}"
          f" (target <= 1.15); pages kept:"
          f" {paired_summary['offload-keep']['vs_overlap_bound']:.3f}")
    args.out.parent.mkdir(exist_ok=True, parents=True)
    args.out.write_text(json.dumps({
        "command": "benchmarks/activation_offload.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "layers": args.layers, "threads": args.threads, "prefetch": args.prefetch,
        "steps": args.steps, "repeats": args.repeats,
        "store_bandwidth": bw, "summary": summary, "bounds": bounds, "runs": runs,
        "paired": {"rounds": args.rounds, "store_bandwidth": paired_bw,
                   "summary": paired_summary, "bounds_s": paired_bounds, "steps": paired},
        "load_average_after": os.getloadavg(),
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
