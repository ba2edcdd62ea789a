"""A DiskStore's journal stays bounded when every write happens under a reservation (the host
optimizer reserves journal space for each whole step): compaction waits for the reservation to
end, then runs. Training on top stays bitwise plain PyTorch."""

from __future__ import annotations

import errno
import json
import shutil
import warnings

import pytest
import torch

import headroom as hr
from headroom.store import DiskStore, StoreFullError
from headroom.store import _ledger as ledger_mod
from tests.optim._models import batch, make_model


def _journal_bytes(folder) -> int:
    return (folder / ledger_mod.JOURNAL).stat().st_size


def _index(folder) -> dict:
    return json.loads((folder / ledger_mod.INDEX).read_bytes())


def test_release_of_a_reservation_compacts_a_journal_past_its_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_mod, "COMPACT_BYTES", 4096)
    s = DiskStore(tmp_path / "s")
    h = s.alloc("x", (8, 4), torch.float32)
    s.flush()
    seq0 = _index(tmp_path / "s")["seq"]
    for step in range(5):
        s.reserve_writes(40)  # as a step does: journal space for all of its writes
        for i in range(40):
            s.write_rows(h, slice(i % 8, i % 8 + 1), torch.full((1, 4), float(step * 40 + i))
                         ).result()
        assert _journal_bytes(tmp_path / "s") > 4096  # nothing compacted under the promise
        s.release_writes()
        assert _journal_bytes(tmp_path / "s") == 0  # compacted once it ended
        assert _index(tmp_path / "s")["seq"] == seq0 + 80 * (step + 1)
    snap = tmp_path / "snap"  # as a kill leaves it: the compacted index says it all
    shutil.copytree(tmp_path / "s", snap, ignore=shutil.ignore_patterns(ledger_mod.LOCK))
    expect = s.read(h).result()
    s.close()
    assert torch.equal(expect[:, 0], torch.arange(192.0, 200.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not closed: a step may be partly applied
        t = DiskStore(snap)
    assert torch.equal(t.read(t.get("x")).result(), expect)
    t.close()


def test_a_reservation_the_disk_cannot_hold_is_store_full(tmp_path, monkeypatch):
    s = DiskStore(tmp_path / "s")
    h = s.put("x", torch.ones(4))

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(ledger_mod, "_keep_size_fallocate", no_space)
    with pytest.raises(StoreFullError, match=r"journal records of 3 writes \(No space left"):
        s.reserve_writes(3)
    monkeypatch.undo()
    s.write(h, torch.full((4,), 2.0)).result()  # nothing was reserved, the store goes on
    s.close()
    t = DiskStore(tmp_path / "s")
    assert torch.equal(t.read(t.get("x")).result(), torch.full((4,), 2.0))
    t.close()


def _loss(model, i: int) -> torch.Tensor:
    x, y = batch(i)
    return ((model(x) - y) ** 2).mean()


@pytest.mark.slow
def test_soak_with_state_on_disk_keeps_every_journal_bounded(tmp_path, monkeypatch):
    """Parameters and optimizer state on DiskStores, activations offloaded to a third: after
    every step each journal is within its compaction bound, the state store's compacts every
    few steps, its folder stops growing, and the parameters equal plain AdamW's."""
    # NOTE: the bound is the larger of COMPACT_BYTES and twice the index, so with a tiny
    # COMPACT_BYTES the state store's (about 18 kB) index sets it: a compaction every 5 steps.
    monkeypatch.setattr(ledger_mod, "COMPACT_BYTES", 1024)
    steps = 16
    ref = make_model(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model = make_model(0)
    folders = {n: tmp_path / n for n in ("params", "state", "act")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu": mechanics only
        hr.offload(model, device="cpu", store=DiskStore(folders["params"]))
    state, act = DiskStore(folders["state"]), DiskStore(folders["act"])
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           state_store=state)
    seqs: list[int] = []
    tensor_bytes: list[int] = []
    for i in range(steps):
        _loss(ref, i).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with hr.offload_activations(store=act, min_bytes=0):
            _loss(model, i).backward()
        opt.step()
        opt.zero_grad()
        for f in folders.values():
            bound = max(1024, 2 * (f / ledger_mod.INDEX).stat().st_size)
            assert _journal_bytes(f) <= bound, (i, f.name, _journal_bytes(f), bound)
        seqs.append(_index(folders["state"])["seq"])
        tensor_bytes.append(sum(p.stat().st_size for p in folders["state"].glob("*.bin")))
    # The state store compacted while open, every few steps (its index moved on) ...
    assert len(set(seqs)) >= 3, seqs
    # ... and holds the same tensor files from the first step on: nothing accumulates.
    assert len(set(tensor_bytes)) == 1, tensor_bytes
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())
    state.close()
    act.close()
