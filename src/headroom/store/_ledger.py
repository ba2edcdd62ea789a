"""What a `DiskStore` folder holds: an index snapshot, an append-only journal and a lock file.

[Note: DiskStore journal]
The folder's metadata is ``index.json`` (a snapshot: tensors, files, checksum segments, writes
in flight, files freed and perhaps not unlinked yet, its sequence number, whether its session
closed) plus ``journal.jsonl`` (records after it, one per line: ``<crc32c hex> <json>``, each
with the next sequence number). The index ends with ``"crc":"xxxxxxxx"``, the CRC32C of its
bytes without that field, checked before parsing (versions 1 and 2 had none and still open). No
object in either may name a key twice. The store journals an ``alloc`` before creating a file,
a ``free`` before unlinking it, an ``x`` when tensors exchange files (one record for all pairs),
and each write twice: ``w`` with the CRC of every extent before the first byte goes out, ``d``
(``ok``, ``none`` written, or ``bad`` = failed part-way) after the last. Reopening replays the
journal over the snapshot; a ``w`` without its ``d`` is checked against the file (new bytes, old
bytes, or torn). A last record without its newline was cut short by a kill and is ignored; one
with it that fails its CRC was damaged later and is refused. Every tensor file in the folder is
accounted for: an entry owns it, or a recorded ``free`` lets opening remove it; any other is
refused, never deleted (it may be a tensor whose entry was lost). Appends are not fsynced (a
killed process's writes reach the disk from the page cache); `DiskStore.flush` fsyncs data and
index, so after a power loss the store is safe as of the last flush (a file allocated after it
whose record was lost is refused as unaccounted). Compaction (index written via tmp + fsync +
rename, then the journal truncated) holds the ledger lock, so no record falls between the two;
it runs once the journal is past `COMPACT_BYTES` and twice the index, except while journal space
is reserved (`Ledger.reserve`), and then when the reservation ends.

[Note: DiskStore files stay inside the folder]
Every file a store opens is ``<folder>/<name>`` with a name it made itself (``NNNNNN-*.bin``
names from the index are checked against that pattern: no ``/``, so no ``..`` or absolute
path), opened with `open_file`: ``O_NOFOLLOW`` (a symbolic link is refused, not followed) and
only a regular file (a FIFO or device is refused without blocking). Every size and offset read
from the index or journal is checked against the tensor's size before use, and a tensor's size
against its file or the disk's free space before anything is read or allocated.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import json
import os
import re
import stat
import threading
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from headroom.store._safetensors import DuplicateKey, open_regular, unique_keys
from headroom.store._segments import BAD, Segments, crc, put, zeros_crc
from headroom.store._store import SCRATCH, StoreCorruptError

__all__ = ["DTYPES", "INDEX", "JOURNAL", "LOCK", "Ledger", "forked_error", "fsync",
           "is_store_file", "not_regular", "open_file"]

INDEX = "index.json"
JOURNAL = "journal.jsonl"
LOCK = "diskstore.lock"
_FORMAT = "headroom.DiskStore"
_BIN = re.compile(r"\d{6,}-[A-Za-z0-9_.-]*\.bin")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}
# NOTE: compaction rewrites the whole index, so it waits until the journal is past a fixed size
# and twice the index: amortized, journaling stays linear in the records written.
COMPACT_BYTES = 4 << 20
MAX_EXTENTS = 32  # a write of more row runs records one unknown span instead of a CRC each
# Bounds far above anything real on numbers read from the index or journal: a damaged value is
# refused before it sizes a loop, a table or a file name.
MAX_TENSOR_BYTES = 1 << 60
MAX_COUNTER = 10**12
_NAME_MAX = 200
_VERSION = 3  # the index version written; 1 and 2 (no checksum of their own) are still read
# Version 3 ends with the CRC32C of the index's bytes without this field (see the Note).
_SEAL = re.compile(rb',"crc":"([0-9a-f]{8})"\}\Z')
_SEAL_BYTES = 18  # len(b',"crc":"xxxxxxxx"}')


def _loads(raw: bytes):
    """JSON of the index or a journal record; a key named twice is refused (a damaged name may
    have become another tensor's, whose entry the parser would silently replace)."""
    return json.loads(raw, object_pairs_hook=unique_keys)


def _seal(body: bytes) -> bytes:
    """``body`` (a JSON object) with its CRC32C added as its last field."""
    return body[:-1] + b',"crc":"%08x"}' % crc(body)


def _unseal(raw: bytes) -> tuple[bytes, bool | None]:
    """``(body, ok)``: the index without its checksum field, and whether it matches (or None)."""
    m = _SEAL.search(raw, max(0, len(raw) - _SEAL_BYTES))
    if m is None:
        return raw, None
    body = raw[:-_SEAL_BYTES] + b"}"
    return body, m.group(1) == b"%08x" % crc(body)


def seg_cap(nbytes: int) -> int:
    """Most checksum segments kept per tensor: enough for one per 4 MiB slice written."""
    return max(64, nbytes >> 22)


def is_store_file(name: str) -> bool:
    """Whether ``name`` is one of the files a DiskStore creates in its folder."""
    return name in (INDEX, INDEX + ".tmp", JOURNAL, LOCK) or _BIN.fullmatch(name) is not None


def open_file(path: str | os.PathLike, flags: int, mode: int = 0o644, *,
              key: str | None = None) -> int:
    """``os.open`` of a regular file in a store's folder, never through a symbolic link (see
    [Note: DiskStore files stay inside the folder]); `StoreCorruptError` otherwise."""
    try:
        return open_regular(path, flags=flags | os.O_NOFOLLOW, mode=mode,
                            refuse=lambda: not_regular(path, "is not a regular file", key))
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise not_regular(path, "is a symbolic link", key) from None


def not_regular(path: str | os.PathLike, what: str, key: str | None) -> StoreCorruptError:
    path = os.fspath(path)
    folder, name = os.path.split(path)
    whose = f" (the file of tensor {key!r})" if key is not None else ""
    return StoreCorruptError(
        f"DiskStore {folder!r}: {name}{whose} {what}; a DiskStore uses only regular files in its"
        " folder, never a link, and nothing was read or written through it. Put the file itself"
        f" there (e.g. cp --remove-destination \"$(readlink -f {path})\" {path}), or delete it"
        " and open the store with recover=True (the tensor reads as damaged until written"
        " again, e.g. by hr.load(checkpoint, model, optimizer))", folder,
        (key,) if key is not None else ())


def _read_meta(path: Path) -> bytes | None:
    """The bytes of the index or journal (``None`` when absent), through `open_file`."""
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        return f.read()


def forked_error(what: str, pid: int) -> RuntimeError:
    return RuntimeError(
        f"{what} was opened in process {pid} and is used here in process {os.getpid()}, a child"
        " forked from it (os.fork, multiprocessing's fork start method, a DataLoader worker),"
        " which has none of its I/O threads and does not own its folder. Use the store only in"
        " the process that opened it: keep offloaded models out of worker processes, or open a"
        " DiskStore on a folder of the child's own")


def fsync(path: str | os.PathLike, *, folder: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY) if folder else open_file(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _corrupt(path: Path, file: Path, what: str, *, recover: bool = False
             ) -> StoreCorruptError:
    """The metadata ``file`` is broken; the fixes (``recover``: recover=True is one)."""
    skip = (" Open it with DiskStore(path, recover=True) to skip that record (its change is"
            " lost; a warning says so), then hr.load(checkpoint, model, optimizer);"
            if recover else "")
    return StoreCorruptError(
        f"DiskStore {str(path)!r}: {file.name} {what}. The folder was not changed.{skip}"
        " Restore the folder from a backup, or start over: DiskStore(path, overwrite=True)"
        " (deletes only the store's files), hr.offload the model into it and"
        " hr.load(checkpoint, model, optimizer)", str(path))


@contextlib.contextmanager
def _refused(path: Path, file: Path, what: str) -> Iterator[None]:
    """A malformed value met inside raises `_corrupt` naming ``file``, ``what`` and the value."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _corrupt(path, file, f"{what} ({e!r})") from None


def _not_writable(path: Path, e: OSError) -> PermissionError:
    return PermissionError(
        f"DiskStore path {str(path)!r} is not writable ({e.strerror or e}); pass a directory"
        " you can write to, e.g. on a local disk with free space")


def _acquire(path: Path) -> int:
    """Open and lock the folder's lock file (released by the OS when the process dies)."""
    try:
        fd = open_file(path / LOCK, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise _not_writable(path, e) from e
    for attempt in range(2):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            if not isinstance(e, BlockingIOError):  # a file system without flock
                warnings.warn(
                    f"DiskStore cannot lock {str(path)!r} ({e.strerror or e}); nothing stops a"
                    " second store from opening the folder, so open it from one place only",
                    UserWarning, stacklevel=4)
                break
            raw = os.pread(fd, 32, 0).decode(errors="replace").strip()
            holder = int(raw) if raw.isdigit() else None
            if holder == os.getpid() and attempt == 0:
                gc.collect()  # an unreachable store's finalizer releases its lock
                continue
            os.close(fd)
            who = ("this process (another DiskStore object: close() it first)"
                   if holder == os.getpid() else
                   f"process {holder}" if holder else "another process")
            raise RuntimeError(
                f"DiskStore folder {str(path)!r} is already open in {who}; a folder serves one"
                " store at a time: close the other store, or give this one another folder"
            ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _int(v, what: str, *, lo: int = 0, hi: int | None = None) -> int:
    """``v`` if it is an int (not a bool) in ``[lo, hi]``; else `ValueError` naming ``what``."""
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise ValueError(f"{what} {v!r}")
    return v


def _segments(key: str, segs, nbytes: int) -> Segments:
    """Checked checksum segments of ``key``: sorted, disjoint, inside ``[0, nbytes)``."""
    if not isinstance(segs, list):
        raise TypeError(f"segments of {key!r} are not a list")
    out: Segments = []
    end = 0
    for seg in segs:
        if not isinstance(seg, list) or len(seg) != 3:
            raise ValueError(f"checksum segment {seg!r} of {key!r}")
        s, t, c = seg
        _int(s, f"segment start of {key!r}", lo=end)
        _int(t, f"segment end of {key!r} ({nbytes} bytes)", lo=s + 1, hi=nbytes)
        if c is not None and c != BAD:
            _int(c, f"checksum segment of {key!r}", hi=0xFFFFFFFF)
        out.append([s, t, c])
        end = t
    return out


def _write_record(rec) -> dict:
    """A checked ``w`` record: key, and extents ``[offset, length, crc or None]``."""
    if not isinstance(rec, dict) or not isinstance(rec.get("k"), str) \
            or not isinstance(rec.get("x"), list):
        raise ValueError(f"write record {rec!r}")
    for x in rec["x"]:
        if not isinstance(x, list) or len(x) != 3:
            raise ValueError(f"extent {x!r} of a write to {rec['k']!r}")
        _int(x[0], "write offset", hi=MAX_TENSOR_BYTES)
        _int(x[1], "write length", hi=MAX_TENSOR_BYTES)
        if x[2] is not None:
            _int(x[2], "write checksum", hi=0xFFFFFFFF)
    return rec


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
except (OSError, AttributeError):  # no libc fallocate: journal space is not reserved
    _LIBC = None


def _keep_size_fallocate(fd: int, offset: int, length: int) -> None:
    """Allocate blocks of ``fd`` past its end without changing its size (Linux
    ``FALLOC_FL_KEEP_SIZE``), for appends to land in; elsewhere nothing is reserved."""
    if _LIBC is None or length <= 0:
        return
    if _LIBC.fallocate(fd, 1, offset, length) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(err, os.strerror(err) + " (journal)")


def _scratch(rec: dict) -> bool:
    """Whether a journal record changes a scratch key (a ``"d"`` counts with its write)."""
    if rec.get("op") == "x":
        pairs = rec.get("pairs")
        return isinstance(pairs, list) and all(
            str(k).startswith(SCRATCH) for p in pairs if isinstance(p, list) for k in p)
    return str(rec.get("k", "")).startswith(SCRATCH)


_OPEN: weakref.WeakSet[Ledger] = weakref.WeakSet()  # ledgers of this process's stores


def _after_fork_in_child() -> None:
    # A forked child's copies of the lock and journal descriptors are closed at once: the lock
    # dies with the process that opened the store, and the child cannot append to its journal.
    for ledger in list(_OPEN):
        ledger.lock = threading.Lock()  # perhaps held by another thread of the parent
        ledger.release()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Ledger:
    """The folder's metadata in memory and on disk. See [Note: DiskStore journal].

    Each change updates memory and appends its journal record under one lock. No reference to
    the store, so the store's finalizer can close it.
    """

    def __init__(self, path: Path, lock_fd: int, *, recover: bool = False) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}  # key -> file, shape, dtype, nbytes, segments
        self._files: set[str] = set()  # the entries' file names
        self.freed: set[str] = set()  # freed (journaled), perhaps not unlinked: `unaccounted`
        self.recover = recover
        self.skipped: int | None = None  # a damaged last journal record skipped (recover)
        self.inflight: dict[int, dict] = {}  # seq of a "w" record -> the record
        self.seq = 0
        self.counter = 0
        self.was_clean = True  # the last session closed (as found when opening)
        self.had_writes = False  # it changed something after its last flush
        self.dirty = False
        self.lock = threading.Lock()
        self._lock_fd = lock_fd
        self._jfd = -1
        self._jbytes = 0
        self._index_bytes = 0
        self._held = 0  # journal bytes reserved for writes promised not to fail (see `reserve`)
        self._reserved_to = 0  # the journal's blocks are allocated up to this offset
        self._pid = os.getpid()
        _OPEN.add(self)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: Path, *, overwrite: bool, recover: bool = False) -> Ledger:
        """Create and lock the folder and read its metadata (nothing in it is changed yet).
        With ``recover`` a damaged last journal record is skipped (`skipped`), not refused.

        Raises:
            PermissionError: the folder cannot be created or written.
            FileExistsError: a non-empty folder that is not a DiskStore's (without ``overwrite``).
            RuntimeError: the folder is open in another store.
            StoreCorruptError: the index or the journal cannot be read.
        """
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _not_writable(path, e) from e
        names = [n for n in os.listdir(path) if not n.startswith(".")]
        ours = {INDEX, JOURNAL, LOCK} & set(names)
        if names and not ours and not overwrite:
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise FileExistsError(
                f"DiskStore folder {str(path)!r} is not empty ({shown}) and holds no DiskStore"
                " index or journal. Pass an empty or new directory, or overwrite=True to delete"
                " the DiskStore files there (index, journal, lock, NNNNNN-*.bin; others stay)")
        fd = _acquire(path)
        ledger = cls(path, fd, recover=recover)
        try:
            if overwrite:
                for n in os.listdir(path):
                    if is_store_file(n) and n != LOCK:
                        os.unlink(path / n)
            ledger._load()
        except BaseException:
            ledger.release()
            raise
        return ledger

    def _load(self) -> None:
        index = self.path / INDEX
        data = None
        raw = _read_meta(index)
        if raw is not None:
            body, sealed = _unseal(raw)
            if sealed is False:
                raise _corrupt(self.path, index, "does not match its checksum (damaged on disk"
                               " or edited)")
            try:
                data = _loads(body)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except DuplicateKey as e:
                raise _corrupt(self.path, index, f"is damaged or edited: {e}") from None
            except (ValueError, RecursionError) as e:
                raise _corrupt(self.path, index, f"is unreadable, truncated or garbled ({e})")\
                    from None
            if data.get("format") != _FORMAT and not (
                    data.get("version") == 1 and isinstance(data.get("tensors"), dict)):
                raise FileExistsError(
                    f"DiskStore folder {str(self.path)!r} holds an index.json that is not a"
                    " DiskStore's; use another folder (or overwrite=True, which deletes it)")
            if sealed is None and data.get("version") not in (1, 2):
                # Versions 1 and 2 had no checksum; a later one without it lost it to damage.
                raise _corrupt(self.path, index, f"has no valid checksum field (version"
                               f" {data.get('version')!r} ends with one; damaged or edited)")
            with _refused(self.path, index, "has an invalid entry"):
                self._load_index(data)
        replayed = self._replay()
        if data is None and not replayed and any(
                _BIN.fullmatch(n) for n in os.listdir(self.path)):
            raise _corrupt(self.path, index, "is missing while tensor files are present")
        for rid, w in list(self.inflight.items()):
            e = self.entries.get(w["k"])
            if e is None:  # its tensor was freed since: nothing to check
                del self.inflight[rid]
            elif any(off + length > e["nbytes"] for off, length, _ in w["x"]):
                raise _corrupt(self.path, index, f"or {JOURNAL} has a write in flight to bytes"
                               f" beyond the end of {w['k']!r} ({e['nbytes']} bytes)")
        data = data or {}
        self.was_clean = bool(data.get("clean", True)) and not replayed and not self.inflight
        self.had_writes = bool(data.get("dirty", False)) or any(
            r["op"] in ("alloc", "free", "w", "x") and not _scratch(r) for r in replayed)

    def _load_index(self, data: dict) -> None:
        self.seq = _int(data.get("seq", 0), "sequence number")
        self.counter = _int(data.get("counter", 0), "file counter", hi=MAX_COUNTER)
        tensors = data["tensors"]
        if not isinstance(tensors, dict):
            raise TypeError(f"tensors is a {type(tensors).__name__}, not an object")
        for key, e in tensors.items():
            if not isinstance(e, dict):
                raise TypeError(f"entry of {key!r} is not an object")
            entry = self._entry(key, e["file"], e["shape"], e["dtype"])
            if "segments" in e:  # version 1 indexes had no checksums
                entry["segments"] = _segments(key, e["segments"], entry["nbytes"])
            else:
                entry["segments"] = [[0, entry["nbytes"], None]] if entry["nbytes"] else []
            self.entries[key] = entry
        inflight = data.get("inflight", {})
        if not isinstance(inflight, dict):
            raise TypeError("inflight is not an object")
        for rid, rec in inflight.items():
            self.inflight[_int(int(rid), "write id")] = _write_record(rec)
        freed = data.get("freed", [])
        if not isinstance(freed, list):
            raise TypeError("freed is not a list")
        for file in freed:
            self._file_name(file, "freed file")
            if file in self._files:
                raise ValueError(f"file {file!r} is both freed and a tensor's")
            self.freed.add(file)

    def _file_name(self, file, what: str) -> None:
        """Check a tensor file name (see [Note: DiskStore files stay inside the folder]); later
        allocations are numbered after it."""
        if not isinstance(file, str) or len(file) > _NAME_MAX or _BIN.fullmatch(file) is None:
            raise ValueError(f"{what} {file!r}")
        counter = _int(int(file.split("-", 1)[0]), f"file number in {what} {file!r}",
                       hi=MAX_COUNTER)
        self.counter = max(self.counter, counter)

    def _entry(self, key: str, file: str, shape: list, dtype: str) -> dict:
        if not isinstance(key, str):
            raise TypeError(f"key {key!r} is not a string")
        if key in self.entries:
            raise ValueError(f"{key!r} is allocated twice")
        self._file_name(file, f"file name of {key!r}")
        if file in self._files:
            raise ValueError(f"file {file!r} of {key!r} belongs to another tensor too")
        if file in self.freed:
            raise ValueError(f"file {file!r} of {key!r} was freed before")
        if not isinstance(shape, list) or not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"shape {shape!r} / dtype {dtype!r} of {key!r}")
        n = DTYPES[dtype].itemsize
        for s in shape:
            n *= _int(s, f"dimension of {key!r}", hi=MAX_TENSOR_BYTES)
            if n > MAX_TENSOR_BYTES:
                raise ValueError(f"shape {shape} of {key!r}: more than {MAX_TENSOR_BYTES} bytes")
        self._files.add(file)
        return {"file": file, "shape": list(shape), "dtype": dtype, "nbytes": n}

    def _replay(self) -> list[dict]:
        """Apply the journal's records after the snapshot; returns them."""
        journal = self.path / JOURNAL
        raw = _read_meta(journal)
        if raw is None:
            return []
        lines = raw.split(b"\n")
        records, bad = [], None
        for no, line in enumerate(lines, 1):
            if not line:
                continue
            if bad is not None:  # a damaged record with good ones after it
                raise _corrupt(self.path, journal, f"record {bad} is damaged (its checksum or"
                               " JSON does not match) and later records exist")
            body = line[9:]
            try:
                if line[8:9] != b" " or int(line[:8], 16) != crc(body):
                    raise ValueError("checksum")
                rec = _loads(body)
            except DuplicateKey as e:
                raise _corrupt(self.path, journal, f"record {no} is invalid ({e})") from None
            except (ValueError, RecursionError):
                bad = no
                # A last record cut short by a kill lacks its newline: ignored (see the Note).
                if no < len(lines) and not any(lines[no:]):
                    if not self.recover:
                        raise _corrupt(self.path, journal, (
                            f"record {no} (the last) is damaged: its checksum or JSON does not"
                            " match, and it is whole (ends with its newline): no kill tore it"),
                            recover=True) from None
                    self.skipped = no
                continue
            s = rec.get("s") if isinstance(rec, dict) else None
            if type(s) is not int:
                raise _corrupt(self.path, journal, f"record {no} has no sequence number")
            if s <= self.seq:
                continue  # already in the index (stopped between the rename and truncation)
            if s != self.seq + 1:
                raise _corrupt(self.path, journal, f"record {no} has sequence number {s}, "
                               f"expected {self.seq + 1} (records are missing)")
            with _refused(self.path, journal, f"record {no} is invalid"):
                self._apply(rec)
            self.seq = s
            records.append(rec)
        return records

    def _apply(self, rec: dict) -> None:
        op = rec["op"]
        if op == "alloc":
            e = self._entry(rec["k"], rec["f"], rec["shape"], rec["dtype"])
            n = e["nbytes"]
            e["segments"] = [[0, n, zeros_crc(n)]] if n else []
            self.entries[rec["k"]] = e
        elif op == "free":
            if not isinstance(rec["k"], str):
                raise TypeError(f"key {rec['k']!r} is not a string")
            e = self.entries.pop(rec["k"], None)
            if e is not None:
                self._files.discard(e["file"])
                self.freed.add(e["file"])  # unlinked after this record: perhaps not yet
            # A write whose end was never journaled (the record failed) dies with its file.
            for rid in [r for r, w in self.inflight.items() if w["k"] == rec["k"]]:
                del self.inflight[rid]
        elif op == "x":
            self._exchange(rec["pairs"])
        elif op == "w":
            self.inflight[rec["s"]] = _write_record(rec)
        elif op == "d":
            if rec["r"] not in ("ok", "none", "bad"):
                raise ValueError(f"result {rec['r']!r}")
            w = self.inflight.pop(_int(rec["id"], "write id"), None)
            if w is not None:
                self._settle(w, rec["r"])
        else:
            raise ValueError(f"unknown operation {op!r}")

    def _exchange(self, pairs, *, apply: bool = True) -> None:
        """Swap the files and checksums of each pair of keys, checked whole before any changes."""
        if not isinstance(pairs, list):
            raise TypeError(f"exchanged pairs {pairs!r} are not a list")
        seen: set[str] = set()
        for p in pairs:
            if not isinstance(p, list) or len(p) != 2 or not all(isinstance(k, str) for k in p):
                raise ValueError(f"exchanged pair {p!r}")
            a, b = (self.entries[k] for k in p)
            if (a["shape"], a["dtype"]) != (b["shape"], b["dtype"]) or p[0] == p[1] \
                    or seen & set(p):
                raise ValueError(f"exchanged pair {p!r}: not two tensors of one shape and dtype")
            seen.update(p)
        if not apply:
            return
        for ka, kb in pairs:
            a, b = self.entries[ka], self.entries[kb]
            for f in ("file", "segments"):
                a[f], b[f] = b[f], a[f]
            # A write whose end is not journaled went to a file, not to a name.
            for w in self.inflight.values():
                if w["k"] in (ka, kb):
                    w["k"] = kb if w["k"] == ka else ka

    def _settle(self, w: dict, result: str) -> None:
        e = self.entries.get(w["k"])
        if e is None or result == "none":
            return
        cap = seg_cap(e["nbytes"])
        for off, length, c in w["x"]:
            put(e["segments"], int(off), int(off) + int(length), BAD if result == "bad" else c,
                cap)

    # ------------------------------------------------------------------ changes
    def _append(self, rec: dict) -> int:
        """Journal ``rec`` with the next sequence number (caller holds ``lock``)."""
        rec["s"] = self.seq + 1
        body = json.dumps(rec, separators=(",", ":")).encode()
        line = b"%08x %s\n" % (crc(body), body)
        try:
            n = os.write(self._jfd, line)
            if n != len(line):  # a short write to a regular file: disk full
                raise OSError(28, "No space left on device (journal)")
        except OSError:
            # A torn line would make the journal unreadable: cut off, the record never happened.
            with contextlib.suppress(OSError):
                os.ftruncate(self._jfd, self._jbytes)
            self._reserved_to = min(self._reserved_to, self._jbytes)
            raise
        self.seq += 1
        self._jbytes += n
        self.dirty |= not _scratch(rec)  # no warning for scratch: see [Note: scratch keys]
        return self.seq

    def alloc(self, key: str, name: str, shape: tuple[int, ...], dtype: str) -> str:
        """Journal a new tensor; returns its file name (``NNNNNN-name.bin``)."""
        with self.lock:
            file = f"{self.counter + 1:06d}-{name}.bin"
            self._record({"op": "alloc", "k": key, "f": file, "shape": list(shape),
                          "dtype": dtype})
            return file

    def free(self, key: str) -> str:
        """Journal that ``key`` is freed; returns its file's name, to `remove` after."""
        with self.lock:
            name = self.entries[key]["file"]
            self._record({"op": "free", "k": key})
            return name

    def _record(self, rec: dict) -> None:
        """Journal ``rec``, then apply it (caller holds ``lock``)."""
        self._append(rec)
        self._apply(rec)
        self._maybe_compact()

    def exchange(self, pairs: list[tuple[str, str]]) -> None:
        """Journal and apply an exchange of the files of each pair of keys, in one record."""
        with self.lock:
            rec = {"op": "x", "pairs": [[a, b] for a, b in pairs]}
            self._exchange(rec["pairs"], apply=False)  # checked before it is journaled
            self._record(rec)

    def begin_write(self, key: str, extents: list[list]) -> int:
        """Journal a write about to start: ``[file offset, length, crc or None]`` each."""
        with self.lock:
            rec = {"op": "w", "k": key, "x": extents}
            rid = self._append(rec)
            self.inflight[rid] = rec
            return rid

    def end_write(self, rid: int, result: str) -> None:
        """``result``: ``"ok"``, ``"none"`` (nothing reached the file) or ``"bad"`` (part did)."""
        with self.lock:
            self._settle(self.inflight.pop(rid), result)
            self._append({"op": "d", "id": rid, "r": result})
            self._maybe_compact()

    def reserve(self, nbytes: int) -> None:
        """Allocate ``nbytes`` more of journal space now for the records of writes promised
        not to fail; `unreserve` ends the promise.

        Raises:
            OSError: the disk cannot hold them (``ENOSPC``); nothing was reserved.
        """
        with self.lock:
            want = self._jbytes + self._held + nbytes
            if want > self._reserved_to:
                _keep_size_fallocate(self._jfd, self._reserved_to, want - self._reserved_to)
                self._reserved_to = want
            self._held += nbytes

    def unreserve(self) -> None:
        """End every reservation; compact the journal if it grew past its threshold meanwhile."""
        with self.lock:
            self._held = 0
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Compact once the journal is past its threshold (caller holds ``lock``). Not while
        journal space is reserved (truncating would give the reserved blocks back):
        `unreserve` compacts then."""
        if self._jfd < 0 or self._held \
                or self._jbytes <= max(COMPACT_BYTES, 2 * self._index_bytes):
            return
        # NOTE: a compaction that fails (a full disk) leaves the journal valid; the next retries.
        with contextlib.suppress(OSError):
            self._compact(clean=False)

    def resolve(self, rid: int, result: str) -> None:
        """Settle a write found unfinished when opening (no record: the open snapshots)."""
        with self.lock:
            self._settle(self.inflight.pop(rid), result)

    def segments(self, key: str) -> Segments:
        with self.lock:
            return [list(s) for s in self.entries[key]["segments"]]

    def set_known(self, key: str, start: int, end: int, value: int) -> None:
        """Fill in the CRC of an unknown segment (computed from the file)."""
        with self.lock:
            e = self.entries.get(key)
            if e is not None and [start, end, None] in e["segments"]:
                put(e["segments"], start, end, value, seg_cap(e["nbytes"]))

    def forget_segments(self, key: str) -> None:
        """No checksum is known for ``key``'s bytes any more (a scratch key written unjournaled)."""
        with self.lock:
            e = self.entries.get(key)
            if e is not None:
                e["segments"] = []

    def drop(self, key: str) -> None:
        """Forget a tensor found unusable when opening (no record: the open snapshots)."""
        with self.lock:
            e = self.entries.pop(key)
            self._files.discard(e["file"])
            self.freed.add(e["file"])

    def mark_bad(self, key: str, start: int, end: int) -> None:
        with self.lock:
            e = self.entries[key]
            put(e["segments"], start, end, BAD, seg_cap(e["nbytes"]))

    # ------------------------------------------------------------------ snapshots
    def start(self) -> None:
        """Begin a session: snapshot the (recovered) state as not clean, open the journal."""
        self._jfd = open_file(self.path / JOURNAL, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.compact(clean=False, flushed=True)

    def compact(self, *, clean: bool, flushed: bool = False) -> None:
        """Write the index (atomically, fsynced) and empty the journal."""
        with self.lock:
            if flushed:
                self.dirty = False
            self._compact(clean=clean)

    def _compact(self, *, clean: bool) -> None:
        data = {"format": _FORMAT, "version": _VERSION, "seq": self.seq,
                "counter": self.counter, "clean": clean, "dirty": self.dirty,
                "tensors": self.entries,
                "inflight": {str(k): v for k, v in self.inflight.items()},
                "freed": sorted(self.freed)}
        blob = _seal(json.dumps(data, separators=(",", ":")).encode())
        tmp = self.path / (INDEX + ".tmp")
        fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path / INDEX)
        fsync(self.path, folder=True)
        os.ftruncate(self._jfd, 0)
        self._jbytes = 0
        self._reserved_to = 0
        self._index_bytes = len(blob)
        if self._held:  # a flush during a reservation: take the freed blocks back
            with contextlib.suppress(OSError):
                _keep_size_fallocate(self._jfd, 0, self._held)
                self._reserved_to = self._held

    def _loose(self) -> list[str]:
        """Names of tensor files in the folder (anything but a directory) no tensor owns."""
        return sorted(n for n in os.listdir(self.path)
                      if _BIN.fullmatch(n) and n not in self._files
                      and not stat.S_ISDIR(os.lstat(self.path / n).st_mode))

    def orphans(self) -> list[str]:
        """Files opening removes: freed tensors' files still there, and ``index.json.tmp``."""
        tmp = INDEX + ".tmp"
        left = [tmp] if os.path.lexists(self.path / tmp) \
            and not stat.S_ISDIR(os.lstat(self.path / tmp).st_mode) else []
        return left + [n for n in self._loose() if n in self.freed]

    def unaccounted(self) -> list[str]:
        """Tensor files in the folder no tensor or recorded free accounts for (`open_checks`)."""
        return [n for n in self._loose() if n not in self.freed]

    def remove(self, name: str) -> None:
        """Unlink ``name``, the file of a freed tensor (a directory there is left alone)."""
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(self.path / name)
        self.forget_freed(name)

    def forget_freed(self, name: str) -> None:
        """``name`` was never this store's file (an allocation found it there): not removed."""
        with self.lock:
            self.freed.discard(name)

    def release(self) -> None:
        """Close the journal and give up the folder's lock."""
        for attr in ("_jfd", "_lock_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def finish(self) -> None:
        """At garbage collection without `close` (no write is left): a clean snapshot, unlocked."""
        if os.getpid() != self._pid:
            return
        if self._jfd >= 0:
            with contextlib.suppress(OSError):
                self.compact(clean=True)
        self.release()
