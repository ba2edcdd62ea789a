"""Quantized parameters resting packed: bitsandbytes' and torchao's weights as they are.

[Note: packed parameters] A quantized weight is not one plain tensor: torchao's are wrapper
subclasses over inner tensors (``__tensor_flatten__``), bitsandbytes' ``Params4bit`` holds
packed codes and a ``quant_state``, ``Int8Params`` int8 rows and scales (``SCB``). A `Packing`
splits one into plain *parts* and rebuilds the same class from them. Each part is a store entry
of its own (``"<name>#<part>"``): the store holds the quantized bytes, never a dequantized copy.
The *master* is the class rebuilt over the store's host tensors, or over `StoreTensor` parts
reading the disk (``meta`` where the class needs memory). The *device copy* is rebuilt once over
persistent device parts resized to 0 while not resident ([Note: masters and device copies]), so
what autograd saved of it stays valid across a release and a re-fetch. Quantized weights do not
train: no gradient, no optimizer step.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from headroom.store import Handle, MetaStore, Store
from headroom.transfer import HandleSource, StoreTensor, resize_storage, stored_view

__all__ = [
    "Packed", "Packing", "as_stored", "check_packable", "is_packed", "meta_like",
    "packable", "packed_nbytes", "packing_of", "part_key", "read_parts", "rest_master",
    "state_entries", "stored_spec", "trains",
]

# dtypes every store keeps as they are; other parts (float8 codes) rest as their bytes (uint8)
_PLAIN_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                 torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}


def part_key(name: str, part: str) -> str:
    return f"{name}#{part}"


def _bnb() -> Any:
    return sys.modules.get("bitsandbytes")


def _bnb_kind(p: torch.Tensor) -> str | None:
    for kind, name in (("bnb4", "Params4bit"), ("bnb8", "Int8Params")):
        c = getattr(getattr(_bnb(), "nn", None), name, None)
        if c is not None and isinstance(p, c):
            return kind
    return None


def is_packed(p: torch.Tensor) -> bool:
    """Whether ``p`` is a quantized parameter (a tensor subclass with parts of its own)."""
    if type(p) in (torch.Tensor, nn.Parameter) or isinstance(p, StoreTensor):
        return False
    return _bnb_kind(p) is not None or hasattr(type(p), "__tensor_flatten__")


def packable(p: torch.Tensor, name: str, owners: list | tuple = (),
             ) -> tuple[Packing, dict[str, torch.Tensor]]:
    """`packing_of` a quantized parameter to offload; raises ValueError saying why it cannot."""
    why = trains(p, name, "requires grad") if p.requires_grad else None
    if why is None:
        try:
            return packing_of(p, name, owners)
        except _Unsupported as e:
            why = str(e)
    raise ValueError(f"hr.offload cannot keep {why}")


def trains(p: torch.Tensor, name: str, how: str) -> str:
    """Why the quantized parameter ``p`` cannot require grad (``how`` it does)."""
    return (f"the quantized parameter {name!r} ({type(p).__name__}) {how}: quantized weights"
            " rest packed and do not train. Freeze it (requires_grad_(False)) and train adapters"
            " over it (peft.get_peft_model)")


class _Unsupported(Exception):
    pass


def check_packable(st: Store, claimed: set[str], p: torch.Tensor, name: str,
                   owners: list) -> None:
    """Refuse, before anything changes, a quantized parameter that cannot rest packed."""
    packing, _ = packable(p, name, owners)
    for k, (shape, dtype) in packing.specs.items():
        key = part_key(name, k)
        if key not in st:
            if p.device.type == "meta" and not isinstance(st, MetaStore):  # (a dry run's)
                raise ValueError(
                    f"the quantized parameter {name!r} is on the meta device and {st!r} holds"
                    f" no value for it ({key!r}): quantize real weights (or load them) before"
                    " hr.offload")
            continue
        if key in claimed:
            raise RuntimeError(
                f"{key!r} in {st!r} is in use by another offloaded model or classifier head;"
                " give each model its own store (or DiskStore directory)")
        h = st.get(key)
        want = stored_spec(shape, dtype)
        if (h.shape, h.dtype) != want:
            raise ValueError(
                f"the store already holds {key!r} as {h.dtype} {h.shape}, but the quantized"
                f" parameter's part is {want[1]} {want[0]}; use an empty directory for a"
                " different model, or quantize the model as it was stored")


def meta_like(p: torch.Tensor, owners: list | tuple = (),
              ) -> tuple[torch.Tensor, dict[int, torch.Tensor]] | None:
    """A quantized parameter's twin over ``meta`` parts (for a dry run) and stand-ins, by
    ``id``, for tensors ``owners`` keep of it (``state.CB``/``SCB``); ``None`` if unsplittable."""
    try:
        packing, _ = packing_of(p, "", owners)
    except _Unsupported:
        return None
    parts = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in packing.specs.items()}
    twin = packing.rebuild(parts)
    stand_ins: dict[int, torch.Tensor] = {}
    if packing.kind == "bnb8":
        # NOTE: scales where the weight holds them now, or the dry run's forward would
        # quantize again, which the real step does not
        twin.CB = parts["data"] if p.CB is not None else None
        twin.SCB = parts["SCB"] if p.SCB is not None else None
        for m, _ in owners:
            state = getattr(m, "state", None)
            for attr, stand_in in (("CB", parts["data"]), ("SCB", parts["SCB"])):
                t = getattr(state, attr, None)
                if isinstance(t, torch.Tensor):
                    stand_ins[id(t)] = stand_in
    return twin, stand_ins


def packed_nbytes(p: torch.Tensor) -> int | None:
    """Bytes of a quantized parameter's parts, or ``None`` if unsplittable; reads no values."""
    try:
        return packing_of(p, "")[0].nbytes
    except _Unsupported:
        return None


