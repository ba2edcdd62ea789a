"""Autocast in a dry run: the target device's ``torch.autocast`` applied to ``meta`` tensors.

Autocast casts only tensors of its own device, so ``meta`` ones pass any region unchanged: the
dry run makes the casts itself, above autograd, asking PyTorch which they are by running each
call once more on ``FakeTensor``s of the target inside a real region (docs/estimate.md). Only
autocast's cache of cast parameters is modeled, from its documented rule. Regions for
``"meta"`` or an accelerator target's own type are the target's autocast.
"""

from __future__ import annotations

import threading
from types import FunctionType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

_AUTOCAST = torch.autocast
_AMP_AUTOCAST = torch.amp.autocast
_IS_ENABLED = torch.is_autocast_enabled
_GET_DTYPE = torch.get_autocast_dtype
_IS_AVAILABLE = torch.amp.is_autocast_available

_LOWER = (torch.float16, torch.bfloat16)
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)

# Functions that never cast: metadata, views, explicit conversions, autograd.
_PASS = frozenset({
    "size", "dim", "stride", "numel", "element_size", "is_floating_point", "is_contiguous",
    "data_ptr", "untyped_storage", "storage_offset", "__len__", "__repr__", "__format__",
    "__hash__", "__bool__", "tolist", "item", "view", "view_as", "reshape", "reshape_as",
    "permute", "transpose", "t", "expand", "expand_as", "unsqueeze", "squeeze", "flatten",
    "unflatten", "narrow", "chunk", "split", "unbind", "__getitem__", "contiguous", "detach",
    "detach_", "requires_grad_", "retain_grad", "register_hook", "backward", "to", "type",
    "type_as", "float", "half", "bfloat16", "double", "int", "long", "bool", "clone", "new_empty",
    "new_zeros", "new_ones", "new_full", "new_tensor", "zero_", "fill_", "copy_", "set_",
    "resize_", "_is_view", "get_device", "cpu", "cuda",
})

_active = threading.local()


def current() -> MetaAutocast | None:
    """The dry run's autocast of this thread, while a dry run runs."""
    return getattr(_active, "amp", None)


