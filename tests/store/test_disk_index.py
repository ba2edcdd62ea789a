"""A DiskStore's index and journal vouch for themselves: a damaged index (any single flipped bit),
a key named twice, a removed or added entry against the files present are refused when opening,
naming the file and the fix; what the store legitimately leaves behind still opens."""

from __future__ import annotations

import collections
import errno
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from headroom.store import DiskStore, StoreCorruptError
from headroom.store import _ledger as ledger_mod
from tests.store._disk_files import edit_index, read_index, sealed, signed, write_index

# Keys a bit apart: a flip in one can make it another ('0' ^ 1 == '1').
KEYS = ["layers.0.weight", "layers.1.weight", "layers.2.weight", "layers.3.weight",
        "layers.0.bias", "layers.1.bias", "head"]


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {k: torch.randn(8, 4, generator=g) for k in KEYS if k.endswith("weight")}
    out |= {k: torch.randn(4, generator=g) for k in KEYS if k.endswith("bias")}
    out["head"] = torch.randint(0, 100, (3, 5), generator=g)
    return out


def _store(folder: Path, *, closed: bool = True) -> dict[str, torch.Tensor]:
    """A store holding `_values` (a row write, a free and a tensor never written among its
    history); ``closed=False``: the folder as a kill would leave it, journal records after
    the index. Returns what each tensor holds."""
    values = _values()
    s = DiskStore(folder, threads=2)
    for k, v in values.items():
        if k != "layers.3.weight":
            s.put(k, v)
    s.free(s.put("gone", torch.ones(6)))
    h = s.alloc("layers.3.weight", (8, 4), torch.float32)
    values["layers.3.weight"] = torch.zeros(8, 4)
    s.write_rows(s.get("layers.1.weight"), slice(2, 4), torch.full((2, 4), 7.0)).result()
    values["layers.1.weight"][2:4] = 7.0
    if closed:
        s.close()
        return values
    s.flush()
    s.write_rows(h, slice(0, 1), torch.ones(1, 4)).result()
    values["layers.3.weight"][0] = 1.0
    s.write(s.get("head"), values["head"] + 1).result()
    values["head"] += 1
    shutil.copytree(folder, folder.with_name(folder.name + "-live"),
                    ignore=shutil.ignore_patterns(ledger_mod.LOCK))
    s.close()
    shutil.rmtree(folder)
    folder.with_name(folder.name + "-live").rename(folder)
    return values


def _files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.name != ledger_mod.LOCK}


def _open(folder: Path, **kw) -> tuple[DiskStore, list[str]]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = DiskStore(folder, **kw)
    return s, [str(x.message) for x in w]


def _assert_holds(s: DiskStore, values: dict[str, torch.Tensor]) -> None:
    assert sorted(s.keys()) == sorted(values)
    for k, v in values.items():
        assert torch.equal(s.read(s.get(k)).result(), v), k


# ---------------------------------------------------------------------- a flipped bit
@pytest.mark.parametrize("closed", [True, False], ids=["closed", "killed"])
def test_every_single_bit_flip_in_the_index_is_refused_or_exact(tmp_path, closed):
    base = tmp_path / "base"
    values = _store(base, closed=closed)
    index = (base / "index.json").read_bytes()
    rnd = random.Random(1234)
    flips = [(rnd.randrange(len(index)), rnd.randrange(8)) for _ in range(120)]
    flips += [(len(index) - 1 - k, rnd.randrange(8)) for k in range(24)]  # the checksum field
    refused = 0
    for n, (pos, bit) in enumerate(flips):
        folder = tmp_path / f"f{n}"
        shutil.copytree(base, folder)
        raw = bytearray(index)
        raw[pos] ^= 1 << bit
        (folder / "index.json").write_bytes(bytes(raw))
        before = _files(folder)
        try:
            s, _ = _open(folder)
        except (StoreCorruptError, FileExistsError) as e:
            refused += 1
            assert "index.json" in str(e), str(e)
            assert _files(folder) == before  # refused before anything changed
            continue
        try:
            _assert_holds(s, values)  # an index that opens holds every value exactly
        finally:
            s.close()
        shutil.rmtree(folder)
    assert refused == len(flips)  # the checksum covers every byte, its own field included


