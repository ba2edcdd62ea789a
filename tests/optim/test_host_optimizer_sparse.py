"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) through
`hr.HostOptimizer`: bitwise torch's SGD, Adagrad and SparseAdam, on CPU parameters, offloaded to
host memory or a DiskStore, with state in memory or on disk; refusals that name their reason."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr

FUSED_DEFAULT = (torch.optim.Adagrad,)  # of these classes, where HostOptimizer picks fused


class _Model(torch.nn.Module):
    def __init__(self, dense: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 6, sparse=True)
        self.bag = torch.nn.EmbeddingBag(30, 6, mode="sum", sparse=True)
        self.lin = torch.nn.Linear(6, 3) if dense else None
        self.to(dtype)

    def forward(self, ids: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).float() + self.bag(bags).float()
        out = self.lin(h.to(self.emb.weight.dtype)).float() if self.lin is not None else h
        return out.pow(2).sum()


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + micro)
    # rows repeat within a batch and across micro-batches: sums the optimizer must see as torch
    return torch.randint(0, 12, (5,), generator=g), torch.randint(0, 9, (5, 3), generator=g)


def _train(model, opt, steps: int = 3, accum: int = 2) -> None:
    for step in range(steps):
        for micro in range(accum):
            model(*_batch(step, micro)).backward()
        opt.step()
        # both ways of clearing gradients, as loops use them
        (opt if step % 2 else model).zero_grad()


class _Split:
    """torch's reference for HostOptimizer's default: the fused kernel for dense gradients,
    the class's default implementation for sparse ones (which fused refuses)."""

    def __init__(self, cls, model: _Model, **kw):
        sparse = [model.emb.weight, model.bag.weight]
        dense = [p for p in model.parameters() if all(p is not q for q in sparse)]
        self.opts = [cls(sparse, **kw)] + ([cls(dense, fused=True, **kw)] if dense else [])

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


def _offloaded(placement: str, tmp_path, **kw) -> _Model:
    model = _Model(**kw)
    if placement != "plain":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device="cpu" with store="cpu": mechanics only
            store = "cpu" if placement == "host" else hr.DiskStore(tmp_path / "params")
            hr.offload(model, device="cpu", store=store)
    return model


def _assert_equal(ref: torch.nn.Module, model: torch.nn.Module) -> None:
    values = model.state_dict()  # an offloaded model's values, read from its store
    for name, p in ref.state_dict().items():
        assert torch.equal(p, values[name]), f"{name} differs from torch's"


CASES = [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1, "fused": False}),
         (torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1, "foreach": True}),
         (torch.optim.SparseAdam, {"lr": 0.05})]


@pytest.mark.parametrize("placement,state", [("plain", "cpu"), ("host", "cpu"), ("disk", "cpu"),
                                             ("host", "disk"), ("disk", "disk")])
@pytest.mark.parametrize("cls,kw", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_sparse_gradients_bitwise(cls, kw, placement, state, tmp_path):
    dense = cls is not torch.optim.SparseAdam  # SparseAdam takes sparse gradients only
    ref = _Model(dense=dense)
    auto_fused = cls in FUSED_DEFAULT and "fused" not in kw and "foreach" not in kw
    ref_opt = _Split(cls, ref, **kw) if auto_fused else cls(ref.parameters(), **kw)
    _train(ref, ref_opt)
    model = _offloaded(placement, tmp_path, dense=dense)
    state_store = hr.DiskStore(tmp_path / "state") if state == "disk" else "cpu"
    opt = hr.HostOptimizer(model.parameters(), cls, state_store=state_store, slice_bytes=96,
                           **copy.deepcopy(kw))
    _train(model, opt)
    _assert_equal(ref, model)


@pytest.mark.parametrize("placement", ["plain", "host", "disk"])
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam],
                         ids=lambda c: c.__name__)
def test_sparse_gradients_of_bf16_parameters_step_fp32_masters(cls, placement, tmp_path):
    """bf16 embeddings: the sparse gradient (summed in bf16, as autograd sums it) steps an fp32
    master, whose rounding is the new bf16 value: a hand-written loop, bitwise."""
    ref = _Model(dense=False, dtype=torch.bfloat16)
    masters = [p.detach().float() for p in ref.parameters()]
    ref_opt = cls(masters, lr=0.1)
    model = _offloaded(placement, tmp_path, dense=False, dtype=torch.bfloat16)
    opt = hr.HostOptimizer(model.parameters(), cls, lr=0.1, slice_bytes=96)
    for step in range(3):
        for micro in range(2):
            ref(*_batch(step, micro)).backward()
            model(*_batch(step, micro)).backward()
        for p, m in zip(ref.parameters(), masters, strict=True):
            m.grad = p.grad.to(torch.float32)
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters, strict=True):
                p.copy_(m)
        opt.step()
        opt.zero_grad()
    _assert_equal(ref, model)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam],
                         ids=lambda c: c.__name__)