class MetaAutocast:
    """The target's autocast (``device_type``) for the ``meta`` tensors of one dry run.

    While entered (by `headroom.fit._dryrun.AttentionAsOnDevice`), ``torch.autocast("meta")``
    opens a region of it.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._regions: list[tuple[bool, torch.dtype, bool]] = []
        self._cache: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._mode: _CastMode | None = None
        self._plans: dict[Any, Any] = {}
        self._outer: MetaAutocast | None = None

    def __enter__(self) -> MetaAutocast:
        self._outer = current()
        _active.amp = self
        for module, name, ours, _ in _PATCHES:
            setattr(module, name, ours)
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.amp = self._outer
        if self._outer is None:
            for module, name, _, torchs in _PATCHES:
                setattr(module, name, torchs)

    @property
    def enabled(self) -> bool:
        return bool(self._regions) and self._regions[-1][0]

    @property
    def dtype(self) -> torch.dtype:
        return self._regions[-1][1] if self._regions else _GET_DTYPE(self.device_type)

    def push(self, enabled: bool, dtype: torch.dtype | None,
             cache_enabled: bool | None) -> None:
        if dtype is None:
            dtype = self.dtype
        if cache_enabled is None:
            cache_enabled = torch.is_autocast_cache_enabled()
        if enabled and dtype not in _LOWER:
            raise ValueError(f"autocast takes torch.float16 or torch.bfloat16, got {dtype}")
        self._regions.append((bool(enabled), dtype, bool(cache_enabled)))
        if self._mode is None:
            self._mode = _CastMode(self)
            self._mode.__enter__()

    def pop(self) -> None:
        self._regions.pop()
        if not self._regions:
            self._cache.clear()  # autocast drops its cast copies as its outermost region exits
            mode, self._mode = self._mode, None
            if mode is not None:
                mode.__exit__(None, None, None)

    def cast_args(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
        """``args`` and ``kwargs`` cast as autocast casts them for ``func``, and the result's
        dtypes (``None``: as they come)."""
        if not self.enabled:
            return args, kwargs, None
        flat, spec = tree_flatten((args, kwargs))
        tensors = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        if not any(flat[i].dtype in _CASTABLE for i in tensors):
            return args, kwargs, None
        plan = self._plan(func, flat, spec, tensors)
        if plan is None:
            return args, kwargs, None
        casts, out_dtypes = plan
        if casts:
            flat = list(flat)
            for i, dtype in casts:
                flat[i] = self._cast(flat[i], dtype)
            args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs, out_dtypes

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype == dtype:
            return t
        _, lower, cache = self._regions[-1]
        # autocast's cache: a leaf that requires grad, cast from float32 to the lower precision
        cached = (cache and dtype == lower and t.dtype == torch.float32 and t.requires_grad
                  and t.is_leaf and not t._is_view())
        if not cached:
            return t.to(dtype)
        key = (id(t), dtype)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        out = t.to(dtype)
        self._cache[key] = (t, out)
        return out

    def _plan(self, func: Any, flat: list, spec: Any, tensors: list[int]) -> Any:
        """``(casts, result dtypes)`` of ``func`` (`_ask_autocast`), remembered by metadata."""
        try:
            key = (func, self._regions[-1][1], spec, tuple(
                (a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in flat))
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in self._plans:
            return self._plans[key]
        plan = _ask_autocast(func, flat, spec, tensors, self.device_type, self._regions[-1][1])
        if key is not None:
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[key] = plan
        return plan


class _CastMode(TorchFunctionMode):
    """Casts the arguments of each function called inside an autocast region of the dry run."""

    def __init__(self, amp: MetaAutocast) -> None:
        super().__init__()
        self.amp = amp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self.amp.enabled or name in _PASS or name.endswith(("__get__", "__set__")):
            return func(*args, **kwargs)
        if isinstance(func, FunctionType):
            # a Python function (F.layer_norm): autocast acts on the ops it calls, one by one,
            # run with the mode still on for them
            with self:
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        args, kwargs, out_dtypes = self.amp.cast_args(func, args, kwargs)
        out = func(*args, **kwargs)
        if out_dtypes is None:
            return out
        flat, spec = tree_flatten(out)
        if len(flat) != len(out_dtypes):
            return out
        fixed = [a.to(d) if isinstance(a, torch.Tensor) and d is not None and a.dtype != d
                 and a.is_floating_point() else a for a, d in zip(flat, out_dtypes, strict=True)]
        return tree_unflatten(fixed, spec) if any(
            f is not a for f, a in zip(fixed, flat, strict=True)) else out


def _ask_autocast(func: Any, flat: list, spec: Any, tensors: list[int], device_type: str,
                  dtype: torch.dtype) -> tuple[list[tuple[int, torch.dtype]], list] | None:
    """The casts autocast (``dtype``) makes of ``func``'s arguments on fake tensors of
    ``device_type``, and the result's dtypes; ``None`` where fake tensors cannot run it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    class _Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[int, torch.dtype]] = []

        def __torch_dispatch__(self, f, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if f is torch.ops.aten._to_copy.default and "dtype" in kwargs:
                self.seen.append((args[0].untyped_storage()._cdata, kwargs["dtype"]))
            return f(*args, **kwargs)

    before = (_IS_ENABLED(device_type), _GET_DTYPE(device_type),
              torch.is_autocast_cache_enabled())
    try:
        with _disable_current_modes(), torch.no_grad(), FakeTensorMode():
            fakes = list(flat)
            where: dict[int, int] = {}
            for i in tensors:
                t = flat[i]
                fakes[i] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                               device=device_type)
                where[fakes[i].untyped_storage()._cdata] = i
            args, kwargs = tree_unflatten(fakes, spec)
            recorder = _Casts()
            torch.set_autocast_enabled(device_type, True)
            torch.set_autocast_dtype(device_type, dtype)
            torch.set_autocast_cache_enabled(False)
            try:
                with recorder:
                    out = func(*args, **kwargs)
            finally:
                torch.set_autocast_enabled(device_type, before[0])
                torch.set_autocast_dtype(device_type, before[1])
                torch.set_autocast_cache_enabled(before[2])
    except Exception:  # an op a fake tensor cannot run (it needs values): autocast casts none
        return None
    casts: list[tuple[int, torch.dtype]] = []
    for storage, to in recorder.seen:
        i = where.get(storage)
        if i is not None and all(j != i for j, _ in casts):
            casts.append((i, to))
    outs = [a.dtype if isinstance(a, torch.Tensor) else None for a in tree_flatten(out)[0]]
    return casts, outs


