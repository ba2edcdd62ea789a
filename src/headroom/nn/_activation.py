"""Activations whose backward keeps a 1-bit mask, or nothing that is not kept anyway: a
:class:`Late` holder keeps what PyTorch's node saves until it can pack a mask (see [Note:
deciding late] in :mod:`headroom.nn._common`); under the caller's saved-tensor hooks they
decide in forward (:class:`_MaskFunction`)."""

from __future__ import annotations

import functools
import math
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from headroom.memory import is_tracking
from headroom.nn import _bitmask
from headroom.nn._bitmask import (
    GREATER,
    INSIDE,
    NONZERO,
    grad_through,
    pack_test,
    unpack_as,
)
from headroom.nn._common import (
    UNSHARED,
    Call,
    KeepsNoInput,
    _hooks_enabled,
    _pending,
    _relu_outputs,
    _top_hooks,
    _use_count,
    activation_call,
    channels_last_dense,
    consumers_keep_output,
    first_order_only,
    note_consumer,
    records_graph,
    register_relu_output,
    save_less,
    settle_pending,
    unchanged,
)


def _pack_layout(
    t: torch.Tensor, op: int = NONZERO, lo: float = 0.0, hi: float = 0.0
) -> tuple[torch.Tensor, bool, bool]:
    """``pack_test(t, op, lo, hi)`` (in memory order where channels-last: no layout copy),
    whether in memory order, and whether a NaN was seen (``INSIDE`` only)."""
    if not t.is_contiguous() and channels_last_dense(t):
        bits, nan = pack_test(t.as_strided((t.numel(),), (1,)), op, lo, hi)
        return bits, True, nan
    bits, nan = pack_test(t, op, lo, hi)
    return bits, False, nan


