"""`add_into` (the host gradient accumulation) gives exactly what ``dst.add_(src)`` gives."""

from __future__ import annotations

import threading

import pytest
import torch

from headroom.store._host import _ADD_CHUNK, add_into

PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
         (torch.float64, torch.float32), (torch.float32, torch.float32),
         (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)]


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.randint(
        -6, 6, (n,), generator=g)
    t[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    return t.to(dtype)


@pytest.mark.parametrize("dst_dtype,src_dtype", PAIRS)
@pytest.mark.parametrize("n", [7, _ADD_CHUNK // 8 + 1, 2 * _ADD_CHUNK + 12345])
def test_bitwise_as_add_(dst_dtype, src_dtype, n):
    dst, src = _values(n, dst_dtype, 0), _values(n, src_dtype, 1)
    want = dst.clone().add_(src)
    add_into(dst, src)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_shapes_and_views():
    src = _values(3 * _ADD_CHUNK, torch.bfloat16, 2).view(3, -1)
    for dst in (_values(3 * _ADD_CHUNK, torch.float32, 3).view(3, -1),
                _values(3 * _ADD_CHUNK, torch.float32, 3).view(-1, 3).t()):  # not contiguous
        want = dst.clone().add_(src)
        add_into(dst, src)
        assert _same(dst, want)
    dst = torch.zeros(3, _ADD_CHUNK)
    add_into(dst, torch.ones(_ADD_CHUNK, dtype=torch.bfloat16))  # broadcast, as add_ does
    assert torch.equal(dst, torch.ones(3, _ADD_CHUNK))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_threads_use_their_own_scratch():
    n = 2 * _ADD_CHUNK + 3
    pairs = [(_values(n, torch.float32, 10 + i), _values(n, torch.bfloat16, 20 + i))
             for i in range(4)]
    wants = [d.clone() for d, _ in pairs]
    for w, (_, s) in zip(wants, pairs, strict=True):
        for _ in range(3):
            w.add_(s)

    def run(i):
        for _ in range(3):
            add_into(*pairs[i])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for (d, _), w in zip(pairs, wants, strict=True):
        assert _same(d, w)
