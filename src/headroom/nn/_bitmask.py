"""Bit-packed boolean masks: 1 bit per element, stored in ``uint8``.

A ReLU backward only needs to know, per element, whether the gradient passes. PyTorch keeps the
whole float output for that (32 bits per element for fp32); a ``bool`` mask keeps 8 bits. Packing
eight mask bytes into one byte keeps 1 bit. Element ``i`` (row-major order) is bit ``i % 8`` of
byte ``i // 8``.

Three implementations give the same bytes:

- Contiguous CPU tensors use the C kernels of ``headroom.nn._bitkernels`` where they were built
  at install: a fused compare-and-pack of float32 or float64 that reads the floats once, and an
  unpack to any float dtype that writes them once; SIMD on x86-64, chosen at run time
  (``benchmarks/mask_kernels.py`` compares them with the NumPy code below).
  ``HEADROOM_NATIVE=0`` in the environment before import turns them off.
- Other CPU tensors, and every CPU tensor where the kernels were not built, use NumPy's
  ``packbits``/``unpackbits`` on zero-copy views (one SIMD pass each, cheaper than the word
  trick below on CPU). A mask needed as floats
  (:func:`unpack_as`) is unpacked with one table lookup per byte straight into the float
  tensor: each byte selects a row of eight 0/1 values of that dtype.
- Other devices use a multiply trick on 64-bit words: the eight 0/1 bytes of a word
  ``w = sum(b_i << 8i)`` times ``0x0102040810204080`` put ``sum(b_i << i)`` in the top byte with
  no carries between partial products (their bit positions are pairwise distinct), so one
  multiply and one shift pack 8 elements. Unpacking replicates the byte into all 8 bytes of a
  word and keeps bit ``i`` in byte ``i``. Both are a few element-wise kernels over n/8 words.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import numpy as np
import torch

from headroom.memory import is_tracking

try:
    if os.environ.get("HEADROOM_NATIVE", "1") == "0":
        raise ImportError("turned off by HEADROOM_NATIVE=0")
    from headroom.nn import _bitkernels as _native
except ImportError:  # not built (no C compiler at install), or turned off
    _native = None

# dtype -> the kernels' dtype code (packing: the first two only)
_NATIVE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_NATIVE_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}

_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)
_PACK = 0x0102040810204080
_SPREAD = 0x0101010101010101
# 0x8040201008040201 does not fit in a signed int64; this is the same bit pattern.
_SELECT = 0x8040201008040201 - (1 << 64)


def native_kernels() -> str | None:
    """The instruction set of the compiled mask kernels in use, or None where they are not."""
    return None if _native is None else _native.simd()


def _scratch_bool(numel: int, device: torch.device) -> torch.Tensor:
    """A scratch ``bool`` buffer of ``numel`` entries; off CPU padded to whole int64 words."""
    # The padding tail must be zero (it becomes the unused high bits of the last byte).
    if device.type != "cpu" and numel % 8:
        return torch.zeros((numel + 7) // 8 * 8, dtype=torch.bool, device=device)
    return torch.empty(numel, dtype=torch.bool, device=device)


def _pack_scratch(buf: torch.Tensor, numel: int, *, use_numpy: bool | None = None) -> torch.Tensor:
    """Pack the first ``numel`` entries of a scratch buffer from :func:`_scratch_bool`."""
    if use_numpy is None:
        use_numpy = buf.device.type == "cpu"
    if use_numpy:
        return torch.from_numpy(np.packbits(buf[:numel].numpy(), bitorder="little"))
    if numel % 8:  # a CPU scratch buffer packed the torch way: pad it
        padded = torch.zeros((numel + 7) // 8 * 8, dtype=torch.bool, device=buf.device)
        padded[:numel].copy_(buf[:numel])
        buf = padded
    # In place on the scratch buffer, so packing allocates nothing full-size beyond it.
    words = buf.view(torch.uint8).view(torch.int64)
    words.mul_(_PACK).bitwise_right_shift_(56)
    return words.to(torch.uint8)


def pack_bool(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor into ``ceil(numel / 8)`` bytes.

    Args:
        mask: any-shaped ``bool`` tensor.

    Returns:
        A 1-D ``uint8`` tensor on ``mask``'s device; bit ``i % 8`` of byte ``i // 8`` is element
        ``i`` of ``mask`` in row-major order.
    """
    numel = mask.numel()
    buf = _scratch_bool(numel, mask.device)
    buf[:numel].copy_(mask.reshape(-1))
    return _pack_scratch(buf, numel)


