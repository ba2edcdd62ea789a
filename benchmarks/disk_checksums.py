"""The cost of DiskStore's checksums: writes, reads and verification on reopen, on vs off.

One workload, run with checksums on and off in the same process, alternating, several repeats;
medians and on/off throughput ratios. Writes: every write computes the CRC32C of its source
buffer in the I/O thread ("off" swaps the CRC function for one that returns 0, so the journal,
locking and bookkeeping stay the same and only the checksum computation is left out). Reads:
``verify_reads=True`` vs ``False``. Reopen: ``DiskStore(path, verify=True)`` (reads the whole
store back) vs ``verify=False``, with the files' pages dropped from the page cache (cold) and
kept (warm). Each on both the page cache (``page_cache=True``) and the disk itself
(``page_cache=False``: writes fdatasync'd, reads after ``posix_fadvise(DONTNEED)``). Last, what
it costs a training step: a model of Linear layers created on ``meta``, ``hr.offload`` into a
DiskStore, SGD through ``hr.HostOptimizer`` (checksums on = CRC32C and ``verify_reads``).

    .venv/bin/python benchmarks/disk_checksums.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import headroom
from headroom.store import DiskStore, _disk, _recover
from headroom.store._segments import crc


def _no_crc(buf, value: int = 0) -> int:
    return 0


def _checksums(on: bool) -> None:
    _disk.crc = crc if on else _no_crc
    _recover.crc = crc if on else _no_crc


def _drop(folder: Path) -> None:
    for f in folder.iterdir():
        if f.suffix == ".bin":
            fd = os.open(f, os.O_RDONLY)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_run(folder: Path, srcs: list[torch.Tensor], *, on: bool, page_cache: bool,
            slice_rows: int, threads: int) -> dict[str, float]:
    """Seconds for each phase of the workload, checksums ``on`` or off."""
    _checksums(on)
    shutil.rmtree(folder, ignore_errors=True)
    s = DiskStore(folder, threads=threads, page_cache=page_cache, verify_reads=on)
    hs = [s.alloc(f"t{i}", tuple(x.shape), x.dtype) for i, x in enumerate(srcs)]
    out: dict[str, float] = {}

    def write_whole():
        for f in [s.write(h, x) for h, x in zip(hs, srcs, strict=True)]:
            f.result()

    def write_rows():  # the sliced optimizer step: consecutive row slices, in order
        futs = []
        for h, x in zip(hs, srcs, strict=True):
            for a in range(0, x.shape[0], slice_rows):
                futs.append(s.write_rows(h, slice(a, a + slice_rows), x[a:a + slice_rows]))
        for f in futs:
            f.result()

    outs = [torch.empty_like(x) for x in srcs]

    def read_whole():
        for f in [s.read(h, out=o) for h, o in zip(hs, outs, strict=True)]:
            f.result()

    def read_rows():
        futs = []
        for h, o in zip(hs, outs, strict=True):
            for a in range(0, o.shape[0], slice_rows):
                futs.append(s.read_rows(h, slice(a, a + slice_rows), out=o[a:a + slice_rows]))
        for f in futs:
            f.result()

    # NOTE: untimed first pass: it allocates the page cache for the new files and faults in
    # the landing buffers, a one-time cost that is not the checksums'.
    write_whole()
    read_whole()
    out["write_whole"] = _timed(write_whole)
    out["write_rows"] = _timed(write_rows)
    if not page_cache:
        _drop(folder)
    out["read_whole"] = _timed(read_whole)
    if not page_cache:
        _drop(folder)
    out["read_rows"] = _timed(read_rows)
    assert all(torch.equal(o, x) for o, x in zip(outs, srcs, strict=True))
    s.close()
    if page_cache:
        out["reopen_warm"] = _timed(lambda: DiskStore(folder, verify=on, threads=threads).close())
    _drop(folder)
    out["reopen_cold"] = _timed(lambda: DiskStore(folder, verify=on, threads=threads,
                                                  page_cache=page_cache).close())
    return out


def train_steps(folder: Path, *, on: bool, page_cache: bool, width: int, blocks: int,
                steps: int, threads: int) -> float:
    """Median seconds of an offloaded training step from a DiskStore (SGD, hr.HostOptimizer):
    every parameter read twice, every gradient written, the step read and written in slices."""
    import torch.nn as nn

    import headroom as hr

    _checksums(on)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                for _ in range(blocks)])
    store = DiskStore(folder, threads=threads, page_cache=page_cache, verify_reads=on)
    hr.offload(model, device="cpu", store=store, prefetch=2)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=1e-3)
    x = torch.randn(64, width)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i:  # the first step allocates gradient files
            times.append(time.perf_counter() - t0)
    opt.close()
    hr.unoffload(model)
    store.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensor-mib", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--slice-mib", type=int, default=16, help="row slice (HostOptimizer's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048, help="training: Linear width")
    ap.add_argument("--blocks", type=int, default=16, help="training: Linear layers")
    ap.add_argument("--steps", type=int, default=3, help="training: timed steps per run")
    ap.add_argument("--dir", default="/tmp/headroom-disk-checksums")
    ap.add_argument("--out", default="benchmarks/results/disk_checksums.json")
    args = ap.parse_args()

    cols = 1024
    rows = (args.tensor_mib << 20) // (4 * cols)
    slice_rows = (args.slice_mib << 20) // (4 * cols)
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(rows, cols, generator=g) for _ in range(args.tensors)]
    total = sum(x.numel() * 4 for x in srcs)
    folder = Path(args.dir)
    load_start = os.getloadavg()
    runs: dict[str, dict[str, list[float]]] = {}
    for rep in range(args.repeats):
        for page_cache in (True, False):
            # NOTE: alternate which goes first, so drift (other processes on the 2 cores, the
            # disk's write-back) does not favour one side.
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                key = f"{'cache' if page_cache else 'disk'}_{'on' if on else 'off'}"
                res = one_run(folder, srcs, on=on, page_cache=page_cache,
                              slice_rows=slice_rows, threads=args.threads)
                res["train_step"] = train_steps(
                    folder, on=on, page_cache=page_cache, width=args.width, blocks=args.blocks,
                    steps=args.steps, threads=args.threads)
                for phase, sec in res.items():
                    runs.setdefault(key, {}).setdefault(phase, []).append(sec)
                print(rep, key, {k: f"{total / v / 1e9:.2f} GB/s" if k != "train_step" else
                                 f"{v:.3f} s" for k, v in res.items()}, flush=True)
    _checksums(True)
    shutil.rmtree(folder, ignore_errors=True)

    summary: dict[str, dict] = {}
    for where in ("cache", "disk"):
        for phase in runs[f"{where}_on"]:
            on = statistics.median(runs[f"{where}_on"][phase])
            off = statistics.median(runs[f"{where}_off"][phase])
            if phase == "train_step":
                summary[f"{where}/{phase}"] = {"s_on": on, "s_off": off,
                                               "time_on_over_off": on / off}
                continue
            summary[f"{where}/{phase}"] = {
                "GBps_on": total / on / 1e9, "GBps_off": total / off / 1e9,
                "time_on_over_off": on / off,
            }
    t0 = time.perf_counter()
    crc(memoryview(srcs[0].numpy()).cast("B"))
    result = {
        "command": "python " + " ".join(sys.argv),
        "args": vars(args),
        "headroom": headroom.__version__,
        "bytes": total,
        "cpu_count": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "crc32c_GBps_one_thread": srcs[0].numel() * 4 / (time.perf_counter() - t0) / 1e9,
        "summary": summary,
        "runs_s": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for k, v in summary.items():
        if "s_on" in v:
            print(f"{k:22s} on {v['s_on']:6.3f} s     off {v['s_off']:6.3f} s   "
                  f"  time on/off {v['time_on_over_off']:.3f}")
            continue
        print(f"{k:22s} on {v['GBps_on']:6.2f} GB/s  off {v['GBps_off']:6.2f} GB/s"
              f"  time on/off {v['time_on_over_off']:.3f}")


if __name__ == "__main__":
    main()
