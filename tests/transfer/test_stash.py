"""transfer.Stash: anonymous storages out to host memory or a DiskStore and back."""

from __future__ import annotations

import shutil

import pytest
import torch

from headroom.store import DiskStore
from headroom.store import _disk as disk_mod
from headroom.store import _ledger as ledger_mod
from headroom.transfer import Stash, resize_storage


def _stores(tmp_path):
    return [None, DiskStore(tmp_path / "d", threads=2)]


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_round_trip_through_a_freed_storage(kind, tmp_path):
    store = None if kind == "host" else DiskStore(tmp_path / "d", threads=2)
    s = Stash("cpu", store)
    t = torch.randn(1000)
    want = t.clone()
    k = s.stash(t.untyped_storage())
    s.wait_out(k)
    resize_storage(t, 0)  # the bytes live only in the stash now
    assert t.untyped_storage().nbytes() == 0
    resize_storage(t, 4000)
    s.restore(k, t.untyped_storage())
    assert torch.equal(t, want)
    s.drop(k)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_space_is_pooled_by_size(kind, tmp_path):
    """A loop stashing the same sizes every step allocates (and creates files) once."""
    store = None if kind == "host" else DiskStore(tmp_path / "d", threads=2)
    s = Stash("cpu", store)
    sizes = [4096, 8192, 4096]
    for step in range(3):
        ts = [torch.full((n // 4,), float(step)) for n in sizes]
        ks = [s.stash(t.untyped_storage()) for t in ts]
        for t, k in zip(ts, ks, strict=True):
            s.wait_out(k)
            resize_storage(t, 0)
        if step == 0 and store is not None:
            files = len(list(store.path.glob("*.bin")))  # scratch keys are not listed
        for t, k, n in zip(ts, ks, sizes, strict=True):
            resize_storage(t, n)
            s.prefetch(k, t.untyped_storage())
        for t, k in zip(ts, ks, strict=True):
            s.restore(k, t.untyped_storage())
            assert torch.equal(t, torch.full_like(t, float(step)))
            s.drop(k)
        assert s.pooled_bytes == sum(sizes)  # all given back, ready for the next step
    if store is not None:
        assert len(list(store.path.glob("*.bin"))) == files == 3
        assert s.pooled_bytes == sum(sizes)
    s.close()
    assert s.pooled_bytes == 0
    if store is not None:
        assert store.keys() == []


def test_restore_into_a_storage_of_another_size_is_refused():
    s = Stash("cpu", None)
    t = torch.randn(10)
    k = s.stash(t.untyped_storage())
    with pytest.raises(ValueError, match="restoring 40 stashed bytes into a storage of 20"):
        s.restore(k, torch.empty(5).untyped_storage())


def test_shared_stashes_are_per_store_and_device_and_release_their_space(tmp_path):
    store = DiskStore(tmp_path / "d", threads=2)
    a = Stash.shared("cpu", store)
    assert Stash.shared(torch.device("cpu"), store) is a
    assert Stash.shared("cpu", None) is not a
    t = torch.randn(256)
    k = a.stash(t.untyped_storage())
    a.wait_out(k)
    a.drop(k)
    assert a.pooled_bytes == 1024 and store.used_bytes == 1024
    Stash.release_shared()
    assert a.pooled_bytes == 0 and store.used_bytes == 0


@pytest.mark.parametrize("verify_reads", [False, True])
def test_a_stash_write_in_flight_at_a_kill_is_dropped_on_reopen(tmp_path, monkeypatch,
                                                                verify_reads):
    """Scratch bytes are worth nothing once their process is gone: even a write torn by a kill
    neither blocks reopening (no recover=True needed) nor survives it; other keys stay. (With
    verified reads, scratch writes are journaled and checksummed like any other.)"""
    store = DiskStore(tmp_path / "d", threads=2, verify_reads=verify_reads)
    store.put("keep", torch.arange(8.0))
    real = disk_mod._pwrite_from

    def half(fd, buf, offset, written):
        real(fd, buf[:len(buf) // 2], offset, written)

    s = Stash("cpu", store)
    monkeypatch.setattr(disk_mod, "_pwrite_from", half)
    monkeypatch.setattr(store._ledger, "end_write", lambda rid, result: None)  # "killed"
    t = torch.randn(1000)
    s.wait_out(s.stash(t.untyped_storage()))
    snap = tmp_path / "snap"
    shutil.copytree(store.path, snap, ignore=shutil.ignore_patterns(ledger_mod.LOCK))
    monkeypatch.undo()
    with pytest.warns(UserWarning):  # not closed
        again = DiskStore(snap)
    assert again.keys() == ["keep"]
    assert torch.equal(again.read(again.get("keep")).result(), torch.arange(8.0))
    again.close()


@pytest.mark.parametrize("verify_reads", [False, True])
def test_scratch_writes_are_journaled_only_when_reads_verify_them(tmp_path, verify_reads):
    store = DiskStore(tmp_path / "d", threads=2, verify_reads=verify_reads)
    s = Stash("cpu", store)
    t = torch.randn(1000)
    want = t.clone()
    k = s.stash(t.untyped_storage())
    s.wait_out(k)
    assert store.stats()["bytes_written"] == 4000
    # checksummed and journaled only when a read would check them; never a stale checksum
    segments = store._ledger.segments(k.handle.key)
    assert bool(segments) == verify_reads
    store.flush()  # reads back nothing, syncs nothing it does not need to
    t.zero_()
    s.restore(k, t.untyped_storage())
    assert torch.equal(t, want)


def test_release_shared_skips_stores_closed_since(tmp_path):
    """A DiskStore closed after its shared stash was used (another model's, another test's)
    is left alone by `release_shared`: its file handles are gone, and so is its space."""
    def used_shared(store):  # a shared stash that pooled a file
        s = Stash.shared("cpu", store)
        k = s.stash(torch.randn(64).untyped_storage())
        s.wait_out(k)
        s.drop(k)
        return s

    old = DiskStore(tmp_path / "old", threads=1)
    used_shared(old)
    old.close()
    live = DiskStore(tmp_path / "live", threads=1)
    a = used_shared(live)
    Stash.release_shared()
    assert a.pooled_bytes == 0 and live.used_bytes == 0
    live.close()
