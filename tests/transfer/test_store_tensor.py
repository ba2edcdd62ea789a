"""StoreTensor: a tensor whose ops run on a store's values (see headroom.transfer._store_tensor)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from headroom.store import DiskStore, HostStore
from headroom.transfer import HandleSource, StoreTensor


def _tensors(store, n=4, shape=(5, 3)):
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(shape, generator=g) for _ in range(n)]
    ts = [StoreTensor(HandleSource(store, store.put(f"t{i}", v)), shape, dtype=torch.float32)
          for i, v in enumerate(values)]
    return values, ts


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_ops_are_those_of_plain_tensors(kind, tmp_path):
    store = HostStore() if kind == "host" else DiskStore(tmp_path / "s")
    values, ts = _tensors(store)
    assert all(t.device.type == "cpu" and type(t) is StoreTensor for t in ts)
    for op in (torch._foreach_norm, lambda xs: torch._foreach_norm(xs, float("inf"))):
        assert all(torch.equal(a, b) for a, b in zip(op(ts), op(values), strict=True))
    assert torch.equal(torch.stack([t.sum() for t in ts]), torch.stack([v.sum() for v in values]))
    torch._foreach_mul_(ts, torch.tensor(0.5))
    torch._foreach_mul_(values, torch.tensor(0.5))
    ts[0].clamp_(-0.1, 0.1)
    values[0].clamp_(-0.1, 0.1)
    ts[1][2:].zero_()  # a view: written through to the store
    values[1][2:].zero_()
    for t, v in zip(ts, values, strict=True):
        assert torch.equal(t.clone(), v) and type(t.clone()) is torch.Tensor
    assert "StoreTensor(shape=(5, 3)" in repr(ts[0])


def test_foreach_holds_one_value_at_a_time(tmp_path):
    """A foreach op over values on disk reads them one by one, not all at once."""
    store = DiskStore(tmp_path / "s")
    _, ts = _tensors(store, n=6)
    alive: list[weakref.ref] = []
    peak = [0]
    real = store.read

    def read(h, out=None):
        fut = real(h, out)
        gc.collect()
        n = sum(r() is not None for r in alive)
        peak[0] = max(peak[0], n)
        alive.append(weakref.ref(fut.result()))
        return fut

    store.read = read
    torch._foreach_norm(ts)
    assert len(alive) == 6 and peak[0] == 0  # no earlier value alive when the next is read


def test_replacing_the_stored_tensor_is_refused(tmp_path):
    _, ts = _tensors(DiskStore(tmp_path / "s"), n=1)
    with pytest.raises(RuntimeError, match="replace the store's tensor"):
        ts[0].set_(torch.zeros(5, 3))
    with pytest.raises(RuntimeError, match="replace the store's tensor"):
        ts[0].resize_(2)
