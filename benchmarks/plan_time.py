"""Claim: hr.plan's step-time model, calibrated on this CPU, predicts measured step times.

For every combination hr.plan considers on ``cpu`` with ``disk=`` (hr.convert, checkpointing of
the first k blocks, activation offload, parameter offload, optimizer state on disk), side by
side in one run: the step time the planner estimates (the dry run's ops priced at this machine's
measured speeds, plus transfers at the measured disk bandwidths) and the measured time of
``--steps`` steps with the plan applied, wall-clock and CPU time of the process (the machine
is shared: other jobs slow the wall clock down, much less the CPU time of one thread); the
estimated peak (the dry run of the whole plan, without the plan's margin for a gradient being
written to disk, recorded beside it) against hr.track_memory's measured one. The
speeds are measured at the start (``measure_speeds(refresh=True)``) and recorded. Steps run in
rounds over groups of ``--group`` combinations (one step of each, then the next round), so a
change of the machine's load falls on all of them alike.

    python benchmarks/plan_time.py [--steps 5] [--threads 1] [--group 12]
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
from headroom.fit import measure_speeds
from headroom.fit._plan import Search

RESULTS = Path(__file__).parent / "results" / "plan_time.json"


def make():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
                           for _ in range(6)], nn.Linear(512, 8))


X = torch.randn(256, 512)


def loss_fn(out):
    return out.square().mean()


def step_of(model, opt):
    def step():
        loss_fn(model(X)).backward()
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group", type=int, default=12)
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
    for c in search.candidates:
        search.refine(c)
        search.whole(c)
    rows = []
    cands = list(enumerate(search.candidates))
    for g in range(0, len(cands), a.group):
        live = []
        for i, c in cands[g:g + a.group]:
            one = search.plan_of(c, 1 << 40)
            one.disk = f"{tmp}/{i}"
            model, opt = one.apply(make())
            step = step_of(model, opt)
            step()
            with hr.track_memory(model=model, optimizer=opt) as mem:
                step()
            live.append((c, step, mem.peak, [], []))
        for _ in range(a.steps):
            for _, step, _, walls, cpus in live:
                w, p = time.perf_counter(), time.process_time()
                step()
                cpus.append(time.process_time() - p)
                walls.append(time.perf_counter() - w)
        for c, _, peak, walls, cpus in live:
            wall, cpu = statistics.median(walls), statistics.median(cpus)
            row = {"plan": "; ".join(c.choice.describe()), "estimated_s": round(c.time_s, 4),
                   "wall_median_s": round(wall, 4), "cpu_median_s": round(cpu, 4),
                   "wall_min_s": round(min(walls), 4),
                   "wall_ratio": round(wall / c.time_s, 2), "cpu_ratio": round(cpu / c.time_s, 2),
                   "estimated_peak": c.peak - c.margin, "margin": c.margin,
                   "measured_peak": peak}
            rows.append(row)
            print(json.dumps(row))
        del live
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "claim": "the planner's step-time model, calibrated on this CPU, against measured steps",
        "command": f"python benchmarks/plan_time.py --steps {a.steps} --threads {a.threads}"
                   f" --group {a.group}",
        "torch": torch.__version__, "machine": platform.machine(),
        "threads": torch.get_num_threads(), "speeds": asdict(speeds),
        "calibration_s": round(calibration_s, 2), "rows": rows,
        **{f"{k}_ratio_{f.__name__}": f(r[f"{k}_ratio"] for r in rows)
           for k in ("wall", "cpu") for f in (min, max)},
        **{f"{k}_ratio_median": statistics.median(r[f"{k}_ratio"] for r in rows)
           for k in ("wall", "cpu")},
        "fastest_estimated": min(rows, key=lambda r: r["estimated_s"])["plan"],
        "fastest_measured_cpu": min(rows, key=lambda r: r["cpu_median_s"])["plan"],
        "rank_correlation_cpu": _spearman([r["estimated_s"] for r in rows],
                                          [r["cpu_median_s"] for r in rows]),
        "rank_correlation_wall": _spearman([r["estimated_s"] for r in rows],
                                           [r["wall_median_s"] for r in rows]),
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
