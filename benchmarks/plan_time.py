"""Claim: hr.plan's step-time model, calibrated on this CPU, predicts measured step times.

For every combination hr.plan considers on ``cpu`` with ``disk=`` (hr.convert, checkpointing of
the first k blocks, activation offload, parameter offload, optimizer state on disk), side by
side in one run: the step time the planner estimates (the dry run's ops priced at this machine's
measured speeds, plus transfers at the measured disk bandwidths) and the median measured time of
``--steps`` steps with the plan applied; the estimated peak (the dry run of the whole plan)
against hr.track_memory's measured one. The speeds are measured at the start
(``measure_speeds(refresh=True)``) and recorded.

    python benchmarks/plan_time.py [--steps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

import headroom as hr
from headroom.planner import measure_speeds
from headroom.planner._plan import Search

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
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp()
    t0 = time.perf_counter()
    speeds = measure_speeds(tmp, refresh=True)
    calibration_s = time.perf_counter() - t0
    print(speeds.describe(), f"({calibration_s:.1f} s to measure)")
    search = Search(make(), (X,), device="cpu", optimizer=torch.optim.AdamW, loss_fn=loss_fn,
                    disk=tmp, speeds=speeds)
    rows = []
    for i, c in enumerate(search.candidates):
        search.refine(c)
        search.whole(c)
        one = search.plan_of(c, 1 << 40)
        one.disk = f"{tmp}/{i}"
        model, opt = one.apply(make())
        t_meas, peak_meas = run(model, opt, a.steps)
        row = {"plan": "; ".join(c.choice.describe()), "estimated_s": round(c.time_s, 4),
               "measured_median_s": round(t_meas, 4), "ratio": round(t_meas / c.time_s, 2),
               "estimated_peak": c.peak, "measured_peak": peak_meas}
        rows.append(row)
        print(json.dumps(row))
    ratios = [r["ratio"] for r in rows]
    est_order = [r["plan"] for r in sorted(rows, key=lambda r: r["estimated_s"])]
    meas_order = [r["plan"] for r in sorted(rows, key=lambda r: r["measured_median_s"])]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "claim": "the planner's step-time model, calibrated on this CPU, against measured steps",
        "command": f"python benchmarks/plan_time.py --steps {a.steps} --threads {a.threads}",
        "torch": torch.__version__, "machine": platform.machine(),
        "threads": torch.get_num_threads(), "speeds": asdict(speeds),
        "calibration_s": round(calibration_s, 2), "rows": rows,
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "fastest_estimated": est_order[0], "fastest_measured": meas_order[0],
        "rank_correlation": _spearman([r["estimated_s"] for r in rows],
                                      [r["measured_median_s"] for r in rows]),
        "peaks_within_5_percent": all(abs(r["estimated_peak"] - r["measured_peak"])
                                      <= 0.05 * r["measured_peak"] for r in rows),
    }, indent=1, default=str))
    print(f"wrote {RESULTS}")


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = rank
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True))
    return round(1 - 6 * d2 / (n * (n * n - 1)), 3) if n > 1 else 1.0


if __name__ == "__main__":
    main()
