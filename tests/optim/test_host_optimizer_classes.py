"""Which torch optimizers `hr.HostOptimizer` takes, and why it refuses the others: the
capability probe (a matrix, with a dense or a sparse gradient), state on disk for every
element-wise class, and sliced fused steps bitwise the whole-tensor kernel."""

from __future__ import annotations

import warnings

import pytest
import torch

import headroom as hr


def _matrices() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3, bias=False))


def _train(model, opt, steps: int = 3) -> None:
    for step in range(steps):
        x = torch.randn(4, model[0].in_features, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("store", ["plain", "host"])
def test_muon_steps_matrices_bitwise(store):
    """Muon takes 2-D parameters only: the probe steps a matrix, so it is accepted."""
    ref, model = _matrices(), _matrices()
    if store == "host":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hr.offload(model, device="cpu", store="cpu")
    _train(ref, torch.optim.Muon(ref.parameters(), lr=0.02))
    _train(model, hr.HostOptimizer(model.parameters(), torch.optim.Muon, lr=0.02))
    values = model.state_dict()
    assert all(torch.equal(p, values[n]) for n, p in ref.state_dict().items())


def test_sparse_adam_accepted():
    """SparseAdam steps sparse gradients only: the probe tries one after a dense one."""
    emb = torch.nn.Embedding(5, 2, sparse=True)
    opt = hr.HostOptimizer(emb.parameters(), torch.optim.SparseAdam, lr=0.1)
    assert opt.options.optimizer_class is torch.optim.SparseAdam


@pytest.mark.parametrize("cls,kw,match", [
    (torch.optim.SGD, {"lr": -0.1}, r"refuses these options \(ValueError: Invalid learning rate"),
    (torch.optim.Adam, {"differentiable": True}, r"differentiable=True\) records its step"),
    (torch.optim.Adam, {"fused": True, "differentiable": True}, r"records its step"),
])
def test_refusals_name_the_real_reason(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        hr.HostOptimizer([torch.nn.Parameter(torch.zeros(2, 3))], cls, **kw)


def test_muon_state_on_disk_refused_as_not_element_wise(tmp_path):
    with pytest.raises(ValueError, match="element-wise"):
        hr.HostOptimizer(_matrices().parameters(), torch.optim.Muon,
                         state_store=hr.DiskStore(tmp_path))


@pytest.mark.parametrize("cls", [torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop],
                         ids=lambda c: c.__name__)
def test_more_element_wise_classes_keep_state_on_disk_bitwise(cls, tmp_path):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model.load_state_dict(ref.state_dict())
    _train(ref, cls(ref.parameters(), lr=0.01))
    opt = hr.HostOptimizer(model.parameters(), cls, lr=0.01,
                           state_store=hr.DiskStore(tmp_path), slice_bytes=64)
    _train(model, opt)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters(),
                                                  strict=True))


def test_sliced_fused_steps_match_the_whole_tensor_kernel(tmp_path):
    """The fused kernel steps full vectors and a tail differently: slices start at multiples
    of 64 elements, so state on disk in small slices is bitwise torch's fused step."""
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(300))
    p = torch.nn.Parameter(ref.detach().clone())
    ref_opt = torch.optim.Adam([ref], fused=True)
    opt = hr.HostOptimizer([p], torch.optim.Adam, state_store=hr.DiskStore(tmp_path),
                           slice_bytes=24)
    for step in range(4):
        g = torch.randn(300, generator=torch.Generator().manual_seed(step))
        ref.grad, p.grad = g.clone(), g.clone()
        ref_opt.step()
        opt.step()
    assert torch.equal(ref, p)
