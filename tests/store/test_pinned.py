"""Page-locked memory: slabs, the arena that carves tensors out of them, the pool, and the
process's budget, with their accounting asserted as numbers.

On this CPU-only build no runtime can pin, so slabs are plain memory standing in for page-locked
memory; the carving, alignment, accounting, budget and release logic is the same that feeds a
device (the backend that would run is chosen by `_pinned._backend`; ``cache`` is forced below to
check the power-of-two accounting of torch's caching host allocator).
"""

from __future__ import annotations

import pytest
import torch

import headroom as hr
from headroom.store import (
    HostStore,
    PinnedArena,
    PinnedPool,
    StoreFullError,
    _pinned,
    pinned_bytes,
    set_pinned_limit,
)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_limit():
    base = pinned_bytes()
    yield
    set_pinned_limit(None)
    assert pinned_bytes() == base, "a test left page-locked memory behind"


def test_spent_bytes_per_backend():
    # torch's caching host allocator rounds to a power of two; registered memory to pages
    assert _pinned.spent(5_120_000_000, "cache") == 8 << 30
    assert _pinned.spent(3 * MiB + 1, "cache") == 4 * MiB
    assert _pinned.spent(4 * MiB, "cache") == 4 * MiB
    page = _pinned._PAGE
    assert _pinned.spent(5_120_000_000, "register") == -(-5_120_000_000 // page) * page
    assert _pinned.spent(1, "register") == page
    assert _pinned.spent(1000, "stand-in") == 1000 and _pinned.spent(1000, "plain") == 1000
    assert _pinned.spent(0, "cache") == 0
    assert _pinned._backend(False, None) == "plain"
    assert _pinned._backend(True, torch.device("cpu")) == "stand-in"  # no runtime here


def test_arena_carves_aligned_separate_tensors_and_gives_empty_slabs_back():
    base = pinned_bytes()
    a = PinnedArena(pin=True, slab_bytes=4 * MiB)
    ts = [a.take(n) for n in (100, 64, 1, 5000)]
    assert [t.numel() for t in ts] == [100, 64, 1, 5000]
    assert all(t.data_ptr() % _pinned.ALIGN == 0 for t in ts)
    assert a.carved_bytes == 128 + 64 + 64 + 5056
    # the first slab is 1 MiB (a small arena pins little), counted against the process budget
    assert a.slab_count == 1 and a.spent_bytes == MiB and pinned_bytes() == base + MiB
    for i, t in enumerate(ts):
        t.fill_(i)
    for i, t in enumerate(ts):
        assert bool((t == i).all())  # carved spans do not overlap
    a.give(ts[1])
    a.give(ts[2])  # a 128-byte hole between ts[0] and ts[3]
    t = a.take(100)
    assert t.data_ptr() == ts[1].data_ptr()  # first fit, the freed spans merged
    a.give(t)
    a.give(ts[0])
    assert a.slab_count == 1 and a.carved_bytes == 5056
    a.give(ts[3])  # nothing carved in the slab any more: back to the system
    assert a.slab_count == 0 and a.spent_bytes == 0 and a.carved_bytes == 0
    assert pinned_bytes() == base


def test_arena_slabs_grow_with_it_and_reserve_sizes_one_slab():
    a = PinnedArena(pin=True, slab_bytes=8 * MiB)
    big = a.take(3 * MiB)  # larger than a first slab: a slab of its own size
    assert a.spent_bytes == 3 * MiB
    small = a.take(MiB)  # no room left: the next slab is as large as the arena so far
    assert a.slab_count == 2 and a.spent_bytes == 6 * MiB
    a.give(big)
    a.give(small)
    assert a.spent_bytes == 0
    sizes = [1_000_000, 2_500_000, 64, 3]
    a.reserve(sizes)
    assert a.slab_count == 1 and a.spent_bytes == sum(-(-n // 64) * 64 for n in sizes)
    ts = [a.take(n) for n in sizes]
    assert a.slab_count == 1 and a.carved_bytes == a.spent_bytes  # no tail wasted
    a.reserve(sizes[:1])  # no room in it: another slab for that one
    assert a.slab_count == 2
    a.close()
    assert a.spent_bytes == 0
    del ts


def test_caching_allocator_backend_spends_powers_of_two(monkeypatch):
    from headroom.store import _host

    for mod in (_pinned, _host):
        monkeypatch.setattr(mod, "_backend", lambda pin, device: "cache" if pin else "plain")
        monkeypatch.setattr(mod, "alloc_slab", _stand_in_cache_slab)
    base = pinned_bytes()
    a = PinnedArena(pin=True, slab_bytes=64 * MiB)
    a.reserve([3_000_000] * 3)  # 9e6 bytes in one slab: the allocator spends 16 MiB
    ts = [a.take(3_000_000) for _ in range(3)]
    assert a.slab_count == 1 and a.spent_bytes == 16 * MiB and pinned_bytes() == base + 16 * MiB
    extra = a.take(7 * MiB)  # the slab's remaining 7.4 MB hold it
    assert a.slab_count == 1
    for t in (*ts, extra):
        a.give(t)
    assert a.spent_bytes == 0 and pinned_bytes() == base
    pool = PinnedPool(pin=True)
    buf = pool.take(3 * MiB + 1)
    assert buf.numel() == 3 * MiB + 1 and pool.total_bytes == 4 * MiB
    pool.forget(buf)
    assert pool.total_bytes == 0 and pinned_bytes() == base


def _stand_in_cache_slab(nbytes, *, pin, device=None):
    # the caching allocator's slab, in plain memory: what `alloc_slab` spends and counts
    backend = _pinned._backend(pin, device)
    cost = _pinned.spent(nbytes, backend)
    if pin:
        _pinned._LEDGER.take(cost)
    size = cost if backend == "cache" else nbytes
    return _pinned.Slab(torch.empty(size, dtype=torch.uint8), cost, False, backend, device)


def test_pinned_host_store_accounts_slabs_and_returns_them_on_free_and_close():
    base = pinned_bytes()
    s = HostStore(pin=True)
    assert s.pinned
    shapes = [(1000, 768), (768,), (3000, 768)]
    s.reserve(int(torch.Size(sh).numel()) * 4 for sh in shapes)
    hs = [s.alloc(f"w{i}", sh, torch.float32) for i, sh in enumerate(shapes)]
    logical = sum(h.nbytes for h in hs)
    assert s.used_bytes == logical
    # one slab, every tensor aligned to 64 bytes: exactly what the store spends and pins
    assert s.spent_bytes == sum(-(-h.nbytes // 64) * 64 for h in hs) == logical
    assert pinned_bytes() == base + s.spent_bytes
    for i, h in enumerate(hs):
        s.write(h, torch.full(h.shape, float(i))).result()
    for i, h in enumerate(hs):
        assert bool((s.host_tensor(h) == i).all())
    s.free(hs[0])
    assert s.spent_bytes == logical and pinned_bytes() == base + logical  # slab still in use
    g = s.alloc("g", (500, 768), torch.float32)  # carved from the freed span
    assert s.spent_bytes == logical
    s.free(g)
    s.free(hs[1])
    s.free(hs[2])  # the slab is empty: given back
    assert s.spent_bytes == 0 and pinned_bytes() == base
    s.alloc("again", (10,), torch.float32)
    assert pinned_bytes() > base
    s.close()
    assert pinned_bytes() == base


def test_budgets_are_enforced_on_spent_bytes_with_errors_naming_the_fix():
    base = pinned_bytes()
    s = HostStore(pin=True, max_bytes=3 * MiB)
    s.alloc("a", (2 * MiB,), torch.uint8)  # a 2 MiB slab
    # 2 MiB logical + 1 MiB would fit a logical budget of 3 MiB, but the next slab is as large
    # as the store so far (2 MiB): 4 MiB spent is over it
    with pytest.raises(StoreFullError, match="max_bytes"):
        s.alloc("b", (MiB // 2,), torch.uint8)
    assert "b" not in s and s.used_bytes == 2 * MiB
    s.close()
    set_pinned_limit(base + MiB)
    s = HostStore(pin=True)
    with pytest.raises(StoreFullError, match="set_pinned_limit"):
        s.alloc("big", (2 * MiB,), torch.uint8)
    pool = PinnedPool(pin=True)
    with pytest.raises(StoreFullError, match="page-locked memory full"):
        pool.take(2 * MiB)
    assert pinned_bytes() == base and s.used_bytes == 0
    s.close()
    with pytest.raises(ValueError, match="pinned limit"):
        set_pinned_limit(-1)


def test_pool_gives_memory_back_on_forget_clear_and_trim():
    base = pinned_bytes()
    pool = PinnedPool(pin=True, max_bytes=3 * MiB)
    a, b = pool.take(MiB), pool.take(MiB)
    assert pool.total_bytes == 2 * MiB and pinned_bytes() == base + 2 * MiB
    pool.give(a)
    assert pool.take(MiB).data_ptr() == a.data_ptr()  # reused by size
    pool.give(a)
    c = pool.take(2 * MiB)  # over the budget: the cached buffer is dropped first
    assert pool.total_bytes == 3 * MiB and pinned_bytes() == base + 3 * MiB
    pool.forget(b)
    pool.give(c)
    assert pool.total_bytes == 2 * MiB
    pool.clear()
    assert pool.total_bytes == 0 and pinned_bytes() == base


def test_unoffload_returns_the_pinned_store(monkeypatch):
    """On the accelerator path (the stream model stands in for the device) an offloaded
    model's masters and gradients rest in one pinned store whose slabs go back on unoffload."""
    import warnings

    from tests._streams import stream_model

    base = pinned_bytes()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    with stream_model(monkeypatch) as m, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store="cpu")
        store = hr.residency.state_of(model).store
        assert store.pinned
        params = sum(p.numel() * 4 for p in model.parameters())
        assert store.spent_bytes == params + 64 * sum(
            (p.numel() * 4) % 64 != 0 for p in model.parameters())
        model(torch.randn(2, 64)).sum().backward()
        assert pinned_bytes() - base == store.spent_bytes >= 2 * params
        hr.unoffload(model)
        m.synchronize()
    assert pinned_bytes() == base


class _FakeDriver:
    """cudaHostRegister/Unregister as the driver treats them: page-locking works on whole pages,
    so a range that touches a page another registration holds fails (cudaError 712), and
    unregistering needs the pointer that was registered."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}  # registered pointer -> bytes
        self.calls = 0

    def _pages(self, ptr, n):
        return set(range(ptr // _pinned._PAGE, (ptr + n - 1) // _pinned._PAGE + 1))

    def cudaHostRegister(self, ptr, n, flags):
        self.calls += 1
        held = set().union(*(self._pages(p, m) for p, m in self.ranges.items()))
        if self._pages(ptr, n) & held:
            return 712
        self.ranges[ptr] = n
        return 0

    def cudaHostUnregister(self, ptr):
        return 0 if self.ranges.pop(ptr, None) is not None else 713


def test_registered_slabs_own_whole_pages_and_unregister_before_their_memory_goes(monkeypatch):
    """The CUDA path of `alloc_slab`, against a driver model: small slabs side by side register
    (whole pages of their own), a tensor's storage starts where its registration does (what
    ``is_pinned`` asks about), and the registration ends at `release` or, for a slab dropped
    without it, when its memory is freed (a later allocation at that address would otherwise
    fail to register)."""
    import gc

    drv = _FakeDriver()
    monkeypatch.setattr(_pinned, "_backend", lambda pin, device: "register" if pin else "plain")
    monkeypatch.setattr(torch.cuda, "cudart", lambda: drv)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    base = pinned_bytes()
    slabs = [_pinned.alloc_slab(n, pin=True) for n in (128, 4096, 4097, 100, 3 * MiB + 5)]
    assert len(drv.ranges) == 5
    for s in slabs:
        ptr = s.tensor.untyped_storage().data_ptr()
        assert s.tensor.data_ptr() == ptr and ptr % _pinned._PAGE == 0
        assert drv.ranges[ptr] == s.spent == _pinned.spent(s.nbytes, "register")
        s.tensor.fill_(7)  # the whole slab is usable memory
    assert pinned_bytes() == base + sum(s.spent for s in slabs)
    slabs[0].release()
    slabs[0].release()  # idempotent
    assert len(drv.ranges) == 4
    del slabs[1]  # dropped without release: unregistered when its memory goes
    gc.collect()
    assert len(drv.ranges) == 3
    view = slabs[1].tensor[10:20]  # a carved tensor outlives its slab object
    ptr = slabs[1].tensor.data_ptr()
    del slabs[1]
    gc.collect()
    assert ptr in drv.ranges
    del view
    gc.collect()
    assert ptr not in drv.ranges
    for s in slabs:
        s.release()
    assert drv.ranges == {} and pinned_bytes() == base
    # a HostStore's arena on the same path: carved tensors, closed, nothing left registered
    store = HostStore(pin=True)
    store.put("w", torch.randn(300))
    store.close()
    assert drv.ranges == {} and pinned_bytes() == base


def test_a_refused_registration_names_the_fix_and_gives_its_budget_back(monkeypatch):
    """The driver refusing to page-lock (a memlock limit): the error says what to do, and the
    bytes taken from the budget for it are given back."""
    drv = _FakeDriver()
    drv.cudaHostRegister = lambda ptr, n, flags: 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(_pinned, "_backend", lambda pin, device: "register" if pin else "plain")
    monkeypatch.setattr(torch.cuda, "cudart", lambda: drv)
    base = pinned_bytes()
    with pytest.raises(RuntimeError, match=r"set_pinned_limit.*DiskStore"):
        _pinned.alloc_slab(3 * MiB, pin=True)
    assert pinned_bytes() == base and drv.ranges == {}
