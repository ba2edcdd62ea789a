"""Multi-label training over 10 million classes on this machine: weights and Adam state on disk.

``HugeClassifier(10_000_000, 128, store=DiskStore(...))`` trained with one-vs-all BCE (about
``--positives`` positives per row among all classes) and ``HostOptimizer(AdamW,
state_store=DiskStore(...))``: the 5.1 GB weight, its gradient and the two Adam moments rest in
files. Each exact step streams the weight twice (loss in forward; loss gradient in backward,
written to the gradient file), then the optimizer streams weight, gradient and state slice by
slice. ``--sample-rate < 1`` is the opt-in approximation: all positives plus uniformly sampled
negatives, row-sparse gradients and lazy Adam (``row_sparse=[head.weight]``).

The training runs in a child process; besides the child's own per-step figures, the parent reads
the child's peak RSS from the kernel after it exits (``RUSAGE_CHILDREN``), a measurement that owes
nothing to headroom. Same batch every step, so the loss falls.

Usage:
    flock /tmp/hr-bigmem.lock .venv/bin/python benchmarks/multilabel_scale.py
    .venv/bin/python benchmarks/multilabel_scale.py --classes 1000000 --steps 2   # quick
    .venv/bin/python benchmarks/multilabel_scale.py --sample-rate 0.01   # approximate mode
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from huge_classifier_scale import _io, _rss_now, _rss_peak

import headroom as hr
from headroom.store import DiskStore

RESULTS = Path(__file__).resolve().parent / "results"


def train(args: argparse.Namespace, root: Path) -> dict:
    """The training run (in the child process); returns its record."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sparse = args.sample_rate < 1.0
    t0 = time.perf_counter()
    cache = not args.no_page_cache
    wstore = DiskStore(root / "weights", page_cache=cache)
    sstore = DiskStore(root / "adam", page_cache=cache)
    head = hr.HugeClassifier(args.classes, args.dim, device="cpu", store=wstore,
                             slice_size=args.slice_size, sample_rate=args.sample_rate)
    opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=args.lr, state_store=sstore,
                           row_sparse=[head.weight] if sparse else ())
    setup_s = time.perf_counter() - t0
    print(f"setup ({args.classes:,} x {args.dim} weight on disk): {setup_s:.1f} s, RSS "
          f"{_rss_now() / 2**30:.2f} GiB", flush=True)
    x = torch.randn(args.batch, args.dim)
    counts = torch.randint(0, 2 * args.positives + 1, (args.batch,))
    rows = [torch.randint(0, args.classes, (int(k),)).unique() for k in counts]
    lengths = torch.tensor([len(r) for r in rows])
    indices = torch.cat(rows)
    targets = (torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), indices)
    steps = []
    for i in range(args.steps):
        r0, w0 = _io(wstore, sstore)
        t, c = time.perf_counter(), time.process_time()
        loss = head(x, targets, loss=args.loss)
        loss.backward()
        t_fb = time.perf_counter() - t
        opt.step()
        opt.zero_grad()
        t_all = time.perf_counter() - t
        cpu = time.process_time() - c
        r1, w1 = _io(wstore, sstore)
        steps.append({"loss": loss.item(), "step_s": t_all, "cpu_s": cpu,
                      "forward_backward_s": t_fb,
                      "optimizer_s": t_all - t_fb, "bytes_read": r1 - r0,
                      "bytes_written": w1 - w0, "rss_peak_bytes": _rss_peak()})
        print(f"step {i}: loss {loss.item():.6f}  {t_all:.1f} s, cpu {cpu:.1f} s (fwd+bwd "
              f"{t_fb:.1f} s, optimizer {t_all - t_fb:.1f} s)  read {(r1 - r0) / 1e9:.1f} GB  "
              f"written {(w1 - w0) / 1e9:.1f} GB  peak RSS {_rss_peak() / 2**30:.2f} GiB",
              flush=True)
    wstore.flush()
    sstore.flush()
    return {
        "mode": "approximate (sampled negatives, lazy Adam)" if sparse else "exact",
        "positives": int(indices.numel()),
        "weight_bytes": 4 * args.classes * args.dim,
        "bytes_on_disk": sum(f.stat().st_size for f in root.rglob("*.bin")),
        "setup_s": setup_s,
        "steps": steps,
        "median_step_s": statistics.median(s["step_s"] for s in steps),
        "median_step_cpu_s": statistics.median(s["cpu_s"] for s in steps),
        "peak_rss_bytes_self": _rss_peak(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--positives", type=int, default=5, help="mean positives per row")
    p.add_argument("--loss", default="bce")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slice-size", type=int, default=None)
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--path", default=None, help="directory for the stores (default: a temp dir)")
    p.add_argument("--no-page-cache", action="store_true",
                   help="DiskStore(page_cache=False): every read really comes from the disk")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RECORD " + json.dumps(train(args, Path(args.child))), flush=True)
        return
    root = Path(args.path) if args.path else Path(tempfile.mkdtemp(prefix="hr-multilabel-"))
    cmd = [sys.executable, __file__, "--child", str(root)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("child", "out", "path", "no_page_cache") and v is not None]
    cmd += ["--no-page-cache"] if args.no_page_cache else []
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    finally:
        if not args.path:
            shutil.rmtree(root, ignore_errors=True)
    lines = proc.stdout.splitlines()
    print("\n".join(line for line in lines if not line.startswith("RECORD ")))
    record = json.loads(next(line for line in lines if line.startswith("RECORD "))[7:])
    record["peak_rss_bytes_child_by_parent"] = (
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    record = {
        "benchmark": "multilabel_scale",
        "config": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "torch": torch.__version__, "load_avg_at_end": os.getloadavg()},
        **record,
    }
    print(f"\n{args.classes:,} classes x {args.dim} features, batch {args.batch}, "
          f"{record['positives']} positives, {args.loss}, {record['mode']}: weight "
          f"{record['weight_bytes'] / 1e9:.2f} GB, on disk {record['bytes_on_disk'] / 1e9:.1f} "
          f"GB; median step {record['median_step_s']:.1f} s; peak RSS "
          f"{record['peak_rss_bytes_child_by_parent'] / 2**30:.2f} GiB (kernel, read by the "
          "parent)")
    name = "multilabel_scale" + ("_sampled" if args.sample_rate < 1 else "") + (
        "_no_page_cache" if args.no_page_cache else "") + ".json"
    out = Path(args.out) if args.out else RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
