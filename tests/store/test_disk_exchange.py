"""DiskStore.exchange: two tensors swap contents by a change of the index, journaled, with their
checksums; a reopened store (after close, or as a kill -9 leaves it) sees the exchange."""

from __future__ import annotations

import shutil
import threading
import warnings

import pytest
import torch

from headroom.store import DiskStore, HostStore, StoreCorruptError
from headroom.store import _ledger as ledger_mod
from headroom.store._store import SCRATCH


def _killed_copy(store: DiskStore, dest):
    """The folder as a process killed right now would leave it (all writes done, no close)."""
    shutil.copytree(store.path, dest, ignore=shutil.ignore_patterns(ledger_mod.LOCK))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "was not closed"
        return DiskStore(dest, verify=True)


def test_exchange_swaps_contents_for_every_holder_and_copies_nothing(tmp_path):
    s = DiskStore(tmp_path / "s")
    a = s.put("w", torch.arange(12.).reshape(4, 3))
    b = s.put("v", torch.ones(4))
    sp = s.alloc_spare(a, SCRATCH + "spare/w")
    assert (sp.shape, sp.dtype) == (a.shape, a.dtype) and "w" in s.file_of(sp).name
    s.write_rows(sp, slice(0, 2), torch.full((2, 3), 7.)).result()
    s.write_rows(sp, slice(2, 4), torch.full((2, 3), 8.)).result()
    written = s.stats()["bytes_written"]
    s.exchange([(a, sp)])
    assert s.stats()["bytes_written"] == written  # an index change, no byte copied
    new = torch.tensor([[7.] * 3] * 2 + [[8.] * 3] * 2)
    assert torch.equal(s.read(s.get("w")).result(), new)  # the same handle object
    assert torch.equal(s.read_rows(sp, slice(1, 3)).result(), torch.arange(3., 9.).reshape(2, 3))
    assert sorted(s.keys()) == ["v", "w"]
    s.exchange([(sp, a)])  # and back
    assert torch.equal(s.read(a).result(), torch.arange(12.).reshape(4, 3))
    s.exchange([(a, sp)])
    # Shapes, dtypes and keys are checked before anything changes.
    with pytest.raises(ValueError, match="one shape and dtype"):
        s.exchange([(a, b)])
    with pytest.raises(ValueError, match="more than one pair"):
        s.exchange([(a, sp), (sp, a)])
    with pytest.raises(KeyError):
        s.exchange([(a, HostStore().put("other", torch.zeros(4, 3)))])
    assert torch.equal(s.read(a).result(), new)
    s.close()
    # Closed and reopened: the exchange is in the index, checksums verified; the spare (a
    # scratch key) is gone with the old bytes.
    s = DiskStore(tmp_path / "s", verify=True)
    assert sorted(s.keys()) == ["v", "w"] and SCRATCH + "spare/w" not in s
    assert torch.equal(s.read(s.get("w")).result(), new)
    s.close()


def test_host_store_cannot_exchange():
    s = HostStore()
    a, b = s.put("a", torch.zeros(2)), s.put("b", torch.ones(2))
    assert not s.can_exchange
    with pytest.raises(NotImplementedError, match="cannot exchange"):
        s.exchange([(a, b)])


def test_a_killed_store_replays_the_exchange_with_its_checksums(tmp_path):
    s = DiskStore(tmp_path / "s")
    a = s.put("w", torch.arange(8.))
    sp = s.alloc_spare(a, SCRATCH + "spare/w")
    s.flush()  # the journal holds only what follows: the spare's write and the exchange
    s.write(sp, torch.full((8,), 5.)).result()
    before = _killed_copy(s, tmp_path / "before")  # killed before the exchange
    assert torch.equal(before.read(before.get("w")).result(), torch.arange(8.))
    before.close()
    s.exchange([(a, sp)])
    after = _killed_copy(s, tmp_path / "after")  # killed after it
    assert torch.equal(after.read(after.get("w")).result(), torch.full((8,), 5.))
    assert after.keys() == ["w"]
    f = after.file_of(after.get("w"))
    after.close()
    # The checksums went with the bytes: a flipped byte in the exchanged file is caught.
    with open(f, "r+b") as fh:
        fh.seek(4)
        fh.write(b"\xff")
    with pytest.raises(StoreCorruptError, match="'w'"):
        DiskStore(tmp_path / "after", verify=True)
    s.close()


def test_exchange_waits_for_writes_issued_before_it(tmp_path, monkeypatch):
    s = DiskStore(tmp_path / "s", threads=2)
    a = s.put("w", torch.zeros(1024))
    sp = s.alloc_spare(a, SCRATCH + "spare/w")
    gate = threading.Event()
    orig = s._write_job

    def slow(*args):
        gate.wait(5)
        return orig(*args)

    monkeypatch.setattr(s, "_write_job", slow)
    fut = s.write(sp, torch.ones(1024))
    t = threading.Timer(0.2, gate.set)
    t.start()
    s.exchange([(a, sp)])  # waits for the write to the spare, then swaps
    assert fut.done()
    assert torch.equal(s.read(a).result(), torch.ones(1024))
    t.join()
    s.close()
