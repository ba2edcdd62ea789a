"""Frozen masters in host memory on a CPU device: their device copies show the masters' own
memory, no copy and no allocation per step (see [Note: shared device copies]), bitwise the plain
model; masters on disk, or cast to another compute dtype, still stream."""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import headroom as hr
from headroom.residency import state_of
from tests.residency._models import Block


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hr.offload with device='cpu'")
        yield


class _Ops(TorchDispatchMode):
    """Counts the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.n: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[func] += 1
        return func(*args, **(kwargs or {}))


def _pair(seed: int = 0):
    """A frozen body of blocks (offloaded) under a trainable embedding (not offloaded)."""
    torch.manual_seed(seed)
    emb = nn.Embedding(40, 16)
    body = nn.Sequential(*[Block(16) for _ in range(3)], nn.LayerNorm(16)).eval()
    body.requires_grad_(False)
    return emb, body


def _step(emb, body, opt, ids):
    loss = body(emb(ids)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(i))


def _walks(monkeypatch) -> list:
    seen = []
    real = nn.Module.named_modules

    def counted(self, *args, **kwargs):
        seen.append(type(self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", counted)
    return seen


def test_frozen_host_masters_are_neither_copied_nor_allocated(monkeypatch):
    import torch.distributed.fsdp  # noqa: F401 - FSDP2 importable: its check is armed

    emb, body = _pair()
    ref_emb, ref_body = copy.deepcopy(emb), copy.deepcopy(body)
    hr.offload(body, device="cpu", store="cpu")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_emb.parameters(), lr=0.1)
    for i in range(2):  # the first steps adopt, settle and warm up
        assert torch.equal(_step(emb, body, opt, _ids(i)), _step(ref_emb, ref_body, ref_opt,
                                                                 _ids(i)))
    with _Ops() as ops:
        loss = _step(emb, body, opt, _ids(2))
    with _Ops() as ref_ops:
        ref_loss = _step(ref_emb, ref_body, ref_opt, _ids(2))
    assert torch.equal(loss, ref_loss) and torch.equal(emb.weight, ref_emb.weight)
    resize = torch.ops.inductor.resize_storage_bytes_.default
    # before: 74 copies per step (every master copied in forward, the blocks again in
    # backward), each with an allocation and a free (resize_storage_bytes_)
    assert ops.n[torch.ops.aten.copy_.default] == ref_ops.n[torch.ops.aten.copy_.default]
    assert ops.n[resize] == 0
    # the whole-model check for FSDP2 walks no module at each forward while nothing is sharded
    if not torch.distributed.fsdp.FSDPModule.__subclasses__():
        seen = _walks(monkeypatch)
        _step(emb, body, opt, _ids(3))
        assert seen == []
    # at rest the device copies hold nothing, and the masters are intact
    state = state_of(body)
    assert all(s.dev.untyped_storage().nbytes() == 0 and not s.shared for s in state.slots)
    for (n, p), q in zip(body.named_parameters(), ref_body.parameters(), strict=True):
        assert torch.equal(p, q), n


def _resident(body) -> list:
    """During the first block's forward, for each of its slots: whether its device copy shows
    its master's memory, the bytes it holds, and its size."""
    state = state_of(body)
    seen = []

    def look(module, args):
        for s in state.blocks[0].slots:
            seen.append((s.dev.data_ptr() == s.param.data_ptr(),
                         s.dev.untyped_storage().nbytes(), s.nbytes))

    body[0].register_forward_pre_hook(look)
    return seen


