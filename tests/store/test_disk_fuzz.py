"""Fuzzing a DiskStore's index and journal: mutated bytes and fields of a real store's files, then
reopen, read, write and close. Only the documented errors, nothing opened outside the folder or
through a link, nothing allocated beyond what the disk was said to hold."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from headroom.store import DiskStore, StoreCorruptError, StoreFullError
from headroom.store import _segments as seg
from tests.store._disk_files import read_index, sealed

SECRET = bytes(range(256)) * 4
FREE = 8 << 20  # what the disk is said to have free while fuzzing
ALLOWED = (StoreCorruptError, StoreFullError, FileExistsError)


def _base(root: Path) -> dict[str, Path]:
    """Two real folders: one closed cleanly, one as a kill would leave it (journal records of
    allocations, whole and row writes and a free after its last snapshot)."""
    closed = root / "closed"
    s = DiskStore(closed, threads=2)
    s.put("a", torch.arange(32.0).reshape(8, 4))
    s.put("b", torch.arange(6))
    r = s.alloc("r", (10, 3), torch.float32)
    s.write_rows(r, slice(2, 5), torch.ones(3, 3)).result()
    s.alloc("z", (5,), torch.int16)
    s.close()
    live = root / "live"
    s = DiskStore(live, threads=2)
    s.put("a", torch.arange(32.0).reshape(8, 4))
    s.put("b", torch.arange(6))
    r = s.alloc("r", (10, 3), torch.float32)
    s.flush()
    s.write_rows(r, slice(2, 5), torch.ones(3, 3)).result()
    s.write(s.get("a"), torch.full((8, 4), 5.0)).result()
    s.free(s.get("b"))
    s.put("c", torch.ones(2, 2, dtype=torch.bfloat16))
    shutil.copytree(live, root / "live-snap", ignore=shutil.ignore_patterns("diskstore.lock"))
    s.close()
    return {"closed": closed, "live": root / "live-snap"}


# ---------------------------------------------------------------------- mutations
NAMES = ["../outside.bin", "/tmp/outside.bin", "000001-a.bin", "000002-b.bin", "000003-r.bin",
         "000099-new.bin", "9" * 40 + "-x.bin", "a", "bad", "ok", "none", "w", "d", "alloc",
         "free", "float32", "bool", "complex128", "headroom-scratch/x", ""]
VALUES = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 3, 4, 63, 64, 2**31, 2**32, 2**44, 2**48, 2**63, 2**64, 10**30]),
    st.integers(-(2**70), 2**70), st.floats(), st.sampled_from(NAMES), st.text(max_size=8),
    st.lists(st.integers(-(2**50), 2**50), max_size=4),
    st.lists(st.lists(st.one_of(st.integers(-4, 2**45), st.none()), min_size=3, max_size=3),
             max_size=3),
    st.dictionaries(st.sampled_from(["k", "x", "op", "s", "f", "shape"]), st.integers(),
                    max_size=3),
)


def _paths(obj, prefix=()):
    """Every path into a JSON value (dict keys, list indices), the root included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _set(obj, path, value, delete: bool):
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


def _sign(rec) -> bytes:
    body = json.dumps(rec, separators=(",", ":")).encode()
    return b"%08x %s\n" % (seg.crc(body), body)


@st.composite
def mutation(draw):
    kind = draw(st.sampled_from(["index field", "journal field", "journal append",
                                 "journal line", "bytes", "file"]))
    return kind, draw(st.randoms(use_true_random=False)), draw(VALUES)


