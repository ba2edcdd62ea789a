"""The 1-bit mask packing used by ReLU and friends."""

from __future__ import annotations

import pytest
import torch

from headroom.nn._bitmask import pack_bool, pack_gt, pack_le, unpack_bool


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 63, 64, 1000, 12345])
def test_round_trip_and_size(numel):
    mask = torch.rand(numel) > 0.5
    bits = pack_bool(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == (numel + 7) // 8
    assert torch.equal(unpack_bool(bits, (numel,)), mask)


def test_comparisons_handle_nan_and_views():
    x = torch.randn(3, 5, 7)
    x[0, 0, 0] = float("nan")
    x[1, 1, 1] = 0.0
    assert torch.equal(unpack_bool(pack_le(x), x.shape), x <= 0)
    assert torch.equal(unpack_bool(pack_gt(x), x.shape), x > 0)
    view = x[:, 1:].transpose(1, 2)  # non-contiguous
    assert torch.equal(unpack_bool(pack_le(view), view.shape), view <= 0)
    assert torch.equal(unpack_bool(pack_bool(view > 0), view.shape), view > 0)


def test_bit_order_is_little_endian_within_a_byte():
    mask = torch.tensor([True, False, False, False, False, False, False, True, True])
    assert pack_bool(mask).tolist() == [0b10000001, 0b1]


def test_pack_nonzero_matches_relu_backward_rule():
    from headroom.nn._bitmask import pack_nonzero, unpack_nonzero

    x = torch.tensor([1.0, 0.0, -0.0, float("nan"), -float("nan"), 3.0, 0.0, 2.0, 5.0])
    bits = pack_nonzero(x)
    passes = unpack_nonzero(bits, x.shape).float()
    g = torch.arange(1.0, 10.0)
    ref = torch.ops.aten.threshold_backward(g, x, 0)
    assert torch.equal(torch.ops.aten.threshold_backward(g, passes, 0), ref)


@pytest.mark.parametrize("numel", [1, 8, 13, 1000])
def test_numpy_and_word_paths_give_the_same_bytes(numel):
    from headroom.nn._bitmask import _pack_scratch, _scratch_bool, unpack_nonzero

    mask = torch.rand(numel) > 0.4
    buf_a, buf_b = _scratch_bool(numel, mask.device), _scratch_bool(numel, mask.device)
    buf_a[:numel].copy_(mask)
    buf_b[:numel].copy_(mask)
    a = _pack_scratch(buf_a, numel, use_numpy=True)
    b = _pack_scratch(buf_b, numel, use_numpy=False)
    assert torch.equal(a, b)
    for use_numpy in (True, False):
        got = unpack_nonzero(a, (numel,), use_numpy=use_numpy)
        assert torch.equal(got.ne(0), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (7,), (2, 4), (3, 5, 7), (4, 3, 16, 16)])
def test_unpack_as_gives_the_mask_in_the_dtype(dtype, shape):
    from headroom.nn._bitmask import unpack_as

    mask = torch.rand(shape) > 0.5
    got = unpack_as(pack_bool(mask), shape, dtype)
    assert got.dtype == dtype and got.shape == mask.shape and got.is_contiguous()
    assert torch.equal(got, mask.to(dtype))
