"""Step time of ``hr.convert`` against plain PyTorch when each runs in a process of its own.

``selective_layers.py`` times every variant in one process, where they share one heap. A user
trains one model per process, and there glibc's ``malloc`` decides, from what the process keeps,
whether to give the top of its heap back to the OS after each step (its trim threshold grows
with the largest freed ``mmap`` chunk): memory given back is faulted in again, zeroed by the
kernel, at the next step. A converted model keeps less, so it can hit that more often. This
script runs plain and converted, each in a fresh process, alternating, for the cases given, with
glibc's defaults and with its thresholds fixed (``MALLOC_MMAP_THRESHOLD_=64 MiB``,
``MALLOC_TRIM_THRESHOLD_=256 MiB``: the heap keeps what it had), and reports per case the median
of the per-round ratios of process CPU time per step and the minor page faults per step.

    .venv/bin/python benchmarks/convert_fresh_process.py

Writes ``benchmarks/results/convert_fresh_process.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
FIXED_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}

CHILD = r"""
import copy, json, resource, statistics, sys, time
import torch
import headroom as hr
sys.path.insert(0, sys.argv[5])
from tests.nn._zoo import densenet_like, mobilenet_v2_like, resnet_like, set_case

name, case, variant, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
torch.manual_seed(0)
build, size = {"resnet_like": (resnet_like, 128),
               "densenet_like": (lambda: densenet_like(12, blocks=(4, 4, 4)), 64),
               "mobilenet_v2_like": (lambda: mobilenet_v2_like(16), 96)}[name]
model = build()
if variant == "headroom":
    model = hr.convert(model)
set_case(model, case)
x = torch.randn(8, 3, size, size).requires_grad_(case == "input")

def step():
    model(x).float().sum().backward()
    model.zero_grad(set_to_none=True)

for _ in range(3):
    step()
cpu, faults = [], []
for _ in range(steps):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = time.process_time()
    step()
    cpu.append(time.process_time() - c0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"cpu_s": statistics.median(cpu), "faults": statistics.median(faults)}))
"""


def run(name: str, case: str, variant: str, steps: int, fixed: bool) -> dict:
    env = dict(os.environ)
    for k in FIXED_HEAP:
        env.pop(k, None)
    if fixed:
        env.update(FIXED_HEAP)
    out = subprocess.run([sys.executable, "-c", CHILD, name, case, variant, str(steps),
                          str(ROOT)], capture_output=True, text=True, env=env, check=False,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="resnet_like:input,densenet_like:input,densenet_like:norm",
                    help="comma-separated model:case pairs")
    ap.add_argument("--rounds", type=int, default=5, help="process pairs per case and heap")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per process")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/convert_fresh_process.json"))
    args = ap.parse_args()
    results = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
               "machine": platform.processor() or platform.machine(), "threads": 1,
               "batch": 8, "fixed_heap_env": FIXED_HEAP, "cases": {}}
    print("| model | case | heap | CPU time, headroom / torch (paired median) | "
          "faults per step: torch / headroom |")
    print("|---|---|---|---:|---:|")
    for pair in args.cases.split(","):
        name, case = pair.split(":")
        row = {}
        for fixed in (False, True):
            runs = {"torch": [], "headroom": []}
            for r in range(args.rounds):
                order = ("torch", "headroom") if r % 2 == 0 else ("headroom", "torch")
                for variant in order:
                    runs[variant].append(run(name, case, variant, args.steps, fixed))
            ratios = [h["cpu_s"] / t["cpu_s"] for h, t in zip(runs["headroom"], runs["torch"],
                                                               strict=True)]
            heap = "fixed" if fixed else "default"
            row[heap] = {
                "runs": runs,
                "ratio_paired_median": statistics.median(ratios),
                "ratios": ratios,
                "faults_median": {v: statistics.median(x["faults"] for x in runs[v])
                                  for v in runs},
            }
            f = row[heap]["faults_median"]
            print(f"| {name} | {case} | {heap} | {row[heap]['ratio_paired_median']:.3f}x "
                  f"({min(ratios):.3f}-{max(ratios):.3f}) | {f['torch']:.0f} / "
                  f"{f['headroom']:.0f} |", flush=True)
        results["cases"][pair] = row
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
