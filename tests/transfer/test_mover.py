"""The mover and parameter bindings: exact fetches (with casts), gradient landing, ordering."""

from __future__ import annotations

import pytest
import torch

from headroom.store import DiskStore, HostStore, resolve_store
from headroom.transfer import Mover, bind, binding, unbind
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


def _gate(monkeypatch):
    """Make every event host wait block until the returned gate is set (a slow device)."""
    import threading

    from tests import _streams

    gate, entered = threading.Event(), threading.Event()
    real = _streams.Event.synchronize

    def slow(self):
        entered.set()
        assert gate.wait(30), "the gate was never opened"
        real(self)

    monkeypatch.setattr(_streams.Event, "synchronize", slow)
    return gate, entered


def test_waiting_for_gradients_blocks_neither_fetches_nor_pushes(monkeypatch):
    """While one thread waits for gradients to land (an optimizer's worker), the backward
    thread still fetches and pushes: the mover holds no lock across a device wait."""
    import threading

    with stream_model(monkeypatch):
        store = HostStore(pin=True)
        h = store.put("x", torch.randn(64, 8))
        b = bind(torch.nn.Parameter(torch.zeros(64, 8)), h,
                 grad_handle=store.alloc("x.grad", (64, 8), torch.float32))
        c = bind(torch.nn.Parameter(torch.zeros(64, 8)), h,
                 grad_handle=store.alloc("y.grad", (64, 8), torch.float32))
        mover = Mover("cpu", store)
        g1, g2 = torch.randn(64, 8), torch.randn(64, 8)
        mover.push_grad(g1, b, accumulate=False)
        gate, entered = _gate(monkeypatch)
        waiter = threading.Thread(target=mover.synchronize)
        waiter.start()
        assert entered.wait(30)  # the waiter is inside a device wait now
        dst = torch.empty(64, 8)
        mover.wait(mover.fetch(h, dst))
        mover.push_grad(g2, c, accumulate=False)
        assert waiter.is_alive()
        gate.set()
        waiter.join()
        mover.synchronize()
        assert torch.equal(store.read(b.grad_handle).result(), g1)
        assert torch.equal(store.read(c.grad_handle).result(), g2)
        assert torch.equal(dst * 1, store.read(h).result())
        mover.close()
        store.close()


def test_a_large_gradient_alone_never_waits(monkeypatch):
    """Staged gradients (accumulated here) land on the mover's own thread; the pushing thread
    waits only when more than one is staged past the bound, never for a single one."""
    import threading

    import headroom.transfer._mover as mover_mod

    with stream_model(monkeypatch):
        monkeypatch.setattr(mover_mod, "_MAX_STAGED_BYTES", 1000)  # each gradient is 2048 B
        store = HostStore(pin=True)
        h = store.put("x", torch.zeros(64, 8))
        b = bind(torch.nn.Parameter(torch.zeros(64, 8)), h,
                 grad_handle=store.alloc("x.grad", (64, 8), torch.float32))
        mover = Mover("cpu", store)
        gate, entered = _gate(monkeypatch)
        g1, g2 = torch.randn(64, 8), torch.randn(64, 8)
        mover.push_grad(g1, b, accumulate=True)  # returns with its landing blocked
        assert entered.wait(30)
        pushed = threading.Event()

        def second():
            mover.push_grad(g2, b, accumulate=True)
            pushed.set()

        t = threading.Thread(target=second)
        t.start()
        assert not pushed.wait(0.5)  # two staged past the bound: it waits for the first
        gate.set()
        t.join()
        mover.synchronize()
        assert torch.equal(store.read(b.grad_handle).result(), g1 + g2)
        mover.close()
        store.close()


def test_disk_reads_are_copied_to_the_device_as_soon_as_they_land(tmp_path, monkeypatch):
    with stream_model(monkeypatch):
        store = DiskStore(tmp_path / "d", threads=2)
        x = torch.randn(64, 8)
        h = store.put("x", x)
        mover = Mover("cpu", store)
        dst = torch.empty(64, 8)
        t = mover.fetch(h, dst)
        t.future.result()
        assert t.issued.wait(30)
        assert t.batch is not None and t.batch.event is not None  # issued before wait()
        mover.wait(t)
        assert torch.equal(dst * 1, x)
        mover.close()
        store.close()