def test_a_damaged_index_is_refused_even_with_recover(tmp_path):
    folder = tmp_path / "s"
    _store(folder)
    raw = bytearray((folder / "index.json").read_bytes())
    raw[raw.index(b"layers.1") + 7] ^= 1  # layers.1 -> layers.0: one key named twice
    (folder / "index.json").write_bytes(bytes(raw))
    for kw in ({}, {"recover": True}):
        with pytest.raises(StoreCorruptError, match=r"index\.json does not match its checksum"
                           r".*The folder was not changed.*Restore the folder from a backup"
                           r".*overwrite=True.*hr\.load"):
            DiskStore(folder, **kw)


def test_index_without_its_checksum_field_is_refused(tmp_path):
    folder = tmp_path / "s"
    _store(folder)
    (folder / "index.json").write_bytes(_unsealed(read_index(folder)))
    with pytest.raises(StoreCorruptError, match=r"index\.json has no valid checksum field"
                       r" \(version 3"):
        DiskStore(folder)


def test_an_index_of_version_2_opens_and_is_rewritten_sealed(tmp_path):
    folder = tmp_path / "s"
    values = _store(folder)
    data = read_index(folder)
    data["version"] = 2
    del data["freed"]
    (folder / "index.json").write_bytes(_unsealed(data))
    s, warned = _open(folder)
    assert not warned
    _assert_holds(s, values)
    s.close()
    raw = (folder / "index.json").read_bytes()
    assert read_index(folder)["version"] == 3 and raw == sealed(read_index(folder))


# ---------------------------------------------------------------------- entries vs files
def _unsealed(data: dict) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _file_of(folder: Path, key: str) -> str:
    return read_index(folder)["tensors"][key]["file"]


def test_a_removed_entry_is_refused_naming_its_file_and_recover_moves_it_aside(tmp_path):
    folder = tmp_path / "s"
    values = _store(folder)
    name = _file_of(folder, "layers.2.weight")
    edit_index(folder, lambda d: d["tensors"].pop("layers.2.weight"))  # checksum valid
    before = _files(folder)
    with pytest.raises(StoreCorruptError, match=rf"1 tensor file\(s\) in the folder are"
                       rf" accounted for by neither index\.json nor journal\.jsonl.*: {name}\."
                       r".*The folder was not changed.*Restore index\.json and journal\.jsonl"
                       r".*recover=True.*NAME\.unaccounted.*overwrite=True") as e:
        DiskStore(folder)
    assert e.value.path == str(folder) and e.value.keys == ()
    assert _files(folder) == before  # nothing deleted: the entry may be all that was lost
    s, warned = _open(folder, recover=True)
    assert any(f"moved aside (not deleted): {name}.unaccounted" in m for m in warned)
    assert "layers.2.weight" not in s.keys()  # noqa: SIM118 - a Store is not a dict
    _assert_holds(s, {k: v for k, v in values.items() if k != "layers.2.weight"})
    s.close()
    assert (folder / f"{name}.unaccounted").read_bytes() == before[name]
    s, warned = _open(folder)  # accounted for from then on
    assert not warned
    s.close()


def test_an_extra_file_is_refused_naming_it(tmp_path):
    folder = tmp_path / "s"
    values = _store(folder)
    # the name of "gone", freed and unlinked before: back in the folder, nothing owns it
    extra = folder / "000007-gone.bin"
    assert read_index(folder)["counter"] >= 7 and read_index(folder)["freed"] == []
    extra.write_bytes((folder / _file_of(folder, "head")).read_bytes())
    before = _files(folder)
    with pytest.raises(StoreCorruptError, match=r": 000007-gone\.bin\..*recover=True"):
        DiskStore(folder)
    assert _files(folder) == before
    (folder / "000007-gone.bin.unaccounted").write_bytes(b"taken")
    s, warned = _open(folder, recover=True)
    assert any("moved aside (not deleted): 000007-gone.bin.unaccounted.1" in m for m in warned)
    _assert_holds(s, values)
    s.close()
    assert (folder / "000007-gone.bin.unaccounted").read_bytes() == b"taken"
    assert (folder / "000007-gone.bin.unaccounted.1").read_bytes() == before[extra.name]


