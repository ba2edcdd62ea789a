"""Task residency: offloaded heads, one task's head on the device, prefetch by announcement."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import headroom as hr
from headroom.residency import state_of
from headroom.store import DiskStore

TASKS = [3, 5, 3, 0, 5, 5, 1]
NUM_HEADS = 8


class MultiTask(nn.Module):
    """Shared parameters (the trunk) and one head per task."""

    def __init__(self, d: int = 8, heads: int = NUM_HEADS) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.heads = nn.ModuleList(nn.Linear(d, 3) for _ in range(heads))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _offload_heads(model: MultiTask, store) -> MultiTask:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cpu+cpu "saves nothing" warning
        hr.offload(model.heads, device="cpu", store=store, prefetch=0)
    return model


@pytest.fixture(params=["cpu", "disk"])
def store(request, tmp_path):
    return "cpu" if request.param == "cpu" else DiskStore(tmp_path / "s", threads=2)


def _resident(model: MultiTask) -> list[int]:
    st = state_of(model.heads)
    return [i for i, b in enumerate(st.blocks) if b.resident]


@pytest.mark.parametrize("announce", [False, True])
@pytest.mark.parametrize("host_opt", [False, True])
def test_only_used_heads_step_and_training_is_exact(store, announce, host_opt):
    if isinstance(store, DiskStore) and not host_opt:
        pytest.skip("torch.optim cannot step parameters on disk (HostOptimizer does)")
    torch.manual_seed(0)
    ref = MultiTask()
    model = _offload_heads(copy.deepcopy(ref), store)
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), **kw)
    if host_opt:
        opt_ref = torch.optim.AdamW(ref.parameters(), fused=True, **kw)
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), **kw)
    for i, task in enumerate(TASKS):
        if announce and i + 1 < len(TASKS):
            hr.prefetch(model.heads[TASKS[i + 1]])
            # The next task's head is on the device before this step's forward.
            assert TASKS[i + 1] in _resident(model)
        x, y = _batch(i)
        for m in (ref, model):
            F.cross_entropy(m(x, task), y).backward()
        if announce and i + 1 < len(TASKS) and TASKS[i + 1] != task:
            assert _resident(model) == [TASKS[i + 1]]  # kept through the whole step
        opt_ref.step()
        opt.step()
        if announce and i + 1 < len(TASKS) and TASKS[i + 1] != task:
            assert _resident(model) == [TASKS[i + 1]]  # no gradient: kept across the step
        opt_ref.zero_grad()
        opt.zero_grad()
    got = {k: v for k, v in model.state_dict().items()}
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.detach()), name
    for t in range(NUM_HEADS):
        changed = not torch.equal(got[f"heads.{t}.weight"], init[f"heads.{t}.weight"])
        # Weight decay and momentum never touched a head without a gradient.
        assert changed == (t in TASKS), t
    assert _resident(model) == []


def test_an_announced_head_with_a_gradient_is_fetched_again_after_the_step():
    torch.manual_seed(0)
    ref = MultiTask()
    model = _offload_heads(copy.deepcopy(ref), "cpu")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        hr.prefetch(model.heads[2])  # used by this step and announced for the next
        x, y = _batch(i)
        for m in (ref, model):
            F.cross_entropy(m(x, 2), y).backward()
        hr.prefetch(model.heads[2])  # announced after its backward: it has a gradient now
        opt_ref.step()
        opt.step()  # released before the step, fetched with the new values after it
        assert _resident(model) == [2]
        dev = model.heads[2].weight
        assert dev is not state_of(model.heads).blocks[2].slots[0].dev  # modules hold masters
        assert torch.equal(state_of(model.heads).blocks[2].slots[0].dev, ref.heads[2].weight)
        opt_ref.zero_grad()
        opt.zero_grad()
    assert torch.equal(model.heads[2].weight, ref.heads[2].weight)


def test_an_announcement_is_replaced_and_dropped_by_a_failure():
    model = _offload_heads(MultiTask(), "cpu")
    hr.prefetch([model.heads[1], model.heads[4]])
    assert _resident(model) == [1, 4]
    hr.prefetch(model.heads[6])
    assert _resident(model) == [6]
    with pytest.raises(RuntimeError, match="boom"):
        h = model.heads[3].register_forward_hook(lambda *a: (_ for _ in ()).throw(
            RuntimeError("boom")))
        try:
            model(torch.randn(2, 8), 3)
        finally:
            h.remove()
    assert _resident(model) == []  # back to the resting state
    hr.prefetch(model.heads[0])
    model.load_state_dict(model.state_dict())
    assert _resident(model) == []
    hr.prefetch(model.heads[0])
    hr.unoffload(model.heads)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_prefetch_refuses_what_is_not_a_block():
    model = _offload_heads(MultiTask(), "cpu")
    with pytest.raises(ValueError, match="blocks of a model offloaded"):
        hr.prefetch(model.heads)
    with pytest.raises(ValueError, match="not a block"):
        hr.prefetch(model.trunk)
    with pytest.raises(ValueError, match="at least one block"):
        hr.prefetch([])


def test_device_holds_the_current_and_the_announced_head(tmp_path):
    model = MultiTask()
    head = sum(p.numel() * p.element_size() for p in model.heads[0].parameters())
    _offload_heads(model, DiskStore(tmp_path / "s", threads=2))
    st = state_of(model.heads)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    seen = []

    def device_bytes(*_):  # an independent count: the storage behind every device copy
        seen.append(sum(s.dev.untyped_storage().nbytes() for s in st.slots))

    hooks = [h.register_forward_pre_hook(device_bytes) for h in model.heads]
    for i, task in enumerate(TASKS[:-1]):
        hr.prefetch(model.heads[TASKS[i + 1]])
        x, y = _batch(i)
        F.cross_entropy(model(x, task), y).backward()
        opt.step()
        opt.zero_grad()
        # Inside the head's forward: that head and the announced one (one if they coincide).
        assert seen[-1] == (1 if TASKS[i + 1] == task else 2) * head, (seen[-1], head)
        between = sum(s.dev.untyped_storage().nbytes() for s in st.slots)
        assert between == (0 if TASKS[i + 1] == task else head)
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("how", ["load", "load_weights"])
def test_loading_values_drops_announcements(tmp_path, how):
    torch.manual_seed(0)
    other = MultiTask()
    model = _offload_heads(MultiTask(), "cpu")
    if how == "load":
        src = copy.deepcopy(other)
        hr.save(tmp_path / "ckpt", _offload_heads(src, "cpu"))
    else:
        hr.save_weights(other, tmp_path / "w")
    hr.prefetch(model.heads[2])
    assert _resident(model) == [2]
    if how == "load":
        hr.load(tmp_path / "ckpt", model)
    else:
        hr.load_weights(model, tmp_path / "w")
    assert _resident(model) == []  # a prefetched copy of the old values is gone
    x = torch.randn(2, 8)
    assert torch.equal(model(x, 2), other(x, 2))


def _fill(p: torch.Tensor, k: float) -> torch.Tensor:
    return torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / k


_WRITES = {
    "copy_": lambda p: p.copy_(_fill(p, 7)),
    "mul_": lambda p: p.mul_(3.0),
    "data.copy_": lambda p: p.data.copy_(_fill(p, 3)),
    "data.mul_": lambda p: p.data.mul_(0.5),
    "data =": lambda p: setattr(p, "data", _fill(p, 5)),
    "init.normal_": lambda p: (torch.manual_seed(4), nn.init.normal_(p)),
}


@pytest.mark.parametrize("write", list(_WRITES))
def test_write_after_prefetch_is_what_the_forward_uses(store, write):
    """A head announced with hr.prefetch (its device copy fetched ahead) and written before
    its forward: the forward computes with the written values, as plain PyTorch would."""
    torch.manual_seed(0)
    ref = MultiTask()
    model = _offload_heads(copy.deepcopy(ref), store)
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x, 1)
    hr.prefetch(model.heads[2])
    assert _resident(model) == [2]
    with torch.no_grad():
        for m in (model, ref):
            _WRITES[write](m.heads[2].weight)
        assert torch.equal(model(x, 2), ref(x, 2))
