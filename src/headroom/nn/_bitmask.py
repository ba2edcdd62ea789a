"""Bit-packed boolean masks: 1 bit per element, stored in ``uint8``.

A ReLU backward only needs to know, per element, whether the gradient passes. PyTorch keeps the
whole float output for that (32 bits per element for fp32); a ``bool`` mask keeps 8 bits. Packing
eight mask bytes into one byte keeps 1 bit.

# NOTE: packing uses a multiply trick on 64-bit words instead of a loop over the 8 bit positions:
# the eight 0/1 bytes of a word ``w = sum(b_i << 8i)`` times ``0x0102040810204080`` put
# ``sum(b_i << i)`` in the top byte with no carries between partial products (their bit positions
# are pairwise distinct), so one multiply, one shift and one mask pack 8 elements. Unpacking
# replicates the byte into all 8 bytes of a word and masks bit ``i`` in byte ``i``. Both are a
# handful of vectorized element-wise kernels over n/8 words, cheap next to the layers around them.
"""

from __future__ import annotations

import torch

_PACK = 0x0102040810204080
_SPREAD = 0x0101010101010101
# NOTE: 0x8040201008040201 does not fit in a signed int64; this is the same bit pattern.
_SELECT = 0x8040201008040201 - (1 << 64)


def _padded_bool(numel: int, device: torch.device) -> torch.Tensor:
    # NOTE: a multiple of 8 bytes so the buffer can be viewed as int64 words.
    return torch.zeros((numel + 7) // 8 * 8, dtype=torch.bool, device=device)


def pack_bool(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor into ``ceil(numel / 8)`` bytes (element order: row-major).

    Args:
        mask: any-shaped ``bool`` tensor.

    Returns:
        A 1-D ``uint8`` tensor; bit ``i % 8`` of byte ``i // 8`` is element ``i`` of ``mask``.
    """
    numel = mask.numel()
    flat = mask.reshape(-1)
    if numel % 8 or flat.data_ptr() % 8:
        buf = _padded_bool(numel, mask.device)
        buf[:numel].copy_(flat)
        flat = buf
    words = flat.view(torch.uint8).view(torch.int64)
    return ((words * _PACK) >> 56).to(torch.uint8)


def pack_le(x: torch.Tensor, threshold: float = 0.0, *, invert: bool = False) -> torch.Tensor:
    """Pack ``x <= threshold`` (or its complement with ``invert``; NaN is never ``<=``).

    The full-size bool tensor lives only inside this call.
    """
    numel = x.numel()
    buf = (
        _padded_bool(numel, x.device)
        if numel % 8
        else torch.empty(numel, dtype=torch.bool, device=x.device)
    )
    torch.le(x.reshape(-1), threshold, out=buf[:numel])
    if invert:
        buf[:numel].logical_not_()
    words = buf.view(torch.uint8).view(torch.int64)
    return ((words * _PACK) >> 56).to(torch.uint8)


def pack_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Pack ``x != 0`` (NaN counts as non-zero, ``-0.0`` as zero).

    # NOTE: written as a cast to ``bool`` (which means exactly ``!= 0``): on CPU the cast kernel
    # is vectorized and ~9x faster than the ``ne`` comparison kernel with a bool output.
    """
    numel = x.numel()
    buf = (
        _padded_bool(numel, x.device)
        if numel % 8
        else torch.empty(numel, dtype=torch.bool, device=x.device)
    )
    buf[:numel].copy_(x.reshape(-1))
    words = buf.view(torch.uint8).view(torch.int64)
    return ((words * _PACK) >> 56).to(torch.uint8)


def pack_gt(x: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Pack ``x > threshold`` (see :func:`pack_le`)."""
    numel = x.numel()
    buf = (
        _padded_bool(numel, x.device)
        if numel % 8
        else torch.empty(numel, dtype=torch.bool, device=x.device)
    )
    torch.gt(x.reshape(-1), threshold, out=buf[:numel])
    words = buf.view(torch.uint8).view(torch.int64)
    return ((words * _PACK) >> 56).to(torch.uint8)


def unpack_bool(bits: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`pack_bool`: a contiguous ``bool`` tensor of ``shape``."""
    return unpack_nonzero(bits, shape).ne(0)


def unpack_nonzero(bits: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``uint8`` tensor of ``shape``, non-zero exactly where the packed mask is set.

    Element ``i`` is ``bit(i) << (i % 8)``: enough for kernels that only test ``> 0`` (ReLU's
    ``threshold_backward``, ``leaky_relu_backward``) once cast to the gradient's dtype, and one
    word-wide multiply and one mask cheaper than normalizing to 0/1.
    """
    numel = 1
    for s in shape:
        numel *= s
    words = (bits.to(torch.int64) * _SPREAD) & _SELECT
    return words.view(torch.uint8)[:numel].view(shape)
