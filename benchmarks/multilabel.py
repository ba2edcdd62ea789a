"""Multi-label BCE over many classes: time and peak RSS against plain PyTorch, in one run.

Methods (each in its own subprocess, since peak RSS is per process):

* ``plain``: ``F.binary_cross_entropy_with_logits(x @ W.T, T)`` with the dense ``B x C`` multi-hot
  target ``T`` built from the positives each step (what a user without headroom writes), then
  backward.
* ``headroom``: ``hr.linear_loss(x, W, (offsets, indices), loss="bce")`` (exact, sliced over
  classes, loss and gradients in one pass).
* ``headroom-fn``: the same loss written as a user's per-slice function,
  ``F.binary_cross_entropy_with_logits(scores, targets, reduction="sum")``, differentiated by
  autograd slice by slice (``reduction="sum"``, divided by ``B x C`` afterwards).

Each repeat is a full forward + backward producing the gradients of ``x`` and ``W``. The
processes stay alive and repeats are interleaved round by round, so load from other work on a
shared machine falls on all methods alike; ratios come from the same rounds. Positives: about
``--positives`` per row (uniform classes, 0 to twice that many per row).

Usage:
    flock /tmp/hr-bigmem.lock .venv/bin/python benchmarks/multilabel.py
    .venv/bin/python benchmarks/multilabel.py --classes 65536 --repeats 2   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("plain", "headroom", "headroom-fn")


def _targets(batch: int, classes: int, positives: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 2 * positives + 1, (batch,))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    rows = []
    for k in counts.tolist():
        # k distinct uniform classes, drawn again on a repeat. (A slice of torch.randperm(C)
        # per row would keep each row's whole C-sized permutation alive: gigabytes of input.)
        row = torch.randint(0, classes, (k,))
        while row.unique().numel() < k:
            row = torch.randint(0, classes, (k,))
        rows.append(row)
    return offsets, torch.cat(rows)


def _bce_sum(scores: torch.Tensor, targets: torch.Tensor, classes: range) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(scores, targets, reduction="sum")


def _step_fn(args: argparse.Namespace, x, w, offsets, indices):
    B, C = args.batch, args.classes
    if args.method == "plain":
        rows = torch.repeat_interleave(torch.arange(B), offsets.diff())

        def step() -> torch.Tensor:
            target = torch.zeros(B, C)
            target[rows, indices] = 1.0
            loss = F.binary_cross_entropy_with_logits(x @ w.T, target)
            loss.backward()
            return loss

        return step
    import headroom as hr

    if args.method == "headroom":
        def step() -> torch.Tensor:
            loss = hr.linear_loss(x, w, (offsets, indices), loss="bce",
                                  slice_size=args.slice_size)
            loss.backward()
            return loss

        return step

    def step() -> torch.Tensor:
        loss = hr.linear_loss(x, w, (offsets, indices), loss=_bce_sum, reduction="sum",
                              slice_size=args.slice_size) / (B * C)
        loss.backward()
        return loss

    return step


def worker(args: argparse.Namespace) -> None:
    """Serve timed repeats of one method on request; print its measurements at the end."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.dim, requires_grad=True)
    w = (torch.randn(args.classes, args.dim) * args.dim**-0.5).requires_grad_()
    offsets, indices = _targets(args.batch, args.classes, args.positives)
    step = _step_fn(args, x, w, offsets, indices)
    rss_inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"ready": True}), flush=True)
    times, cpu_times, losses = [], [], []
    for line in sys.stdin:
        if line.strip() != "run":
            break
        x.grad = w.grad = None
        t, c = time.perf_counter(), time.process_time()
        losses.append(step().item())
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
        print(json.dumps({"time_s": times[-1], "cpu_s": cpu_times[-1]}), flush=True)
    print(json.dumps({
        "method": args.method, "times_s": times, "cpu_times_s": cpu_times,
        "median_s": statistics.median(times), "min_s": min(times),
        "median_cpu_s": statistics.median(cpu_times),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_inputs_bytes": rss_inputs, "loss": losses[-1], "positives": len(indices),
        "grad_w_norm": float(w.grad.norm()), "grad_x_norm": float(x.grad.norm()),
    }), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--classes", type=int, default=262144)
    p.add_argument("--positives", type=int, default=5, help="mean positives per row")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slice-size", type=int, default=None)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out", default=None, help="JSON path (default: results/multilabel.json)")
    p.add_argument("--method", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.method:
        worker(args)
        return
    shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k not in ("method", "methods", "out") and v is not None]
    procs = {}
    for m in args.methods.split(","):
        proc = subprocess.Popen([sys.executable, __file__, "--method", m, *shared],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not proc.stdout.readline():
            raise SystemExit(f"{m}: failed to start (exit {proc.wait()})")
        procs[m] = proc
    for r in range(args.repeats):
        for m, proc in procs.items():
            proc.stdin.write("run\n")
            proc.stdin.flush()
            rep = json.loads(proc.stdout.readline())
            print(f"round {r}: {m:>12} {rep['time_s']:8.2f} s wall  {rep['cpu_s']:7.2f} s cpu",
                  flush=True)
    results = {m: json.loads(proc.communicate("stop\n")[0].strip().splitlines()[-1])
               for m, proc in procs.items()}
    base = results.get("plain")
    print(f"\nB={args.batch} D={args.dim} C={args.classes}, "
          f"{results[next(iter(results))]['positives']} positives, fp32 BCE forward+backward, "
          f"{args.threads} threads, median of {args.repeats}")
    print(f"{'method':>12} | {'median s':>9} | {'x plain':>7} | {'min s':>8} | {'cpu s':>7} | "
          f"{'peak RSS GiB':>12} | {'x plain':>7} | loss")
    for m, r in results.items():
        if base:
            r["time_ratio_to_plain"] = r["median_s"] / base["median_s"]
            r["cpu_ratio_to_plain"] = r["median_cpu_s"] / base["median_cpu_s"]
            r["rss_ratio_to_plain"] = r["peak_rss_bytes"] / base["peak_rss_bytes"]
        print(f"{m:>12} | {r['median_s']:9.2f} | {r.get('time_ratio_to_plain', 1):7.2f} | "
              f"{r['min_s']:8.2f} | {r['median_cpu_s']:7.2f} | "
              f"{r['peak_rss_bytes'] / 2**30:12.2f} | {r.get('rss_ratio_to_plain', 1):7.2f} | "
              f"{r['loss']:.6f}")
    record = {
        "benchmark": "multilabel",
        "config": {k: v for k, v in vars(args).items() if k != "method"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "load_avg_at_end": os.getloadavg()},
        "results": results,
    }
    out = Path(args.out) if args.out else RESULTS / "multilabel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
