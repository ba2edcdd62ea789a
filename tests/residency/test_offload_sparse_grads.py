"""Sparse gradients (``nn.Embedding(sparse=True)``) of offloaded parameters: ``param.grad`` is
the sparse tensor torch's own run leaves there (the same entries in the same order), over
backward passes, ``zero_grad``, assigned gradients and dense ones mixed in; host memory and
DiskStore."""

from __future__ import annotations

import warnings

import pytest
import torch

import headroom as hr


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 4, sparse=True)

    def forward(self, ids: torch.Tensor, dense: bool = False) -> torch.Tensor:
        out = self.emb(ids).pow(2).sum()
        if dense:  # the weight read whole: a dense gradient
            out = out + self.emb.weight.sin().sum()
        return out


def _pair(store: str, tmp_path) -> tuple[_Model, _Model]:
    ref, model = _Model(), _Model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu" with store="cpu": mechanics only
        hr.offload(model, device="cpu",
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "s"))
    return ref, model


def _same_grad(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.is_sparse == b.is_sparse
    if a.is_sparse:
        assert torch.equal(a._indices(), b._indices())
        assert torch.equal(a._values(), b._values())
        assert a.is_coalesced() == b.is_coalesced()
    else:
        assert torch.equal(a, b)


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_sparse_gradient_lands_as_torch_leaves_it(store, tmp_path):
    ref, model = _pair(store, tmp_path)
    for m in (ref, model):
        m(_ids(0)).backward()
    _same_grad(ref.emb.weight.grad, model.emb.weight.grad)
    for m in (ref, model):  # accumulated: appended in order, as autograd's += does
        m(_ids(1)).backward()
        m(torch.tensor([3, 3])).backward()  # values autograd hands over expanded
    _same_grad(ref.emb.weight.grad, model.emb.weight.grad)
    for m in (ref, model):
        m.zero_grad()
        m(_ids(2)).backward()
    _same_grad(ref.emb.weight.grad, model.emb.weight.grad)


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_assigned_and_mixed_gradients(store, tmp_path):
    ref, model = _pair(store, tmp_path)
    g = torch.sparse_coo_tensor(torch.tensor([[1, 4, 1]]), torch.ones(3, 4), (20, 4),
                                check_invariants=False)
    for m in (ref, model):  # an assigned sparse gradient, then a backward adds to it
        m.emb.weight.grad = g.clone()
        m(_ids(0)).backward()
    _same_grad(ref.emb.weight.grad, model.emb.weight.grad)
    for m in (ref, model):  # sparse, then a dense one: their sum is dense
        m(_ids(1), dense=True).backward()
    _same_grad(ref.emb.weight.grad, model.emb.weight.grad)
    for m in (ref, model):  # dense, then sparse: added into the dense gradient
        m(_ids(2)).backward()
    _same_grad(ref.emb.weight.grad, model.emb.weight.grad)
    for m in (ref, model):  # a dense one assigned, then sparse ones added
        m.emb.weight.grad = torch.full((20, 4), 0.25)
        m(_ids(3)).backward()
        m(_ids(4)).backward()
    _same_grad(ref.emb.weight.grad, model.emb.weight.grad)
