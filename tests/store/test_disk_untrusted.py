"""DiskStore with a folder it did not write: symbolic links, hand-edited index and journal sizes,
raw errors from forged fields, and argument validation."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from headroom.store import DiskStore, HostStore, StoreCorruptError, StoreFullError
from headroom.store import _recover as recover_mod
from headroom.store import _segments as seg
from tests.store._disk_files import edit_index, read_index

SECRET = bytes(range(64))


def _store(folder: Path) -> Path:
    """A closed store holding ``x`` (16 float32 ones); returns the path of x's file."""
    s = DiskStore(folder)
    f = s.file_of(s.put("x", torch.ones(16)))
    s.close()
    return f


def _edit_index(folder: Path, edit) -> None:
    edit_index(folder, edit)  # re-sealed: what is tested is the edited field


def _journal(folder: Path, *records: dict) -> None:
    """Append ``records`` to the folder's journal with the next sequence numbers, signed."""
    seq = read_index(folder)["seq"]
    with open(folder / "journal.jsonl", "ab") as f:
        for rec in records:
            seq += 1
            body = json.dumps({**rec, "s": seq}, separators=(",", ":")).encode()
            f.write(b"%08x %s\n" % (seg.crc(body), body))


# ---------------------------------------------------------------------- 8: symbolic links
@pytest.mark.parametrize("checksum", ["verify=False", "version 1 index", "null checksum"])
def test_symlink_where_a_tensor_file_was_is_refused_when_opening(tmp_path, checksum):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(SECRET)
    folder = tmp_path / "s"
    f = _store(folder)
    kw = {}
    if checksum == "verify=False":
        kw = {"verify": False}
    elif checksum == "version 1 index":
        _edit_index(folder, lambda d: d.update(
            version=1, format=None,
            tensors={"x": {k: v for k, v in d["tensors"]["x"].items() if k != "segments"}}))
    else:
        _edit_index(folder, lambda d: d["tensors"]["x"].update(segments=[[0, 64, None]]))
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(StoreCorruptError, match=rf"{f.name} \(the file of tensor 'x'\) is a"
                       r" symbolic link.*nothing was read or written through it.*recover=True"
                       ) as e:
        DiskStore(folder, **kw)
    assert e.value.keys == ("x",)
    assert outside.read_bytes() == SECRET and f.is_symlink()
    with pytest.raises(StoreCorruptError, match="symbolic link"):
        DiskStore(folder, recover=True, **kw)  # not damage to recover from: refused the same
    f.unlink()  # the fix the message names: remove the link, recover the tensor
    with pytest.warns(UserWarning, match="damaged"):
        s = DiskStore(folder, recover=True, **kw)
    with pytest.raises(StoreCorruptError, match="damaged"):
        s.read(s.get("x")).result()
    s.close()
    assert outside.read_bytes() == SECRET


@pytest.mark.parametrize("op", ["read", "write", "write_rows", "flush"])
def test_symlink_placed_while_open_is_never_read_or_written(tmp_path, op):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(SECRET)
    s = DiskStore(tmp_path / "s", verify_reads=False)
    h = s.put("x", torch.ones(16))
    hr = s.alloc("r", (4, 4), torch.float32)
    s.write_rows(hr, slice(1, 2), torch.ones(1, 4)).result()  # leaves unknown segments
    f = s.file_of(hr if op == "flush" else h)
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(StoreCorruptError, match="is a symbolic link"):
        if op == "read":
            s.read(h).result()
        elif op == "write":
            s.write(h, torch.full((16,), 7.0)).result()
        elif op == "write_rows":
            s.write_rows(h, slice(2, 5), torch.full((3,), 7.0)).result()
        else:
            s.flush()  # reads back the unknown segments of r to checksum them
    assert outside.read_bytes() == SECRET
    assert not s._ledger.inflight  # a refused write leaves no write in flight
    f.unlink()
    shutil.copyfile(outside, f)  # the fix the message names
    s.close()
    assert outside.read_bytes() == SECRET


# ---------------------------------------------------------------------- 10: sizes
def _bounded_file_crcs(monkeypatch, folder: Path) -> None:
    real = recover_mod.file_crcs

    def checked(ranges, pool, page_cache=True):
        for path, start, end in ranges:
            size = os.path.getsize(path) if os.path.exists(path) else 0
            assert 0 <= start <= end <= size, f"checksum pass over {path} {start}-{end}: {size}"
        return real(ranges, pool, page_cache)

    monkeypatch.setattr(recover_mod, "file_crcs", checked)