def test_a_missing_file_is_refused_naming_it_unless_never_written(tmp_path):
    folder = tmp_path / "s"
    values = _store(folder)
    name = _file_of(folder, "layers.0.bias")
    (folder / name).unlink()
    with pytest.raises(StoreCorruptError, match=rf"'layers\.0\.bias' \({name}, bytes 0-16:"
                       r" file missing\).*recover=True"):
        DiskStore(folder)
    (folder / name).write_bytes(values["layers.0.bias"].numpy().tobytes())
    never = _file_of(folder, "layers.3.weight")
    (folder / never).unlink()  # allocated, never written: it held zeros, and is made again
    s, _ = _open(folder)
    _assert_holds(s, values)
    s.close()


def test_a_key_named_twice_is_refused(tmp_path):
    folder = tmp_path / "s"
    _store(folder)
    twice = _unsealed(read_index(folder)).replace(b'"layers.1.bias":', b'"layers.0.bias":')
    seal = b',"crc":"%08x"}' % ledger_mod.crc(twice)
    (folder / "index.json").write_bytes(twice[:-1] + seal)  # a valid checksum
    with pytest.raises(StoreCorruptError, match=r"index\.json is damaged or edited: the key"
                       r" 'layers\.0\.bias' appears twice"):
        DiskStore(folder)
    (folder / "index.json").write_bytes(twice.replace(b'"version":3', b'"version":2'))
    with pytest.raises(StoreCorruptError, match=r"the key 'layers\.0\.bias' appears twice"):
        DiskStore(folder)  # an index of version 2 (no checksum) too


def test_a_journal_record_naming_a_key_twice_is_refused(tmp_path):
    folder = tmp_path / "s"
    _store(folder)
    seq = read_index(folder)["seq"]
    body = (b'{"op":"alloc","k":"y","k":"z","f":"000099-y.bin","shape":[2],'
            b'"dtype":"float32","s":%d}' % (seq + 1))
    (folder / "journal.jsonl").write_bytes(b"%08x %s\n" % (ledger_mod.crc(body), body))
    with pytest.raises(StoreCorruptError, match=r"journal\.jsonl record 1 is invalid \(the key"
                       r" 'k' appears twice"):
        DiskStore(folder)


def test_a_damaged_last_journal_record_is_refused_unless_recover(tmp_path):
    """The last record (an exchange) with a flipped bit: skipping it silently would leave the
    two tensors each holding the other's values."""
    folder = tmp_path / "s"
    s = DiskStore(folder)
    a, b = s.put("a", torch.zeros(4)), s.put("b", torch.ones(4))
    s.flush()
    s.exchange([(a, b)])
    shutil.copytree(folder, tmp_path / "snap", ignore=shutil.ignore_patterns(ledger_mod.LOCK))
    s.close()
    journal = tmp_path / "snap" / "journal.jsonl"
    raw = bytearray(journal.read_bytes())
    assert raw.count(b"\n") == 1 and b'"op":"x"' in raw
    raw[raw.index(b'"pairs"') + 2] ^= 4
    journal.write_bytes(bytes(raw))
    with pytest.raises(StoreCorruptError, match=r"journal\.jsonl record 1 \(the last\) is"
                       r" damaged.*whole.*recover=True.*overwrite=True"):
        DiskStore(tmp_path / "snap")
    t, warned = _open(tmp_path / "snap", recover=True)
    assert any("record 1, the last, was damaged and skipped" in m for m in warned)
    t.close()
    torn = tmp_path / "torn"  # cut short by a kill: no newline, ignored as before
    shutil.copytree(folder, torn)
    body = signed({"op": "free", "k": "a", "s": read_index(torn)["seq"] + 1})
    (torn / "journal.jsonl").write_bytes(body[:-5])
    t, warned = _open(torn)
    assert sorted(t.keys()) == ["a", "b"] and not warned
    t.close()


