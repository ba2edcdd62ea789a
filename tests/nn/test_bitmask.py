"""The 1-bit mask packing used by ReLU and friends."""

from __future__ import annotations

import pytest
import torch

from headroom.nn._bitmask import GREATER, pack_bool, pack_test, unpack_bool


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
    assert torch.equal(unpack_bool(pack_test(x, GREATER)[0], x.shape), x > 0)
    view = x[:, 1:].transpose(1, 2)  # non-contiguous
    assert torch.equal(unpack_bool(pack_test(view, GREATER)[0], view.shape), view > 0)
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


def _special_values(n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(n, dtype=torch.float64)
    x[::3] = 0.0
    x[1::7] = -0.0
    x[2::11] = float("nan")
    x[3::13] = float("inf")
    x[4::17] = -float("inf")
    x = x.to(dtype)
    if n > 5:
        x[5] = torch.finfo(dtype).tiny / 4  # a subnormal: non-zero
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 12345])
def test_native_kernels_give_the_numpy_bytes(monkeypatch, dtype, numel):
    from headroom.nn import _bitmask

    if _bitmask._native is None:
        pytest.skip("the C kernels were not built here")
    x = _special_values(numel, dtype)
    native_bits = _bitmask.pack_nonzero(x)
    native_floats = _bitmask.unpack_as(native_bits, x.shape, dtype)
    monkeypatch.setattr(_bitmask, "_native", None)
    numpy_bits = _bitmask.pack_nonzero(x)
    assert torch.equal(native_bits, numpy_bits)
    assert torch.equal(native_bits, pack_bool(x != 0))
    assert torch.equal(native_floats, _bitmask.unpack_as(numpy_bits, x.shape, dtype))
    assert torch.equal(native_floats, (x != 0).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_native_unpack_of_half_dtypes(dtype):
    from headroom.nn import _bitmask

    mask = torch.rand(1001) > 0.5
    got = _bitmask.unpack_as(pack_bool(mask), mask.shape, dtype)
    assert got.dtype == dtype and torch.equal(got, mask.to(dtype))


def test_native_kernels_on_a_large_buffer():
    """Above 64 Ki elements the kernels release the GIL: same bytes."""
    from headroom.nn import _bitmask

    native = _bitmask._native
    if native is None:
        pytest.skip("the C kernels were not built here")
    n = (1 << 21) + 8 * 77 + 3
    x = _special_values(n, torch.float32)
    want = pack_bool(x != 0)
    bits = torch.full_like(want, 0xAA)
    native.pack_nonzero(x.data_ptr(), n, bits.data_ptr(), 0)
    assert torch.equal(bits, want)
    floats = torch.full((n,), 7.0)
    native.unpack(bits.data_ptr(), n, floats.data_ptr(), 0)
    assert torch.equal(floats, (x != 0).float())


def test_native_kernels_refuse_bad_arguments():
    from headroom.nn import _bitmask

    native = _bitmask._native
    if native is None:
        pytest.skip("the C kernels were not built here")
    x = torch.ones(8)
    out = torch.empty(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dtype"):
        native.pack_nonzero(x.data_ptr(), 8, out.data_ptr(), 2)  # no float16 packing
    with pytest.raises(ValueError, match="count"):
        native.unpack(out.data_ptr(), -1, x.data_ptr(), 0)
    with pytest.raises(TypeError):
        native.unpack(out.data_ptr(), 8, x.data_ptr())  # no dtype
    with pytest.raises(ValueError, match="cannot hold"):
        _bitmask.unpack_as(out, (9,), torch.float32)
    with pytest.raises(ValueError, match="op"):
        native.pack_cmp(x.data_ptr(), 8, out.data_ptr(), 0, 3, 0.0, 0.0)
    with pytest.raises(TypeError):
        native.pack_cmp(x.data_ptr(), 8, out.data_ptr(), 0, 1)
    with pytest.raises(TypeError):
        native.unpack(out.data_ptr(), 8, x.data_ptr(), 0, 0)  # zero without one


def test_native_kernels_are_built_here():
    """Where a C compiler is installed they are built: a silent fallback would hide a broken
    build (the tests above would all skip)."""
    import os
    import shutil

    from headroom.nn._bitmask import native_kernels

    if os.environ.get("HEADROOM_NATIVE", "1") == "0":
        pytest.skip("turned off by HEADROOM_NATIVE=0")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the NumPy code runs instead")
    assert native_kernels() in {"avx512f", "avx2", "scalar"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 9, 16, 17, 1000, 70001])
def test_pack_test_kernels_numpy_and_torch_agree(monkeypatch, dtype, numel):
    """``x > lo`` and ``lo < x < hi`` (ordered: NaN clear, with a NaN flag for the latter) give
    the same bytes from the C kernels, the NumPy code and torch's comparisons."""
    from headroom.nn import _bitmask
    from headroom.nn._bitmask import GREATER, INSIDE, pack_test

    x = _special_values(numel, torch.float64).to(dtype) * 2
    cases = [(GREATER, 0.0, 0.0), (GREATER, -0.3, 0.0), (INSIDE, 0.0, 6.0), (INSIDE, -0.5, 0.5)]
    for op, lo, hi in cases:
        ref = x > lo if op == GREATER else (x > lo) & (x < hi)
        nan = op == INSIDE and bool(x.isnan().any())
        got = [pack_test(x, op, lo, hi)]
        got.append(pack_test(x.unsqueeze(0).expand(2, -1)[1], op, lo, hi))  # a strided view
        monkeypatch.setattr(_bitmask, "_native", None)
        got.append(pack_test(x, op, lo, hi))
        monkeypatch.undo()
        for bits, seen in got:
            assert torch.equal(bits, pack_bool(ref)), (op, lo, hi)
            assert seen == nan


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 8, 13, 1000, 70001])
def test_unpack_with_values(monkeypatch, dtype, numel):
    from headroom.nn import _bitmask

    mask = torch.rand(numel) > 0.5
    want = torch.where(mask, 0.25, -0.5).to(dtype)
    bits = pack_bool(mask)
    for native in (True, False):
        if not native:
            monkeypatch.setattr(_bitmask, "_native", None)
        for reuse in (False, True):
            got = _bitmask.unpack_as(bits, mask.shape, dtype, reuse=reuse, values=(-0.5, 0.25))
            assert got.dtype == dtype and torch.equal(got, want)
