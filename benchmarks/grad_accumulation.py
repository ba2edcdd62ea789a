"""Gradient accumulation on a model trained from disk: summed in the store or on the device.

``device="cpu"``, parameters on a `hr.DiskStore` (page cache off, so that every byte goes to
the disk), ``hr.HostOptimizer(AdamW)`` with its state on disk, ``--accum`` micro-batches per
step. Two ways, side by side in one process, their steps interleaved round by round:

* ``store``: ``hr.offload(..., grad_accumulation="store")`` (the default): each backward's
  gradient goes to the store, read back, added and written again by the next one.
* ``device``: ``grad_accumulation="device"``: the micro-batches' gradients are summed where
  the model computes (here the CPU's RAM: 4 bytes per parameter more) and written once, when
  the step reads them.
* ``plain``: the same model resident in RAM with ``torch.optim.AdamW``: the time of the
  computation alone, and the reference every headroom run must equal bitwise.

Reports per step: wall time (median of ``--steps`` after a warm-up), the store's bytes read and
written (parameters, gradients; the optimizer state's store apart), the process's peak RSS
growth during the step, and checks that both headroom runs end bitwise equal to ``plain``.
Writes ``benchmarks/results/grad_accumulation.json``.

    .venv/bin/python benchmarks/grad_accumulation.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of

ROOT = Path(__file__).resolve().parent.parent


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def build(width: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[MLP(width) for _ in range(blocks)])


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS


def setup(doc: str, name: str, *, accum: int, steps: int) -> tuple[argparse.Namespace, Path]:
    """The options of a disk-trained MLP benchmark (``name``: its results file and scratch
    folder), parsed; threads set; an empty scratch folder."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--accum", type=int, default=accum)
    ap.add_argument("--steps", type=int, default=steps, help="timed steps (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=f"/tmp/headroom-{name.replace('_', '-')}")
    ap.add_argument("--out", default=str(ROOT / f"benchmarks/results/{name}.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return args, root


def _proc_written() -> int:
    """Bytes this process has sent to the storage layer (``/proc/self/io``), 0 if unknown."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def timed_rounds(runs: dict, batches: list, step, *, rss: bool = False) -> None:
    """Each run steps every group of micro-batches, round by round (load falls on all alike),
    the first round a warm-up; appends each run's step time, its store's bytes read and
    written, the bytes the process wrote as the kernel counts them (``os_written``, an
    independent check of the store's count with the page cache off) and (``rss``) its peak
    RSS growth to the run's lists."""
    width = max(len(m) for m in runs)
    for s, xs in enumerate(batches):
        for mode, r in runs.items():
            st = r["store"]
            before = st.stats() if st is not None else None
            os0 = _proc_written()
            if rss:
                _reset_peak()
                rss0 = _status("VmRSS")
            t = time.perf_counter()
            step(mode, r, xs)
            dt = time.perf_counter() - t
            if s == 0:
                continue  # warm-up (the first step creates the state)
            r["times"].append(dt)
            if rss:
                r["rss"].append(_status("VmHWM") - rss0)
            if st is not None:
                after = st.stats()
                r["read"].append(after["bytes_read"] - before["bytes_read"])
                r["written"].append(after["bytes_written"] - before["bytes_written"])
                r.setdefault("os_written", []).append(_proc_written() - os0)
            print(f"step {s}: {mode:>{width}} {dt:7.2f} s", flush=True)


def disk_medians(r: dict) -> dict:
    """A run's median store bytes read and written per step (none without a store)."""
    if r["store"] is None:
        return {}
    return {"disk_read_bytes_per_step": statistics.median(r["read"]),
            "disk_written_bytes_per_step": statistics.median(r["written"]),
            "os_written_bytes_per_step": statistics.median(r["os_written"])}


def collect(name: str, args, runs: dict, ref: str, exact_key: str, n_params: int,
            extra=lambda r: {}) -> dict:
    """The results JSON of a benchmark's runs (times, store bytes, ``extra(run)``), each run
    checked bitwise against run ``ref`` (exits naming the first that differs)."""
    want = runs[ref]["model"].state_dict()
    out = {"benchmark": name, "config": vars(args), "params": n_params,
           "machine": {"platform": platform.platform(), "torch": torch.__version__,
                       "threads": args.threads},
           "results": {}}
    for mode, r in runs.items():
        sd = r["model"].state_dict()
        exact = all(torch.equal(sd[k], v) for k, v in want.items())
        out["results"][mode] = {"median_step_s": statistics.median(r["times"]),
                                "step_s": r["times"], exact_key: exact, **extra(r),
                                **disk_medians(r)}
        if not exact:
            raise SystemExit(f"{mode} is not bitwise equal to {ref}")
    return out


def ratios(new: dict, old: dict) -> dict:
    """Step time and store bytes of one run's results over another's."""
    return {"time": new["median_step_s"] / old["median_step_s"],
            "disk_read": new["disk_read_bytes_per_step"] / old["disk_read_bytes_per_step"],
            "disk_written": (new["disk_written_bytes_per_step"]
                             / old["disk_written_bytes_per_step"])}


def main() -> None:
    args, root = setup(__doc__, "grad_accumulation", accum=4, steps=3)

    runs = {}
    for mode in ("plain", "store", "device"):
        model = build(args.width, args.blocks)
        if mode == "plain":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as the host step
            store = None
        else:
            store = hr.DiskStore(root / f"params-{mode}", page_cache=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hr.offload(model, device="cpu", store=store, grad_accumulation=mode)
            opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                   state_store=hr.DiskStore(root / f"state-{mode}",
                                                            page_cache=False))
        runs[mode] = {"model": model, "opt": opt, "store": store, "times": [], "read": [],
                      "written": [], "rss": []}
    n_params = sum(p.numel() for p in runs["plain"]["model"].parameters())
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(args.batch, args.width, generator=g) for _ in range(args.accum)]
               for _ in range(args.steps + 1)]

    def step(mode, r, xs) -> None:
        for x in xs:
            (r["model"](x).square().mean() / len(xs)).backward()
        r["opt"].step()
        r["opt"].zero_grad()

    timed_rounds(runs, batches, step, rss=True)

    for r in runs.values():
        if r["store"] is not None:
            assert state_of(r["model"])._held == {}
    out = collect("grad_accumulation", args, runs, "plain", "exact_vs_plain", n_params,
                  lambda r: {"median_rss_growth_bytes": statistics.median(r["rss"])})
    out["device_vs_store"] = ratios(out["results"]["device"], out["results"]["store"])
    gib = 2 ** 30
    print(f"{n_params / 1e6:.0f}M parameters, {args.accum} micro-batches of {args.batch}")
    for mode, res in out["results"].items():
        io = (f", disk read {res['disk_read_bytes_per_step'] / gib:.2f} GiB, written"
              f" {res['disk_written_bytes_per_step'] / gib:.2f} GiB"
              if "disk_read_bytes_per_step" in res else "")
        print(f"  {mode:>6}: {res['median_step_s']:.2f} s/step, RSS growth"
              f" {res['median_rss_growth_bytes'] / gib:.2f} GiB{io}, exact {res['exact_vs_plain']}")
    print("  device / store:", {k: round(v, 3) for k, v in out["device_vs_store"].items()})
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
