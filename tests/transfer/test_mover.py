"""The mover and parameter bindings: exact fetches (with casts), gradient landing, ordering."""

from __future__ import annotations

import pytest
import torch

from headroom.transfer import (
    DiskStore,
    HostStore,
    Mover,
    bind,
    binding,
    resolve_store,
    unbind,
)
from tests._streams import stream_model
from tests.conftest import DEVICES


def _stores(tmp_path, device):
    return [resolve_store("cpu", device), DiskStore(tmp_path / "m", threads=2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_fetch_is_exact_and_keeps_version(tmp_path, device, compute_dtype):
    for store in _stores(tmp_path, device):
        x = torch.randn(33, 17)
        h = store.put("x", x)
        mover = Mover(device, store)
        dst = torch.nn.Parameter(torch.empty(33, 17, device=device, dtype=compute_dtype))
        v = dst._version
        t = mover.fetch(h, dst)
        mover.wait(t)
        mover.wait(t)  # idempotent
        assert torch.equal(dst.detach().cpu(), x.to(compute_dtype))
        assert dst._version == v  # saved references in autograd stay valid
        store.close()


@pytest.mark.parametrize("device", DEVICES)
def test_push_grad_overwrites_then_accumulates(tmp_path, device):
    for store in _stores(tmp_path, device):
        p = torch.nn.Parameter(torch.zeros(8, 4))
        b = bind(p, store.put("p", p.detach()), grad_handle=store.alloc("p.grad", (8, 4),
                                                                        torch.float32))
        assert binding(p) is b and b.store is store and not b.has_grad
        mover = Mover(device, store)
        g1, g2 = torch.randn(8, 4, device=device), torch.randn(8, 4, device=device)
        mover.push_grad(g1, b, accumulate=False)
        mover.push_grad(g2, b, accumulate=True)
        mover.synchronize()
        assert b.has_grad
        expect = g1.cpu().clone()
        expect += g2.cpu()
        assert torch.equal(store.read(b.grad_handle).result(), expect)
        mover.push_grad(g2.to(torch.bfloat16), b, accumulate=False)  # casts to the fp32 store
        mover.synchronize()
        assert torch.equal(store.read(b.grad_handle).result(), g2.cpu().to(torch.bfloat16).float())
        unbind(p)
        assert binding(p) is None
        store.close()


def test_bind_checks_shape():
    s = HostStore()
    with pytest.raises(ValueError, match="shape mismatch"):
        bind(torch.zeros(3), s.put("w", torch.zeros(4)))


def test_disk_fetch_overlaps_on_io_thread(tmp_path):
    store = DiskStore(tmp_path / "o", threads=2)
    hs = [store.put(f"w{i}", torch.full((256, 256), float(i))) for i in range(4)]
    mover = Mover("cpu", store)
    dsts = [torch.empty(256, 256) for _ in hs]
    tickets = [mover.fetch(h, d) for h, d in zip(hs, dsts, strict=True)]  # all in flight at once
    assert any(t.future is not None for t in tickets)
    for i, (t, d) in enumerate(zip(tickets, dsts, strict=True)):
        mover.wait(t)
        assert torch.equal(d, torch.full((256, 256), float(i)))
    store.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_accelerator_path_bookkeeping_on_cpu(kind, tmp_path, monkeypatch):
    """The accelerator path on the CPU under the stream model (tests/_streams.py): staging
    buffers, pool reuse, gradient landings, every copy checked for ordering."""
    with stream_model(monkeypatch):
        _bookkeeping(kind, tmp_path)


def _bookkeeping(kind, tmp_path):
    store = HostStore(pin=True) if kind == "host" else DiskStore(tmp_path / "a", threads=2)
    x = torch.randn(64, 8)
    h = store.put("x", x)
    mover = Mover("cpu", store)
    assert mover.accelerated
    for dtype in (torch.float32, torch.bfloat16):
        dst = torch.nn.Parameter(torch.empty(64, 8, dtype=dtype))
        mover.wait(mover.fetch(h, dst))
        assert torch.equal(dst.detach(), x.to(dtype)) and dst._version == 0
    p = torch.nn.Parameter(torch.zeros(64, 8))
    b = bind(p, h, grad_handle=store.alloc("x.grad", (64, 8), torch.float32))
    grads = [torch.randn(64, 8) for _ in range(3)]
    mover.push_grad(grads[0], b, accumulate=False)
    for g in grads[1:]:
        mover.push_grad(g, b, accumulate=True)
    mover.synchronize()
    expect = grads[0].clone()
    for g in grads[1:]:
        expect += g
    assert torch.equal(store.read(b.grad_handle).result(), expect)
    mover.wait_reads()
    # every landing retired, every staging buffer back in the pool
    assert not mover._landings and not mover._staged and not mover._inflight
    assert mover._pool.total_bytes == sum(
        n * len(bufs) for n, bufs in mover._pool._free.items())
    mover.close()
    assert mover._pool.total_bytes == 0
    store.close()
