"""Disk: tensors in files under a directory, read and written by background threads."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import torch

from headroom.store._handle import Handle
from headroom.store._ledger import DTYPES, MAX_EXTENTS, Ledger, forked_error, fsync, open_file
from headroom.store._pools import Pool, stop_pool
from headroom.store._recover import open_checks, range_crc
from headroom.store._safetensors import buffer_view, pread_into
from headroom.store._segments import BAD, combine, crc, scan
from headroom.store._store import SCRATCH, Store, StoreCorruptError, StoreFullError, done

__all__ = ["DiskStore"]


class _ShortFile(OSError):
    """A tensor file ended before the bytes a read needs (it was truncated since opening)."""


def _pwrite_from(fd: int, buf: memoryview, offset: int, written: list[int]) -> None:
    while len(buf):
        n = os.pwritev(fd, [buf], offset)
        written[0] += n
        buf = buf[n:]
        offset += n


def _runs(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """Consecutive runs of sorted row indices as ``(first_row, count, position_in_rows)``."""
    r = rows.tolist()
    runs = []
    start = 0
    for i in range(1, len(r) + 1):
        if i == len(r) or r[i] != r[i - 1] + 1:
            runs.append((r[start], i - start, start))
            start = i
    return runs


_RECORD_BYTES = 384  # a journal record of a write of one range of rows, with room to spare
_PIECE_BYTES = 4 << 20  # reads of at least two of these are split across the I/O threads
_CHECK_CHUNK = 1 << 20  # a checked read lands and is checksummed in chunks of this size


def _split(extents: list[tuple[int, int, int]], threads: int) -> list[list[tuple[int, int, int]]]:
    """Cut extents into at most ``threads`` groups of about equal bytes (page-aligned cuts)."""
    total = sum(length for _, _, length in extents)
    if threads < 2 or total < 2 * _PIECE_BYTES:
        return [extents]
    piece = max(_PIECE_BYTES, -(-total // threads))
    piece = -(-piece // 4096) * 4096
    groups: list[list[tuple[int, int, int]]] = [[]]
    room = piece
    for pos, offset, length in extents:
        while length:
            if room == 0:
                groups.append([])
                room = piece
            k = min(room, length)
            groups[-1].append((pos, offset, k))
            pos, offset, length, room = pos + k, offset + k, length - k, room - k
    return groups


def _all_of(futs: list[Future], result, finish: Callable[[], None] | None = None) -> Future:
    """A future that resolves to ``result`` once every one of ``futs`` is done (first error),
    after ``finish()`` (run by the thread that completed the last one) returns."""
    out: Future = Future()
    lock = threading.Lock()
    left = [len(futs)]
    errors: list[BaseException] = []
    finishing = [finish]  # emptied before ``out`` completes (see headroom.store._pools)

    def done_one(f: Future) -> None:
        with lock:
            if f.exception() is not None:
                errors.append(f.exception())
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        fin = finishing.pop()
        if not errors and fin is not None:
            try:
                fin()
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                errors.append(e)
        del fin
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result(result)

    for f in futs:
        f.add_done_callback(done_one)
    return out


def _settle(pending: dict[str, Future], lock: threading.RLock, key: str, fut: Future) -> None:
    """``key``'s operation is done: forget it unless a later one took its place."""
    with lock:
        if pending.get(key) is fut:
            del pending[key]


