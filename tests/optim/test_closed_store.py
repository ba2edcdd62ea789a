"""A store closed while a model or optimizer still keeps tensors in it: every later use says
so (closed), never that the disk is full, and nothing changes."""

from __future__ import annotations

import pytest
import torch

import headroom as hr
from headroom.store import StoreFullError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])


def _values(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("where", ["params", "state", "both"])
def test_step_after_close_names_the_closed_store(tmp_path, where):
    model = _model()
    store = hr.DiskStore(tmp_path / "s")
    if where in ("params", "both"):
        hr.offload(model, device="cpu", store=store)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=store if where in ("state", "both") else "cpu")
    x = torch.randn(2, 8)
    model(x).sum().backward()
    opt.step()
    model(x).sum().backward()
    if where == "state":
        before = _values(model)
    store.close()
    with pytest.raises(RuntimeError, match=r"is closed \(close\(\) was called\)") as info:
        opt.step()
    assert not isinstance(info.value, StoreFullError)
    assert "free space" not in str(info.value)
    if where == "state":  # the parameters live in memory: visibly untouched
        assert all(torch.equal(a, b) for a, b in zip(before, _values(model), strict=True))


def test_store_methods_after_close(tmp_path):
    store = hr.DiskStore(tmp_path / "s")
    h = store.put("w", torch.ones(4))
    store.close()
    for call in (lambda: store.read(h), lambda: store.write(h, torch.zeros(4)),
                 lambda: store.put("v", torch.ones(2)), lambda: store.reserve_writes(4),
                 lambda: store.flush(), lambda: store.free(h)):
        with pytest.raises(RuntimeError, match="is closed"):
            call()
    store.close()  # a second close does nothing
    again = hr.DiskStore(tmp_path / "s")
    assert torch.equal(again.read(again.get("w")).result(), torch.ones(4))
    again.close()


def test_forward_after_close_names_the_closed_store(tmp_path):
    model = _model()
    store = hr.DiskStore(tmp_path / "s")
    hr.offload(model, device="cpu", store=store)
    store.close()
    with pytest.raises(RuntimeError, match="is closed"):
        model(torch.randn(2, 8))
