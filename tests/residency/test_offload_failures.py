"""What survives a failure inside an offloaded model's forward or backward.

After any exception (``KeyboardInterrupt`` included) raised in forward or backward, the model is
back in its resting state (the same parameter objects, nothing left on the device), and after
``zero_grad()`` training goes on bitwise equal to plain training that never saw the failed call.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from headroom.residency._group import DeviceCopy
from headroom.store import DiskStore, HostStore, StoreFullError

D = 16
N_BLOCKS = 4


class Injected(Exception):
    pass


class Fail(nn.Module):
    """Raises in forward, or in backward (from a tensor hook), when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str | None = None
        self.exc: type[BaseException] = Injected

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.phase == "forward":
            raise self.exc("injected in forward")
        if self.phase == "backward" and x.requires_grad:
            exc = self.exc

            def boom(grad):
                raise exc("injected in backward")

            x = x.view_as(x)
            x.register_hook(boom)
        return x


class Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.fail = Fail()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fail(torch.tanh(self.fc(x)))


class Net(nn.Module):
    """Four blocks and parameters outside them (the norm), with a failure point in each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Blk() for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(D)
        self.fail = Fail()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.fail(self.norm(x))


def _fail_point(model: Net, where: int) -> Fail:
    return model.fail if where == N_BLOCKS else model.blocks[where].fail


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(100 + i))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    return model(_batch(i)).square().mean()


def _offload(model: nn.Module, store) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cpu + cpu store "saves nothing"
        return hr.offload(model, device="cpu", store=store)


def _make_store(kind: str, tmp_path, **kw):
    return HostStore(**kw) if kind == "cpu" else DiskStore(tmp_path / "s", threads=2, **kw)


def _optimizer(kind: str, params):
    if kind == "host":
        return hr.HostOptimizer(params, torch.optim.AdamW, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _assert_resting(model: nn.Module, params_before: list[torch.Tensor]) -> None:
    now = list(model.parameters())
    assert [id(p) for p in now] == [id(p) for p in params_before]
    assert not any(isinstance(p, DeviceCopy) for p in now)
    state = state_of(model)
    assert not any(b.resident for b in [*state.blocks, state.rest])
    for s in state.slots:
        assert s.dev.untyped_storage().nbytes() == 0, s.name  # device copies released
        for m, attr in s.owners:
            assert m._parameters[attr] is s.param


def _fail_once(model: Net, where: int, phase: str, exc: type[BaseException]) -> None:
    point = _fail_point(model, where)
    point.phase, point.exc = phase, exc
    try:
        with pytest.raises(exc, match="injected"):
            _loss(model, 999).backward()
    finally:
        point.phase = None


@pytest.mark.parametrize("store_kind", ["cpu", "disk"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("where", range(N_BLOCKS + 1))
def test_failure_restores_resting_state_and_training_stays_exact(store_kind, phase, where,
                                                                   tmp_path):
    """Every failure position, forward and backward, host and disk store; one optimizer
    created before the failure (HostOptimizer, and torch's AdamW where the masters are in
    memory) and one created right after it."""
    torch.manual_seed(0)
    ref = Net()
    opt_kinds = ["host", "torch"] if store_kind == "cpu" else ["host"]
    for opt_kind in opt_kinds:
        for created in ("before", "after"):
            r = copy.deepcopy(ref)
            m = _offload(copy.deepcopy(ref), _make_store(store_kind, tmp_path / opt_kind /
                                                         created))
            opt_r = _optimizer("torch" if opt_kind == "torch" else "torch", r.parameters())
            params = list(m.parameters())
            steps = range(3)
            if created == "before":
                opt = _optimizer(opt_kind, m.parameters())
                _loss(m, 0).backward()  # some gradient is already accumulated when it fails
                _fail_once(m, where, phase, Injected)
                _assert_resting(m, params)
                opt.zero_grad()
            else:
                _fail_once(m, where, phase, Injected)
                _assert_resting(m, params)
                opt = _optimizer(opt_kind, m.parameters())  # from the restored parameters
                opt.zero_grad()
            for i in steps:
                for model, o in ((r, opt_r), (m, opt)):
                    _loss(model, i).backward()
                    o.step()
                    o.zero_grad()
            got = dict(m.state_dict())
            for name, p in r.state_dict().items():
                assert torch.equal(got[name], p), (opt_kind, created, name)


@pytest.mark.parametrize("store_kind", ["cpu", "disk"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_keyboard_interrupt_restores_resting_state(store_kind, phase, tmp_path):
    """Ctrl-C is a BaseException: module hooks with always_call=True do not see it."""
    torch.manual_seed(0)
    ref = Net()
    m = _offload(copy.deepcopy(ref), _make_store(store_kind, tmp_path))
    params = list(m.parameters())
    opt = _optimizer("host", m.parameters())
    for where in (0, 2, N_BLOCKS):
        _fail_once(m, where, phase, KeyboardInterrupt)
        _assert_resting(m, params)
    opt.zero_grad()
    opt_r = _optimizer("torch", ref.parameters())
    for i in range(2):
        for model, o in ((ref, opt_r), (m, opt)):
            _loss(model, i).backward()
            o.step()
            o.zero_grad()
    got = dict(m.state_dict())
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p), name


def test_block_failure_caught_inside_the_forward_goes_on():
    """A model that catches a block's error itself (e.g. a fallback path) keeps working."""

    class Fallback(Net):
        def forward(self, x):
            for b in self.blocks:
                with contextlib.suppress(Injected):  # skip the block that failed
                    x = b(x)
            return self.norm(x)

    torch.manual_seed(0)
    ref = Fallback()
    m = _offload(copy.deepcopy(ref), "cpu")
    for model in (ref, m):
        model.blocks[1].fail.phase = "forward"
    for model in (ref, m):
        _loss(model, 0).backward()
    for (n, p), q in zip(ref.named_parameters(), m.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, n
        else:
            assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("store_kind", ["cpu", "disk"])
def test_store_full_at_backward_writes_nothing_and_training_stays_exact(store_kind, tmp_path):
    """No room for the gradients: the error comes at the start of backward, before any
    gradient lands; after freeing space and zero_grad, training is exact."""
    torch.manual_seed(0)
    ref = Net()
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    store = _make_store(store_kind, tmp_path, max_bytes=param_bytes)
    m = _offload(copy.deepcopy(ref), store)
    params = list(m.parameters())
    opt = _optimizer("host", m.parameters())
    with pytest.raises(StoreFullError, match="No gradient was written"):
        _loss(m, 999).backward()
    _assert_resting(m, params)
    assert all(p.grad is None for p in m.parameters())
    store.max_bytes = None  # space freed
    opt.zero_grad()
    opt_r = _optimizer("torch", ref.parameters())
    for i in range(3):
        for model, o in ((ref, opt_r), (m, opt)):
            _loss(model, i).backward()
            o.step()
            o.zero_grad()
    got = dict(m.state_dict())
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p), name


def test_stale_device_copies_are_not_used_after_a_step():
    """A forward whose backward never ran leaves the outside group resident; an optimizer step
    then changes the masters, and the next forward must not compute with the old copies."""
    torch.manual_seed(0)
    ref = Net()
    m = _offload(copy.deepcopy(ref), "cpu")
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for model, o in ((ref, opt_r), (m, opt)):
        _loss(model, 1).backward()
        model(_batch(0))  # grad mode on, no backward (an evaluation that forgot no_grad)
        o.step()
        o.zero_grad()
    with torch.no_grad():
        assert torch.equal(m(_batch(2)), ref(_batch(2)))


def test_optimizer_given_device_copies_is_refused():
    """Defence in depth: parameters listed mid-forward are the device copies; an optimizer
    built from them fails at its first step, before anything changed."""
    torch.manual_seed(0)
    m = _offload(Net(), "cpu")
    grabbed = []

    def grab(module, args):
        grabbed.extend(module.parameters())

    m.blocks[1].fc.register_forward_pre_hook(grab)
    _loss(m, 0).backward()
    assert any(isinstance(p, DeviceCopy) for p in grabbed)
    opt = torch.optim.SGD(grabbed, lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match="device cop"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