def _apply(folder: Path, kind: str, rnd, value, outside: Path) -> None:
    index, journal = folder / "index.json", folder / "journal.jsonl"
    if kind == "index field":  # re-sealed, so that the field itself is what is checked
        data = read_index(folder)
        path = rnd.choice(list(_paths(data)))
        index.write_bytes(sealed(_set(data, path, value, path != () and rnd.random() < .2)))
    elif kind in ("journal field", "journal line"):
        lines = journal.read_bytes().splitlines(keepends=True)
        if not lines:
            return
        i = rnd.randrange(len(lines))
        if kind == "journal line":  # drop, repeat or swap a whole record
            j = rnd.randrange(len(lines))
            op = rnd.choice(["drop", "repeat", "swap"])
            if op == "drop":
                del lines[i]
            elif op == "repeat":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
        else:
            rec = json.loads(lines[i][9:])
            path = rnd.choice(list(_paths(rec)))
            lines[i] = _sign(_set(rec, path, value, path != () and rnd.random() < .2))
        journal.write_bytes(b"".join(lines))
    elif kind == "journal append":
        seq = json.loads(index.read_text()).get("seq", 0)
        n = sum(1 for _ in journal.read_bytes().splitlines()) if journal.exists() else 0
        rec = rnd.choice([
            {"op": "alloc", "k": "new", "f": "000099-new.bin", "shape": [value],
             "dtype": "float32"},
            {"op": "alloc", "k": "new", "f": value, "shape": [4], "dtype": "float32"},
            {"op": "w", "k": rnd.choice(["a", "r", "c", "new"]), "x": [[0, value, 1]]},
            {"op": "w", "k": "a", "x": [[value, 8, None]]},
            {"op": "d", "id": value, "r": "ok"},
            {"op": "free", "k": value},
            {"op": value, "k": "a"},
        ])
        rec["s"] = seq + n + 1 if isinstance(seq, int) else 1
        with open(journal, "ab") as f:
            f.write(_sign(rec))
    elif kind == "bytes":
        f = rnd.choice([index, journal])
        raw = bytearray(f.read_bytes()) if f.exists() else bytearray()
        pos = rnd.randrange(len(raw) + 1)
        op = rnd.choice(["flip", "truncate", "insert", "delete", "nest"])
        if op == "flip" and raw:
            raw[min(pos, len(raw) - 1)] ^= 1 << rnd.randrange(8)
        elif op == "truncate":
            del raw[pos:]
        elif op == "insert":
            raw[pos:pos] = rnd.randbytes(rnd.randrange(1, 9))
        elif op == "delete":
            del raw[pos:pos + rnd.randrange(1, 9)]
        else:
            raw = bytearray(b"[" * 50_000)
        f.write_bytes(bytes(raw))
    else:  # what stands where a tensor file was
        files = sorted(folder.glob("*.bin"))
        if not files:
            return
        f = rnd.choice(files)
        op = rnd.choice(["symlink", "fifo", "dir", "delete", "truncate", "grow", "symlink index"])
        if op == "symlink index":
            index.unlink()
            index.symlink_to(outside)
            return
        f.unlink()
        if op == "symlink":
            f.symlink_to(outside)
        elif op == "fifo":
            os.mkfifo(f)
        elif op == "dir":
            f.mkdir()
        elif op == "truncate":
            f.write_bytes(b"\0" * rnd.randrange(4))
        elif op == "grow":
            f.write_bytes(b"\1" * 4096)


# ---------------------------------------------------------------------- the watch
class _Watch:
    """Fails the example if the store opens anything outside ``folder`` or through a link, or
    allocates more than the disk was said to have free."""

    def __init__(self, monkeypatch) -> None:
        self.folder: str | None = None
        self.errors: list[str] = []
        real_open, real_falloc = os.open, os.posix_fallocate
        usage = collections.namedtuple("usage", "total used free")

        def watched_open(path, flags, mode=0o777, *, dir_fd=None):
            if self.folder is not None and dir_fd is None:
                p = os.path.abspath(os.fspath(path))
                if os.path.dirname(p) != self.folder and p != self.folder:
                    self.errors.append(f"opened {p} outside the folder")
                elif p != self.folder and os.path.islink(p) and not flags & os.O_NOFOLLOW:
                    self.errors.append(f"opened {p}, a symbolic link, following it")
            return real_open(path, flags, mode, dir_fd=dir_fd)

        def watched_fallocate(fd, offset, length):
            if self.folder is not None and offset + length > FREE:
                self.errors.append(f"posix_fallocate of {offset + length} bytes")
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_falloc(fd, offset, length)

        monkeypatch.setattr(os, "open", watched_open)
        monkeypatch.setattr(os, "posix_fallocate", watched_fallocate)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, FREE))


def _exercise(folder: Path, verify: bool, recover: bool) -> None:
    """Open, read every tensor, write one, flush and close; only documented errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            s = DiskStore(folder, threads=2, verify=verify, recover=recover)
        except ALLOWED as e:
            event(f"refused: {type(e).__name__}")
            return
    event("opened")
    try:
        for key in s.keys():  # noqa: SIM118 - a Store is not iterable
            with contextlib.suppress(StoreCorruptError):
                s.read(s.get(key)).result()
        keys = s.keys()
        if keys:
            h = s.get(keys[0])
            s.write(h, torch.zeros(h.shape, dtype=h.dtype)).result()
        s.put("fresh", torch.ones(3))
        s.flush()
    finally:
        with contextlib.suppress(StoreCorruptError):
            s.close()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return _base(tmp_path_factory.mktemp("fuzz-bases"))


@settings(max_examples=200, deadline=10_000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(base=st.sampled_from(["closed", "live"]), mutations=st.lists(mutation(), min_size=1,
                                                                   max_size=3),
       verify=st.booleans(), recover=st.booleans())
def test_fuzzed_index_and_journal(bases, tmp_path, monkeypatch, base, mutations, verify,
                                  recover):
    watch = _Watch(monkeypatch)
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        outside = work / "outside.bin"
        outside.write_bytes(SECRET)
        folder = work / "store"
        shutil.copytree(bases[base], folder)
        for kind, rnd, value in mutations:
            # A mutation that an earlier one made impossible (the JSON is no longer JSON) is
            # skipped.
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError,
                                     IndexError, OSError, RecursionError):
                _apply(folder, kind, rnd, value, outside)
        watch.folder = str(folder)
        try:
            _exercise(folder, verify, recover)
        finally:
            watch.folder = None
        assert not watch.errors, watch.errors
        assert outside.read_bytes() == SECRET
    finally:
        shutil.rmtree(work, ignore_errors=True)
