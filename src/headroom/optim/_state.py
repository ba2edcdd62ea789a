"""The host optimizer's state dicts: the wrapped class's layout, with fp32 masters kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from headroom.optim._entries import HOSTED, MASTER_DTYPES, Entry

if TYPE_CHECKING:  # pragma: no cover
    from headroom.optim._host_optimizer import HostOptimizer
    from headroom.store import Handle, Store

__all__ = ["ParamState", "SavedView", "index_state", "load_state_dict", "saved_view"]


def index_state(opt: HostOptimizer, e: Entry) -> dict[str, Any] | None:
    """One parameter's state (with the fp32 master of a bf16/fp16 one), or ``None``."""
    if not e.streamed:
        st = opt._inner.state.get(e.master) if opt._inner is not None else None
        if not st:
            return None
        st = dict(st)
        if e.param.dtype not in MASTER_DTYPES:
            st["master"] = e.master  # the fp32 master of a bf16/fp16 parameter
        return st
    if not e.initialized:
        return None
    store = opt._state_store or opt._aux
    st = dict(e.small)
    for k, h in e.state_handles.items():
        st[k] = _as_param(e, store.read(h).result())
    if e.lowp:
        st["master"] = _as_param(e, store.read(e.master_handle).result())
    return st


def _as_param(e: Entry, local: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2) parameter's state tensor as a DTensor sharded like it, as torch keeps
    it (torch.distributed.checkpoint would save a plain tensor as replicated: one rank's)."""
    if not e.sharded:
        return local
    from torch.distributed.tensor import DTensor

    p = e.param
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _local(t: Any) -> Any:
    """The local shard of a DTensor (see `_as_param`)."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _key(k: Any) -> Any:
    """A parameter's key in a state dict: its index (maybe a string, as in JSON) or its name
    (torch.distributed.checkpoint's get_state_dict)."""
    return int(k) if isinstance(k, str) and k.isdigit() else k


def load_state_dict(opt: HostOptimizer, state_dict: dict[str, Any]) -> None:
    """See `HostOptimizer.load_state_dict`."""
    opt._wait()
    if opt._mover is not None:
        opt._mover.wait_reads()  # copy-backs still reading the masters written below
    saved = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in opt.param_groups]
    if sizes != [len(g["params"]) for g in saved]:  # in number or size
        raise ValueError(
            "loaded state dict has parameter groups of sizes "
            f"{[len(g['params']) for g in saved]}, this optimizer has {sizes}"
        )
    id_map = {_key(old): opt._entries[id(p)] for sg, g in zip(saved, opt.param_groups, strict=True)
              for old, p in zip(sg["params"], g["params"], strict=True)}
    states = state_dict["state"]
    unknown = [k for k in states if _key(k) not in id_map]
    if unknown:  # before anything changes
        raise ValueError(
            f"loaded state dict has state for {unknown[0]!r}, which its param_groups do not"
            " list; pass a state dict made by state_dict() of this optimizer (or of"
            " optimizer_class), or through torch.distributed.checkpoint.state_dict's"
            " get_state_dict/set_state_dict"
        )
    # every state is replaced: a mix left by a failed step ends, and so does a step left
    # part-way by a failed final backward (nothing of it committed or exchanged in)
    opt._drop_step()
    opt._torn = None
    for sg, g in zip(saved, opt.param_groups, strict=True):
        for k, v in sg.items():
            if k != "params":
                g[k] = tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v
    inner_sd_state = {}
    streamed_state: dict[Entry, dict[str, Any]] = {}
    opt._masters_loaded = set()
    for old, st in states.items():
        e = id_map[_key(old)]
        if e.streamed:
            streamed_state[e] = st
        else:
            inner_sd_state[e] = dict(st)
            master = inner_sd_state[e].pop("master", None)
            if master is not None and e.kind == HOSTED:
                with torch.no_grad():
                    e.master.copy_(master)
                opt._masters_loaded.add(id(e))
    if opt._inner is not None:
        order = [e for e in opt._order if not e.streamed]
        inner_ids = {e: i for i, e in enumerate(order)}
        inner_groups = [{**opt._hparams(gi), "params": [inner_ids[e] for e in order
                                                         if e.group == gi]}
                        for gi in sorted(opt._inner_index)]
        opt._inner.load_state_dict({
            "state": {inner_ids[e]: st for e, st in inner_sd_state.items()},
            "param_groups": inner_groups,
        })
    for e in opt._order:
        if e.streamed:
            e.initialized = False
            e.small = {}
    opt._allocate_state(list(streamed_state))
    store = opt._state_store or opt._aux
    for e, st in streamed_state.items():
        for k, h in e.state_handles.items():
            if k not in st:
                raise ValueError(f"loaded state of parameter {e.index} lacks {k!r}")
            t = _local(st[k]).detach().to("cpu", h.dtype).reshape(h.shape).contiguous()
            store.write(h, t).result()
        if e.lowp:  # without an fp32 master (the plain class's), from the stored value
            master = _local(st["master"]) if "master" in st else \
                e.bound.store.read(e.bound.handle).result()
            t = master.detach().to("cpu", torch.float32).reshape(e.master_handle.shape)
            store.write(e.master_handle, t.contiguous()).result()
        e.small = {k: (v.detach().clone().cpu() if isinstance(v, torch.Tensor) else v)
                   for k, v in st.items() if k not in e.state_handles and k != "master"}
        e.initialized = True
    opt._refresh_state_view()


@dataclass(frozen=True)
class ParamState:
    """One parameter's optimizer state, as a checkpoint writes it.

    Attributes:
        index: its index in the wrapped class's state dict.
        param: the parameter.
        state: the state in memory (``"master"``: a bf16/fp16 parameter's fp32 master, where
            in memory); ``None``: no state yet.
        resting: the state tensors resting in ``store`` (``"master"`` too for a lowp
            parameter), read slice by slice.
        store: where ``resting`` is (``None`` when nothing rests).
    """

    index: int
    param: torch.Tensor
    state: dict[str, Any] | None
    resting: dict[str, Handle]
    store: Store | None


@dataclass(frozen=True)
class SavedView:
    """What a checkpoint of a `HostOptimizer` saves, read without copying resting state.

    Attributes:
        groups: per parameter group, its hyperparameters and its parameters' indices.
        params: every parameter's `ParamState`, in index order.
        inner_class: the name of the wrapped optimizer class.
    """

    groups: list[tuple[dict[str, Any], list[int]]]
    params: list[ParamState]
    inner_class: str


def saved_view(opt: HostOptimizer) -> SavedView:
    """The state of ``opt`` for a checkpoint, after its step in flight (if any) ended."""
    opt._wait()
    groups = [(opt._hparams(gi), [opt._entries[id(p)].index for p in g["params"]])
              for gi, g in enumerate(opt.param_groups)]
    store = opt._state_store or opt._aux
    params = []
    for e in opt._order:
        if not (e.streamed and e.initialized):  # (no state yet: None)
            params.append(ParamState(e.index, e.param, index_state(opt, e) or None, {}, None))
        else:
            resting = dict(e.state_handles)
            if e.master_handle is not None:
                resting["master"] = e.master_handle
            params.append(ParamState(e.index, e.param, dict(e.small), resting, store))
    return SavedView(groups, params, opt._cls.__name__)