def _unpack_layout(
    bits: torch.Tensor,
    shape: torch.Size,
    stride: tuple[int, ...],
    memory_order: bool,
    dtype: torch.dtype,
    *,
    reuse: bool = False,
    values: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The mask of :func:`_pack_layout` as ``dtype`` values (1/0, or ``values``), laid out with
    ``stride`` like the tensor PyTorch's backward would have read."""
    # The strides matter bitwise downstream: the backward kernel lays its output out like its
    # inputs, and a next backward (a batch norm) reduces in another order for channels-last.
    if memory_order:
        flat = unpack_as(bits, (bits.numel() * 8,), dtype, reuse=reuse, values=values)
        return flat.as_strided(shape, stride)
    passes = unpack_as(bits, shape, dtype, reuse=reuse, values=values)
    if passes.stride() == stride:
        return passes
    out = torch.empty_strided(shape, stride, dtype=dtype, device=passes.device)
    return out.copy_(passes)


def _signed_cache(fn):
    """``lru_cache`` that also keys on the sign of float arguments: ``-0.0 == 0.0`` as a key,
    but the ops' results differ in sign."""
    cached = functools.lru_cache(maxsize=64)(lambda signs, *args: fn(*args))

    @functools.wraps(fn)
    def call(*args):
        return cached(tuple(math.copysign(1.0, a) for a in args if isinstance(a, float)), *args)
    return call


@_signed_cache
def _hardtanh_values(lo: float, hi: float, dtype: torch.dtype) -> tuple[float, float] | None:
    """Stand-in values for ``hardtanh_backward`` (passes where ``lo < x < hi`` in ``dtype``):
    ``(lo, a value strictly inside)``, or None where 0 and 1 are such a pair (ReLU6)."""
    lo_d, hi_d = (torch.tensor(v, dtype=dtype).item() for v in (lo, hi))
    if lo_d >= 0.0 and lo_d < 1.0 < hi_d:
        return None
    inside = torch.tensor((lo_d + hi_d) / 2, dtype=dtype).item()
    if not lo_d < inside < hi_d:
        inside = lo_d  # none in this dtype: no mask bit is set, the value is never written
    return (lo_d, inside)


class Late:
    """The tensor an activation's node saves, kept whole until nothing else references its
    storage, then packed to a 1-bit mask (see [Note: deciding late]). :meth:`hold` is the pack
    hook of the node's save of ``watched`` (``op``: NONZERO for ReLU, GREATER for LeakyReLU,
    INSIDE ``lo < x < hi`` for Hardtanh); the decision goes to the call site's ``call``."""
    # Unpacked, the mask is positive exactly where set (Hardtanh: ``lo`` and a value inside),
    # laid out like the original, for PyTorch's own kernel. A Hardtanh input with a NaN stays
    # whole: PyTorch's kernel passes the gradient at a NaN in its scalar loop, not its vector one.

    __slots__ = (
        "tensor",
        "version",
        "key",
        "op",
        "lo",
        "hi",
        "seq",
        "checks",
        "bits",
        "shape",
        "stride",
        "dtype",
        "memory_order",
        "values",
        "ptr",
        "watch",
        "call",
        "__weakref__",
    )

    def __init__(
        self, call: Call | None, op: int, lo: float, hi: float, watched: torch.Tensor
    ) -> None:
        self.tensor = None  # until hold()
        self.version = watched._version
        self.key = watched.untyped_storage()._cdata
        self.op, self.lo, self.hi = op, lo, hi
        self.bits = None
        self.call = call
        self.checks = 0
        st = _pending
        st.seq = self.seq = st.seq + 1
        ref = weakref.ref(self)
        made = st.made
        made.append(ref)
        if len(made) > 512 and not st.roots:
            # Layers called on their own (no root's end settles): drop the dead and decided
            st.made = [r for r in made if (h := r()) is not None and h.tensor is not None]
        # The caller dropping ``watched`` (a variable rebound in nn.Sequential's loop) is often
        # the earliest moment the storage can be unshared: try then (weakly: no cycle).
        self.watch = weakref.ref(watched, functools.partial(_released, ref))

    def hold(self, t: torch.Tensor) -> Late:
        """The pack hook: keep ``t``, an alias of the watched tensor without the graph (the
        tensor itself would make a cycle through its node, which holds this object)."""
        self.tensor = t
        call = self.call
        if call is not None:
            if call.keep is False and _pending.roots and t.numel() >= _PACK_AHEAD_FROM:
                self.pack()  # see _PACK_AHEAD_FROM
            call.keep = True  # until this holder packs a mask
        return self

    def settle(self, dying: int = 0, counted: bool = False) -> bool:
        """Pack the tensor if nothing else (but ``dying`` tensors; ``counted``: checked by the
        caller) references its storage; whether it is decided."""
        t = self.tensor
        if t is None:
            return True
        if not counted and _use_count(self.key) != UNSHARED + dying:
            return False
        if t._version != self.version:
            self.bits = None
            return True  # changed in place: kept, so that backward raises as PyTorch's does
        if self.bits is None and not self.pack():
            return True
        if self.call is not None:
            self.call.keep = False
        self.tensor = None
        return True

    def pack(self) -> bool:
        """Compute the mask (the tensor stays until :meth:`settle`); False where it must stay
        whole (a NaN for Hardtanh)."""
        t = self.tensor
        native = _bitmask._native
        if native is not None and t.is_cpu and t.is_contiguous():
            # The common case without the generic dispatch. ``stride`` None: contiguous.
            dtype = t.dtype
            code = 0 if dtype is torch.float32 else 1 if dtype is torch.float64 else -1
            if code >= 0:
                n = t.numel()
                bits = torch.empty((n + 7) >> 3, dtype=torch.uint8)
                ptr = bits.data_ptr()
                op = self.op
                if op == NONZERO:
                    native.pack_nonzero(t.data_ptr(), n, ptr, code)
                elif native.pack_cmp(t.data_ptr(), n, ptr, code, op, self.lo, self.hi):
                    return False  # a NaN (INSIDE): kept whole
                self.shape, self.stride, self.dtype = t.shape, None, dtype
                if op == INSIDE:
                    self.values, self.ptr = _hardtanh_values(self.lo, self.hi, dtype), 0
                else:  # 1/0 floats unpack fast in float32 (see unpack)
                    self.values, self.ptr = None, ptr if code == 0 else 0
                self.memory_order, self.bits = False, bits
                return True
        bits, memory_order, nan = _pack_layout(t, self.op, self.lo, self.hi)
        if nan:
            return False
        self.shape, self.stride, self.dtype = t.shape, t.stride(), t.dtype
        self.values = None if self.op != INSIDE else _hardtanh_values(self.lo, self.hi, t.dtype)
        self.memory_order, self.bits, self.ptr = memory_order, bits, 0
        return True

    def drop_mask(self) -> None:
        if self.tensor is not None:  # still kept whole: a mask packed ahead goes
            self.bits = None

    def _stride(self) -> tuple[int, ...]:
        stride = self.stride
        if stride is None:
            stride = self.stride = _contiguous_strides(self.shape)
        return stride

    def grad(self, grad: torch.Tensor, spec: _Spec):
        """The input gradient for :class:`_LateFunction`: ``spec.kernel(grad, saved)`` on the
        kept tensor, else one pass over the mask where the layouts allow, else the kernel on it."""
        t = self.tensor
        if t is not None:
            return spec.kernel(grad, unchanged(t, self.version))
        if (
            not torch.is_grad_enabled()
            and grad.dtype == self.dtype
            and grad.shape == self.shape
            and grad.stride() == self._stride()
            and (channels_last_dense(grad) if self.memory_order else grad.is_contiguous())
        ):
            out = grad_through(self.bits, grad, scale=spec.scale, slope=spec.slope)
            if out is not None:
                return out
        return spec.kernel(grad, self.unpack())

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t is not None:
            return unchanged(t, self.version)
        native = _bitmask._native
        if self.ptr and native is not None and not _grad_enabled() and not is_tracking():
            # The common case (a contiguous float32 1/0 mask at ``ptr``) without the generic
            # dispatch, into _bitmask.reusable_float32's buffer (its common case inlined).
            buf = _bitmask._reusable.buffers.get(torch.float32)
            got = None
            if buf is not None and _use_count(buf.key) == buf.unshared:
                got = buf.views.get(self.shape)
            if got is None:
                got = _bitmask.reusable_float32(self.shape)
            native.unpack(self.ptr, got[2], got[1], 0)
            return got[0]
        return _unpack_layout(
            self.bits,
            self.shape,
            self._stride(),
            self.memory_order,
            self.dtype,
            reuse=not torch.is_grad_enabled(),
            values=self.values,
        )


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _released(holder_ref: weakref.ref, _tensor_ref, _finalizing=sys.is_finalizing) -> None:
    """The caller's tensor a :class:`Late` holder watches is being freed: try to settle."""
    # The dying tensor's own storage reference goes right after this: one more is expected.
    # Not inside backward, where settling would pack a mask that the node is about to unpack.
    # Nor while the interpreter exits: modules are torn down (`sys` may already be None: the
    # check is bound here), and nothing will read the mask.
    holder = holder_ref()
    if holder is None or holder.tensor is None or _finalizing() or _graph_task_id() != -1:
        return
    if _use_count(holder.key) == UNSHARED + 1:
        holder.settle(1, True)
    else:
        _pending.young.append(holder_ref)  # still shared (a view): try at next layer starts


_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled


# --- one Function for large or cloning activations -----------------------------------------------
#
# On PyTorch's node backward unpacks a mask into floats that the kernel reads; from _FUSE_FROM
# elements on, this Function's one fused pass from the bits (bitwise the same) costs less than
# that, and hardtanh_ would save a clone of its input.
_FUSE_FROM = 1 << 18  # elements
# Where the call site's last holder packed a mask, a holder this large packs right after the op
# (tensor in cache); an unneeded one goes at the root's end. Small ones would only add to peaks.
_PACK_AHEAD_FROM = 1 << 15  # elements


class _Spec:
    """How :class:`_LateFunction` and :class:`_MaskFunction` run an activation and its backward."""

    __slots__ = ("fn", "inplace", "saves_result", "op", "lo", "hi", "kernel", "scale", "slope")

    def __init__(self, fn, inplace, saves_result, op, lo, hi, kernel, scale=False, slope=0.0):
        self.fn, self.inplace, self.saves_result = fn, inplace, saves_result
        self.op, self.lo, self.hi = op, lo, hi
        self.kernel, self.scale, self.slope = kernel, scale, slope


class _LateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: _Spec, call: Call | None) -> torch.Tensor:
        if spec.inplace:
            ctx.mark_dirty(x)
        out = spec.fn(x)
        watched = out if spec.saves_result else x
        # A detached alias: ``out`` will hold ctx (its grad_fn), which holds the holder.
        ctx.holder = Late(call, spec.op, spec.lo, spec.hi, watched).hold(watched.detach())
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.holder.grad(grad, ctx.spec), None, None


