"""`StoreTensor`: a tensor whose values rest in a store, for code that reads ``p`` and ``p.grad``
(clipping, ``GradScaler.unscale_``, training frameworks; see docs/frameworks.md).

A wrapper subclass (no storage) with the parameter's shape, dtype and device; every op runs
torch's own kernel on the stored values, bitwise as on a plain tensor holding them (in the stored
dtype, which may be wider). Functional ops read the value once; in-place ops write it back (a
scaling ``mul_`` on disk is recorded instead: `DiskStore.scale_`); ``foreach`` ops run one tensor
at a time; ``detach`` and views of values not in host memory are `StoreTensor` objects over them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from headroom.store import Handle, MetaStore, Store
from headroom.transfer._binding import ParamBinding, note_value_edit, sync_grad
from headroom.transfer._pickle import keep_for_child

__all__ = ["GradSource", "HandleSource", "HeldSource", "Source", "StoreTensor", "ViewSource",
           "is_stored_grad", "stored_view"]

_aten = torch.ops.aten
_ALIASES = (_aten.detach.default, _aten.alias.default)
# Ops that would give a `StoreTensor` storage, or make it another tensor than the store's.
_REFUSED = {
    _aten.set_.source_Storage, _aten.set_.source_Tensor, _aten.set_.default,
    _aten.set_.source_Storage_storage_offset, _aten.resize_.default, _aten.as_strided_.default,
}


_FOREACH_SCALE_OPS = {_aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar}
_SCALE_OPS = {_aten.mul_.Tensor, _aten.mul_.Scalar, *_FOREACH_SCALE_OPS}


def _is_one(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return (x.dim() == 0 and not isinstance(x, StoreTensor) and not x.is_complex()
                and bool(x == 1))
    return isinstance(x, (int, float)) and x == 1


class Source:
    """Where a `StoreTensor`'s values rest: read whole, written whole."""

    def read(self) -> tuple[torch.Tensor, bool]:
        """The value as a host tensor, and whether it is the store's own memory (live)."""
        raise NotImplementedError

    def live(self) -> bool:
        """Whether `read` gives the store's own memory (writes to it land in the store)."""
        raise NotImplementedError

    def write(self, value: torch.Tensor) -> None:
        """Make ``value`` (a host tensor) the whole stored value."""
        raise NotImplementedError

    def key(self) -> tuple:
        """Identity of the values (two sources with the same key hold the same values)."""
        raise NotImplementedError

    def accumulate(self, t: torch.Tensor) -> bool:
        """Add ``t`` (autograd accumulating a new gradient) its own way; False: not handled."""
        return False

    def scale(self, op: Any, factor: Any) -> bool:
        """Scale the values by a scalar without reading them now (`DiskStore.scale_`); False:
        not handled."""
        return False

    def clear(self) -> bool:
        """Set the values to zero without reading them (``zero_``); False: not handled."""
        return False

    def describe(self) -> str:
        raise NotImplementedError

    def edited(self) -> None:
        """An op is about to change the values in place through a `StoreTensor` over them."""


def _read(store: Store, h: Handle) -> tuple[torch.Tensor, bool]:
    host = store.host_tensor(h)
    if host is not None:
        return host, True
    return store.read(h).result(), False


class HandleSource(Source):
    """The values of one store handle (an offloaded parameter's master); ``prepare`` is called
    before every read or write (e.g. to fill values still pending for a model built on meta)."""

    def __init__(self, store: Store, handle: Handle, *,
                 prepare: Callable[[], None] | None = None) -> None:
        self.store = store
        self.handle = handle
        self.prepare = prepare

    def read(self) -> tuple[torch.Tensor, bool]:
        if self.prepare is not None:
            self.prepare()
        return _read(self.store, self.handle)

    def live(self) -> bool:
        return self.store.host_tensor(self.handle) is not None

    def write(self, value: torch.Tensor) -> None:
        if self.prepare is not None:
            self.prepare()
        h = self.handle
        self.store.write(h, value.detach().to("cpu", h.dtype).contiguous()).result()

    def key(self) -> tuple:
        return ("value", id(self.store), self.handle.key)

    def edited(self) -> None:
        # a consumer holding a copy of the values (an fp32 master) learns of it, unread
        note_value_edit(self.store, self.handle.key)

    def describe(self) -> str:
        return f"{self.handle.key!r} in {self.store!r}"