class _Region(_AUTOCAST):
    """``torch.autocast`` in a dry run: the target's for emulated types, else torch's own."""

    def __init__(self, device_type: str, dtype: torch.dtype | None = None,
                 enabled: bool = True, cache_enabled: bool | None = None) -> None:
        self._meta = _emulated(device_type)
        if self._meta:
            self.device = device_type
            self.fast_dtype = dtype
            self._enabled = enabled
            self._cache_enabled = cache_enabled
        else:
            super().__init__(device_type, dtype=dtype, enabled=enabled,
                             cache_enabled=cache_enabled)

    def __enter__(self):
        if not self._meta:
            return super().__enter__()
        self._amp = current()
        if self._amp is not None:
            self._amp.push(self._enabled, self.fast_dtype, self._cache_enabled)
        return self

    def __exit__(self, *exc: Any):
        if not self._meta:
            return super().__exit__(*exc)
        if self._amp is not None:
            self._amp.pop()
        return None


def _emulated(device_type: Any) -> bool:
    """Whether autocast of ``device_type`` is the dry run's: ``"meta"``, and an accelerator
    target's own type. NOTE: a CPU target's ``"cpu"`` regions stay torch's: known values are
    computed on the CPU, and checkpointing restores the CPU's state beside the device's."""
    if device_type == "meta":
        return True
    amp = current()
    return amp is not None and device_type == amp.device_type and device_type != "cpu"


def _is_enabled(*args: Any) -> bool:
    if args and _emulated(args[0]):
        amp = current()
        return amp is not None and amp.enabled
    return _IS_ENABLED(*args)


def _get_dtype(device_type: str) -> torch.dtype:
    if _emulated(device_type):
        amp = current()
        return amp.dtype if amp is not None else torch.float16
    return _GET_DTYPE(device_type)


def _is_available(device_type: str) -> bool:
    return device_type == "meta" or _IS_AVAILABLE(device_type)


# (module, name, the dry run's, torch's own): what entering a `MetaAutocast` replaces
_PATCHES = ((torch, "autocast", _Region, _AUTOCAST),
            (torch.amp, "autocast", _Region, _AMP_AUTOCAST),
            (torch, "is_autocast_enabled", _is_enabled, _IS_ENABLED),
            (torch, "get_autocast_dtype", _get_dtype, _GET_DTYPE),
            (torch.amp, "is_autocast_available", _is_available, _IS_AVAILABLE))


def check_autocast(dtype: Any, device: str) -> torch.dtype | None:
    """``autocast=`` of `hr.estimate` checked: ``None``, ``torch.float16`` or ``torch.bfloat16``
    for a device type with an autocast; else a ValueError."""
    if dtype is None:
        return None
    if dtype not in _LOWER:
        raise ValueError(
            f"autocast= is the dtype of torch.autocast, torch.bfloat16 or torch.float16 (or"
            f" None: off), got {dtype!r}")
    device_type = device.split(":")[0]
    if not _IS_AVAILABLE(device_type):
        raise ValueError(f"autocast= : torch.autocast has no {device_type!r} device type")
    return dtype