# NOTE: the C ``apply`` directly: the Python classmethod binds defaults for a setup_context
# (none here) and unwraps functorch wrappers (never here, see records_graph). The backward node
# likewise skips BackwardCFunction.apply's per-call search for a ``vjp`` override (none).
_late_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _LateFunction)
_LateFunction._backward_cls.apply = _LateFunction.backward


def _apply_late(x: torch.Tensor, spec: _Spec, call: Call | None = None) -> torch.Tensor:
    out = _late_apply(x, spec, call)
    if spec.inplace:
        # Autograd bumps a dirty input's version once more after forward returns.
        out.grad_fn.holder.version = out._version
    return out


def _fuses(x: torch.Tensor) -> bool:
    """Whether an activation on ``x`` runs :class:`_LateFunction` for its fused backward."""
    return (
        x.numel() >= _FUSE_FROM
        and x.is_cpu
        and x.dtype in (torch.float32, torch.float64)
        and _bitmask._native is not None
    )


@_signed_cache  # specs are immutable: shared by every module
def _leaky_relu_spec(slope: float, inplace: bool) -> _Spec:
    kernel = functools.partial(
        torch.ops.aten.leaky_relu_backward, negative_slope=slope, self_is_result=inplace
    )
    fn = functools.partial(F.leaky_relu_ if inplace else F.leaky_relu, negative_slope=slope)
    return _Spec(fn, inplace, inplace, GREATER, 0.0, 0.0, kernel, True, slope)