class GradSource(Source):
    """The accumulated gradient of a store-resident parameter (``binding.grad_handle``).

    Reads wait for the gradient's producer (`sync_grad`); a gradient cleared since the tensor
    was handed out (``zero_grad``) raises. ``push(grad)`` adds a new gradient when autograd
    accumulates into ``param.grad`` (`Mover.push_grad`); ``None``: an ordinary ``add_``.
    """

    def __init__(self, b: ParamBinding, *,
                 push: Callable[[torch.Tensor], None] | None = None) -> None:
        self.binding = b
        self.push = push

    def accumulate(self, t: torch.Tensor) -> bool:
        if self.push is None:
            return False
        self._handle()
        self.push(t)
        return True

    def _handle(self) -> Handle:
        b = self.binding
        if b.grad_handle is None or not b.has_grad:
            raise RuntimeError(
                f"the gradient of {b.handle.key!r} was cleared (zero_grad) after this tensor was"
                " taken from param.grad; read param.grad again (None until the next backward)")
        sync_grad(b)
        return b.grad_handle

    def read(self) -> tuple[torch.Tensor, bool]:
        h = self._handle()
        return _read(self.binding.store, h)

    def scale(self, op: Any, factor: Any) -> bool:
        # NOTE: clipping scales every gradient after reading it for the norm; on disk the
        # scaling is recorded and applied at the next read: one read and write fewer each.
        store = self.binding.store
        defer = getattr(store, "scale_", None)
        if defer is None or self.live():
            return False
        defer(self._handle(), op, factor)
        return True

    def clear(self) -> bool:
        # zero_grad(set_to_none=False): a sum held back is dropped, and nothing is read.
        b = self.binding
        if b.grad_handle is None:
            return False  # never stored: the read raises, naming it
        if not b.has_grad:
            return True  # cleared already: the next backward starts it afresh, as from zeros
        h = b.grad_handle
        # Until the zeros are in, the gradient reads as cleared (a read raises, the next
        # backward starts afresh): an interrupt half-way leaves no partial state.
        b.has_grad = False
        sync_grad(b)  # a sum held back is dropped; what was handed over before lands first
        host = b.store.host_tensor(h)
        if host is not None:
            host.zero_()
        else:
            b.store.write(h, torch.zeros(h.shape, dtype=h.dtype)).result()
        b.has_grad = True
        return True

    def live(self) -> bool:
        b = self.binding
        return b.grad_handle is not None and b.store.host_tensor(b.grad_handle) is not None

    def write(self, value: torch.Tensor) -> None:
        h = self._handle()
        self.binding.store.write(h, value.detach().to("cpu", h.dtype).contiguous()).result()

    def key(self) -> tuple:
        return ("grad", id(self.binding))

    def edited(self) -> None:
        self.binding.grad_edits += 1

    def describe(self) -> str:
        return f"the gradient of {self.binding.handle.key!r} in {self.binding.store!r}"


class HeldSource(Source):
    """The values a parameter had when it left its store, held (not what later takes its place)."""

    def __init__(self, value: torch.Tensor, describe: str) -> None:
        self.value = value
        self._describe = describe

    def read(self) -> tuple[torch.Tensor, bool]:
        return self.value, True

    def live(self) -> bool:
        return True

    def write(self, value: torch.Tensor) -> None:
        self.value.copy_(value)

    def key(self) -> tuple:
        return ("held", id(self))

    def describe(self) -> str:
        return self._describe