class _ReadCheck:
    """Checksums of one read: segments it covers whole are verified before its future resolves.

    Each piece of a split read computes the CRCs of its share of those segments in its own
    thread, right after reading them; `finish` combines the shares, then applies ``scales``.
    """

    def __init__(self, store: DiskStore, key: str, extents: list[tuple[int, int, int]],
                 verify: bool, out: torch.Tensor, scales: list) -> None:
        self.store, self.key, self.extents, self.verify = store, key, extents, verify
        self.out, self.scales = out, scales
        self.parts: list[tuple[tuple, int, int, int]] = []  # (segment, start, end, crc)
        self.lock = threading.Lock()

    def covered(self) -> list[list]:
        """Segments with a known CRC that the read covers (raises if it touches bad bytes)."""
        # Looked up when a piece runs (operations on a key run in order): the bytes it finds.
        segs = self.store._ledger.segments(self.key)
        covered, bad = scan(segs, [(off, off + length) for _, off, length in self.extents])
        if bad:
            raise self.store._corrupt(self.key, bad[0][0], bad[0][1], (
                "these bytes are marked damaged (a torn or failed write, kept by recover=True)"
                " until written again, e.g. by hr.load(checkpoint, model, optimizer)"))
        return covered if self.verify else []

    def read(self, fd: int, mv: memoryview, extents: list[tuple[int, int, int]],
             covered: list) -> None:
        """Read ``extents`` into ``mv`` with the CRCs of this piece's share of each covered
        segment (both sorted by file offset), each chunk checksummed while still in cache."""
        found = []
        k = 0
        for pos, off, length in extents:
            end = off + length
            while k < len(covered) and covered[k][1] <= off:
                k += 1
            shares = []
            j = k
            while j < len(covered) and covered[j][0] < end:
                seg = covered[j]
                shares.append([tuple(seg), max(seg[0], off), min(seg[1], end), 0])
                j += 1
            first = 0
            for c0 in range(off, end, _CHECK_CHUNK):
                c1 = min(c0 + _CHECK_CHUNK, end)
                pread_into(fd, mv[pos + c0 - off:pos + c1 - off], c0, _ShortFile)
                q = first
                while q < len(shares) and shares[q][1] < c1:
                    share = shares[q]
                    a, b = max(share[1], c0), min(share[2], c1)
                    if a < b:
                        share[3] = crc(mv[pos + a - off:pos + b - off], share[3])
                    if share[2] <= c1:
                        first = q + 1
                    q += 1
            found += [tuple(share) for share in shares]
        with self.lock:
            self.parts += found

    def finish(self) -> None:
        by_seg: dict[tuple, list] = {}
        for seg, a, b, c in self.parts:
            by_seg.setdefault(seg, []).append((a, b, c))
        for (s, e, want), parts in by_seg.items():
            parts.sort()
            got = parts[0][2]
            for a, b, c in parts[1:]:
                got = combine(got, c, b - a)
            if got != want:
                raise self.store._corrupt(self.key, s, e, (
                    f"read CRC32C {got:08x}, stored {want:08x}: the file was changed or damaged"
                    " on disk. Rewrite the tensor (hr.load(checkpoint, model, optimizer)), or"
                    " reopen with DiskStore(path, recover=True) to find all damage"))
        if self.scales:  # the recorded scalings (see `DiskStore.scale_`), in order
            with torch.no_grad():
                for op, factor in self.scales:
                    op([self.out] if op.__name__.startswith("_foreach") else self.out, factor)