# ---------------------------------------------------------------------- what still opens
def test_a_free_journaled_but_not_unlinked_still_opens(tmp_path, monkeypatch):
    """Stopped between the journaled free and the unlink, before or after a snapshot."""
    for flushed in (False, True):
        folder = tmp_path / f"s{flushed}"
        s = DiskStore(folder)
        s.put("keep", torch.arange(4.0))
        h = s.put("gone", torch.ones(3))
        s.flush()
        gone = s.file_of(h).name
        real = os.unlink

        def refuse(path, *a, gone=gone, real=real, **kw):
            if os.path.basename(path) == gone:
                raise PermissionError(errno.EACCES, "injected", path)
            return real(path, *a, **kw)

        monkeypatch.setattr(os, "unlink", refuse)
        with pytest.raises(PermissionError):
            s.free(h)
        if flushed:
            s.flush()  # the snapshot now lists the file as freed; the journal is empty
            assert gone in read_index(folder)["freed"]
            assert (folder / "journal.jsonl").stat().st_size == 0
        snap = tmp_path / f"snap{flushed}"
        shutil.copytree(folder, snap, ignore=shutil.ignore_patterns(ledger_mod.LOCK))
        monkeypatch.undo()
        s.close()  # closing removes nothing: the file stays, listed as freed
        assert (folder / gone).exists() and gone in read_index(folder)["freed"]
        for f in (snap, folder):
            t, _ = _open(f)
            assert t.keys() == ["keep"] and not (f / gone).exists()
            assert torch.equal(t.read(t.get("keep")).result(), torch.arange(4.0))
            t.close()
            assert read_index(f)["freed"] == []


def test_a_kill_between_the_journaled_free_and_the_unlink_still_opens(tmp_path):
    from tests.store.test_disk_safety import Child

    folder = tmp_path / "s"
    child = Child("free", folder)
    child.wait_for("freeing")
    child.died()
    assert len(list(folder.glob("*-gone.bin"))) == 1  # killed before the unlink
    s, warned = _open(folder)
    assert s.keys() == ["keep"] and not list(folder.glob("*-gone.bin"))
    assert torch.equal(s.read(s.get("keep")).result(), torch.arange(10.0))
    s.close()


def test_files_a_dropped_tensor_leaves_are_removed(tmp_path, monkeypatch):
    """recover=True drops a tensor whose short file the disk cannot fill: what is left of
    its file is the store's to remove, not an unaccounted file."""
    folder = tmp_path / "s"
    s = DiskStore(folder)
    s.put("x", torch.ones(4))
    h = s.put("big", torch.ones(1000))
    f = s.file_of(h)
    s.close()
    os.truncate(f, 10)
    edit_index(folder, lambda d: d["tensors"]["big"].update(
        segments=[[0, 4000, ledger_mod.zeros_crc(4000)]]))  # as if never written
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 100))
    with pytest.warns(UserWarning, match="dropped"):
        s = DiskStore(folder, recover=True)
    monkeypatch.undo()
    assert s.keys() == ["x"] and not f.exists()
    s.close()
    s, warned = _open(folder)
    assert s.keys() == ["x"] and not warned
    s.close()


def test_write_index_helper_matches_the_store(tmp_path):
    """The tests' sealing is the store's: an index rewritten from its fields is identical."""
    folder = tmp_path / "s"
    _store(folder)
    raw = (folder / "index.json").read_bytes()
    write_index(folder, read_index(folder))
    assert (folder / "index.json").read_bytes() == raw
