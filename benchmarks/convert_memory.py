"""Bytes kept for backward on the first and second forward, and the peak during forward: plain
PyTorch vs memsave_torch vs ``hr.convert``, for every model of ``tests/nn/_zoo.py`` (the models the
tests check at small sizes), in the cases of its ``CASES``.

"Kept" is the bytes of storages created during a forward (seen by a ``TorchDispatchMode``) and
of NumPy buffers allocated during it (seen by ``tracemalloc``) that are still alive when it
returns; parameters, buffers and the output are not counted; no saved-tensor hooks are
installed, so headroom runs its fast path, as in training. "Peak" is the most bytes of created
storages alive at once during the forward. Every variant is a fresh copy of the same model, so
"first" is the first forward a converted model ever runs. Each forward is followed by a backward;
outputs and gradients of headroom are checked bitwise against PyTorch's, memsave_torch's are
compared too (and reported where they differ).

Run (memsave_torch is optional; give the folder that contains the ``memsave_torch`` package):

    MEMSAVE_TORCH_PATH=/path/to/memsave_checkout .venv/bin/python benchmarks/convert_memory.py

Writes ``benchmarks/results/convert_memory.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path

import torch
from torch import nn

import headroom as hr

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' models and measurements
from selective_layers import load_memsave  # noqa: E402
from tests.nn._measure import forward_bytes  # noqa: E402
from tests.nn._zoo import BUILDERS, CASES, NORMS, resnet_like, set_case, vgg_like  # noqa: E402

MiB = 1 << 20


def _models(scale: int) -> dict[str, tuple]:
    models = {
        "vgg_like": (
            lambda s: vgg_like(8 * s, size=32, stages=3, hidden=64),
            lambda s, b: (b, 3, 32, 32),
        ),
        "resnet_like": (
            lambda s: resnet_like(8 * s, stem=3, blocks=(1, 1, 1)),
            lambda s, b: (b, 3, 32 * s, 32 * s),
        ),
    }
    models.update(BUILDERS)
    return models


def _step(model: nn.Module, x: torch.Tensor, case: str, seed: int):
    """One forward (measured) and backward; returns (kept, peak, output, grads)."""
    x = x.detach().clone().requires_grad_(case == "input")
    state = [*model.parameters(), *model.buffers()]
    torch.manual_seed(seed)
    kept, peak, out = forward_bytes(lambda: model(x), state)
    grads: list[torch.Tensor | None] = []
    if out.requires_grad:
        weights = torch.linspace(-1, 1, out.numel()).view_as(out)
        (out * weights).sum().backward()
        grads = [x.grad] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return kept, peak, out.detach(), grads


def _same(a, b) -> bool:
    if not torch.equal(a[2], b[2]) or len(a[3]) != len(b[3]):
        return False
    return all(
        (u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
        for u, v in zip(a[3], b[3], strict=True)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=2, help="model width/size multiplier")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--models", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/convert_memory.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    memsave = load_memsave()
    models = _models(args.scale)
    wanted = [m for m in args.models.split(",") if m] or list(models)
    results: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "scale": args.scale,
        "batch": args.batch,
        "memsave_torch": memsave is not None,
        "models": {},
    }
    print(
        "| model | case | torch kept 1st/2nd | memsave 1st/2nd | headroom 1st/2nd "
        "| peak torch/memsave/headroom (KiB) | headroom exact | memsave exact |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in wanted:
        build, shape = models[name]
        torch.manual_seed(0)
        try:
            base = build(args.scale)
        except ImportError as exc:  # transformers missing
            print(f"{name}: skipped ({exc})")
            continue
        x = torch.randn(shape(args.scale, args.batch))
        rows = {}
        for case in CASES[:4]:
            if case == "norm" and not any(isinstance(m, NORMS) for m in base.modules()):
                continue
            variants = {"torch": copy.deepcopy(base), "headroom": hr.convert(copy.deepcopy(base))}
            if memsave is not None:
                try:
                    variants["memsave"] = memsave(copy.deepcopy(base))
                except Exception as exc:  # noqa: BLE001 - a peer's failure is reported
                    print(f"{name}: memsave_torch failed to convert ({exc!r})")
            row = {}
            ref = None
            for vname, model in variants.items():
                set_case(model, case)
                try:
                    first = _step(model, x, case, seed=1)
                    second = _step(model, x, case, seed=2)
                except Exception as exc:  # noqa: BLE001 - a peer's failure is reported
                    row[vname] = {"error": repr(exc)}
                    continue
                if vname == "torch":
                    ref = (first, second)
                row[vname] = {
                    "kept_first": first[0],
                    "kept_second": second[0],
                    "peak_first": first[1],
                    "peak_second": second[1],
                }
                if ref is not None and vname != "torch":
                    row[vname]["exact"] = _same(ref[0], first) and _same(ref[1], second)
            rows[case] = row

            def cell(v, key, row=row):
                r = row.get(v)
                if r is None:
                    return "n/a"
                if "error" in r:
                    return "error"
                return f"{r[key + '_first'] / 1024:.1f} / {r[key + '_second'] / 1024:.1f}"

            peaks = " / ".join(
                f"{row[v]['peak_first'] / 1024:.1f}"
                if v in row and "error" not in row[v]
                else "n/a"
                for v in ("torch", "memsave", "headroom")
            )
            ms = row.get("memsave", {})
            print(
                f"| {name} | {case} | {cell('torch', 'kept')} | {cell('memsave', 'kept')} | "
                f"{cell('headroom', 'kept')} | {peaks} | "
                f"{row.get('headroom', {}).get('exact', 'n/a')} | "
                f"{ms.get('exact', ms.get('error', 'n/a'))} |",
                flush=True,
            )
        results["models"][name] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