class ViewSource(Source):
    """A view (``view``, slicing, ...) of another source's values, read and written through it."""

    def __init__(self, base: Source, func: Any, args: tuple, kwargs: dict, index: int | None):
        self.base = base
        self.func = func
        self.args = args  # args[0] is the base's place
        self.kwargs = kwargs
        self.index = index

    def _view(self, value: torch.Tensor) -> torch.Tensor:
        out = self.func(value, *self.args[1:], **self.kwargs)
        return out if self.index is None else out[self.index]

    def read(self) -> tuple[torch.Tensor, bool]:
        value, live = self.base.read()
        return self._view(value), live

    def live(self) -> bool:
        return self.base.live()

    def write(self, value: torch.Tensor) -> None:
        base, live = self.base.read()
        self._view(base).copy_(value)
        if not live:
            self.base.write(base)

    def key(self) -> tuple:
        return ("view", id(self))

    def edited(self) -> None:
        self.base.edited()

    def describe(self) -> str:
        return f"a view ({self.func}) of {self.base.describe()}"


class StoreTensor(torch.Tensor):
    """A tensor whose values rest in ``source`` (see the module docstring), reporting ``shape``
    (the stored one), ``dtype`` and ``device`` (the parameter's); ops compute in the stored
    dtype. ``nn.Parameter(StoreTensor(...))`` works."""

    _source: Source

    @staticmethod
    def __new__(cls, source: Source, shape: tuple[int, ...], *, dtype: torch.dtype,
                device: torch.device | str = "cpu", requires_grad: bool = False) -> StoreTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                requires_grad=requires_grad)
        t._source = source
        return t

    # Results are ordinary tensors, never this class (see __torch_dispatch__).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # NOTE: ``param.data = x`` swaps the implementation below the dispatcher, ignored by a
        # wrapper; the value is written into the store instead (PEFT's safe merge does this).
        if not isinstance(value, torch.Tensor) or value.shape != self.shape:
            raise RuntimeError(
                f"cannot rebind .data of a tensor whose values rest in a store"
                f" ({self._source.describe()}) to {getattr(value, 'shape', type(value).__name__)}:"
                f" its shape is fixed by the store ({tuple(self.shape)}). Assign a tensor of that"
                " shape, or hr.unoffload(model) first")
        if value.dtype != self.dtype:  # .half(), .to(dtype) of a module: nothing converted
            raise RuntimeError(
                f"cannot convert a tensor whose values rest in a store"
                f" ({self._source.describe()}) from {self.dtype} to {value.dtype}: the store"
                " keeps its dtype. Convert the model before hr.offload, use hr.offload(...,"
                " compute_dtype=...) for lower-precision compute, or hr.unoffload(model) first")
        if isinstance(value, StoreTensor) and value._source.key() == self._source.key():
            return
        with torch.no_grad():
            self.copy_(value)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"StoreTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device},"
                f" values={self._source.describe()})")

    def __reduce_ex__(self, protocol: int) -> Any:
        # Pickled as copy.deepcopy gives: the values, a plain tensor (or parameter).
        value = self.stored().to(self.dtype, copy=True)
        if getattr(self, "_is_param", False):
            value = torch.nn.Parameter(value, requires_grad=self.requires_grad)
        keep_for_child(value)  # see its NOTE
        return value.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        # A copy in memory, as a plain tensor (a parameter stays a parameter).
        if id(self) in memo:
            return memo[id(self)]
        v = self.stored().to(self.dtype, copy=True)
        if getattr(self, "_is_param", False):  # as nn.Parameter.__deepcopy__: no .grad
            out = torch.nn.Parameter(v, requires_grad=self.requires_grad)
        else:
            out = v.requires_grad_(self.requires_grad)
            if self.grad is not None:
                out.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = out
        return out

    def stored(self) -> torch.Tensor:
        """The stored values as an ordinary host tensor (a copy when they rest on disk)."""
        return self._source.read()[0]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in _written(func, args, kwargs):  # `Source.edited` of what ``func`` writes
            for t in (x if isinstance(x, (list, tuple)) else (x,)):
                if isinstance(t, StoreTensor):
                    t._source.edited()
        if func in _ALIASES:
            src = args[0]
            return StoreTensor(src._source, tuple(src.shape), dtype=src.dtype, device=src.device)
        if func in _REFUSED:
            raise RuntimeError(
                f"{func} on a tensor whose values rest in a store"
                f" ({_first(args, kwargs)._source.describe()}) is not supported: it would"
                " replace the store's tensor. Write its values instead (param.data.copy_(x)),"
                " or hr.unoffload(model) first")
        if (func is _aten.copy_.default and isinstance(args[1], StoreTensor)
                and isinstance(args[0], StoreTensor)
                and args[0]._source.key() == args[1]._source.key()):
            return args[0]  # a copy onto itself (load_state_dict of what the store holds)
        if (func is _aten.add_.Tensor and isinstance(args[0], StoreTensor)
                and not isinstance(args[1], StoreTensor) and kwargs.get("alpha", 1) == 1
                and args[0]._source.accumulate(args[1])):
            return args[0]
        if (func is _aten.zero_.default and isinstance(args[0], StoreTensor)
                and args[0]._source.clear()):
            return args[0]
        if func is _aten._foreach_zero_.default:  # zero_grad(set_to_none=False, foreach=True)
            return _foreach_unhandled(func, args, kwargs, lambda s: s.clear())
        if func in _SCALE_OPS and _is_one(args[1]):
            # NOTE: x * 1 is x bit for bit: clipping that does not clip (coefficient clamped
            # to 1) then costs no read and write of every gradient on disk.
            return None if func in _FOREACH_SCALE_OPS else args[0]
        if func in _SCALE_OPS and _is_scalar(args[1]):
            if func in _FOREACH_SCALE_OPS:
                factor = _own_scalar(args[1])
                return _foreach_unhandled(func, args, kwargs, lambda s: s.scale(func, factor))
            if isinstance(args[0], StoreTensor) and args[0]._source.scale(
                    func, _own_scalar(args[1])):
                return args[0]
        if func.__name__.startswith(("_foreach_", "_amp_foreach_")):
            return _foreach(func, args, kwargs)
        if (_is_view(func) and isinstance(args[0], StoreTensor)
                and not (args[0].device.type == "cpu" and args[0]._source.live())):
            return _view(func, args, kwargs)
        return _run(func, args, kwargs)


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _is_scalar(x: Any) -> bool:
    """A number, or a 0-dim host tensor holding one (what clipping scales by)."""
    if isinstance(x, torch.Tensor):
        return (x.dim() == 0 and not isinstance(x, StoreTensor) and x.device.type == "cpu"
                and not x.requires_grad)
    return isinstance(x, (int, float))