@pytest.mark.parametrize(("segments", "what"), [
    ([[0, 2**44, 123]], r"segment end of 'x' \(64 bytes\) 17592186044416"),
    ([[-8, 64, 123]], r"segment start of 'x' -8"),
    ([[0, 32, None], [16, 64, 5]], r"segment start of 'x' 16"),  # overlapping
    ([[0, 64.0, None]], r"segment end of 'x' \(64 bytes\) 64.0"),
    ([[0, 64, "fast"]], r"checksum segment of 'x'"),
    ([[0, 64, 2**40]], r"checksum segment of 'x'"),
])
def test_index_segment_outside_its_tensor_fails_before_reading(tmp_path, monkeypatch,
                                                               segments, what):
    folder = tmp_path / "s"
    _store(folder)
    _edit_index(folder, lambda d: d["tensors"]["x"].update(segments=segments))
    _bounded_file_crcs(monkeypatch, folder)
    with pytest.raises(StoreCorruptError, match=rf"index\.json has an invalid entry.*{what}"):
        DiskStore(folder)


def test_write_in_flight_beyond_its_tensor_or_to_a_freed_one(tmp_path, monkeypatch):
    folder = tmp_path / "s"
    _store(folder)
    _bounded_file_crcs(monkeypatch, folder)
    _edit_index(folder, lambda d: d.update(inflight={"7": {"op": "w", "k": "x", "s": 7,
                                                           "x": [[0, 2**44, 1]]}}))
    with pytest.raises(StoreCorruptError, match=r"write in flight to bytes beyond the end of 'x'"):
        DiskStore(folder)
    # A write in flight to a tensor that is gone has nothing left to check (raw KeyError before).
    _edit_index(folder, lambda d: d.update(inflight={"7": {"op": "w", "k": "gone", "s": 7,
                                                           "x": [[0, 4, 1]]}}))
    s = DiskStore(folder)
    assert torch.equal(s.read(s.get("x")).result(), torch.ones(16))
    s.close()


