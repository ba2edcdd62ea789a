"""Linear + cross-entropy over many classes: time and peak RSS, side by side in one run.

Methods (each measured in its own subprocess, since peak RSS is per process):

* ``plain``: ``F.cross_entropy(x @ W.T, y)`` on the full ``B x C`` logits, then backward.
* ``cce``: cut-cross-entropy's ``torch_compile`` implementation (if it is installed), warmed up
  once at the same shape so compile time is not counted (reported separately).
* ``headroom``: ``hr.linear_cross_entropy`` (exact, sliced over classes).

Each repeat is a full forward + backward producing the gradients of ``x`` and ``W``. The three
processes stay alive and the repeats are interleaved round by round (plain, cce, headroom,
plain, ...), so load from other work on a shared machine falls on all methods alike. The table
shows median (and min) wall time, median CPU time of the process, and ratios to ``plain``.

Usage:
    flock /tmp/hr-bigmem.lock .venv/bin/python benchmarks/huge_classifier.py
    .venv/bin/python benchmarks/huge_classifier.py --classes 65536 --repeats 2   # quick look

On a machine with an accelerator, ``--device cuda`` runs the same comparison there (peak device
memory from ``torch.cuda.max_memory_allocated`` instead of RSS) and adds the weight in host
memory, streamed to the device slice by slice by the transfer layer's ``RowStreamer``:

* ``headroom-host``: a pageable host weight (copied through page-locked staging), ``--prefetch``;
* ``headroom-host-pinned``: a page-locked host weight (what ``HugeClassifier(store="cpu")``
  holds), copied straight from it;
* ``headroom-host-p0``: the pageable weight with ``prefetch=0`` (the copies do not overlap
  compute: what streaming saves).

It also measures host->device and device->host bandwidth from page-locked memory and reports the
transfer-bound limit of a streamed step: the weight crosses to the device twice (forward and
backward) and its gradient comes back once, on separate copy engines, so
``max(2 * bytes(W) / H2D, bytes(W) / D2H)``; a streamed step can not beat
``max(device-resident time, transfer limit)``.

    .venv/bin/python benchmarks/huge_classifier.py --device cuda --repeats 5
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

RESULTS = Path(__file__).resolve().parent / "results"


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device: str) -> None:
    if device != "cpu":
        torch.accelerator.synchronize()


def copy_bandwidth(device: str, nbytes: int = 256 << 20, repeats: int = 7) -> dict:
    """Median host->device and device->host bytes/s from page-locked memory (one copy each)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(repeats + 1):
            _sync(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            times.append(time.perf_counter() - t)
        out[f"{name}_bytes_per_s"] = nbytes / statistics.median(times[1:])
    return out


def worker(args: argparse.Namespace) -> dict:
    """Run one method in this process and return its measurements."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = args.device
    B, D, C = args.batch, args.dim, args.classes
    # Drawn on the CPU and moved: every method gets the same numbers wherever they live.
    x = torch.randn(B, D).to(dev).requires_grad_()
    host = args.method.startswith("headroom-host")
    wdev = "cpu" if host else dev
    w = (torch.randn(C, D) * D**-0.5).to(wdev)
    if args.method == "headroom-host-pinned":
        w = w.pin_memory()
    w.requires_grad_()
    prefetch = 0 if args.method == "headroom-host-p0" else args.prefetch
    y = torch.randint(0, C, (B,)).to(dev)
    rss_inputs = _peak_rss_bytes()

    if args.method == "plain":
        import torch.nn.functional as F

        def step() -> torch.Tensor:
            loss = F.cross_entropy(x @ w.T, y)
            loss.backward()
            return loss
    elif args.method == "cce":
        from cut_cross_entropy import linear_cross_entropy as cce

        def step() -> torch.Tensor:
            loss = cce(x, w, y, impl="torch_compile")
            loss.backward()
            return loss
    else:
        import headroom as hr

        def step() -> torch.Tensor:
            loss = hr.linear_cross_entropy(x, w, y, slice_size=args.slice_size,
                                           prefetch=prefetch)
            loss.backward()
            return loss

    compile_s = None
    if args.method == "cce":
        t = time.perf_counter()
        step()
        _sync(dev)
        compile_s = time.perf_counter() - t
    if dev != "cpu":
        torch.cuda.reset_peak_memory_stats()
    # NOTE: serve repeats on request so the driver can interleave methods round by round:
    # on a shared machine the load changes over minutes, and interleaving spreads it evenly.
    print(json.dumps({"ready": True, "warmup_compile_s": compile_s}), flush=True)
    times, cpu_times, losses = [], [], []
    for line in sys.stdin:
        if line.strip() != "run":
            break
        x.grad = None
        w.grad = None
        t, c = time.perf_counter(), time.process_time()
        loss = step()
        _sync(dev)
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
        losses.append(loss.item())
        print(json.dumps({"time_s": times[-1], "cpu_s": cpu_times[-1]}), flush=True)
    out = {
        "method": args.method,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "median_cpu_s": statistics.median(cpu_times),
        "peak_rss_bytes": _peak_rss_bytes(),
        "rss_after_inputs_bytes": rss_inputs,
        "loss": losses[-1],
        "grad_w_norm": float(w.grad.norm()),
        "grad_x_norm": float(x.grad.norm()),
        "warmup_compile_s": compile_s,
    }
    if dev != "cpu":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    return out


def check_results(results: dict) -> None:
    """Every method's loss and gradient norms against plain PyTorch's (same inputs); a
    mismatch stops the run before anything is reported."""
    ref = results.get("plain")
    if not ref or "error" in ref:
        return
    for m, r in results.items():
        if "error" in r or m == "plain":
            continue
        for key in ("loss", "grad_w_norm", "grad_x_norm"):
            rel = abs(r[key] - ref[key]) / max(abs(ref[key]), 1e-30)
            r.setdefault("relative_difference_to_plain", {})[key] = rel
            if rel > 1e-4:
                raise SystemExit(f"{m}: {key} {r[key]} differs from plain's {ref[key]}"
                                 f" (relative {rel:.1e})")
    print("losses and gradient norms match plain PyTorch's (relative 1e-4)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--classes", type=int, default=262144)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slice-size", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefetch", type=int, default=1,
                   help="slices copied ahead in the streamed host-weight methods")
    p.add_argument("--methods", default=None, help="comma list (default: all available)")
    p.add_argument("--out", default=None, help="JSON path (default: results/huge_classifier.json)")
    p.add_argument("--method", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.method:
        print(json.dumps(worker(args)))
        return

    methods = ["plain", "cce", "headroom"]
    if args.device != "cpu":
        methods += ["headroom-host", "headroom-host-pinned", "headroom-host-p0"]
    if args.methods:
        methods = args.methods.split(",")
    try:
        import cut_cross_entropy  # noqa: F401
    except ImportError:
        if "cce" in methods:
            print("cut-cross-entropy is not installed: skipping it "
                  "(pip install cut-cross-entropy)")
            methods.remove("cce")

    procs: dict[str, subprocess.Popen] = {}
    results: dict[str, dict] = {}
    for m in methods:
        cmd = [sys.executable, __file__, "--method", m] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("method", "methods", "out") and v is not None
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            print(f"{m}: failed to start ({proc.returncode})")
            results[m] = {"method": m, "error": f"exit {proc.returncode}"}
            continue
        procs[m] = proc
        print(f"{m}: ready {line.strip()}", flush=True)
    for r in range(args.repeats):
        for m, proc in procs.items():
            proc.stdin.write("run\n")
            proc.stdin.flush()
            rep = json.loads(proc.stdout.readline())
            print(f"round {r}: {m:>20} {rep['time_s']:8.3f} s wall  {rep['cpu_s']:7.2f} s cpu",
                  flush=True)
    for m, proc in procs.items():
        out, _ = proc.communicate("stop\n")
        results[m] = json.loads(out.strip().splitlines()[-1])

    check_results(results)
    limit = None
    if args.device != "cpu":
        bw = copy_bandwidth(args.device)
        w_bytes = args.classes * args.dim * 4
        limit = {
            **bw,
            "weight_bytes": w_bytes,
            "transfer_limit_s": max(2 * w_bytes / bw["h2d_bytes_per_s"],
                                    w_bytes / bw["d2h_bytes_per_s"]),
        }
        resident = results.get("headroom", {}).get("median_s")
        if resident is not None:
            limit["lower_bound_s"] = max(resident, limit["transfer_limit_s"])
    base = results.get("plain", {}).get("median_s")
    base_cpu = results.get("plain", {}).get("median_cpu_s")
    print(f"\nB={args.batch} D={args.dim} C={args.classes} fp32 forward+backward, "
          f"{args.threads} threads, device {args.device}, median of {args.repeats}")
    print(f"{'method':>20} | {'median s':>9} | {'x plain':>7} | {'min s':>7} | "
          f"{'cpu s':>7} | {'x plain':>7} | {'peak RSS GiB':>12}"
          + (" | peak dev GiB" if args.device != "cpu" else ""))
    for m, r in results.items():
        if "error" in r:
            print(f"{m:>20} | failed")
            continue
        ratio = r["median_s"] / base if base else float("nan")
        cpu_ratio = r["median_cpu_s"] / base_cpu if base_cpu else float("nan")
        r["ratio_to_plain"] = ratio
        r["cpu_ratio_to_plain"] = cpu_ratio
        line = (f"{m:>20} | {r['median_s']:9.3f} | {ratio:7.2f} | {r['min_s']:7.3f} | "
                f"{r['median_cpu_s']:7.2f} | {cpu_ratio:7.2f} | "
                f"{r['peak_rss_bytes'] / 2**30:12.2f}")
        if "peak_device_bytes" in r:
            line += f" | {r['peak_device_bytes'] / 2**30:12.2f}"
        print(line)
    if limit is not None:
        print(f"H2D {limit['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H "
              f"{limit['d2h_bytes_per_s'] / 1e9:.1f} GB/s (page-locked, 256 MiB); W "
              f"{limit['weight_bytes'] / 2**30:.2f} GiB: transfer-bound limit "
              f"{limit['transfer_limit_s']:.3f} s per step")
        lb = limit.get("lower_bound_s")
        for m, r in results.items():
            if m.startswith("headroom-host") and "median_s" in r and lb:
                r["x_lower_bound"] = r["median_s"] / lb
                r["x_device_resident"] = r["median_s"] / results["headroom"]["median_s"]
                print(f"{m:>20}: {r['x_device_resident']:.2f}x device-resident, "
                      f"{r['x_lower_bound']:.2f}x max(device-resident, transfer limit)")
    record = {
        "benchmark": "huge_classifier",
        "transfer": limit,
        "config": {k: v for k, v in vars(args).items() if k not in ("method",)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
        "results": results,
    }
    out = Path(args.out) if args.out else RESULTS / (
        "huge_classifier.json" if args.device == "cpu" else "huge_classifier_gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