@_signed_cache
def _hardtanh_spec(lo: float, hi: float, inplace: bool) -> _Spec:
    kernel = functools.partial(torch.ops.aten.hardtanh_backward, min_val=lo, max_val=hi)
    fn = functools.partial(F.hardtanh_ if inplace else F.hardtanh, min_val=lo, max_val=hi)
    return _Spec(fn, inplace, inplace, INSIDE, lo, hi, kernel)


_relu_kernel = functools.partial(torch.ops.aten.threshold_backward, threshold=0)
_RELU = _Spec(torch.relu, False, True, NONZERO, 0.0, 0.0, _relu_kernel)
_RELU_ = _Spec(torch.relu_, True, True, NONZERO, 0.0, 0.0, _relu_kernel)


def _threshold_backward(grad: torch.Tensor, passes: torch.Tensor) -> torch.Tensor:
    """PyTorch's ReLU backward kernel, ``passes <= 0 ? 0 : grad``, into ``passes`` where both
    share one layout (one full-size allocation fewer, the layout PyTorch would pick)."""
    if passes.stride() == grad.stride() and passes.is_contiguous():
        return torch.ops.aten.threshold_backward.grad_input(grad, passes, 0, grad_input=passes)
    return torch.ops.aten.threshold_backward(grad, passes, 0)


