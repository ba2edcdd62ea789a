"""Quantizing an offloaded model block by block as its values arrive (``hr.load_weights(...,
quantize=fn)``): ``fn(block)`` runs over host values, what it replaced rests packed in the store
([Note: packed parameters]) and the full-precision entries leave it; what it left alone is
written as a load would. At most one block's values are in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from headroom.residency._adopt import rescan, retire
from headroom.residency._group import Group
from headroom.residency._meta import prune_pending
from headroom.store import trim_heap

if TYPE_CHECKING:  # pragma: no cover
    from headroom.residency._schedule import Offload

__all__ = ["quantize_block"]


def quantize_block(state: Offload, group: Group, values: dict[int, torch.Tensor],
                   fn: Callable[[nn.Module], object]) -> None:
    """Run ``fn`` on ``group``'s module over host values of its parameters (``values``: slot
    id -> value; others read from the store) and keep the result in the store. If ``fn``
    raises, the block holds its masters again, the store unchanged for what it had not replaced.
    """
    if state.busy:
        raise RuntimeError("quantizing a block during the model's forward or backward")
    state.drop_announced()
    st = state.store
    temps: dict[int, nn.Parameter] = {}
    slots = list(group.slots)
    for s in slots:
        v = values.get(id(s))
        if v is None:
            if not s.binding.has_value:
                raise RuntimeError(f"{s.name!r} has no value to quantize (load it first)")
            v = st.read(s.binding.handle).result()
        temps[id(s)] = nn.Parameter(v, requires_grad=s.param.requires_grad)
        s.show(temps[id(s)])
    state.res.mover.wait_reads()
    # NOTE: fn may read the block (state_dict()), which would initialize every pending module
    pending, state.pending_modules = state.pending_modules, {}
    try:
        fn(group.module)
    finally:
        state.pending_modules = {**pending, **state.pending_modules}
        replaced = []
        for s in slots:
            t = temps[id(s)]
            if s not in state.slots:
                continue  # taken out with the module fn swapped (see _adopt)
            if all(dict.get(m._parameters, a) is t for m, a in s.owners):
                h = s.binding.handle
                if id(s) in values:
                    st.write(h, t.detach().to("cpu", h.dtype).contiguous()).result()
                    s.binding.has_value = True
                s.show(s.param)
            else:
                replaced.append(s)
        if replaced:  # their values are the temporaries fn consumed
            for s in replaced:
                s.binding.has_value = False
            retire(state, replaced)
    rescan(state)  # adopt what fn registered past the hooks
    prune_pending(state)  # modules fn replaced would stay alive there, with their values
    trim_heap()  # the block's full-precision values go back to the OS, not to malloc's pool
    for s in slots:
        if s not in state.slots:
            # NOTE: a retired slot is in reference cycles: its owners would keep fn's old
            # modules (full-precision values) alive until a collection
            s.owners = []