_STORES: weakref.WeakSet[DiskStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A parent thread may have held a store's lock at the fork: fresh locks let the child's
    # calls reach the error saying the store is not theirs, instead of hanging.
    for store in list(_STORES):
        store._lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _finish(ledger: Ledger, *pools: Pool) -> None:
    """A store garbage-collected without `DiskStore.close` (no job is left: each holds it)."""
    if os.getpid() == ledger._pid:  # a forked child has no threads of the parent's pools
        for pool in pools:
            stop_pool(pool)
    ledger.finish()


class DiskStore(Store):
    """Tensors in files under ``path``, one file per tensor, moved by background threads.

    Reads land in preallocated host tensors (``os.preadv``, no extra copy); writes go out with
    ``os.pwritev``. Operations on one key run in issue order, on different keys concurrently.

    Crash safety (docs/offload.md; [Note: DiskStore journal]): a store whose process was killed
    reopens with every tensor holding its last completed write, checked against its checksums;
    a torn one raises `StoreCorruptError` (or opens marked damaged with ``recover=True``). After
    a power loss the store is safe as of the last `flush`. A lock file keeps a second store out
    of the folder. The store belongs to the process that opened it (in a forked child methods
    raise `RuntimeError`, `close` does nothing) and cannot be pickled or copied (`TypeError`);
    one collected without `close` still ends its threads and unlocks the folder, index clean.

    Args:
        path: directory for the files; created if missing. A DiskStore's files there are
            reopened (see `keys`, `get`); a non-empty directory without them is refused.
        max_bytes: byte budget for the store, an int (``64 << 30`` for 64 GiB); ``None`` means
            the free space of the disk.
        threads: background read threads, at least 1 (writes get half as many, at least one).
            Reads of 8 MiB or more are split across them; more help fast NVMe drives.
        page_cache: keep the files' pages in the OS page cache (the default). ``False`` drops
            them after each read and write (writes cost a data sync each): a model bigger than
            RAM does not evict everything else, and every read comes from the disk.
        verify: when reopening, read every tensor back and check it against its checksums
            (``False`` checks only the writes in flight when a previous process stopped).
        verify_reads: check the checksums of the byte ranges a read covers whole before the
            read completes. ``None`` (the default): on with ``page_cache=False``, where it costs
            little next to the disk; off with the page cache, where it would cost about half
            again the read time.
        recover: open a store whose tensors fail their checks anyway: the damaged byte ranges
            raise `StoreCorruptError` on read until rewritten (e.g. by ``hr.load``). Tensor
            files nothing accounts for are renamed ``NAME.unaccounted``; a damaged last journal
            record is skipped. A warning lists each. A damaged index is refused all the same.
        overwrite: delete the DiskStore files in ``path`` (index, journal, ``NNNNNN-*.bin``)
            and start empty; other files there are kept.

    Raises:
        TypeError: an argument of the wrong type (``max_bytes="1GB"``, ``threads=2.5``,
            ``verify="no"``). ValueError: ``threads < 1`` or ``max_bytes < 0``.
        PermissionError: ``path`` cannot be created or written.
        FileExistsError: ``path`` is not empty and holds no DiskStore (pass ``overwrite=True``
            or an empty directory).
        RuntimeError: another store (in this process or another) has ``path`` open; from any
            method, used in a forked child.
        StoreCorruptError: when opening, a tensor fails its checks, the metadata is broken or a
            tensor file is unaccounted for; from reads, a checksum mismatch or a damaged range;
            from anything, a symbolic link or a non-regular file where a store file was.
        StoreFullError: from `put`/`alloc` when the budget or the disk is full; when opening,
            a missing tensor file that the disk has no room to create again.

    Example:
        >>> store = DiskStore(tmp_path / "weights")            # doctest: +SKIP
        >>> h = store.put("w", torch.ones(4, 4))               # doctest: +SKIP
        >>> store.read(h).result().sum().item()                # doctest: +SKIP
        16.0
    """

    holds_host_memory = False
    durable = True

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        threads: int = 4,
        page_cache: bool = True,
        verify: bool = True,
        verify_reads: bool | None = None,
        recover: bool = False,
        overwrite: bool = False,
    ) -> None:
        if not isinstance(threads, int) or isinstance(threads, bool):
            raise TypeError(f"DiskStore threads must be an int (I/O threads, e.g. threads=4),"
                            f" got {type(threads).__name__} {threads!r}")
        if threads < 1:
            raise ValueError(f"DiskStore threads must be >= 1 (I/O threads, e.g. threads=4),"
                             f" got {threads}")
        for name, value in (("page_cache", page_cache), ("verify", verify),
                            ("recover", recover), ("overwrite", overwrite),
                            ("verify_reads", verify_reads)):
            if not isinstance(value, bool) and not (name == "verify_reads" and value is None):
                raise TypeError(f"DiskStore {name} must be True or False"
                                f"{' (or None)' if name == 'verify_reads' else ''},"
                                f" got {type(value).__name__} {value!r}")
        super().__init__(max_bytes=max_bytes)
        self._pid = os.getpid()
        _STORES.add(self)
        self.path = Path(path)
        self._pending: dict[str, Future] = {}
        self._scales: dict[str, list[tuple[Callable, object]]] = {}  # see `scale_`
        self._unsynced: set[str] = set()
        self._checked: set[str] = set()  # scratch keys journaled all the same (`alloc_spare`)
        self.page_cache = page_cache
        self.verify_reads = (not page_cache) if verify_reads is None else verify_reads
        self._stats = {"bytes_read": 0, "bytes_written": 0, "read_busy_s": 0.0, "reads": 0,
                       "writes": 0, "write_busy_s": 0.0, "read_write_overlap_s": 0.0}
        self._active = {"read": 0, "write": 0}  # operations in flight
        self._since = {"read": 0.0, "write": 0.0, "both": 0.0}  # when each became busy
        # NOTE: reads (prefetches that compute waits for) get their own threads, so they never
        # queue behind writes nobody waits for; fewer write threads leave the disk to reads.
        self._threads = threads
        self._pool = Pool(max_workers=self._threads, thread_name_prefix="hr-disk")
        self._wpool = Pool(max_workers=max(1, self._threads // 2),
                           thread_name_prefix="hr-disk-w")
        self._closed = False
        self._stashes: dict = {}  # pooled `Stash` objects by device, see `Stash.shared`
        ledger = None
        try:
            self._ledger = ledger = Ledger.open(self.path, overwrite=overwrite, recover=recover)
            open_checks(self._ledger, self._pool, verify=verify, recover=recover,
                        page_cache=page_cache)
            for name in self._ledger.orphans():
                self._ledger.remove(name)
            self._ledger.start()
            for key in [k for k in self._ledger.entries if k.startswith(SCRATCH)]:
                # scratch of a process that stopped: worth nothing
                self._ledger.remove(self._ledger.free(key))
        except BaseException:
            if ledger is not None:
                ledger.release()
            self._pool.shutdown()
            self._wpool.shutdown()
            raise
        for key, e in self._ledger.entries.items():
            self._handles[key] = Handle.of(key, tuple(e["shape"]), DTYPES[e["dtype"]], self)
            self._used += e["nbytes"]
        # The finalizer holds no reference back to the store: see `_finish`.
        self._finalizer = weakref.finalize(self, _finish, self._ledger, self._pool, self._wpool)

    def __repr__(self) -> str:
        return f"DiskStore({str(self.path)!r}, used={self._used}, max_bytes={self.max_bytes})"

    def _not_portable(self) -> str:
        return (
            f"{self!r} cannot be pickled or copied: it owns its folder's lock and journal and its"
            " I/O threads in this process. Open DiskStore(path) in the other process once this"
            " one is closed (store.close()), or pass the offloaded model (it pickles into a"
            " plain model holding its values)")

    def _corrupt(self, key: str, start: int, end: int, why: str) -> StoreCorruptError:
        file = self._ledger.entries.get(key, {}).get("file", "?")
        return StoreCorruptError(
            f"DiskStore {str(self.path)!r}: tensor {key!r} ({file}, bytes {start}-{end}): {why}",
            str(self.path), (key,))

    def _own(self) -> None:
        """Raise in a forked child (threads and folder are the parent's) or once closed."""
        if os.getpid() != self._pid:
            raise forked_error(repr(self), self._pid)
        if self._closed:
            raise RuntimeError(
                f"{self!r} is closed (close() was called): close a store after its last use;"
                " to go on, open the folder again with DiskStore(path) and offload into it,"
                " or hr.load a checkpoint")

    # ------------------------------------------------------------------ I/O plumbing
    def _file(self, handle: Handle) -> str:
        self._check(handle)
        return os.path.join(self.path, self._ledger.entries[handle.key]["file"])

    def _submit_parts(self, key: str, parts: list[tuple], result, *, write: bool = False,
                      finish: Callable[[], None] | None = None) -> Future:
        """Run ``fn(*args)`` of every part concurrently, after the previous operation on ``key``;
        a future of ``result`` once all are done and ``finish()`` returned (see `_all_of`)."""
        self._own()
        with self._lock:
            prev = self._pending.get(key)

            def run(fn, args):
                if prev is not None:
                    prev.exception()  # wait; its error was reported to its own caller
                return fn(*args)

            # No deadlock: a task waits only for an earlier one; pools start tasks in order.
            pool = self._wpool if write else self._pool
            futs = [pool.submit(run, fn, args) for fn, args in parts]
            fut = futs[0] if len(futs) == 1 and finish is None else \
                _all_of(futs, result, finish)
            self._pending[key] = fut
        # NOTE: callbacks run after the caller's wait returns: this one holds the table, not
        # the store, so a caller that drops the store then does not race an I/O thread.
        fut.add_done_callback(partial(_settle, self._pending, self._lock, key))
        return fut

    def _submit_write(self, handle: Handle, src: torch.Tensor,
                      extents: list[tuple[int, int, int]]) -> Future:
        job = (self._write_job, (handle.key, self._file(handle), src, extents))
        return self._submit_parts(handle.key, [job], None, write=True)

    def _io_error(self, e: OSError, path: str) -> OSError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFullError(
                f"disk full while writing {path} (a file of {self!r}); free space there or"
                " give DiskStore a directory on a larger disk")
        return e

    def stats(self) -> dict[str, float]:
        """I/O counters since creation: ``bytes_read``, ``bytes_written``, ``reads``, ``writes``,
        ``read_busy_s`` / ``write_busy_s`` (wall seconds with a read / write in flight, checksums
        included) and ``read_write_overlap_s`` (seconds with both in flight)."""
        with self._lock:
            return dict(self._stats)

    def _busy(self, kind: str, delta: int, nbytes: int = 0) -> None:
        """Count one read or write starting (``delta=1``) or ending (``-1``)."""
        now = time.perf_counter()
        active, since = self._active, self._since
        with self._lock:
            both = active["read"] > 0 and active["write"] > 0
            if delta > 0 and active[kind] == 0:
                since[kind] = now
            active[kind] += delta
            if delta < 0 and active[kind] == 0:
                self._stats[f"{kind}_busy_s"] += now - since[kind]
            now_both = active["read"] > 0 and active["write"] > 0
            if now_both and not both:
                since["both"] = now
            elif both and not now_both:
                self._stats["read_write_overlap_s"] += now - since["both"]
            if delta < 0:
                self._stats["bytes_read" if kind == "read" else "bytes_written"] += nbytes
                self._stats[kind + "s"] += 1

    def _drop_cache(self, fd: int, offset: int, length: int, written: bool) -> None:
        if self.page_cache:
            return
        if written:
            os.fdatasync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _read_job(self, path: str, t: torch.Tensor, extents: list[tuple[int, int, int]],
                  check: _ReadCheck) -> torch.Tensor:
        """Read ``extents`` (``(byte in t, byte in file, length)``) into ``t``, checked."""
        covered = check.covered()
        with self._counted("read", extents):
            mv = buffer_view(t)
            fd = open_file(path, os.O_RDONLY, key=check.key)
            try:
                if covered:
                    check.read(fd, mv, extents, covered)
                else:
                    for pos, offset, length in extents:
                        pread_into(fd, mv[pos:pos + length], offset, _ShortFile)
                for _, offset, length in extents:
                    self._drop_cache(fd, offset, length, False)
            except _ShortFile:
                raise self._corrupt(check.key, extents[0][1], extents[-1][1] + extents[-1][2], (
                    "the file is shorter than the tensor (truncated since the store opened it);"
                    " restore the folder, or reopen with DiskStore(path, recover=True) and"
                    " hr.load(checkpoint, model, optimizer)")) from None
            finally:
                os.close(fd)
        return t

    @contextlib.contextmanager
    def _counted(self, kind: str, extents: list[tuple[int, int, int]]):
        """One read or write in flight (`stats`); its bytes count once it succeeds."""
        self._busy(kind, 1)
        n = 0
        try:
            yield
            n = sum(length for _, _, length in extents)
        finally:
            self._busy(kind, -1, n)

    def _write_job(self, key: str, path: str, t: torch.Tensor,
                   extents: list[tuple[int, int, int]]) -> None:
        """Write ``extents`` of ``t``, journaled before and after. See [Note: DiskStore journal]."""
        with self._counted("write", extents):
            mv = buffer_view(t)
            if key.startswith(SCRATCH) and not self.verify_reads and key not in self._checked:
                # Nothing checks these bytes (see [Note: scratch keys]): no checksum, no records.
                self._ledger.forget_segments(key)  # no stale checksum of the old bytes
                x = None
            elif len(extents) <= MAX_EXTENTS:
                # The CRCs are taken in the I/O thread before the first byte goes out: a write the
                # process does not live to finish is still recognised as complete or torn.
                x = [[off, length, crc(mv[pos:pos + length])] for pos, off, length in extents]
            else:
                lo, hi = extents[0][1], extents[-1][1] + extents[-1][2]
                x = [[lo, hi - lo, None]]
            try:  # opened before the write is journaled: no record of one that never started
                fd = open_file(path, os.O_WRONLY, key=key)
            except OSError as e:
                raise self._io_error(e, path) from e
            rid, written = None, [0]
            try:
                if x is not None:
                    rid = self._journaled(self._ledger.begin_write, key, x)
                self._pwrite_extents(fd, mv, extents, written)
            except OSError as e:
                if rid is not None:  # part may have reached the file: marked bad, not mixed
                    self._ledger.end_write(rid, "bad" if written[0] else "none")
                raise self._io_error(e, path) from e
            finally:
                os.close(fd)
            if rid is not None:  # the data is in place; its record may still fail
                self._journaled(self._ledger.end_write, rid, "ok")
                with self._lock:
                    self._unsynced.add(path)

    def _journaled(self, change: Callable, *args):
        """``change(*args)``, a journaled change of the ledger; a full disk is `StoreFullError`."""
        try:
            return change(*args)
        except OSError as e:
            raise self._io_error(e, str(self.path)) from e

    def _pwrite_extents(self, fd: int, mv: memoryview, extents: list[tuple[int, int, int]],
                        written: list[int]) -> None:
        for pos, offset, length in extents:
            _pwrite_from(fd, mv[pos:pos + length], offset, written)
            self._drop_cache(fd, offset, length, True)

    # ------------------------------------------------------------------ protocol
    def alloc(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *, zero: bool = True
    ) -> Handle:
        return self._alloc(key, shape, dtype, key)

    def _alloc(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, named: str
               ) -> Handle:
        """Allocate ``key`` in a file named after ``named``."""
        self._own()
        handle = Handle.of(key, shape, dtype, self)
        dname = str(dtype).removeprefix("torch.")
        if dname not in DTYPES:
            raise TypeError(f"DiskStore cannot keep dtype {dtype} ({key!r})")
        free = shutil.disk_usage(self.path).free
        if handle.nbytes > free:
            raise StoreFullError(
                f"disk full: {key!r} needs {handle.nbytes} bytes, {free} free under"
                f" {self.path}; free space or use a directory on a larger disk")
        self._reserve(handle)
        try:
            name = self._ledger.alloc(key, re.sub(r"[^A-Za-z0-9_.-]", "_", named)[:80],
                                      handle.shape, dname)
        except OSError as e:
            self._release(handle)
            raise self._io_error(e, str(self.path)) from e
        path = os.path.join(self.path, name)
        created = False
        try:
            # O_EXCL: a file that is already there is never truncated; it is not ours.
            fd = open_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, key=key)
            created = True
            try:
                # Blocks reserved now (read as zeros): a full disk fails here, not mid-training.
                if handle.nbytes:
                    os.posix_fallocate(fd, 0, handle.nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                self._ledger.free(key)
            self._release(handle)
            if created:
                with contextlib.suppress(OSError):
                    self._ledger.remove(name)
            else:  # absent, or a file that is not ours (FileExistsError): never removed
                self._ledger.forget_freed(name)
            if isinstance(e, FileExistsError):
                raise FileExistsError(
                    f"{path} appeared in the folder of {self!r} while it was open; something"
                    " else writes there. Give the store a folder of its own") from e
            raise self._io_error(e, path) from e
        return handle  # fallocated blocks are already zero-filled

    can_exchange = True

    def alloc_spare(self, handle: Handle, key: str) -> Handle:
        """A tensor under ``key`` of ``handle``'s shape and dtype, to be exchanged with it
        (`exchange`). A scratch ``key`` is dropped on reopen, but written with checksums and
        journal records like ``handle``, whose bytes it may become.

        Raises:
            StoreFullError: the budget or the disk cannot hold it.
        """
        self._check(handle)
        # its file named after ``handle``: exchanged, it holds that tensor's bytes
        h = self._alloc(key, handle.shape, handle.dtype, handle.key)
        with self._lock:
            self._checked.add(key)
        return h

    def exchange(self, pairs: list[tuple[Handle, Handle]]) -> None:
        """Swap the contents of each pair of tensors ``(a, b)`` (same shape and dtype), all
        pairs at once, for every holder of either handle: files and checksums trade places in
        the index, no byte is copied.

        Operations on those tensors issued before finish first; issue none from another thread
        while it runs. One journal record: a store reopened after ``kill -9`` sees every pair
        exchanged or none (after a power loss, as of the last `flush`).

        Raises:
            KeyError: a handle is not in this store.
            ValueError: a pair of different shapes or dtypes, or a tensor in two pairs.
            StoreFullError: the journal record could not be written (nothing was exchanged).
        """
        self._own()
        pairs = list(pairs)
        for a, b in pairs:
            self._check(a)
            self._check(b)
            if (a.shape, a.dtype) != (b.shape, b.dtype) or a.key == b.key:
                raise ValueError(f"DiskStore.exchange needs two tensors of one shape and dtype,"
                                 f" got {a} and {b}")
        keys = [k for a, b in pairs for k in (a.key, b.key)]
        if len(set(keys)) != len(keys):
            raise ValueError("DiskStore.exchange: a tensor is in more than one pair")
        while True:
            with self._lock:
                prev = [f for k in keys if (f := self._pending.get(k)) is not None]
                if not prev:
                    self._journaled(self._ledger.exchange, [(a.key, b.key) for a, b in pairs])
                    for a, b in pairs:  # deferred scalings go with the bytes they scale
                        sa, sb = self._scales.pop(a.key, None), self._scales.pop(b.key, None)
                        self._scales.update({k: v for k, v in ((a.key, sb), (b.key, sa))
                                             if v is not None})
                    return
            for f in prev:
                f.exception()  # wait; its error went to its own caller

    def read(self, handle: Handle, out: torch.Tensor | None = None) -> Future:
        out = self._out(handle, out, handle.shape)
        return self._read(handle, out, [(0, 0, handle.nbytes)] if handle.nbytes else [])

    def _read(self, handle: Handle, out: torch.Tensor,
              extents: list[tuple[int, int, int]]) -> Future:
        if not extents:
            return done(out)
        with self._lock:  # the scalings of exactly the operations queued before this read
            path = self._file(handle)
            check = _ReadCheck(self, handle.key, extents, self.verify_reads, out,
                               list(self._scales.get(handle.key, ())))
            # A large read goes out in pieces at once: more requests in flight for the disk.
            return self._submit_parts(
                handle.key, [(self._read_job, (path, out, p, check))
                             for p in _split(extents, self._threads)], out, finish=check.finish)

    def write(self, handle: Handle, src: torch.Tensor) -> Future:
        self._check_src(handle, src, handle.shape, "write to")
        if handle.nbytes == 0:
            return done(None)
        with self._lock:
            fut = self._submit_write(handle, src, [(0, 0, handle.nbytes)])
            # Dropped once the write is queued: one that fails to start keeps the scalings.
            self._scales.pop(handle.key, None)
        return fut

    def scale_(self, handle: Handle, op: Callable, factor: object) -> None:
        """Scale a stored tensor in place by a scalar, deferred: ``op(t, factor)`` (or
        ``op([t], factor)`` for a ``_foreach`` op), an element-wise in-place op such as
        ``torch.ops.aten.mul_.Tensor`` with a 0-dim ``factor``.

        Nothing is read or written now: every later read applies the recorded ops, in order,
        to what it reads (bitwise the scaled value); a whole `write` replaces them. A row
        write, `flush`, `close` or `file_of` writes the scaled value out first. Until then the
        file holds the unscaled values, which a store reopened after ``kill -9`` reads (for
        gradient clipping, the gradients of an interrupted step are not kept anyway).

        Raises:
            KeyError: ``handle`` is not in this store.
        """
        self._own()
        self._check(handle)
        with self._lock:
            self._scales.setdefault(handle.key, []).append((op, factor))

    def _write_out_scales(self, keys: list[str] | None = None) -> None:
        """Write out the deferred scalings of ``keys`` (all by default), see `scale_`."""
        with self._lock:
            todo = [k for k in (self._scales if keys is None else keys) if k in self._scales]
        for k in todo:
            h = self._handles.get(k)
            if h is None:
                continue
            with self._lock:
                scales = list(self._scales.get(k, ()))
            fut = self.write(h, self.read(h).result())
            if fut.exception() is not None:
                # The file still holds the unscaled value (or damaged bytes): they stay recorded.
                with self._lock:
                    self._scales[k] = scales + self._scales.get(k, [])
                fut.result()

    @staticmethod
    def _extents(handle: Handle, rows: slice | torch.Tensor) -> list[tuple[int, int, int]]:
        """``(byte in buffer, byte in file, length)`` of each run of consecutive rows."""
        rb = handle.row_nbytes
        if isinstance(rows, slice):
            return [(0, rows.start * rb, (rows.stop - rows.start) * rb)] \
                if rows.stop > rows.start else []
        return [(pos * rb, first * rb, count * rb) for first, count, pos in _runs(rows)]

    def read_rows(
        self, handle: Handle, rows: slice | torch.Tensor, out: torch.Tensor | None = None
    ) -> Future:
        rows = self._check_rows(handle, rows)
        out = self._out(handle, out, self._rows_shape(handle, rows))
        return self._read(handle, out, self._extents(handle, rows))

    def write_rows(self, handle: Handle, rows: slice | torch.Tensor, src: torch.Tensor) -> Future:
        rows = self._check_rows(handle, rows)
        self._check_src(handle, src, self._rows_shape(handle, rows), "write to")
        extents = self._extents(handle, rows)
        if not extents:
            return done(None)
        if handle.key in self._scales:  # the other rows keep their scaled values
            self._write_out_scales([handle.key])
        with self._lock:  # the file looked up and the write queued with no `exchange` between
            return self._submit_write(handle, src, extents)

    def reserve_writes(self, count: int) -> None:
        # Two records per write (begin and done), each at most this long for one range of rows.
        self._own()
        try:
            self._ledger.reserve(max(0, count) * 2 * _RECORD_BYTES)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StoreFullError(
                f"{self!r} is full: the disk under {self.path} has no room for the journal"
                f" records of {count} writes ({e.strerror or e}); free space there or give"
                " DiskStore a directory on a larger disk") from e

    def release_writes(self) -> None:
        self._ledger.unreserve()

    def file_of(self, handle: Handle) -> Path:
        """The file that holds ``handle`` (for inspection and benchmarks)."""
        self._write_out_scales([handle.key])
        return Path(self._file(handle))

    def damaged(self) -> dict[str, list[tuple[int, int]]]:
        """Byte ranges, by key, marked damaged (they raise on read until written again)."""
        with self._ledger.lock:
            out = {k: [(s, e) for s, e, c in v["segments"] if c == BAD]
                   for k, v in self._ledger.entries.items()}
        return {k: v for k, v in out.items() if v}

    def free(self, handle: Handle) -> None:
        self._own()
        self._check(handle)
        with self._lock:
            prev = self._pending.get(handle.key)
        if prev is not None:
            prev.exception()
        with self._lock:
            self._scales.pop(handle.key, None)
            name = self._ledger.free(handle.key)  # journaled before the file goes
            self._checked.discard(handle.key)
            self._release(handle)
        self._ledger.remove(name)

    def _fill_job(self, key: str, path: str, unknown: list[tuple[int, int]]) -> None:
        for s, e in unknown:
            c = range_crc(path, s, e - s, self.page_cache)
            if c is not None:
                self._ledger.set_known(key, s, e, c)

    def _sync(self, *, clean: bool) -> None:
        self._own()
        self._write_out_scales()
        with self._lock:
            pending = list(self._pending.values())
        for fut in pending:
            fut.result()
        # Unknown checksums are read back, each as an operation on its key (in order).
        futs = []
        for key in self.keys():
            try:
                unknown = [(s, e) for s, e, c in self._ledger.segments(key) if c is None]
                path = os.path.join(self.path, self._ledger.entries[key]["file"])
            except KeyError:
                continue  # freed meanwhile by another thread
            if unknown:
                futs.append(self._submit_parts(key, [(self._fill_job, (key, path, unknown))],
                                               None))
        for fut in futs:
            fut.result()
        with self._lock:
            unsynced, self._unsynced = self._unsynced, set()
        for path in unsynced:
            with contextlib.suppress(FileNotFoundError):  # freed since
                fsync(path)
        self._ledger.compact(clean=clean, flushed=True)

    def flush(self) -> None:
        """Wait for all pending reads and writes, make them durable and snapshot the index.

        Unknown checksums (of bytes row writes cut out of a written range) are computed by
        reading those bytes back; the files written since the last flush are fsynced, then
        ``index.json`` is replaced atomically and the journal emptied. After a power loss, the
        store is intact as of the last flush.

        Raises:
            OSError: the first error of a pending write that nobody waited for.
        """
        self._sync(clean=False)

    def close(self) -> None:
        """Flush, mark the folder closed cleanly, stop the I/O threads and unlock the folder.
        The tensors' files stay; reopen with ``DiskStore(path)``. Scratch space (offloaded
        activations) is freed: a backward that still needs it raises instead. Afterwards every
        method raises `RuntimeError` (closed); a second ``close()`` does nothing."""
        if self._closed or os.getpid() != self._pid:
            return  # in a forked child: the parent's store, which stays open there
        try:
            # Every scratch key is freed (see [Note: scratch keys]): a restore of one raises.
            for stash in list(self._stashes.values()):
                stash.close()
            self._stashes.clear()
            with self._lock:
                scratch = [h for k, h in self._handles.items() if k.startswith(SCRATCH)]
            for handle in scratch:
                self.free(handle)
            self._sync(clean=True)
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._wpool.shutdown(wait=True)
            self._finalizer.detach()
            self._ledger.release()

