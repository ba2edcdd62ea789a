"""The dry run's memo of meta kernel results: the same tensors as the kernels, the same estimate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import headroom as hr
from headroom.fit import _dryrun
from headroom.optim import HostOptimizerOptions


def _layout(t):
    return t.shape, t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes()


@pytest.fixture
def empty_memo(monkeypatch):
    monkeypatch.setattr(_dryrun._MetaResults, "_seen", {})
    monkeypatch.setattr(_dryrun._MetaResults, "_kinds", {})


def test_remembered_results_are_the_kernels(empty_memo):
    a = torch.empty(64, 128, device="meta").t()
    b = torch.empty(128, 1, device="meta")
    c = torch.empty(64, 3, device="meta")
    ops = [(torch.ops.aten.add.Tensor, (a, b)), (torch.ops.aten.sqrt.default, (a,)),
           (torch.ops.aten.mm.default, (a, c)), (torch.ops.aten.sum.dim_IntList, (a, [0]))]
    for func, args in ops:
        first = _dryrun._MetaResults.call(func, args, {})
        again = _dryrun._MetaResults.call(func, args, {})
        assert again is not first
        assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
        assert _layout(again) == _layout(first) == _layout(func(*args))
    assert len(_dryrun._MetaResults._seen) == len(ops)
    x = torch.empty(4, 5, device="meta")
    for _ in range(2):  # in place: its self, remembered after the first call
        assert _dryrun._MetaResults.call(torch.ops.aten.lerp_.Scalar, (x, x, 0.5), {}) is x
    assert len(_dryrun._MetaResults._seen) == len(ops) + 1


def test_ops_that_change_their_self_always_run(empty_memo):
    src = torch.empty(6, 4, device="meta")
    for _ in range(2):
        t = torch.empty(0, device="meta")
        out = _dryrun._MetaResults.call(torch.ops.aten.set_.source_Tensor, (t, src), {})
        assert out is t and t.shape == (6, 4)
        u = torch.empty(0, device="meta")
        _dryrun._MetaResults.call(torch.ops.aten.resize_.default, (u, [3, 3]), {})
        assert u.shape == (3, 3)


def test_a_failing_op_fails_every_time(empty_memo):
    a, b = torch.empty(3, 4, device="meta"), torch.empty(5, 4, device="meta")
    for _ in range(2):
        with pytest.raises(RuntimeError):
            _dryrun._MetaResults.call(torch.ops.aten.add.Tensor, (a, b), {})
    assert not _dryrun._MetaResults._seen


@pytest.mark.parametrize("state", ["cpu", "disk"])
def test_estimate_is_the_same_without_the_memo(state, monkeypatch, empty_memo):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))

    x = torch.randn(16, 32)
    opts = HostOptimizerOptions(torch.optim.AdamW, {"lr": 1e-2, "fused": False}, state, False,
                                2048, 32 << 20)

    def run():
        e = hr.estimate(model(), (x,), optimizer=opts, device="cpu", checkpoint=["1"],
                        offload_activations=1024)
        timeline = [(s.phase, s.module, s.by_category) for s in e.timeline]
        return e.peak, dict(e.peak_by_category), timeline, e.ops

    with_memo = run()
    assert _dryrun._MetaResults._seen  # the memo was used
    monkeypatch.setattr(_dryrun._MetaResults, "call",
                        staticmethod(lambda func, args, kwargs: func(*args, **kwargs)))
    assert run() == with_memo
