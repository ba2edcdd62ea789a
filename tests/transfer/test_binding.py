"""Store-resident parameter bindings: the gradient-ready signal between producer and consumer."""

from __future__ import annotations

import pytest
import torch

from headroom.store import HostStore
from headroom.transfer import bind, grad_ready, on_grad_ready, sync_grad, unbind


def _bound():
    store = HostStore()
    p = torch.nn.Parameter(torch.zeros(3))
    b = bind(p, store.put("w", torch.ones(3)), grad_handle=store.alloc("w.grad", (3,),
                                                                     torch.float32))
    return p, b


def test_listeners_fire_in_order_and_remove_symmetrically():
    p, b = _bound()
    calls = []
    h1 = on_grad_ready(p, lambda q: calls.append(("a", q)))
    h2 = on_grad_ready(p, lambda q: calls.append(("b", q)))
    grad_ready(p)
    assert [c for c, _ in calls] == ["a", "b"] and all(q is p for _, q in calls)
    h1.remove()
    h1.remove()  # idempotent
    calls.clear()
    grad_ready(p)
    assert [c for c, _ in calls] == ["b"]
    h2.remove()
    calls.clear()
    grad_ready(p)
    assert calls == [] and b.listeners == []


def test_sync_grad_calls_the_producers_wait():
    p, b = _bound()
    sync_grad(b)  # no producer wait: nothing to do
    waits = []
    b.grad_sync = lambda: waits.append(1)
    sync_grad(b)
    assert waits == [1]


def test_on_grad_ready_needs_a_bound_parameter():
    p, _ = _bound()
    unbind(p)
    with pytest.raises(ValueError, match="store-resident"):
        on_grad_ready(p, lambda q: None)
    grad_ready(p)  # an unbound parameter has no listeners: a no-op