def _own_scalar(x: Any) -> Any:
    """A copy of the factor: changing the caller's tensor later changes no recorded scaling."""
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _is_view(func) -> bool:
    rets = func._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def _view(func, args, kwargs):
    """A `StoreTensor` over a view of values not in host memory (writes go to the store)."""
    base: StoreTensor = args[0]
    shaped = torch.empty(base.shape, dtype=base.dtype, device="meta")
    out = func(shaped, *args[1:], **kwargs)
    if isinstance(out, torch.Tensor):
        return StoreTensor(ViewSource(base._source, func, args, kwargs, None), tuple(out.shape),
                           dtype=base.dtype, device=base.device)
    return [StoreTensor(ViewSource(base._source, func, args, kwargs, i), tuple(o.shape),
                        dtype=base.dtype, device=base.device) for i, o in enumerate(out)]


def _first(args, kwargs) -> StoreTensor:
    flat, _ = tree_flatten((args, kwargs))
    return next(x for x in flat if isinstance(x, StoreTensor))


def _written(func, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments (tensors or lists of tensors) that ``func`` writes, per its schema."""
    where = _WRITES.get(func)
    if where is None:
        where = _WRITES[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    return [args[i] if i < len(args) else kwargs[name]
            for i, name in where if i < len(args) or name in kwargs]


def _run(func, args, kwargs):
    """Run ``func`` on the stored values of its `StoreTensor` arguments."""
    flat, spec = tree_flatten((args, kwargs))
    wrappers = [x for x in flat if isinstance(x, StoreTensor)]
    dev = wrappers[0].device
    written = _written(func, args, kwargs)
    written_ids = {id(t) for w in written for t in (w if isinstance(w, (list, tuple)) else [w])}
    values: dict[tuple, tuple[torch.Tensor, bool]] = {}
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (original, host copy) written by func
    new_flat = []
    for x in flat:
        if isinstance(x, StoreTensor):
            k = x._source.key()
            if k not in values:
                values[k] = x._source.read()
            new_flat.append(values[k][0])
        elif isinstance(x, torch.Tensor) and dev.type != "cpu" and x.device.type != "cpu":
            h = x.detach().to("cpu")
            if id(x) in written_ids:
                moved.append((x, h))
            new_flat.append(h)
        else:
            new_flat.append(x)
    a, k = tree_unflatten(new_flat, spec)
    out = func(*a, **k)
    if written:
        for x in wrappers:
            if id(x) in written_ids:
                v, live = values[x._source.key()]
                if not live:
                    x._source.write(v)
        for orig, h in moved:
            orig.copy_(h)
        if func._schema.returns and func._schema.returns[0].alias_info is not None:
            return written[0]
        return out
    if dev.type != "cpu":
        flat_out, spec_out = tree_flatten(out)
        out = tree_unflatten([o.to(dev) if isinstance(o, torch.Tensor) else o
                              for o in flat_out], spec_out)
    return out


def _foreach_unhandled(func, args, kwargs, handled: Callable[[Source], bool]) -> None:
    """A foreach op on the tensors of ``args[0]`` whose source ``handled`` did not take."""
    rest = [t for t in args[0] if not (isinstance(t, StoreTensor) and handled(t._source))]
    if rest:
        _foreach(func, (rest, *args[1:]), kwargs)


def _foreach(func, args, kwargs):
    """A foreach op one index at a time where a `StoreTensor` is involved (one value in memory
    at once), the others in one call."""
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    n = len(args[lists[0]])

    def has_wrapper(i: int) -> bool:
        return any(isinstance(args[j][i], StoreTensor) for j in lists)

    def sub(idx: list[int]) -> tuple:
        return tuple([a[i] for i in idx] if j in lists else a for j, a in enumerate(args))

    plain = [i for i in range(n) if not has_wrapper(i)]
    results: dict[int, Any] = {}
    if plain:
        out = func(*sub(plain), **kwargs)
        if isinstance(out, (list, tuple)):
            results.update(zip(plain, out, strict=True))
    for i in sorted(set(range(n)).difference(plain)):
        out = _run(func, sub([i]), kwargs)
        if isinstance(out, (list, tuple)):
            results[i] = out[0]
    return [results[i] for i in range(n)] if results else None


def is_stored_grad(t: torch.Tensor, b: ParamBinding) -> bool:
    """Whether ``t`` (a ``param.grad``) is ``b``'s stored gradient as its producer leaves it:
    a `StoreTensor` over it, the host tensor itself (in the parameter's dtype), or for a sparse
    gradient ``b.grad_sparse``."""
    src = getattr(t, "_source", None)  # a StoreTensor, or a dry run's stand-in (stored_view)
    if src is not None:
        return isinstance(src, GradSource) and src.binding is b
    if b.grad_sparse is not None or t.is_sparse:
        return t is b.grad_sparse
    h = b.grad_handle
    if h is None:
        return False
    host = b.store.host_tensor(h)
    if host is None or t.dtype != host.dtype or t.numel() != host.numel():
        return False
    if t.is_meta:  # a dry run's host tensor (`headroom.store.MetaStore`): no data pointer
        return host.is_meta and t.untyped_storage()._cdata == host.untyped_storage()._cdata
    return t.device.type == "cpu" and t.data_ptr() == host.data_ptr()


def stored_view(source: Source, shape: tuple[int, ...], *, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """A `StoreTensor` over ``source``; in a dry run (`MetaStore`) a ``meta`` stand-in holding
    no memory, with the same ``_source``."""
    store = source.binding.store if isinstance(source, GradSource) else source.store
    if not isinstance(store, MetaStore):
        return StoreTensor(source, shape, dtype=dtype, device=device)
    t = store.stand_in(shape, dtype)
    t._source = source
    return t
