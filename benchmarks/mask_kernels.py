"""Claim: headroom's C mask kernels pack and unpack a ReLU's 1-bit mask faster than the NumPy
code they replace (1.5-2x on this machine), with the same bytes, and take the mask's cost in a
ResNet-18-like step down accordingly.

Side by side in one run:

- kernels alone, on float32 buffers of several sizes: ``pack_nonzero`` and ``unpack_as`` with
  the C kernels, and with the NumPy fallback (what runs where no C compiler was available at
  install), median of interleaved repeats;
- in a real step (the ResNet-like model of ``selective_layers.py``, only the BatchNorm affine
  parameters training, so all 17 ReLU calls keep a mask): the time spent inside packing and
  unpacking per step, with each implementation, and the step's CPU time against plain PyTorch
  (interleaved, a random order per repeat).

    python benchmarks/mask_kernels.py [--repeats 31]

Writes ``benchmarks/results/mask_kernels.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import headroom as hr
from headroom.nn import _activation, _bitmask

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' models
from tests.nn._zoo import resnet_like, set_case  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "mask_kernels.json"


@contextmanager
def numpy_fallback(on: bool):
    """Run the NumPy code instead of the C kernels while active (when ``on``)."""
    saved = _bitmask._native
    if on:
        _bitmask._native = None
    try:
        yield
    finally:
        _bitmask._native = saved


def kernels_alone(sizes: list[int], repeats: int) -> dict:
    out = {}
    for n in sizes:
        torch.manual_seed(0)
        x = torch.relu(torch.randn(n))
        times: dict[str, list[float]] = {}
        bits = {}
        for _ in range(repeats):
            for impl in ("native", "numpy"):
                with numpy_fallback(impl == "numpy"):
                    t0 = time.perf_counter()
                    b = _bitmask.pack_nonzero(x)
                    t1 = time.perf_counter()
                    _bitmask.unpack_as(b, x.shape, x.dtype, reuse=True)
                    t2 = time.perf_counter()
                bits[impl] = b
                times.setdefault(f"pack_{impl}", []).append(t1 - t0)
                times.setdefault(f"unpack_{impl}", []).append(t2 - t1)
        assert torch.equal(bits["native"], bits["numpy"]), "the two implementations differ"
        row = {k: statistics.median(v) for k, v in times.items()}
        row["pack_speedup"] = row["pack_numpy"] / row["pack_native"]
        row["unpack_speedup"] = row["unpack_numpy"] / row["unpack_native"]
        out[str(n)] = row
        print(
            f"{n:>9d} floats | pack  native {row['pack_native'] * 1e6:7.1f} us"
            f"  numpy {row['pack_numpy'] * 1e6:7.1f} us ({row['pack_speedup']:.2f}x)"
            f" | unpack native {row['unpack_native'] * 1e6:7.1f} us"
            f"  numpy {row['unpack_numpy'] * 1e6:7.1f} us ({row['unpack_speedup']:.2f}x)",
            flush=True,
        )
    return out


class _Timed:
    """Wraps what a converted activation calls to pack its mask (``Late.pack``) and to use it in
    backward (``Late.unpack``, and ``grad_through``, which computes the gradient straight from
    the mask where the C kernels run), summing the time inside each."""

    def __init__(self) -> None:
        self.seconds = {"pack": 0.0, "unpack": 0.0}
        self._saved = (_activation.Late.pack, _activation.Late.unpack, _activation.grad_through)

    def _wrap(self, fn, key):
        def timed(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            self.seconds[key] += time.perf_counter() - t0
            return r

        return timed

    def __enter__(self):
        pack, unpack, through = self._saved
        _activation.Late.pack = self._wrap(pack, "pack")
        _activation.Late.unpack = self._wrap(unpack, "unpack")
        _activation.grad_through = self._wrap(through, "unpack")
        return self

    def __exit__(self, *exc) -> None:
        _activation.Late.pack, _activation.Late.unpack, _activation.grad_through = self._saved


def in_a_step(repeats: int, seed: int) -> dict:
    torch.manual_seed(0)
    plain = resnet_like()
    set_case(plain, "norm")
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(8, 3, 128, 128)

    def step(model) -> float:
        c0 = time.process_time()
        model(x).sum().backward()
        cpu = time.process_time() - c0
        model.zero_grad(set_to_none=True)
        return cpu

    variants = ("plain", "native", "numpy")
    for v in variants:  # warm-up (the ReLUs learn their consumers)
        with numpy_fallback(v == "numpy"):
            step(plain if v == "plain" else ours)
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    inside: dict[str, list[dict[str, float]]] = {"native": [], "numpy": []}
    rng = random.Random(seed)
    order = list(variants)
    for _ in range(repeats):
        rng.shuffle(order)
        for v in order:
            if v == "plain":
                cpu[v].append(step(plain))
                continue
            with numpy_fallback(v == "numpy"), _Timed() as timed:
                cpu[v].append(step(ours))
            inside[v].append(dict(timed.seconds))
    base = statistics.median(cpu["plain"])
    out = {"plain_cpu_s": base}
    for v in ("native", "numpy"):
        row = {
            "cpu_s": statistics.median(cpu[v]),
            "cpu_vs_plain": statistics.median(cpu[v]) / base,
            "cpu_vs_plain_paired": statistics.median(
                a / b for a, b in zip(cpu[v], cpu["plain"], strict=True)
            ),
            "pack_s_per_step": statistics.median(s["pack"] for s in inside[v]),
            "unpack_s_per_step": statistics.median(s["unpack"] for s in inside[v]),
        }
        out[v] = row
        print(
            f"ResNet-like norm step, {v:6s}: pack {row['pack_s_per_step'] * 1e3:.2f} ms"
            f" + unpack {row['unpack_s_per_step'] * 1e3:.2f} ms per step;"
            f" step {row['cpu_s'] * 1e3:.1f} ms = {row['cpu_vs_plain']:.3f}x plain"
            f" (paired {row['cpu_vs_plain_paired']:.3f}x)",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels = _bitmask.native_kernels()
    if kernels is None:
        print("the C kernels are not built here (no C compiler at install?): nothing to compare")
        return
    print(f"C kernels: {kernels}; torch {torch.__version__}, 1 thread")
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "simd": kernels,
        "threads": 1,
        "repeats": args.repeats,
        "kernels_alone": kernels_alone([1 << 18, 1 << 20, 1 << 22], args.repeats),
        "resnet_like_norm_step": in_a_step(args.repeats, args.seed),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