def test_journal_alloc_of_an_absent_file_larger_than_the_disk(tmp_path, monkeypatch):
    folder = tmp_path / "s"
    _store(folder)
    big = 1 << 48  # more than any disk this runs on
    _journal(folder, {"op": "alloc", "k": "big", "f": "000099-big.bin", "shape": [big // 4],
                      "dtype": "float32"})
    sizes = []
    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        sizes.append(length)
        if length > 1 << 20:  # never let a forged size reach the disk, fixed or not
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    before = sorted(os.listdir(folder))
    with pytest.raises(StoreFullError, match=r"'big' \(000099-big\.bin, 281474976710656 bytes\)"
                       r".*recover=True"):
        DiskStore(folder)
    assert sorted(os.listdir(folder)) == before and sizes == []  # nothing created or allocated
    with pytest.warns(UserWarning, match=r"dropped \(file missing, and too large for the disk\):"
                      r" 'big'"):
        s = DiskStore(folder, recover=True)
    assert s.keys() == ["x"] and torch.equal(s.read(s.get("x")).result(), torch.ones(16))
    s.close()
    s = DiskStore(folder)  # opens as usual from then on
    assert s.keys() == ["x"]
    s.close()
    assert all(n <= 1 << 20 for n in sizes)


@pytest.mark.parametrize(("record", "what"), [
    ({"op": "alloc", "k": "y", "f": "000005-y.bin", "shape": "12", "dtype": "float32"},
     "shape '12'"),
    ({"op": "alloc", "k": "y", "f": "000005-y.bin", "shape": [2.5], "dtype": "float32"},
     "dimension of 'y' 2.5"),
    ({"op": "alloc", "k": 5, "f": "000005-y.bin", "shape": [2], "dtype": "float32"},
     "key 5 is not a string"),
    ({"op": "alloc", "k": "y", "f": "../000005-y.bin", "shape": [2], "dtype": "float32"},
     "file name"),
    ({"op": "alloc", "k": "y", "f": "000001-x.bin", "shape": [2], "dtype": "float32"},
     "belongs to another tensor"),
    ({"op": "alloc", "k": "x", "f": "000005-y.bin", "shape": [2], "dtype": "float32"},
     "'x' is allocated twice"),
    ({"op": "alloc", "k": "y", "f": "9" * 30 + "-y.bin", "shape": [2], "dtype": "float32"},
     "file number"),
    ({"op": "w", "k": "x", "x": [[-8, 16, 1]]}, "write offset -8"),
    ({"op": "d", "id": 3, "r": "fine"}, "result 'fine'"),
])
def test_forged_journal_records_are_named(tmp_path, record, what):
    folder = tmp_path / "s"
    _store(folder)
    _journal(folder, record)
    with pytest.raises(StoreCorruptError, match=rf"journal\.jsonl record 1 is invalid.*{what}"):
        DiskStore(folder)


def test_deeply_nested_index_or_journal_is_corrupt_not_a_recursion_error(tmp_path):
    folder = tmp_path / "s"
    _store(folder)
    good = (folder / "index.json").read_bytes()
    (folder / "index.json").write_bytes(b"[" * 100_000)
    with pytest.raises(StoreCorruptError, match=r"index\.json is unreadable"):
        DiskStore(folder)
    (folder / "index.json").write_bytes(good)
    body = b"[" * 100_000
    (folder / "journal.jsonl").write_bytes(b"%08x %s\n" % (seg.crc(body), body) * 2)
    with pytest.raises(StoreCorruptError, match=r"journal\.jsonl record 1 is damaged"):
        DiskStore(folder)


def test_fifo_where_a_file_was_is_refused_without_blocking(tmp_path):
    folder = tmp_path / "s"
    f = _store(folder)
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(StoreCorruptError, match="is not a regular file"):
        DiskStore(folder, verify=False)
    f.unlink()
    (folder / "journal.jsonl").unlink()
    os.mkfifo(folder / "journal.jsonl")
    with pytest.raises(StoreCorruptError, match=r"journal\.jsonl is not a regular file"):
        DiskStore(folder)


# ---------------------------------------------------------------------- 7: arguments
@pytest.mark.parametrize(("kw", "err", "what"), [
    ({"threads": -4}, ValueError, r"threads must be >= 1.*got -4"),
    ({"threads": 0}, ValueError, r"threads must be >= 1"),
    ({"threads": 2.5}, TypeError, r"threads must be an int"),
    ({"threads": "4"}, TypeError, r"threads must be an int"),
    ({"max_bytes": "1GB"}, TypeError, r"max_bytes must be an int number of bytes.*64 << 30"),
    ({"max_bytes": 1e9}, TypeError, r"max_bytes must be an int"),
    ({"max_bytes": -1}, ValueError, r"max_bytes must be >= 0"),
    ({"verify": "no"}, TypeError, r"verify must be True or False"),
    ({"page_cache": None}, TypeError, r"page_cache must be True or False"),
    ({"verify_reads": 1}, TypeError, r"verify_reads must be True or False \(or None\)"),
])
def test_diskstore_arguments_are_validated(tmp_path, kw, err, what):
    with pytest.raises(err, match=what):
        DiskStore(tmp_path / "s", **kw)
    assert not (tmp_path / "s").exists() or not os.listdir(tmp_path / "s")


def test_hoststore_max_bytes_is_validated():
    with pytest.raises(TypeError, match=r"HostStore max_bytes must be an int"):
        HostStore(max_bytes="1GB")


def test_valid_arguments_still_open(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = DiskStore(tmp_path / "s", threads=1, max_bytes=1 << 20, verify_reads=None)
    s.put("x", torch.ones(3))
    s.close()


def test_tensor_file_truncated_while_open_is_named(tmp_path):
    s = DiskStore(tmp_path / "s")
    h = s.put("x", torch.ones(16))
    os.truncate(s.file_of(h), 10)
    with pytest.raises(StoreCorruptError, match=r"'x' \(000001-x\.bin, bytes 0-64\): the file"
                       r" is shorter than the tensor"):
        s.read(h).result()
    s.close()


def test_directory_named_like_a_tensor_file_is_left_alone(tmp_path):
    folder = tmp_path / "s"
    _store(folder)
    (folder / "000777-mine.bin").mkdir()
    s = DiskStore(folder)
    assert s.keys() == ["x"] and (folder / "000777-mine.bin").is_dir()
    s.close()