# ---------------------------------------------------------------------------------- packings
@dataclass(eq=False)
class Packing:
    """How one quantized parameter splits into plain parts (``specs``: name -> shape and
    dtype) and is rebuilt from them (``build``); ``kind``: ``"flatten"``, ``"bnb4"``, ``"bnb8"``."""

    kind: str
    cls: type
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    build: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    is_param: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.specs.values())

    def rebuild(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        t = self.build(parts)
        if self.is_param and not isinstance(t, nn.Parameter):
            t = nn.Parameter(t, requires_grad=False)
        return t


def packing_of(p: torch.Tensor, name: str, owners: list | tuple = (),
               ) -> tuple[Packing, dict[str, torch.Tensor]]:
    """``p``'s `Packing` and its parts now; ``owners``: its ``(module, attr)`` registrations
    (an 8-bit layer keeps its scales). Raises `_Unsupported` saying why it cannot be split."""
    kind = _bnb_kind(p)
    if kind == "bnb4":
        return _bnb4(p, name)
    if kind == "bnb8":
        return _bnb8(p, name, owners)
    if hasattr(type(p), "__tensor_flatten__"):
        return _flatten(p, name)
    raise _Unsupported(f"{name!r} is a {type(p).__name__}, a tensor subclass headroom cannot"
                       " split into plain tensors")


def _spec(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    return tuple(t.shape), t.dtype


def _check_plain_part(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _Unsupported(f"{what} is a {type(t).__name__}, not a tensor")
    if type(t) not in (torch.Tensor, nn.Parameter) and not isinstance(t, StoreTensor):
        raise _Unsupported(f"{what} is a {type(t).__name__}, which cannot be split further")
    if t.is_sparse or t.layout != torch.strided:
        raise _Unsupported(f"{what} has layout {t.layout}; only strided parts can rest in a store")
    if t.device.type not in ("cpu", "meta") and not t.is_contiguous():
        raise _Unsupported(f"{what} is not contiguous")
    return t.detach()


# --- torchao and any traceable wrapper subclass ---------------------------------------------
@dataclass(eq=False)
class _Tree:
    cls: type
    ctx: Any
    size: torch.Size
    stride: tuple[int, ...]
    children: dict[str, _Tree | None]


def _flatten(p: torch.Tensor, name: str) -> tuple[Packing, dict[str, torch.Tensor]]:
    parts: dict[str, torch.Tensor] = {}

    def walk(t: torch.Tensor, prefix: str, depth: int) -> _Tree:
        if depth > 8:
            raise _Unsupported(f"{name!r}: tensor subclasses nested more than 8 deep")
        try:
            names, ctx = t.__tensor_flatten__()
        except Exception as e:  # noqa: BLE001 - reported as the reason
            raise _Unsupported(f"{name!r} ({type(t).__name__}): __tensor_flatten__ failed:"
                               f" {type(e).__name__}: {e}") from e
        children: dict[str, _Tree | None] = {}
        for n in names:
            inner = getattr(t, n)
            key = prefix + n
            if isinstance(inner, torch.Tensor) and hasattr(type(inner), "__tensor_flatten__") \
                    and type(inner) not in (torch.Tensor, nn.Parameter):
                children[n] = walk(inner, key + ".", depth + 1)
            else:
                parts[key] = _check_plain_part(inner, f"{name!r}'s inner tensor {key!r}")
                children[n] = None
        return _Tree(type(t), ctx, t.size(), tuple(t.stride()), children)

    tree = walk(p, "", 0)

    def build(got: dict[str, torch.Tensor]) -> torch.Tensor:
        return _unflatten(tree, got, "")

    specs = {k: _spec(v) for k, v in parts.items()}
    packing = Packing("flatten", type(p), specs, build, is_param=isinstance(p, nn.Parameter))
    # a subclass whose rebuild loses something is refused rather than streamed wrong
    try:
        probe = build({k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in specs.items()})
    except Exception as e:  # noqa: BLE001 - reported as the reason
        raise _Unsupported(f"{name!r} ({type(p).__name__}) cannot be rebuilt from its inner"
                           f" tensors (__tensor_unflatten__: {type(e).__name__}: {e})") from e
    if type(probe) is not type(p) or probe.shape != p.shape or probe.dtype != p.dtype:
        raise _Unsupported(f"{name!r} ({type(p).__name__}) rebuilt from its inner tensors is a"
                           f" {type(probe).__name__} {probe.dtype} {tuple(probe.shape)}")
    return packing, parts


def _unflatten(tree: _Tree, got: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    inner = {n: got[prefix + n] if sub is None else _unflatten(sub, got, f"{prefix}{n}.")
             for n, sub in tree.children.items()}
    return tree.cls.__tensor_unflatten__(inner, tree.ctx, tree.size, tree.stride)


# --- bitsandbytes ---------------------------------------------------------------------------
def _bnb4(p: torch.Tensor, name: str) -> tuple[Packing, dict[str, torch.Tensor]]:
    F = _bnb().functional
    qs = p.quant_state
    if not getattr(p, "bnb_quantized", False) or qs is None:
        raise _Unsupported(
            f"{name!r} is a bitsandbytes Params4bit that is not quantized yet (it quantizes when"
            " its module is moved to a device): call .to(device) on the model (or load it with"
            " a BitsAndBytesConfig) before hr.offload")
    data = p.data
    if getattr(qs, "packing_format_for_cpu", False):  # repacked for a CPU kernel: undone
        data, qs = F._convert_weight_packed_for_cpu_inverse(data, qs)
        p.data, p.quant_state = data, qs
    parts = {"data": _check_plain_part(data, f"{name!r}'s packed codes"),
             "absmax": _check_plain_part(qs.absmax, f"{name!r}'s absmax"),
             "code": _check_plain_part(qs.code, f"{name!r}'s code book")}
    s2 = qs.state2 if qs.nested else None
    if s2 is not None:
        parts["offset"] = _check_plain_part(torch.as_tensor(qs.offset), f"{name!r}'s offset")
        parts["state2.absmax"] = _check_plain_part(s2.absmax, f"{name!r}'s nested absmax")
        parts["state2.code"] = _check_plain_part(s2.code, f"{name!r}'s nested code book")
    cls = type(p)
    meta = dict(shape=qs.shape, dtype=qs.dtype, blocksize=qs.blocksize, quant_type=qs.quant_type,
                s2=(s2.blocksize, s2.dtype) if s2 is not None else None,
                p_blocksize=p.blocksize, compress_statistics=p.compress_statistics,
                p_quant_type=p.quant_type, quant_storage=p.quant_storage,
                module=getattr(p, "module", None))

    def state(got: dict[str, torch.Tensor]) -> Any:
        QuantState = _bnb().functional.QuantState
        state2 = None
        if meta["s2"] is not None:
            state2 = QuantState(absmax=got["state2.absmax"], code=got["state2.code"],
                                blocksize=meta["s2"][0], dtype=meta["s2"][1])
        return QuantState(absmax=got["absmax"], shape=meta["shape"], code=got["code"],
                          blocksize=meta["blocksize"], quant_type=meta["quant_type"],
                          dtype=meta["dtype"],
                          offset=got["offset"] if state2 is not None else None, state2=state2)

    def build(got: dict[str, torch.Tensor]) -> torch.Tensor:
        return cls(data=got["data"], requires_grad=False, quant_state=state(got),
                   blocksize=meta["p_blocksize"], compress_statistics=meta["compress_statistics"],
                   quant_type=meta["p_quant_type"], quant_storage=meta["quant_storage"],
                   module=meta["module"], bnb_quantized=True)

    packing = Packing("bnb4", cls, {k: _spec(v) for k, v in parts.items()}, build,
                      extra={"state": state})
    return packing, parts


def _bnb8(p: torch.Tensor, name: str, owners) -> tuple[Packing, dict[str, torch.Tensor]]:
    if getattr(p, "has_fp16_weights", False) or p.dtype != torch.int8:
        raise _Unsupported(
            f"{name!r} is a bitsandbytes Int8Params holding {p.dtype} weights"
            " (has_fp16_weights=True, or not quantized yet): only int8 weights rest packed."
            " Load the model with load_in_8bit (has_fp16_weights=False) and move it to a device"
            " before hr.offload")
    scb = p.SCB
    if scb is None:
        # After a forward, Linear8bitLt keeps the scales in its module state instead.
        for m, _ in owners:
            scb = getattr(getattr(m, "state", None), "SCB", None)
            if scb is not None:
                break
    if scb is None:
        raise _Unsupported(f"{name!r} is a bitsandbytes Int8Params without its scales (SCB)")
    parts = {"data": _check_plain_part(p.data, f"{name!r}'s int8 weight"),
             "SCB": _check_plain_part(scb, f"{name!r}'s scales")}
    cls = type(p)

    def build(got: dict[str, torch.Tensor]) -> torch.Tensor:
        data = got["data"]
        return cls(data=data, requires_grad=False, has_fp16_weights=False,
                   CB=data if data.device.type != "meta" else None, SCB=got["SCB"])

    return Packing("bnb8", cls, {k: _spec(v) for k, v in parts.items()}, build), parts


# ----------------------------------------------------------------------------- packed slots
def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its bytes for a dtype not every store keeps (float8 codes)."""
    return t if t.dtype in _PLAIN_DTYPES else t.view(torch.uint8)


def stored_spec(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[int, ...],
                                                                      torch.dtype]:
    """The shape and dtype a part of ``shape`` and ``dtype`` rests as in a store."""
    if dtype in _PLAIN_DTYPES:
        return shape, dtype
    return tuple(torch.empty(shape, dtype=dtype, device="meta").view(torch.uint8).shape), \
        torch.uint8


def as_stored(t: torch.Tensor) -> torch.Tensor:
    """A part's value as written to a store (host, contiguous, its bytes; ``meta`` stays)."""
    t = t.detach()
    return _bytes_view((t if t.is_meta else t.to("cpu")).contiguous())


def _from_stored(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return v if v.dtype == dtype else v.view(dtype)


class Packed:
    """One offloaded quantized parameter: part ``handles`` in the store, master ``param``,
    device copy ``dev`` over persistent ``parts`` (0 bytes while not resident)."""

    __slots__ = ("name", "owners", "packing", "handles", "param", "dev", "parts", "targets",
                 "tickets", "group", "nbytes")

    def __deepcopy__(self, memo):
        return self  # offload bookkeeping is shared by copies of hooks, never copied

    def __init__(self, name: str, owners: list[tuple[nn.Module, str]], packing: Packing,
                 handles: dict[str, Handle], param: torch.Tensor, device: torch.device) -> None:
        self.name = name
        self.owners = owners
        self.packing = packing
        self.handles = handles
        self.param = param
        self.parts = {k: torch.empty(s, dtype=d, device=device)
                      for k, (s, d) in packing.specs.items()}
        # what a fetch copies into: the part itself, or its bytes
        self.targets = {k: _bytes_view(t) for k, t in self.parts.items()}
        self.dev = packing.rebuild(self.parts)
        for t in self.parts.values():
            resize_storage(t, 0)
        self.tickets: list = []
        self.group = None
        self.nbytes = packing.nbytes
        self.restore()

    def show(self, t: torch.Tensor) -> None:
        for module, attr in self.owners:
            module._parameters[attr] = t

    def items(self) -> list[tuple[Handle, torch.Tensor]]:
        """``(handle, destination)`` of each part, for the mover (storages allocated first)."""
        out = []
        for k, t in self.parts.items():
            resize_storage(t, t.numel() * t.element_size())
            out.append((self.handles[k], self.targets[k]))
        return out

    def free(self) -> None:
        """Give the device copy's memory back (and undo what a forward rebound in it)."""
        self.restore()
        for t in self.parts.values():
            resize_storage(t, 0)

    def restore(self) -> None:
        """Point the device copy at its persistent parts again: bitsandbytes repacks a 4-bit
        weight at an inference forward, and an 8-bit layer computes with its module state's
        ``CB``/``SCB`` (its first forward takes them from the weight)."""
        kind = self.packing.kind
        if kind == "bnb4":
            with torch.no_grad():
                self.dev.data = self.parts["data"]
            self.dev.quant_state = self.packing.extra["state"](self.parts)
        elif kind == "bnb8":
            data = self.parts["data"]
            with torch.no_grad():
                self.dev.data = data
            self.dev.CB = self.dev.SCB = None
            for m, _ in self.owners:
                st = getattr(m, "state", None)
                if st is not None and hasattr(st, "CB"):
                    st.CB, st.SCB = data, self.parts["SCB"]

    def keep_values(self, parts: dict[str, torch.Tensor]) -> None:
        """The master holds ``parts`` (host copies), not the store's: it leaves the store."""
        p = self.param
        kind = self.packing.kind
        with torch.no_grad():
            if kind == "flatten":
                for key, v in parts.items():
                    *path, last = key.split(".")
                    owner = p
                    for n in path:
                        owner = getattr(owner, n)
                    setattr(owner, last, v)
            elif p.device.type == "meta":  # a DiskStore's placeholder: a parameter with memory
                self.show(self.packing.rebuild(parts))
            else:
                p.data = parts["data"]
                if kind == "bnb4":
                    p.quant_state = self.packing.extra["state"](parts)
                else:
                    p.CB, p.SCB = parts["data"], parts["SCB"]

    def unbind_owners(self) -> None:
        """`hr.unoffload`: an 8-bit layer's module state forgets the device copy's parts."""
        if self.packing.kind == "bnb8":
            for m, _ in self.owners:
                st = getattr(m, "state", None)
                if st is not None and hasattr(st, "CB"):
                    st.CB = st.SCB = None


def rest_master(packing: Packing, store: Store, handles: dict[str, Handle]) -> torch.Tensor:
    """The master at rest: the class over the store's host tensors or `StoreTensor` parts
    (``meta`` for bitsandbytes' packed codes, whose class needs memory, and byte parts)."""
    got = {}
    for k, h in handles.items():
        shape, dtype = packing.specs[k]
        host = store.host_tensor(h)
        if host is not None:
            got[k] = _from_stored(host, dtype)
        elif ((packing.kind in ("bnb4", "bnb8") and k == "data") or dtype not in _PLAIN_DTYPES) \
                and not isinstance(store, MetaStore):  # (a dry run's stand-ins hold nothing)
            got[k] = torch.empty(shape, dtype=dtype, device="meta")
        else:
            got[k] = stored_view(HandleSource(store, h), shape, dtype=dtype)
    return packing.rebuild(got)


def read_parts(packed: Packed, store: Store) -> dict[str, torch.Tensor]:
    """Host copies of every part, read from the store."""
    out = {}
    for k, h in packed.handles.items():
        host = store.host_tensor(h)
        v = host.clone() if host is not None else store.read(h).result()
        out[k] = _from_stored(v, packed.packing.specs[k][1])
    return out


def state_entries(q: Packed, parts: dict[str, torch.Tensor], prefix: str,
                  attr: str) -> dict[str, torch.Tensor]:
    """The ``state_dict`` entries of the parameter from host copies of its parts, bitsandbytes'
    own keys beside it (a 4-bit ``quant_state``'s, an 8-bit layer's ``SCB``)."""
    value = q.packing.rebuild(parts)
    out = {prefix + attr: value.detach()}
    if q.packing.kind == "bnb4":
        for k, v in value.quant_state.as_dict(packed=True).items():
            out[f"{prefix}{attr}.{k}"] = v
    elif q.packing.kind == "bnb8":
        out[prefix + "SCB"] = parts["SCB"]
    return out
