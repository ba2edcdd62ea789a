"""The names a wrapped model's tensors have in a checkpoint of the model before it was wrapped.

PEFT puts the model under ``base_model.model.`` and each adapted layer's module under
``base_layer``; `checkpoint_names` gives `load_weights` both names, so a base checkpoint loads
into a wrapped model as strictly as into an unwrapped one. The adapters (siblings of a
``base_layer``) are loaded when the files hold them and otherwise keep their values.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from headroom.residency import is_packed

if TYPE_CHECKING:  # pragma: no cover
    from headroom.checkpoint._weights import _Target

__all__ = ["checkpoint_names", "module_tensors", "refuse_quantized"]

_BASE = "base_layer"


def module_tensors(model: nn.Module
                   ) -> Iterator[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """``(state_dict name, module, attribute, tensor, is_buffer)`` of every parameter and
    persistent buffer, a tied one under each of its names, without reading any store."""
    for mname, m in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        for n, p in m._parameters.items():
            if p is not None:
                yield prefix + n, m, n, p, False
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                yield prefix + n, m, n, b, True


def checkpoint_names(model: nn.Module, targets: list[_Target],
                     available: Collection[str]) -> list[_Target]:
    """``targets`` with the checkpoint names of wrapped tensors added to their names, less the
    wrappers' own tensors that the checkpoint does not hold."""
    if all(any(n in available for n in t.names) for t in targets):
        return targets  # an unwrapped model, or a checkpoint of the wrapped one
    wrappers = [f"{name}." for name, m in model.named_modules()
                if isinstance(m._modules.get(_BASE), nn.Module)]
    if not wrappers:
        return targets
    prefix = _prefix([n for t in targets for n in t.names], available)
    out = []
    for t in targets:
        if any(n in available for n in t.names):
            out.append(t)
            continue
        mapped = [m for m in (_unwrapped(n, prefix) for n in t.names) if m in available]
        if mapped:
            t.names.extend(m for m in mapped if m not in t.names)
            out.append(t)
        elif not all(_own(n, wrappers) for n in t.names):
            out.append(t)  # a base tensor the checkpoint lacks: reported as missing
    return out


def _unwrapped(name: str, prefix: str) -> str:
    if prefix and name.startswith(prefix):
        name = name[len(prefix):]
    return ".".join(part for part in name.split(".") if part != _BASE)


def _own(name: str, wrappers: list[str]) -> bool:
    """A tensor of a wrapper itself (an adapter), not of the module it wraps."""
    return any(name.startswith(w) and not name.startswith(f"{w}{_BASE}.") for w in wrappers)


def _prefix(names: list[str], available: Collection[str]) -> str:
    """The leading path the wrapped model's names have and the checkpoint's lack (e.g.
    ``base_model.model.``): the one that makes the most names match, shortest first."""
    best, hits = "", -1
    heads = {".".join(n.split(".")[:k]) + "." for n in names[:64] for k in range(1, 4)
             if n.count(".") >= k}
    for cand in ["", *sorted(heads, key=len)]:
        h = sum(1 for n in names if _unwrapped(n, cand) in available)
        if h > hits:
            best, hits = cand, h
    return best


def refuse_quantized(named: Iterable[tuple[str, torch.Tensor | None]], what: str,
                     fix: str) -> None:
    """Raise ``TypeError`` naming the quantized weights among ``named`` (`is_packed`; not a
    DTensor), before ``what`` has written anything, with ``fix``."""
    quantized = [(n, type(t).__name__) for n, t in named if t is not None and is_packed(t)
                 and not isinstance(getattr(t, "_local_tensor", None), torch.Tensor)]
    if quantized:
        listed = ", ".join(f"{n} ({c})" for n, c in quantized[:5])
        more = " ..." if len(quantized) > 5 else ""
        raise TypeError(f"{what} cannot handle quantized weights: {listed}{more}"
                        f" ({len(quantized)} in all); nothing was written. {fix}")