class _MaskFunction(torch.autograd.Function):
    """A :class:`_Spec` activation deciding in forward (under the caller's saved-tensor hooks):
    the mask of what PyTorch's node saves, unpacked for PyTorch's kernel (as :class:`Late`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: _Spec) -> torch.Tensor:
        if spec.inplace:
            ctx.mark_dirty(x)
        out = spec.fn(x)
        saved = out if spec.saves_result else x
        bits, ctx.memory_order, nan = _pack_layout(saved, spec.op, spec.lo, spec.hi)
        ctx.save_for_backward(saved.detach() if nan else bits)  # a NaN (Hardtanh): kept whole
        ctx.spec, ctx.keep = spec, nan
        ctx.shape, ctx.stride = saved.shape, saved.stride()
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        (saved,) = ctx.saved_tensors
        if ctx.keep:
            return spec.kernel(grad, saved), None
        values = _hardtanh_values(spec.lo, spec.hi, grad.dtype) if spec.op == INSIDE else None
        mask = _unpack_layout(saved, ctx.shape, ctx.stride, ctx.memory_order, grad.dtype,
                              values=values)
        # The mask is this call's own: ReLU's kernel may write its result into it.
        return (_threshold_backward if spec.op == NONZERO else spec.kernel)(grad, mask), None


class ReLU(nn.ReLU):
    """``nn.ReLU`` that keeps a 1-bit mask, or nothing its consumers do not keep already."""

    def _hr_saves_input(self) -> bool:
        return False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (records_graph() and input.requires_grad):
            return super().forward(input)
        if _pending.young:
            settle_pending()
        if _relu_outputs:
            note_consumer(self, input)
        relu = torch.relu_ if self.inplace else torch.relu
        sites, site, call = activation_call(self, input)
        # (hooks_free inlined: this runs at every ReLU call)
        if _top_hooks(False) is None and _hooks_enabled():
            if input.numel() >= _FUSE_FROM and _fuses(input):
                return _apply_late(input, _RELU_ if self.inplace else _RELU, call)
            out = relu(input)
            save_less(out.grad_fn._raw_saved_result, Late(call, NONZERO, 0.0, 0.0, out).hold)
            return out
        # Under the caller's hooks the choice is made now.
        if consumers_keep_output(sites, site):
            out = super().forward(input)
        else:
            out = _MaskFunction.apply(input, _RELU_ if self.inplace else _RELU)
        register_relu_output(sites, site, out)
        return out


class LeakyReLU(KeepsNoInput, nn.LeakyReLU):
    """``nn.LeakyReLU`` that keeps a 1-bit sign mask, or nothing its consumers do not keep."""

    def _hr_fast(self, input: torch.Tensor) -> torch.Tensor | None:
        if self.inplace and self.negative_slope < 0:
            return None
        slope, inplace = float(self.negative_slope), self.inplace
        call = activation_call(self, input)[2]
        if _fuses(input):
            return _apply_late(input, _leaky_relu_spec(slope, inplace), call)
        if inplace:
            out = F.leaky_relu_(input, slope)  # LeakyReluBackward1 saves the result
            save_less(out.grad_fn._raw_saved_result, Late(call, GREATER, 0.0, 0.0, out).hold)
        else:
            out = F.leaky_relu(input, slope)  # LeakyReluBackward0 saves the input
            save_less(out.grad_fn._raw_saved_self, Late(call, GREATER, 0.0, 0.0, input).hold)
        return out

    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.inplace and self.negative_slope < 0:
            return self._hr_torch_forward(input)  # PyTorch raises its own error for this
        return _MaskFunction.apply(
            input, _leaky_relu_spec(float(self.negative_slope), self.inplace))


class _HardtanhMixin(KeepsNoInput):
    def _hr_fast(self, input: torch.Tensor) -> torch.Tensor | None:
        if self.min_val > self.max_val:
            return None
        lo, hi, inplace = float(self.min_val), float(self.max_val), self.inplace
        call = activation_call(self, input)[2]
        # In place always through the Function: PyTorch's hardtanh_ node saves a clone.
        if inplace or _fuses(input):
            return _apply_late(input, _hardtanh_spec(lo, hi, inplace), call)
        out = F.hardtanh(input, lo, hi)  # HardtanhBackward0 saves the input
        save_less(out.grad_fn._raw_saved_self, Late(call, INSIDE, lo, hi, input).hold)
        return out

    def _hr_forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.min_val > self.max_val:
            return self._hr_torch_forward(input)  # PyTorch raises its own error for this
        lo, hi = float(self.min_val), float(self.max_val)
        return _MaskFunction.apply(input, _hardtanh_spec(lo, hi, self.inplace))


class Hardtanh(_HardtanhMixin, nn.Hardtanh):
    """``nn.Hardtanh`` that keeps a 1-bit pass mask, or nothing its consumers do not keep."""


class ReLU6(_HardtanhMixin, nn.ReLU6):
    """``nn.ReLU6`` that keeps a 1-bit pass mask, or nothing its consumers do not keep."""

