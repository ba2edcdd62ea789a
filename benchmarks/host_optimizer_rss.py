"""Peak RSS and step time of a bf16 model offloaded to host memory, stepped by HostOptimizer.

A bf16 MLP (``--blocks`` x ``nn.Linear(2048, 2048)`` + GELU, 24 blocks: 100.7M parameters)
offloaded with ``hr.offload(model, device="cpu", store="cpu")`` and trained by
``hr.HostOptimizer(model.parameters(), torch.optim.AdamW, overlap=True)`` (fp32 masters and
state in host memory, no disk anywhere), 4 micro-batches per step, the last one inside
``opt.final_backward()``. Each run is a fresh child process that reports

- ``fixed``: its RSS after importing torch and headroom;
- ``peak_rss``: the kernel's peak RSS of the whole process (VmHWM) after each step;
- ``step_s``: wall time of each iteration (4 micro-batches and ``step()``).

Trees compare in one run: ``--compare REF`` (repeatable) extracts ``git archive REF src`` into a
temporary directory (with this tree's compiled extensions) and runs the same child there, runs
of the trees alternating. The working tree is always measured as ``this``.

    .venv/bin/python benchmarks/host_optimizer_rss.py --compare 6e1bf0b^1 --compare 6e1bf0b
    .venv/bin/python benchmarks/host_optimizer_rss.py --blocks 4 --steps 2     # quick

Results: ``benchmarks/results/host_optimizer_rss.json``. Peak RSS is a property of the code and
barely moves between runs; times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "host_optimizer_rss.json"

CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

import torch
import headroom as hr
torch.set_num_threads(int(sys.argv[4]))
blocks, steps, accum = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
fixed = status("VmRSS")
torch.manual_seed(0)
layers = []
for _ in range(blocks):
    layers += [torch.nn.Linear(2048, 2048), torch.nn.GELU()]
model = torch.nn.Sequential(*layers).to(torch.bfloat16)
hr.offload(model, device="cpu", store="cpu")
opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, overlap=True, lr=1e-4)
n_params = sum(p.numel() for p in model.parameters())
g = torch.Generator().manual_seed(0)
xs = [torch.randn(16, 2048, generator=g).to(torch.bfloat16) for _ in range(accum)]
setup = status("VmRSS")
peaks, times = [], []
for s in range(steps):
    t0 = time.perf_counter()
    for m, x in enumerate(xs):
        with opt.final_backward(m == accum - 1):
            (model(x).float().pow(2).mean() / accum).backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
    peaks.append(status("VmHWM"))
check = float(sum(p.float().sum() for p in model.parameters()))
print(json.dumps({"fixed": fixed, "after_setup": setup, "peak_rss": peaks, "step_s": times,
                  "end_rss": status("VmRSS"), "n_params": n_params, "checksum": check}))
"""


def _tree(ref: str, into: Path) -> Path:
    """``git archive ref src`` under ``into``, with this tree's compiled extensions."""
    dest = into / ref.replace("/", "_").replace("^", "_parent").replace("~", "_back")
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for so in (ROOT / "src").rglob("*.so"):
        target = dest / so.relative_to(ROOT)
        if target.parent.exists() and not target.exists():
            shutil.copy2(so, target)
    return dest / "src"


def _run(src: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(args.blocks), str(args.steps), str(args.accum),
         str(args.threads)],
        env=env, capture_output=True, text=True, timeout=3600, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"child on {src} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--compare", action="append", default=[], metavar="REF",
                    help="also measure this git revision (repeatable)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    mib = 1 << 20
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="hr-rss-trees-") as tmp:
        trees = {"this": ROOT / "src"}
        for ref in args.compare:
            trees[ref] = _tree(ref, Path(tmp))
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for rep in range(args.repeats):
            names = list(trees)
            names = names[rep % len(names):] + names[:rep % len(names)]  # rotate the order
            for name in names:
                r = _run(trees[name], args)
                runs[name].append(r)
                print(f"{name:>12}: peak RSS {r['peak_rss'][-1] / mib:7.0f} MiB (fixed "
                      f"{r['fixed'] / mib:.0f}), steps "
                      + ", ".join(f"{t:.2f}" for t in r["step_s"]) + " s", flush=True)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {
            "peak_rss_mib": statistics.median(r["peak_rss"][-1] for r in rs) / mib,
            "peak_rss_after_step_mib": [p / mib for p in rs[0]["peak_rss"]],
            "fixed_mib": statistics.median(r["fixed"] for r in rs) / mib,
            # the first step creates the state; later steps are the steady state
            "median_step_s": statistics.median(t for r in rs for t in r["step_s"][1:])
            if args.steps > 1 else None,
            "checksum": rs[0]["checksum"],
        }
    if args.compare:
        base = summary["this"]["peak_rss_mib"]
        for name in args.compare:
            summary[name]["this_minus_it_mib"] = base - summary[name]["peak_rss_mib"]
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_start": load_start},
        "config": {"blocks": args.blocks, "steps": args.steps, "accum": args.accum,
                   "threads": args.threads, "batch": 16, "width": 2048, "dtype": "bfloat16",
                   "n_params": next(iter(runs.values()))[0]["n_params"]},
        "summary": summary,
        "runs": runs,
    }
    out["machine"]["load_avg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
