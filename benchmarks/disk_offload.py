"""Train a model bigger than this process's memory from disk: device="cpu", DiskStore.

The model is created on the meta device, so its parameters are initialized module by module
straight into the store and never exist whole in RAM. Each step streams every block from disk
in forward, again in backward, writes the gradients, and steps SGD through the store with
``hr.HostOptimizer``. Reports the process's peak RSS (VmHWM) against the fp32 bytes of
parameters + gradients, the step time, and the store's achieved read throughput (bytes read /
wall time with a read in flight) as a ratio to a raw sequential read of the same files, both
with the page cache dropped (``DiskStore(page_cache=False)`` / ``posix_fadvise(DONTNEED)``).

    flock /tmp/hr-bigmem.lock .venv/bin/python benchmarks/disk_offload.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from headroom.store import DiskStore


def _fixed_mmap_threshold() -> None:
    # NOTE: glibc raises its mmap threshold after large frees, after which freed parameter
    # storage stays in the heap instead of going back to the OS; a fixed threshold keeps RSS
    # honest for a process that frees and refills large buffers every block.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB


def _rss_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def raw_read(files: list[Path], chunk: int = 64 << 20) -> tuple[int, float]:
    """Sequentially read ``files`` (page cache dropped first); returns (bytes, seconds)."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    buf = bytearray(chunk)
    mv = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(mv):
                total += n
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return total, time.perf_counter() - t0


