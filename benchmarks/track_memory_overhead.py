"""Claim: tracking memory with hr.track_memory costs under 1.5x a training step's time.

Side by side in one run, on the same models and batches: plain PyTorch, headroom's tracker, and
PyTorch's own MemTracker (torch.distributed._tools.mem_tracker). Each configuration runs
interleaved rounds of several steps; we report the median step time and ratios to plain, and the
peak each tracker measured (they should agree).

    python benchmarks/track_memory_overhead.py [--rounds 7] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import headroom as hr

RESULTS = Path(__file__).parent / "results" / "track_memory_overhead.json"


def transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 4, enable_nested_tensor=False))
    x = torch.randn(16, 128, 256)
    return model, x, lambda out: out.square().mean()


def cnn():
    torch.manual_seed(0)
    chans = [3, 32, 64, 64, 128]
    layers: list[nn.Module] = []
    for a, b in zip(chans, chans[1:], strict=False):
        layers += [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 2 * 2, 10))
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))
    return model, x, lambda out: F.cross_entropy(out, y)


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1024)
    )
    x = torch.randn(256, 1024)
    return model, x, lambda out: out.square().mean()


MODELS = {"transformer": transformer, "cnn": cnn, "mlp": mlp}


def run(name: str, rounds: int, steps: int) -> dict:
    model, x, loss_fn = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss_fn(model(x)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()  # warm up (optimizer state exists from here on)

    def plain():
        t = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t) / steps, None

    def headroom():
        with hr.track_memory(model=model, optimizer=opt) as mem:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            dt = (time.perf_counter() - t) / steps
        return dt, mem.peak

    def memtracker():
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(model, opt, x)
        with mt:
            t = time.perf_counter()
            for _ in range(steps):
                step()
                mt.reset_mod_stats()
            dt = (time.perf_counter() - t) / steps
        snap = mt.get_tracker_snapshot("peak")
        return dt, sum(d["Total"] for d in snap.values())

    configs = {"plain": plain, "headroom": headroom, "memtracker": memtracker}
    times: dict[str, list[float]] = {k: [] for k in configs}
    peaks: dict[str, int | None] = {}
    for _ in range(rounds):  # interleaved, so load changes hit every configuration alike
        for k, fn in configs.items():
            dt, peak = fn()
            times[k].append(dt)
            peaks[k] = peak
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "median_step_s": med,
        "ratio_to_plain": {k: med[k] / med["plain"] for k in configs},
        "peak_bytes": {k: v for k, v in peaks.items() if v is not None},
        "rounds": rounds,
        "steps_per_round": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    args = ap.parse_args()
    rows = [run(m, args.rounds, args.steps) for m in args.models]
    head = f"{'model':<12}{'plain ms':>10}{'headroom':>10}{'MemTracker':>12}"
    print(head + "  peak (headroom / MemTracker)")
    for r in rows:
        m, q = r["median_step_s"], r["ratio_to_plain"]
        p = r["peak_bytes"]
        print(
            f"{r['model']:<12}{m['plain'] * 1e3:>10.1f}"
            f"{q['headroom']:>9.2f}x{q['memtracker']:>11.2f}x"
            f"  {p['headroom'] / 2**20:.1f} / {p['memtracker'] / 2**20:.1f} MiB"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "claim": "hr.track_memory overhead on a CPU training step (target < 1.5x)",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "results": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