def pack_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x != 0`` (NaN counts as non-zero, ``-0.0`` as zero)."""
    # Written as a cast to ``bool`` (which means exactly ``!= 0``): on CPU the cast kernel
    # is vectorized, unlike the ``ne`` comparison kernel with a bool output.
    if x.device.type == "cpu":
        # float16/bfloat16 keep torch's cast, which compares in float32 like PyTorch's
        # kernels do (and so treats subnormals as they do under torch.set_flush_denormal).
        code = _NATIVE_CODES.get(x.dtype, 9) if _native is not None else 9
        if code < 2 and x.is_contiguous():
            numel = x.numel()
            bits = torch.empty((numel + 7) // 8, dtype=torch.uint8)
            _native.pack_nonzero(x.data_ptr(), numel, bits.data_ptr(), code)
            return bits
        # One comparison and NumPy's packbits, which reads any strides in row-major
        # order: 2 calls instead of 4, which matters for the fixed cost of the many small
        # tensors of a late CNN stage. NumPy's float ``!= 0`` is SIMD, cheaper than torch's
        # cast to bool; dtypes NumPy lacks (bfloat16) take torch's cast.
        if x.dtype in _NUMPY_FLOATS:
            return torch.from_numpy(np.packbits(x.detach().numpy() != 0, bitorder="little"))
        return torch.from_numpy(np.packbits(x.bool().numpy(), bitorder="little"))
    return pack_bool(x)  # its copy into a bool buffer is the cast


# Tests :func:`pack_test` can pack (the C kernels' op codes).
NONZERO, GREATER, INSIDE = 0, 1, 2


def pack_test(
    x: torch.Tensor, op: int, lo: float = 0.0, hi: float = 0.0
) -> tuple[torch.Tensor, bool]:
    """Pack one test of each element of ``x``, in row-major order.

    Args:
        x: a floating-point tensor.
        op: :data:`NONZERO` (``x != 0``: NaN set, ``-0.0`` clear, as :func:`pack_nonzero`),
            :data:`GREATER` (``x > lo``) or :data:`INSIDE` (``lo < x < hi``); the last two are
            ordered comparisons, false for NaN, made in ``x``'s dtype like PyTorch's kernels.
        lo: the lower bound of ``GREATER`` and ``INSIDE``.
        hi: the upper bound of ``INSIDE``.

    Returns:
        ``(bits, nan_seen)``: the packed mask, and for ``INSIDE`` whether ``x`` holds a NaN
        (always False for the other tests).
    """
    if op == NONZERO:
        return pack_nonzero(x), False
    if x.device.type == "cpu":
        code = _NATIVE_CODES.get(x.dtype, 9) if _native is not None else 9
        if code < 2 and x.is_contiguous():
            numel = x.numel()
            bits = torch.empty((numel + 7) // 8, dtype=torch.uint8)
            nan = _native.pack_cmp(x.data_ptr(), numel, bits.data_ptr(), code, op, lo, hi)
            return bits, bool(nan)
        if x.dtype in (torch.float32, torch.float64):
            a = x.detach().numpy()
            # Bounds rounded to the array's dtype first, as PyTorch's kernels do.
            lo_, hi_ = a.dtype.type(lo), a.dtype.type(hi)
            test = a > lo_ if op == GREATER else (a > lo_) & (a < hi_)
            nan = op == INSIDE and bool(np.isnan(a).any())
            return torch.from_numpy(np.packbits(test, bitorder="little")), nan
    test = torch.gt(x, lo) if op == GREATER else torch.gt(x, lo).logical_and_(torch.lt(x, hi))
    nan = op == INSIDE and bool(torch.isnan(x).any())
    return pack_bool(test), nan


def _pack_compared(compare, x: torch.Tensor, threshold: float) -> torch.Tensor:
    numel = x.numel()
    buf = _scratch_bool(numel, x.device)
    compare(x.reshape(-1), threshold, out=buf[:numel])
    return _pack_scratch(buf, numel)


def pack_le(x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Pack ``x <= threshold`` (NaN is never ``<=``)."""
    return _pack_compared(torch.le, x, threshold)