def store_stream(store: DiskStore, handles) -> tuple[int, float]:
    """Read every tensor through the store, all submitted at once (its threads, its page-cache
    policy); returns (bytes, seconds)."""
    os.sync()
    bufs = [torch.empty(h.shape, dtype=h.dtype) for h in handles[:8]]
    total = 0
    t0 = time.perf_counter()
    futs = []
    for i, h in enumerate(handles):
        out = bufs[i % len(bufs)] if bufs[i % len(bufs)].shape == h.shape else None
        futs.append(store.read(h, out=out))
        total += h.nbytes
        if len(futs) >= 8:
            futs.pop(0).result()
    for f in futs:
        f.result()
    return total, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4, help="DiskStore I/O threads")
    ap.add_argument("--prefetch", type=int, default=2, help="blocks fetched ahead")
    ap.add_argument("--dir", default="/tmp/headroom-disk-offload")
    ap.add_argument("--out", default="benchmarks/results/disk_offload.json")
    args = ap.parse_args()
    _fixed_mmap_threshold()
    shutil.rmtree(args.dir, ignore_errors=True)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[MLP(args.width) for _ in range(args.blocks)])
    n_params = sum(p.numel() for p in model.parameters())
    store = DiskStore(args.dir, threads=args.threads, page_cache=False)
    t0 = time.perf_counter()
    hr.offload(model, device="cpu", store=store, prefetch=args.prefetch)
    # Parameters created on meta get their values when first needed (the first forward):
    # a forward without gradients here writes them, so that setup includes it, the files hold
    # data before the raw reads, and the random draws come in the same order as for a model
    # initialized on the CPU.
    with torch.no_grad():
        model(torch.zeros(1, args.width))
    setup_s = time.perf_counter() - t0
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=1e-3, overlap=False)
    x = torch.randn(args.batch, args.width)

    files = [store.file_of(s.binding.handle) for s in state_of(model).slots]
    raw_before = raw_read(files)
    stream_bytes, stream_s = store_stream(store, [s.binding.handle for s in state_of(model).slots])

    times, losses, step_ratios, raw_each = [], [], [], []
    before = store.stats()
    for _ in range(args.steps):
        # NOTE: a raw read right before each step: this machine's disk (a virtual one) and its
        # load from other processes drift by 30% within a minute, so each step's read
        # throughput is compared with the raw read taken next to it.
        raw_i = raw_read(files)
        raw_each.append(raw_i[0] / raw_i[1])
        s0 = store.stats()
        t = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        s1 = store.stats()
        step_bps = (s1["bytes_read"] - s0["bytes_read"]) / (s1["read_busy_s"] - s0["read_busy_s"])
        step_ratios.append(step_bps / raw_each[-1])
    after = store.stats()
    peak_rss = _rss_peak()

    read_bytes = after["bytes_read"] - before["bytes_read"]
    read_s = after["read_busy_s"] - before["read_busy_s"]
    store_bps = read_bytes / read_s
    raw_after = raw_read(files)
    # NOTE: the raw read is taken before and after training and averaged: the virtual disk's
    # own caching outside this machine makes consecutive reads of the same files vary.
    raw_bps = (raw_before[0] + raw_after[0]) / (raw_before[1] + raw_after[1])
    stream_bps = stream_bytes / stream_s

    param_grad_bytes = 2 * 4 * n_params
    result = {
        "command": "flock /tmp/hr-bigmem.lock .venv/bin/python benchmarks/disk_offload.py",
        "args": vars(args),
        "params": n_params,
        "param_and_grad_bytes_fp32": param_grad_bytes,
        "peak_rss_bytes": peak_rss,
        "param_grad_over_peak_rss": param_grad_bytes / peak_rss,
        "setup_s": setup_s,
        "step_s_median": statistics.median(times),
        "step_s": times,
        "losses": losses,
        "store_read_bytes_per_step": read_bytes / args.steps,
        "store_read_GBps": store_bps / 1e9,
        "raw_sequential_read_GBps": raw_bps / 1e9,
        "raw_read_before_after_GBps": [raw_before[0] / raw_before[1] / 1e9,
                                       raw_after[0] / raw_after[1] / 1e9],
        "read_throughput_ratio": store_bps / raw_bps,
        "read_throughput_ratio_per_step": step_ratios,
        "read_throughput_ratio_median_of_steps": statistics.median(step_ratios),
        "raw_read_before_each_step_GBps": [b / 1e9 for b in raw_each],
        "store_stream_GBps": stream_bps / 1e9,
        "store_stream_ratio": stream_bps / raw_bps,
        "store_written_bytes_per_step": (after["bytes_written"] - before["bytes_written"])
        / args.steps,
        # NOTE: what the read throughput depends on: how big the reads are, how much of the
        # read-busy time the disk also served writes (gradients, the step's write-back).
        "reads_per_step": (after["reads"] - before["reads"]) / args.steps,
        "mean_read_bytes": read_bytes / max(1, after["reads"] - before["reads"]),
        "read_busy_s_per_step": read_s / args.steps,
        "write_busy_s_per_step": (after["write_busy_s"] - before["write_busy_s"]) / args.steps,
        "read_write_overlap_fraction": (after["read_write_overlap_s"]
                                        - before["read_write_overlap_s"]) / read_s,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    gib = 2**30
    print(f"model: {args.blocks} blocks x 2 x Linear({args.width}, {args.width}),"
          f" {n_params / 1e6:.0f}M params")
    print(f"{'fp32 params + grads':<34}{param_grad_bytes / gib:8.2f} GiB")
    print(f"{'peak RSS (VmHWM)':<34}{peak_rss / gib:8.2f} GiB"
          f"   ratio {param_grad_bytes / peak_rss:.2f}x (target >= 2)")
    print(f"{'step time (median)':<34}{statistics.median(times):8.2f} s")
    print(f"{'store reads per step':<34}{read_bytes / args.steps / gib:8.2f} GiB")
    print(f"{'raw sequential read, same files':<34}{raw_bps / 1e9:8.3f} GB/s"
          f"   (before {raw_before[0] / raw_before[1] / 1e9:.3f}, after"
          f" {raw_after[0] / raw_after[1] / 1e9:.3f})")
    print(f"{'store reads during training':<34}{store_bps / 1e9:8.3f} GB/s"
          f"   ratio {store_bps / raw_bps:.2f} (target >= 0.8)")
    print(f"{'same, each step vs its own raw read':<34}{statistics.median(step_ratios):8.2f}"
          f"   median ratio of {len(step_ratios)} steps"
          f" ({', '.join(f'{r:.2f}' for r in step_ratios)})")
    print(f"{'reads sharing the disk with writes':<34}"
          f"{result['read_write_overlap_fraction'] * 100:8.0f} %   of read-busy time"
          f" ({result['reads_per_step']:.0f} reads/step, mean"
          f" {result['mean_read_bytes'] / 2**20:.1f} MiB)")
    print(f"{'store reading all files, no compute':<34}{stream_bps / 1e9:8.3f} GB/s"
          f"   ratio {stream_bps / raw_bps:.2f}")
    print(f"wrote {args.out}")
    store.close()
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
