"""Train a 10-million-class classifier on this machine: weights and Adam state on disk.

``HugeClassifier(10_000_000, 128, store=DiskStore(...))`` holds a 5.1 GB fp32 weight (and a
5.1 GB gradient) in files; ``HostOptimizer(AdamW, state_store=DiskStore(...))`` keeps the two
Adam moments (10.2 GB) in files too. Each step streams the weight twice (exact loss forward,
gradient pass backward), writes the gradient, then the optimizer streams weight, gradient and
state through AdamW slice by slice. The process never holds more than a few slices.

With the default ``page_cache=True`` the OS may keep the files' pages in its cache (they do not
count in RSS, and the cache gives them back under pressure); ``--no-page-cache`` drops them after
every read and write so each step really reads from and writes to the disk.

Reports peak RSS of the whole process, time per step (split into forward+backward and optimizer
step), bytes read/written per step and the losses (the same batch every step, so they fall).

Usage:
    flock /tmp/hr-bigmem.lock .venv/bin/python benchmarks/huge_classifier_scale.py
    .venv/bin/python benchmarks/huge_classifier_scale.py --classes 1000000 --steps 2  # quick
    .venv/bin/python benchmarks/huge_classifier_scale.py --sample-rate 0.01   # approximate mode

``--sample-rate < 1`` runs the opt-in approximate (Partial-FC style) mode with row-sparse
gradients and lazy Adam (only sampled rows are read, updated and written).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import headroom as hr
from headroom.store import DiskStore

RESULTS = Path(__file__).resolve().parent / "results"


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _io(*stores: DiskStore) -> tuple[int, int]:
    r = w = 0
    for s in stores:
        st = s.stats()
        r += int(st.get("bytes_read", 0))
        w += int(st.get("bytes_written", 0))
    return r, w


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--classes", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slice-size", type=int, default=None)
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--path", default=None, help="directory for the stores (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the store files")
    p.add_argument("--no-page-cache", action="store_true",
                   help="DiskStore(page_cache=False): every read really comes from the disk")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    root = Path(args.path) if args.path else Path(tempfile.mkdtemp(prefix="hr-huge-"))
    sparse = args.sample_rate < 1.0
    try:
        t0 = time.perf_counter()
        cache = not args.no_page_cache
        wstore = DiskStore(root / "weights", page_cache=cache)
        sstore = DiskStore(root / "adam", page_cache=cache)
        head = hr.HugeClassifier(args.classes, args.dim, device="cpu", store=wstore,
                                 slice_size=args.slice_size, sample_rate=args.sample_rate)
        opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=args.lr,
                               state_store=sstore,
                               row_sparse=[head.weight] if sparse else ())
        setup_s = time.perf_counter() - t0
        print(f"setup (init {args.classes:,} x {args.dim} weight on disk): {setup_s:.1f} s, "
              f"RSS {_rss_now() / 2**30:.2f} GiB", flush=True)
        x = torch.randn(args.batch, args.dim)
        y = torch.randint(0, args.classes, (args.batch,))
        steps = []
        for i in range(args.steps):
            r0, w0 = _io(wstore, sstore)
            t = time.perf_counter()
            loss = head(x, y)
            loss.backward()
            t_fb = time.perf_counter() - t
            opt.step()
            opt.zero_grad()
            t_all = time.perf_counter() - t
            r1, w1 = _io(wstore, sstore)
            steps.append({"loss": loss.item(), "step_s": t_all, "forward_backward_s": t_fb,
                          "optimizer_s": t_all - t_fb, "bytes_read": r1 - r0,
                          "bytes_written": w1 - w0, "rss_peak_bytes": _rss_peak()})
            print(f"step {i}: loss {loss.item():.5f}  {t_all:.1f} s (fwd+bwd {t_fb:.1f} s, "
                  f"optimizer {t_all - t_fb:.1f} s)  read {(r1 - r0) / 1e9:.1f} GB  "
                  f"written {(w1 - w0) / 1e9:.1f} GB  peak RSS {_rss_peak() / 2**30:.2f} GiB",
                  flush=True)
        wstore.flush()
        sstore.flush()
        disk_bytes = sum(f.stat().st_size for f in root.rglob("*.bin"))
    finally:
        if not args.keep and not args.path:
            shutil.rmtree(root, ignore_errors=True)

    fp32 = 4 * args.classes * args.dim
    record = {
        "benchmark": "huge_classifier_scale",
        "config": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                    "torch": torch.__version__},
        "mode": "approximate (sampled, lazy Adam)" if sparse else "exact",
        "weight_bytes": fp32,
        "bytes_on_disk": disk_bytes,
        "setup_s": setup_s,
        "steps": steps,
        "median_step_s": statistics.median(s["step_s"] for s in steps),
        "peak_rss_bytes": _rss_peak(),
    }
    print(f"\n{args.classes:,} classes x {args.dim} features, batch {args.batch}, "
          f"{record['mode']}: weight {fp32 / 1e9:.2f} GB, on disk {disk_bytes / 1e9:.1f} GB "
          f"(weight, gradient, Adam moments); median step {record['median_step_s']:.1f} s; "
          f"peak RSS {record['peak_rss_bytes'] / 2**30:.2f} GiB")
    name = "huge_classifier_scale" + ("_sampled" if sparse else "") + (
        "_no_page_cache" if args.no_page_cache else "") + ".json"
    out = Path(args.out) if args.out else RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
