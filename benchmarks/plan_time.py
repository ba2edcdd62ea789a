"""Claim: hr.plan's step-time model ranks plans as measured steps on this CPU do, within a factor.

Side by side in one run: for each combination hr.plan considers on ``cpu`` with ``disk=``, the
step time the planner estimates (FLOPs over this CPU's measured matmul speed, transfers over
the declared disk bandwidth) and the median measured time of steps with the plan applied, with
the measured peak (hr.track_memory) against the estimated one.

    python benchmarks/plan_time.py [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import headroom as hr
from headroom.planner import plan
from headroom.planner._plan import Plan

RESULTS = Path(__file__).parent / "results" / "plan_time.json"


def make():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
                           for _ in range(6)], nn.Linear(512, 8))


X = torch.randn(256, 512)


def loss_fn(out):
    return out.square().mean()


def run(model, opt, steps):
    def step():
        loss_fn(model(X)).backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times), mem.peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    a = parser.parse_args()
    warnings.simplefilter("ignore")
    tmp = tempfile.mkdtemp()
    p = plan(make(), (X,), loss_fn=loss_fn, budget="64GiB", device="cpu",
             optimizer=torch.optim.AdamW, disk=tmp)
    rows = []
    for i, (choice, peak, t_est) in enumerate(p.candidates):
        one = Plan(choice, peak, t_est, p.plain_peak, p.plain_time_s, p.budget, p.device,
                   p.optimizer, p.optimizer_kwargs, f"{tmp}/{i}", p.slice_bytes)
        model, opt = one.apply(make())
        t_meas, peak_meas = run(model, opt, a.steps)
        row = {"plan": "; ".join(choice.describe()), "estimated_s": round(t_est, 4),
               "measured_median_s": round(t_meas, 4), "ratio": round(t_meas / t_est, 2),
               "estimated_peak": peak, "measured_peak": peak_meas}
        rows.append(row)
        print(json.dumps(row))
    est_order = [r["plan"] for r in sorted(rows, key=lambda r: r["estimated_s"])]
    meas_order = [r["plan"] for r in sorted(rows, key=lambda r: r["measured_median_s"])]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "claim": "the planner's step-time model against measured step times on this CPU",
        "command": f"python benchmarks/plan_time.py --steps {a.steps}",
        "torch": torch.__version__, "machine": platform.machine(),
        "threads": torch.get_num_threads(), "rows": rows,
        "fastest_estimated": est_order[0], "fastest_measured": meas_order[0],
        "peaks_within_estimate": all(r["measured_peak"] <= r["estimated_peak"] for r in rows),
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
