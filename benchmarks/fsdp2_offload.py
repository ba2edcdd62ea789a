"""Sharded training state per rank: FSDP2 + headroom against hr.data_parallel and FSDP2's own
``CPUOffloadPolicy``, on CPU with gloo (2 and 4 ranks).

One model (a stack of MLP blocks and a head), AdamW, the same batches. Three setups, each in a
fresh set of processes (so that RSS is the setup's own):

1. ``data_parallel``: ``hr.offload(model, store="cpu")`` + ``hr.data_parallel`` +
   ``hr.HostOptimizer``: every rank holds the whole model, its gradients and optimizer state.
2. ``fsdp2_cpu_offload``: ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` +
   ``torch.optim.AdamW``: each rank holds its shards in host memory.
3. ``fsdp2_headroom``: ``fully_shard`` then ``hr.offload(model, store="cpu")`` +
   ``hr.HostOptimizer``: each rank's shards rest in its headroom store.
4. ``fsdp2_headroom_disk``: the same with ``store=hr.DiskStore(...)`` and
   ``HostOptimizer(state_store=hr.DiskStore(...))`` (a folder of each per rank, in a temporary
   directory): each rank's shards and optimizer state rest in files; "store" is then the bytes
   in its files (with the optimizer's spare state and undo copies), and the training state in
   host memory counts the shards read at the time (none between steps) and the gradients. The
   files' pages in the OS page cache are not the process's memory (not in its RSS).

Per rank: bytes in headroom's stores (parameters and gradients of an offloaded model; shards of
a sharded one), the training state it holds (parameters, gradients, optimizer state: bytes of
the local tensors), the growth of the process's resident memory over a few training steps
(peak RSS after the steps minus RSS before the model was built, ``VmHWM`` reset with
``/proc/self/clear_refs``; and the RSS left after the C allocator gave its free memory back,
which is what stays live), and the median step time. On a CPU the "device" is the host, so the
setups keep the same bytes in different places; what this measures is how much each rank holds,
not speed (the step times are from a shared 2-core machine).

    .venv/bin/python benchmarks/fsdp2_offload.py                 # 2 and 4 ranks (~2 min)
    .venv/bin/python benchmarks/fsdp2_offload.py --quick         # a smoke test
    .venv/bin/python benchmarks/fsdp2_offload.py --setups fsdp2_headroom_disk --merge
                                           # one setup, its rows replaced in the results JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results" / "fsdp2_offload.json"
SETUPS = ("data_parallel", "fsdp2_cpu_offload", "fsdp2_headroom", "fsdp2_headroom_disk")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x)


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                got[k] = int(v.split()[0]) * 1024
    return got["VmRSS"], got["VmHWM"]


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:  # pragma: no cover - not Linux
        pass


def _tensor_bytes(ts) -> int:
    n = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            n += t.numel() * t.element_size()
    return n


def _build(setup: str, cfg: dict, rank: int, *, steps: int, tmp: str = ""):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import headroom as hr
    from headroom.residency import state_of
    from headroom.residency._dtensor import sharded_state_of

    torch.manual_seed(0)
    model = Net(cfg["d"], cfg["n"])
    kw = dict(lr=1e-4, weight_decay=0.1)
    if setup == "data_parallel":
        hr.offload(model, device="cpu", store="cpu")
        fwd = hr.data_parallel(model)
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **kw)
        store = state_of(model).store
    else:
        pol = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) \
            if setup == "fsdp2_cpu_offload" else {}
        for b in model.layers:
            fully_shard(b, **pol)
        fully_shard(model, **pol)
        store = None
        if setup == "fsdp2_headroom":
            hr.offload(model, device="cpu", store="cpu")
            store = sharded_state_of(model).store
            opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **kw)
        elif setup == "fsdp2_headroom_disk":
            hr.offload(model, device="cpu", store=hr.DiskStore(os.path.join(tmp, "shards")))
            store = sharded_state_of(model).store
            opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW,
                                   state_store=hr.DiskStore(os.path.join(tmp, "state")), **kw)
        else:
            opt = torch.optim.AdamW(model.parameters(), **kw)
        fwd = model
    times = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(cfg["batch"], cfg["d"], generator=g)
        y = torch.randint(0, 16, (cfg["batch"],), generator=g)
        t0 = time.perf_counter()
        F.cross_entropy(fwd(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as between steps
        times.append(time.perf_counter() - t0)
    return model, fwd, opt, store, times


def _run(rank: int, world: int, port: int, setup: str, cfg: dict, out) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    # A tiny model through the same setup first: what the first step imports and allocates
    # once (DTensor dispatch, gloo buffers) is not counted as training state.
    import tempfile

    tmp = tempfile.mkdtemp(prefix=f"fsdp2-offload-r{rank}-")
    _build(setup, dict(cfg, d=16, n=1), rank, steps=2, tmp=os.path.join(tmp, "warm"))
    _reset_peak()
    rss0, _ = _rss()
    model, fwd, opt, store, times = _build(setup, cfg, rank, steps=cfg["steps"],
                                           tmp=os.path.join(tmp, "run"))
    store_bytes = store.used_bytes if store is not None else 0
    params = list(model.parameters())
    disk = None
    if setup == "fsdp2_headroom_disk":
        from headroom.residency._dtensor import sharded_state_of

        disk = sharded_state_of(model).disk
        store_bytes += opt.options.state_store.used_bytes
    rss1, peak = _rss()
    from headroom.store import trim_heap

    trim_heap()  # freed memory the C allocator kept: what remains is live
    rss2, _ = _rss()
    res = {
        "rank": rank,
        "store_bytes": store_bytes,
        # on disk: the shards held in host memory now (none between steps), and the most
        # held at once during the steps
        "parameters": disk.resident_bytes if disk is not None else _tensor_bytes(params),
        "peak_resident_shards": disk.peak_resident_bytes if disk is not None else None,
        "gradients": _tensor_bytes(p.grad for p in params),
        "optimizer_state": _tensor_bytes(v for s in opt.state.values() for v in s.values()),
        "rss_growth": rss1 - rss0,
        "peak_rss_growth": peak - rss0,
        "rss_growth_after_trim": rss2 - rss0,
        "step_s_median": statistics.median(times[1:]) if len(times) > 1 else times[0],
    }
    res["training_state"] = res["parameters"] + res["gradients"] + res["optimizer_state"]
    out.put(res)
    dist.barrier()
    dist.destroy_process_group()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, setup: str, cfg: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_run, args=(r, world, port, setup, cfg, out))
             for r in range(world)]
    for p in procs:
        p.start()
    res = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"{setup} world {world}: a rank exited with {p.exitcode}")
    return sorted(res, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other setups' rows of the results JSON (same config)")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    cfg = dict(d=a.d, n=a.n, batch=a.batch, steps=a.steps)
    if a.quick:
        cfg.update(d=64, n=2, steps=2)
    model_params = sum(p.numel() for p in Net(cfg["d"], cfg["n"]).parameters())
    runs = []
    for world in [int(w) for w in a.worlds.split(",")]:
        for setup in a.setups.split(","):
            ranks = run(world, setup, cfg)
            runs.append({"world": world, "setup": setup, "ranks": ranks})
            mean = {k: statistics.mean(r[k] for r in ranks)
                    for k in ("store_bytes", "training_state", "peak_rss_growth",
                              "rss_growth_after_trim", "step_s_median")}
            print(f"world {world} {setup:<18} store {mean['store_bytes'] / 2**20:8.1f} MiB"
                  f"  state {mean['training_state'] / 2**20:8.1f} MiB"
                  f"  peak RSS growth {mean['peak_rss_growth'] / 2**20:8.1f} MiB"
                  f"  after trim {mean['rss_growth_after_trim'] / 2**20:8.1f} MiB"
                  f"  step {mean['step_s_median'] * 1e3:7.1f} ms", flush=True)
    full_state = model_params * 4 * 4  # fp32 parameters, gradients, two AdamW moments
    summary = []
    for r in runs:
        ranks = r["ranks"]
        summary.append({
            "world": r["world"], "setup": r["setup"],
            "store_MiB_per_rank": round(statistics.mean(x["store_bytes"] for x in ranks)
                                        / 2**20, 2),
            "training_state_fraction_of_replica": round(
                statistics.mean(x["training_state"] for x in ranks) / full_state, 4),
            "peak_rss_growth_MiB_per_rank": round(
                statistics.mean(x["peak_rss_growth"] for x in ranks) / 2**20, 1),
            "rss_growth_after_trim_MiB_per_rank": round(
                statistics.mean(x["rss_growth_after_trim"] for x in ranks) / 2**20, 1),
            "step_ms_median": round(statistics.median(x["step_s_median"] for x in ranks)
                                    * 1e3, 1),
        })
        if ranks[0].get("peak_resident_shards") is not None:
            summary[-1]["peak_resident_shards_MiB_per_rank"] = round(
                statistics.mean(x["peak_resident_shards"] for x in ranks) / 2**20, 2)
    doc = {
        "command": "benchmarks/fsdp2_offload.py " + " ".join(
            f"--{k}" if v is True else f"--{k} {v}" for k, v in vars(a).items()
            if k not in ("out", "quick") and v is not False
            and not (k == "setups" and v == ",".join(SETUPS))),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "config": cfg, "model_parameters": model_params,
        "full_replica_training_state_bytes": full_state,
        "runs": runs, "summary": summary,
    }
    if a.merge and Path(a.out).exists():
        old = json.loads(Path(a.out).read_text())
        if old["config"] != cfg:
            raise SystemExit(f"--merge: {a.out} has config {old['config']}, not {cfg}")
        new = {(r["world"], r["setup"]) for r in runs}
        order = {s: i for i, s in enumerate(SETUPS)}

        def merged(key: str, mine: list) -> list:
            rows = [r for r in old[key] if (r["world"], r["setup"]) not in new] + mine
            return sorted(rows, key=lambda r: (r["world"], order.get(r["setup"], 99)))

        old["runs"], old["summary"] = merged("runs", runs), merged("summary", summary)
        old.setdefault("merged_commands", []).append(doc["command"])
        doc = old
    if not a.quick:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.out}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