def test_zero_grad_keeping_tensors_steps_empty_sparse_gradients_as_torch(cls, tmp_path):
    """``zero_grad(set_to_none=False)`` leaves empty sparse gradients: the next step still
    counts (Adagrad's and SparseAdam's step), as in torch."""
    ref, model = _Model(dense=False), _offloaded("disk", tmp_path, dense=False)
    ref_opt = cls(ref.parameters(), lr=0.1)
    opt = hr.HostOptimizer(model.parameters(), cls, lr=0.1,
                           state_store=hr.DiskStore(tmp_path / "state"), slice_bytes=96)
    for m, o in ((ref, ref_opt), (model, opt)):
        m(*_batch(0, 0)).backward()
        o.step()
        o.zero_grad(set_to_none=False)
        o.step()  # an empty gradient
        m(*_batch(1, 0)).backward()
        o.step()
    _assert_equal(ref, model)
    if cls is not torch.optim.SGD:
        assert [s["step"] for s in opt.state_dict()["state"].values()] == \
            [s["step"] for s in ref_opt.state_dict()["state"].values()]


@pytest.mark.parametrize("placement,state", [("disk", "cpu"), ("host", "disk")])
def test_sgd_momentum_on_sparse_gradients_sliced_is_refused_with_its_reason(placement, state,
                                                                          tmp_path):
    """torch keeps SGD's momentum for a sparse gradient as a sparse tensor, which cannot rest
    dense in a store: refused before anything changes (in host memory it steps, bitwise)."""
    model = _offloaded(placement, tmp_path, dense=False)
    state_store = hr.DiskStore(tmp_path / "state") if state == "disk" else "cpu"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                           state_store=state_store)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(*_batch(0, 0)).backward()
    with pytest.raises(ValueError, match=r"momentum_buffer.*state_store='cpu'"):
        opt.step()
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_sgd_momentum_on_sparse_gradients_in_host_memory_bitwise(tmp_path):
    ref, model = _Model(dense=False), _offloaded("host", tmp_path, dense=False)
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    _train(model, hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9))
    _assert_equal(ref, model)


def test_clip_grad_norm_refuses_sparse_gradients_as_torch_does(tmp_path):
    model = _offloaded("host", tmp_path)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(*_batch(0, 0)).backward()
    dense = model.lin.weight.grad.clone()
    with pytest.raises(RuntimeError, match="sparse gradients.*nothing was clipped"):
        opt.clip_grad_norm_(1e-3)
    assert torch.equal(model.lin.weight.grad, dense)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.SparseAdam], ids=lambda c: c.__name__)
def test_a_failing_disk_write_in_a_sparse_step_is_undone_and_the_retry_is_exact(cls, tmp_path):
    """A step over the rows a sparse gradient names fails half-way (a disk write raises):
    every parameter and all state are as before it; with the disk back, the same step gives
    torch's result."""
    ref = _Model(dense=False)
    ref_opt = cls(ref.parameters(), lr=0.1)
    _train(ref, ref_opt, steps=2, accum=1)
    model = _offloaded("disk", tmp_path, dense=False)
    state = hr.DiskStore(tmp_path / "state")
    opt = hr.HostOptimizer(model.parameters(), cls, lr=0.1, state_store=state, slice_bytes=96)
    _train(model, opt, steps=1, accum=1)  # the first step makes the state of every row
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    model(*_batch(1, 0)).backward()
    store = model.emb.weight._headroom_binding.store
    real, calls = store.write_rows, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("injected disk failure")
        return real(*args, **kw)

    store.write_rows = failing
    with pytest.raises(OSError, match="injected") as info:
        opt.step()
    store.write_rows = real
    assert "undone" in "".join(info.value.__notes__)
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    now = opt.state_dict()["state"]
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(now[i][k])), (i, k)
    opt.step()  # the gradient is kept: the same step again
    _assert_equal(ref, model)
