"""Bit-packed masks: element ``i`` (row-major) is bit ``i % 8`` of ``uint8`` byte ``i // 8``.

Same bytes three ways: the C kernels of ``headroom.nn._bitkernels`` for contiguous CPU tensors
where built (``HEADROOM_NATIVE=0`` before import turns them off), NumPy for other CPU tensors, and
elsewhere a multiply on 64-bit words: eight 0/1 bytes times ``0x0102040810204080`` gather their
bits in the top byte, carry-free; unpacking spreads a byte over 8 and keeps bit ``i`` of byte ``i``.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import numpy as np
import torch

from headroom.memory import is_tracking
from headroom.nn._common import _use_count

try:
    if os.environ.get("HEADROOM_NATIVE", "1") == "0":
        raise ImportError("turned off by HEADROOM_NATIVE=0")
    from headroom.nn import _bitkernels as _native
except ImportError:  # not built (no C compiler at install), or turned off
    _native = None

# dtype -> the kernels' dtype code (packing: the first two only)
_NATIVE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}

_PACK = 0x0102040810204080
_SPREAD = 0x0101010101010101
# 0x8040201008040201 does not fit in a signed int64; this is the same bit pattern.
_SELECT = 0x8040201008040201 - (1 << 64)


def native_kernels() -> str | None:
    """The instruction set of the compiled mask kernels in use, or None where they are not."""
    return None if _native is None else _native.simd()


def _scratch_bool(numel: int, device: torch.device) -> torch.Tensor:
    """A scratch ``bool`` buffer of ``numel`` entries; off CPU zero-padded to int64 words."""
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
    """Pack a ``bool`` tensor into ``ceil(numel / 8)`` bytes on its device."""
    numel = mask.numel()
    buf = _scratch_bool(numel, mask.device)
    buf[:numel].copy_(mask.reshape(-1))
    return _pack_scratch(buf, numel)


def pack_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x != 0`` (NaN counts as non-zero, ``-0.0`` as zero)."""
    if x.device.type == "cpu":
        # float16/bfloat16 take torch's cast, which compares in float32 like PyTorch's kernels
        # (subnormals as under torch.set_flush_denormal).
        code = _NATIVE_CODES.get(x.dtype, 9) if _native is not None else 9
        if code < 2 and x.is_contiguous():
            numel = x.numel()
            bits = torch.empty((numel + 7) // 8, dtype=torch.uint8)
            _native.pack_nonzero(x.data_ptr(), numel, bits.data_ptr(), code)
            return bits
        # NumPy's SIMD ``!= 0`` and packbits, which reads any strides: fewer calls for the
        # many small tensors of a late CNN stage; dtypes NumPy lacks take torch's bool cast.
        if x.dtype in _NUMPY_FLOATS:
            return torch.from_numpy(np.packbits(x.detach().numpy() != 0, bitorder="little"))
        return torch.from_numpy(np.packbits(x.bool().numpy(), bitorder="little"))
    return pack_bool(x)  # its copy into a bool buffer is the cast (vectorized, unlike ``ne``)


# Tests :func:`pack_test` can pack (the C kernels' op codes).
NONZERO, GREATER, INSIDE = 0, 1, 2


def pack_test(
    x: torch.Tensor, op: int, lo: float = 0.0, hi: float = 0.0
) -> tuple[torch.Tensor, bool]:
    """``(bits, nan_seen)``: one test per element of float tensor ``x``, packed, and for
    ``INSIDE`` whether ``x`` holds a NaN. ``op``: :data:`NONZERO` (as :func:`pack_nonzero`),
    :data:`GREATER` (``x > lo``) or :data:`INSIDE` (``lo < x < hi``), compared in ``x``'s
    dtype like PyTorch's kernels (false for NaN)."""
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
            lo_, hi_ = a.dtype.type(lo), a.dtype.type(hi)  # rounded as PyTorch's kernels do
            test = a > lo_ if op == GREATER else (a > lo_) & (a < hi_)
            nan = op == INSIDE and bool(np.isnan(a).any())
            return torch.from_numpy(np.packbits(test, bitorder="little")), nan
    test = torch.gt(x, lo) if op == GREATER else torch.gt(x, lo).logical_and_(torch.lt(x, hi))
    nan = op == INSIDE and bool(torch.isnan(x).any())
    return pack_bool(test), nan


def unpack_nonzero(
    bits: torch.Tensor, shape: torch.Size | tuple[int, ...], *, use_numpy: bool | None = None
) -> torch.Tensor:
    """``uint8`` tensor of ``shape``, non-zero exactly where the packed mask is set: 0/1 on
    CPU, ``bit(i) << (i % 8)`` off CPU (enough for kernels that test ``> 0``)."""
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
    """256 x 8 table: bit ``i`` of ``b`` at ``[b, i]``, as ``dtype`` 1/0 (or ``values[::-1]``)."""
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
        self.base = self.unshared = _use_count(self.key)  # and with only the cached views held
        self.views: dict[torch.Size, tuple[torch.Tensor, int, int]] = {}  # (view, ptr, numel)


class _Reusable(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, _Buffer] = {}


_reusable = _Reusable()


def _free_buffer(numel: int, dtype: torch.dtype) -> _Buffer:
    """This thread's reusable ``dtype`` buffer, grown to at least ``numel`` elements."""
    # A mask is needed as floats only inside the node's backward; a fresh allocation each time
    # costs page faults. Reused only while the use count shows no view held outside the cache:
    # a caller keeping the tensor (double backward) leaves it to that caller and gets a new one.
    buffers = _reusable.buffers
    buf = buffers.get(dtype)
    if buf is not None and buf.flat.numel() >= numel and _use_count(buf.key) == buf.unshared:
        return buf
    buf = buffers[dtype] = _Buffer(numel, dtype)
    return buf


def _reusable_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU ``dtype`` buffer of ``numel`` elements that nothing else uses right now."""
    return _free_buffer(numel, dtype).flat[:numel]


def reusable_float32(shape: torch.Size) -> tuple[torch.Tensor, int, int]:
    """``(tensor, data pointer, numel)``: a float32 CPU tensor of ``shape`` nothing else uses
    now (see :func:`_free_buffer`); views are cached by shape: no tensor op per call."""
    buffers = _reusable.buffers
    buf = buffers.get(torch.float32)
    if buf is not None and _use_count(buf.key) == buf.unshared:
        got = buf.views.get(shape)
        if got is not None:
            return got
    n = shape.numel()
    buf = _free_buffer(n, torch.float32)
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
    """Contiguous ``dtype`` tensor of ``shape``, positive where the packed mask is set, else 0
    (1/0 on CPU, as :func:`unpack_nonzero` off it; exactly ``values=(clear, set)`` if given).
    ``reuse=True``: on CPU maybe a view of a per-thread buffer (see :func:`_free_buffer`), for
    callers done with it before they return. Under the memory tracker always a fresh tensor."""
    # NumPy's allocator asks for huge pages for large arrays (fewer page faults). The NumPy path
    # is one vectorized ``np.take`` of a :func:`_lut` row per byte (torch's uint8 -> float cast
    # is not vectorized); ``mode="wrap"`` (a no-op) lets it write straight into ``out``.
    if bits.device.type == "cpu" and _native is not None and dtype in _NATIVE_CODES:
        numel = math.prod(shape)
        if not bits.is_contiguous() or bits.dtype != torch.uint8 or bits.numel() * 8 < numel:
            raise ValueError(f"a packed mask of {bits.numel()} bytes cannot hold {numel} bits")
        tracking = is_tracking()
        if reuse and not tracking:
            out = _reusable_buffer(numel, dtype)
        elif dtype in _NUMPY_FLOATS and not tracking:  # NumPy's allocator
            out = torch.from_numpy(np.empty(numel, dtype=_NUMPY_FLOATS[dtype]))
        else:
            out = torch.empty(numel, dtype=dtype)
        _native.unpack(bits.data_ptr(), numel, out.data_ptr(), _NATIVE_CODES[dtype],
                       *(() if values is None else _patterns(dtype, values)))
        return out.view(shape)
    if bits.device.type == "cpu" and dtype in _NUMPY_FLOATS:
        numel = math.prod(shape)
        rows = (numel + 7) // 8
        tracking = is_tracking()
        if reuse or tracking:
            n = rows * 8
            out = torch.empty(n, dtype=dtype) if tracking else _reusable_buffer(n, dtype)
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
    """``where(mask, grad, grad * slope if scale else 0)`` in one pass over ``grad``'s memory,
    bitwise as PyTorch's activation backward kernels; None where the C kernels cannot."""
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