def pack_gt(x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Pack ``x > threshold`` (NaN is never ``>``)."""
    return _pack_compared(torch.gt, x, threshold)


def unpack_nonzero(
    bits: torch.Tensor, shape: torch.Size | tuple[int, ...], *, use_numpy: bool | None = None
) -> torch.Tensor:
    """``uint8`` tensor of ``shape``, non-zero exactly where the packed mask is set.

    On CPU the values are 0/1. Off CPU element ``i`` is ``bit(i) << (i % 8)``, which saves
    normalizing and is enough for the kernels it feeds (``threshold_backward`` and
    ``leaky_relu_backward`` test ``> 0``) once cast to the gradient's dtype.
    """
    numel = math.prod(shape)
    if use_numpy is None:
        use_numpy = bits.device.type == "cpu"
    if use_numpy:
        flat = np.unpackbits(bits.numpy(), count=numel, bitorder="little")
        return torch.from_numpy(flat).view(shape)
    words = bits.to(torch.int64)
    words.mul_(_SPREAD).bitwise_and_(_SELECT)
    return words.view(torch.uint8)[:numel].view(shape)


@functools.cache
def _lut(dtype: torch.dtype, values: tuple[float, float] | None = None) -> np.ndarray:
    """256 x 8 table: row ``b`` holds bit ``i`` of ``b`` in column ``i``, as ``dtype`` (1 and 0,
    or ``values[1]`` and ``values[0]``)."""
    rows = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    table = torch.from_numpy(rows).to(dtype)
    if values is not None:
        table = torch.where(table != 0, values[1], values[0]).to(dtype)
    return table.numpy()


_UNSIGNED = {torch.float32: torch.int32, torch.float64: torch.int64}


@functools.cache
def _patterns(dtype: torch.dtype, values: tuple[float, float]) -> tuple[int, int]:
    """The bit patterns of ``values`` in ``dtype``, as unsigned integers (the C unpack's)."""
    width = torch.empty((), dtype=dtype).element_size() * 8
    ints = torch.tensor(values, dtype=dtype).view(_UNSIGNED.get(dtype, torch.int16))
    zero, one = (int(v) % (1 << width) for v in ints.tolist())
    return zero, one


class _Buffer:
    """A per-thread reusable flat buffer of one dtype and views of it cached by shape."""

    __slots__ = ("flat", "key", "base", "unshared", "views")

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.flat = torch.empty(numel, dtype=dtype)
        self.key = self.flat.untyped_storage()._cdata
        self.base = self.unshared = _use_count(self.key)
        # shape -> (view, its data pointer, numel); ``unshared`` counts them: the use count
        # while nothing else holds a view
        self.views: dict[torch.Size, tuple[torch.Tensor, int, int]] = {}


class _Reusable(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, _Buffer] = {}


_reusable = _Reusable()
# A private PyTorch function; where a version lacks it, nothing is reused.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _free_buffer(numel: int, dtype: torch.dtype) -> _Buffer | None:
    """This thread's reusable ``dtype`` buffer, grown to at least ``numel`` elements, or None
    where no torch function says whether it is free (then the caller allocates)."""
    # A masked ReLU's backward needs its mask as floats only inside PyTorch's own
    # ReluBackward0 (see _activation.Late), which drops them when it returns. Unpacking into a
    # fresh allocation each time costs page faults for every large buffer. The buffer is
    # reused only while nothing else holds a view of it (its storage's use count is back to
    # what it was with only the cached views: the caller's views are gone), so a caller that
    # keeps the tensor (double backward, looking at ``grad_fn._saved_result``, another thread:
    # the buffer is per thread anyway) gets a fresh one and the old one lives on with it. One
    # buffer per thread and dtype, as large as the largest mask unpacked on that thread so far,
    # stays allocated.
    if _use_count is None:
        return None
    buffers = _reusable.buffers
    buf = buffers.get(dtype)
    if buf is not None and buf.flat.numel() >= numel and _use_count(buf.key) == buf.unshared:
        return buf
    buf = buffers[dtype] = _Buffer(numel, dtype)
    return buf


def _reusable_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU ``dtype`` buffer of ``numel`` elements that nothing else uses right now."""
    buf = _free_buffer(numel, dtype)
    if buf is None:
        return torch.empty(numel, dtype=dtype)
    return buf.flat[:numel]


def reusable_float32(shape: torch.Size) -> tuple[torch.Tensor, int, int]:
    """``(tensor, its data pointer, its numel)``: a contiguous float32 CPU tensor of ``shape``
    that nothing else uses right now, for a caller done with it before it returns (see
    :func:`_free_buffer`). A view of this thread's buffer, cached by shape (the same shapes
    come back every step), so that a call costs no tensor operation."""
    buffers = _reusable.buffers
    buf = buffers.get(torch.float32)
    if buf is not None and _use_count(buf.key) == buf.unshared:
        got = buf.views.get(shape)
        if got is not None:
            return got
    n = shape.numel()
    buf = _free_buffer(n, torch.float32)
    if buf is None:
        out = torch.empty(shape)
        return out, out.data_ptr(), n
    if len(buf.views) > 256:  # many shapes: keep the recent ones (none is held: buf is free)
        buf.views.clear()
        buf.unshared = buf.base
    view = buf.flat[:n].view(shape)
    got = buf.views[shape] = (view, view.data_ptr(), n)
    buf.unshared += 1  # the cached view holds the storage too
    return got


def unpack_as(
    bits: torch.Tensor,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
    *,
    reuse: bool = False,
    values: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Contiguous ``dtype`` tensor of ``shape``, positive where the packed mask is set, else 0.

    On CPU the values are 1 and 0; off CPU they are as :func:`unpack_nonzero`'s. With
    ``values=(clear, set)`` they are exactly those two values (rounded to ``dtype``). With
    ``reuse=True`` a CPU result may be a view of a per-thread buffer that the next call with
    ``reuse=True`` overwrites once the caller has dropped every view of it: for callers that
    are done with the result before they return (see :func:`_reusable_buffer`). While
    headroom's memory tracker runs, every result is a fresh allocation it can see.
    """
    # On CPU, one ``np.take`` of the 8-value row of :func:`_lut` per mask byte: a single
    # vectorized pass instead of ``unpackbits`` plus PyTorch's uint8 -> float cast (whose CPU
    # copy loop is not vectorized). ``mode="wrap"`` (a no-op: a byte always indexes one of the
    # 256 rows) lets NumPy write straight into ``out`` instead of into a temporary it would copy
    # from. ``out`` comes from NumPy's allocator, which asks the kernel for huge pages for large
    # arrays (fewer page faults than a ``torch.empty`` buffer). While headroom's memory tracker
    # runs, the buffer comes from PyTorch so that the tracker sees it.
    if bits.device.type == "cpu" and _native is not None and dtype in _NATIVE_CODES:
        numel = math.prod(shape)
        if not bits.is_contiguous() or bits.dtype != torch.uint8 or bits.numel() * 8 < numel:
            raise ValueError(f"a packed mask of {bits.numel()} bytes cannot hold {numel} bits")
        if is_tracking():
            out = torch.empty(numel, dtype=dtype)
        elif reuse:
            out = _reusable_buffer(numel, dtype)
        elif dtype in _NATIVE_NUMPY:  # NumPy's allocator: see the note above
            out = torch.from_numpy(np.empty(numel, dtype=_NATIVE_NUMPY[dtype]))
        else:
            out = torch.empty(numel, dtype=dtype)
        _native.unpack(bits.data_ptr(), numel, out.data_ptr(), _NATIVE_CODES[dtype],
                       *(() if values is None else _patterns(dtype, values)))
        return out.view(shape)
    if bits.device.type == "cpu" and dtype in _NUMPY_FLOATS:
        numel = math.prod(shape)
        rows = (numel + 7) // 8
        if reuse and not is_tracking():
            out = _reusable_buffer(rows * 8, dtype)
            table = out.numpy().reshape(rows, 8)
        elif is_tracking():
            out = torch.empty(rows * 8, dtype=dtype)
            table = out.numpy().reshape(rows, 8)
        else:
            table = np.empty((rows, 8), dtype=_lut(dtype).dtype)
            out = torch.from_numpy(table).view(-1)
        np.take(_lut(dtype, values), bits.numpy()[:rows], axis=0, out=table, mode="wrap")
        return (out[:numel] if numel % 8 else out).view(shape)
    if values is not None:
        passes = unpack_bool(bits, shape)
        full = torch.full(shape, values[0], dtype=dtype, device=bits.device)
        return full.masked_fill_(passes, values[1])
    return unpack_nonzero(bits, shape).to(dtype)


def grad_through(
    bits: torch.Tensor, grad: torch.Tensor, *, scale: bool = False, slope: float = 0.0
) -> torch.Tensor | None:
    """``where(mask, grad, grad * slope if scale else 0)`` in one pass over ``grad``'s memory
    (mask bit ``i`` for element ``i`` of that memory), bitwise as PyTorch's ReLU, Hardtanh and
    LeakyReLU backward kernels compute it; None where the C kernels cannot (not built, not a
    dense float32/float64 CPU tensor), for the caller to unpack the mask instead."""
    if (
        _native is None
        or grad.device.type != "cpu"
        or grad.dtype not in (torch.float32, torch.float64)
        or bits.numel() * 8 < grad.numel()
    ):
        return None
    out = torch.empty_like(grad)
    code = _NATIVE_CODES[grad.dtype]
    _native.grad(bits.data_ptr(), grad.data_ptr(), grad.numel(), out.data_ptr(), code, scale, slope)
    return out


def unpack_bool(bits: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bool`: a contiguous ``bool`` tensor of ``shape``."""
    return unpack_nonzero(bits, shape).ne(0)
