"""Page-locked bytes spent for a model's host masters and gradients: one pinned allocation per
tensor (torch's caching host allocator) against headroom's slabs.

torch's caching host allocator rounds every pinned allocation up to the next power of two
(``CachingHostAllocator.h``: ``PowerOf2Ceil``, the default configuration). headroom carves
tensors out of slabs: on CUDA one slab registered at its own size per reserved group
(``hr.offload`` reserves the masters together and each backward the gradients together), on
other accelerators one power-of-two slab per group. The figures are that arithmetic, done by
``headroom.store._pinned.spent`` (the rule the accounting uses) over the real shapes, and,
as a check that the code spends what the arithmetic says, a pinned ``HostStore`` filled with
the same shapes at 1/64 of their rows (plain memory standing in where no runtime can pin).

    .venv/bin/python benchmarks/pinned_memory.py
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from headroom.store import HostStore, pinned_bytes
from headroom.store._pinned import ALIGN, _backend, spent


def llama_7b() -> list[tuple[int, ...]]:
    d, ff, layers, vocab = 4096, 11008, 32, 32000
    per_layer = [(d, d)] * 4 + [(ff, d), (ff, d), (d, ff), (d,), (d,)]
    return [(vocab, d)] + per_layer * layers + [(d,), (vocab, d)]


def gpt2_xl() -> list[tuple[int, ...]]:
    d, layers, vocab, ctx = 1600, 48, 50257, 1024
    per_layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d),
                 (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (ctx, d)] + per_layer * layers + [(d,), (d,)]


def head_10m() -> list[tuple[int, ...]]:
    return [(10_000_000, 128), (10_000_000,)]  # a 5.12 GB classifier weight and its bias


def figures(shapes: list[tuple[int, ...]], itemsize: int = 4) -> dict:
    sizes = [math.prod(s) * itemsize for s in shapes]
    logical = 2 * sum(sizes)  # masters and gradients
    per_tensor = 2 * sum(spent(n, "cache") for n in sizes)
    group = sum(-(-n // ALIGN) * ALIGN for n in sizes)
    return {
        "tensors": 2 * len(sizes),
        "logical_bytes": logical,
        "per_tensor_pinned_bytes": per_tensor,
        "slabs_registered_bytes": 2 * spent(group, "register"),
        "slabs_power_of_two_bytes": 2 * spent(group, "cache"),
        "per_tensor_over_logical": per_tensor / logical,
        "registered_over_logical": 2 * spent(group, "register") / logical,
        "power_of_two_slabs_over_logical": 2 * spent(group, "cache") / logical,
    }


def check_store(shapes: list[tuple[int, ...]], scale: int = 64) -> dict:
    """A pinned HostStore holding masters and gradients of the shapes with rows / ``scale``."""
    small = [(max(1, s[0] // scale), *s[1:]) for s in shapes]
    base = pinned_bytes()
    store = HostStore(pin=True)
    # One slab per reserved group (masters, then gradients), costing what its backend spends.
    backend = _backend(True, store._arena.device)
    group = sum(-(-math.prod(s) * 4 // ALIGN) * ALIGN for s in small)
    for tag in ("master", "grad"):
        store.reserve(math.prod(s) * 4 for s in small)
        for i, s in enumerate(small):
            store.alloc(f"{tag}{i}", s, torch.float32, zero=False)
    out = {"rows_divided_by": scale, "logical_bytes": store.used_bytes,
           "spent_bytes": store.spent_bytes, "pinned_bytes": pinned_bytes() - base,
           "backend": backend,
           "expected_bytes": 2 * spent(group, backend)}
    store.close()
    out["pinned_after_close"] = pinned_bytes() - base
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/pinned_memory.json")
    args = ap.parse_args()
    models = {"llama-7b fp32": llama_7b(), "gpt2-xl fp32": gpt2_xl(),
              "10M-class head, 128 features, fp32": head_10m()}
    rows = {name: figures(shapes) for name, shapes in models.items()}
    check = check_store(llama_7b())
    for name, r in rows.items():
        print(f"{name:>36}: {r['logical_bytes'] / 2**30:7.2f} GiB logical;"
              f" per-tensor pinning {r['per_tensor_over_logical']:.3f}x,"
              f" registered slabs {r['registered_over_logical']:.4f}x,"
              f" power-of-two slabs {r['power_of_two_slabs_over_logical']:.3f}x")
    print(f"check (llama-7b rows / 64, this build): {check}")
    assert check["spent_bytes"] == check["pinned_bytes"] == check["expected_bytes"]
    assert check["pinned_after_close"] == 0
    acc = torch.accelerator
    runtime = str(acc.current_accelerator()) if acc.is_available() else \
        "none (CPU-only build: plain memory counted as registered)"
    out = {"command": ".venv/bin/python benchmarks/pinned_memory.py", "models": rows,
           "store_check": check, "pinning_runtime": runtime}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