@pytest.mark.parametrize("case", ["disk", "compute_dtype"])
def test_masters_on_disk_or_cast_are_copied(case, tmp_path):
    emb, body = _pair()
    ref_emb, ref_body = copy.deepcopy(emb), copy.deepcopy(body)
    if case == "disk":  # streams: device copies of their own, filled from the files
        hr.offload(body, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    else:
        hr.offload(body, device="cpu", store="cpu", compute_dtype=torch.float64)
        ref_body.double()
    seen = _resident(body)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_emb.parameters(), lr=0.1)
    run, ref_run = body, ref_body
    if case == "compute_dtype":
        run, ref_run = (lambda x: body(x.double())), (lambda x: ref_body(x.double()))
    for i in range(2):
        assert torch.equal(_step(emb, run, opt, _ids(i)), _step(ref_emb, ref_run, ref_opt,
                                                                _ids(i)))
    assert torch.equal(emb.weight, ref_emb.weight)
    assert seen and all(not same and held == n for same, held, n in seen)
    assert all(s.dev.untyped_storage().nbytes() == 0 for s in state_of(body).slots)


def test_writes_to_frozen_masters_reach_forward_and_backward():
    """A frozen master written between steps (load_state_dict) and between a forward and its
    backward (``.data`` in place) computes with the new values, as in plain PyTorch."""
    emb, body = _pair()
    ref_emb, ref_body = copy.deepcopy(emb), copy.deepcopy(body)
    hr.offload(body, device="cpu", store="cpu")
    seen = _resident(body)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_emb.parameters(), lr=0.1)
    _, new = _pair(seed=1)
    for b, e, o in ((body, emb, opt), (ref_body, ref_emb, ref_opt)):
        _step(e, b, o, _ids(0))
        b.load_state_dict(new.state_dict())
        _step(e, b, o, _ids(1))
        loss = b(e(_ids(2))).square().mean()
        with torch.no_grad():
            for m in (b[0].fc1, b[3]):  # in a block, and outside the blocks (kept resident)
                m.weight.data.mul_(2)
        loss.backward()
        o.step()
        o.zero_grad()
    assert torch.equal(emb.weight, ref_emb.weight)
    for (n, p), q in zip(body.named_parameters(), ref_body.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert seen and all(same and held == n for same, held, n in seen)


def test_unfrozen_masters_train_on_copies():
    """Freezing and unfreezing between forward and backward, and between steps: a device copy
    that autograd saved views of keeps its own memory until that graph is gone."""
    emb, body = _pair()
    ref_emb, ref_body = copy.deepcopy(emb), copy.deepcopy(body)
    hr.offload(body, device="cpu", store="cpu")
    params = [*emb.parameters(), *body.parameters()]
    ref_params = [*ref_emb.parameters(), *ref_body.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    for b, e, o in ((body, emb, opt), (ref_body, ref_emb, ref_opt)):
        b[1].requires_grad_(True)  # trains: copied in forward
        loss = b(e(_ids(0))).square().mean()
        b[1].requires_grad_(False)  # frozen before its backward: copied again, not shared
        loss.backward()
        o.step()
        o.zero_grad()
        _step(e, b, o, _ids(1))  # frozen: shared
        b[2].requires_grad_(True)
        _step(e, b, o, _ids(2))  # trains again: copied
    assert torch.equal(emb.weight, ref_emb.weight)
    for (n, p), q in zip(body.named_parameters(), ref_body.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("opt", ["torch", "host"])
def test_unfrozen_after_prefetch_trains_like_plain(opt):
    """A block announced with `hr.prefetch` while frozen (its device copies show the masters)
    and unfrozen before its forward trains as on the plain model: stepped after its backward
    by torch.optim, or inside it by `HostOptimizer.final_backward`."""
    emb, body = _pair()
    ref_emb, ref_body = copy.deepcopy(emb), copy.deepcopy(body)
    hr.offload(body, device="cpu", store="cpu")
    seen = _resident(body)

    def make(e, b):
        params = [*e.parameters(), *b.parameters()]
        if opt == "host":
            return hr.HostOptimizer(params, torch.optim.SGD, lr=0.1)
        return torch.optim.SGD(params, lr=0.1)

    o, ref_o = make(emb, body), make(ref_emb, ref_body)
    for i in range(3):
        if i == 1:
            hr.prefetch(body[0])
            assert len(seen) == 12  # the first step's; announced, not used yet
            body[0].requires_grad_(True)
            ref_body[0].requires_grad_(True)
        for b, e, oo in ((body, emb, o), (ref_body, ref_emb, ref_o)):
            loss = b(e(_ids(i))).square().mean()
            if opt == "host" and b is body:
                with oo.final_backward():
                    loss.backward()
            else:
                loss.backward()
            oo.step()
            oo.zero_grad()
    # shown the masters' memory when fetched frozen (announced: before unfreezing)
    assert [same for same, _, _ in seen] == [True] * 24 + [False] * 12
    assert torch.equal(emb.weight, ref_emb.weight)
    for (n, p), q in zip(body.named_parameters(), ref_body.parameters(), strict=True):
        assert torch.equal(p, q), n


def _warm_pair():
    """(embedding, offloaded body, optimizer) and the plain twin, two steps in."""
    emb, body = _pair()
    ref_emb, ref_body = copy.deepcopy(emb), copy.deepcopy(body)
    hr.offload(body, device="cpu", store="cpu")
    pairs = ((emb, body, torch.optim.SGD(emb.parameters(), lr=0.1)),
             (ref_emb, ref_body, torch.optim.SGD(ref_emb.parameters(), lr=0.1)))
    for i in range(2):
        for e, b, o in pairs:
            _step(e, b, o, _ids(i))
    return pairs


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_interrupted_step_leaves_the_masters_and_trains_like_plain(where):
    """Ctrl-C in a block's forward or backward while its device copies show the masters'
    memory: the copies get their own (empty) storage back (at once, or at the next parameter
    listing after backward), the masters are untouched, and the step run again trains
    bitwise like plain."""
    (emb, body, opt), (ref_emb, ref_body, ref_opt) = _warm_pair()

    def interrupt(*args):
        raise KeyboardInterrupt

    def in_backward(module, args, out):
        out.register_hook(interrupt)  # raised when backward reaches this block

    handle = body[1].register_forward_hook(interrupt if where == "forward" else in_backward)
    with pytest.raises(KeyboardInterrupt):
        _step(emb, body, opt, _ids(2))
    handle.remove()
    opt.zero_grad()
    list(body.parameters())  # after a backward cut short, listing releases (docs/offload.md)
    state = state_of(body)
    assert all(s.dev.untyped_storage().nbytes() == 0 and not s.shared for s in state.slots)
    for (n, p), q in zip(body.named_parameters(), ref_body.parameters(), strict=True):
        assert torch.equal(p, q), n
    for i in range(2, 4):
        assert torch.equal(_step(emb, body, opt, _ids(i)),
                           _step(ref_emb, ref_body, ref_opt, _ids(i)))
    assert torch.equal(emb.weight, ref_emb.weight)


def test_shared_blocks_are_fetched_once_per_step(monkeypatch):
    """A block whose device copies all show their masters stays resident from its forward to
    the end of the backward: not fetched again for the backward, its inputs not watched."""
    from headroom.residency._group import Residency
    from headroom.residency._schedule import _AfterBackward

    (emb, body, opt), (ref_emb, ref_body, ref_opt) = _warm_pair()
    shares, real = [], Residency._share
    monkeypatch.setattr(Residency, "_share", lambda self, s: shares.append(s) or real(self, s))
    watched, real_apply = [], _AfterBackward.apply
    monkeypatch.setattr(_AfterBackward, "apply", lambda *a: watched.append(1) or real_apply(*a))
    loss = _step(emb, body, opt, _ids(2))
    assert torch.equal(loss, _step(ref_emb, ref_body, ref_opt, _ids(2)))
    assert torch.equal(emb.weight, ref_emb.weight)
    slots = state_of(body).slots
    assert len(shares) == len(slots) and watched == []  # before: each block's twice, 3 watched
    assert all(s.dev.untyped_storage().nbytes() == 0 and not s.shared for s in slots)
