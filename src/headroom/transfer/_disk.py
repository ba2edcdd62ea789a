"""Disk: tensors in files under a directory, read and written by background threads."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from headroom.transfer._handle import Handle
from headroom.transfer._store import Store, StoreFullError, done

__all__ = ["DiskStore"]

_INDEX = "index.json"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise OSError(errno.EIO, "unexpected end of file")
        buf = buf[n:]
        offset += n


def _pwrite_from(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwritev(fd, [buf], offset)
        buf = buf[n:]
        offset += n


def _view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory; the caller keeps ``t`` alive.

    NOTE: not ``t.numpy()``: that marks the storage non-resizable, and offloaded parameters
    resize their storage to 0 between uses.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _runs(rows: torch.Tensor) -> list[tuple[int, int, int]]:
    """Consecutive runs of sorted row indices as ``(first_row, count, position_in_rows)``."""
    if rows.numel() == 0:
        return []
    r = rows.tolist()
    runs = []
    start = pos = 0
    for i in range(1, len(r) + 1):
        if i == len(r) or r[i] != r[i - 1] + 1:
            runs.append((r[start], i - start, pos))
            pos += i - start
            start = i
    return runs


_PIECE_BYTES = 4 << 20  # reads of at least two of these are split across the I/O threads


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


def _all_of(futs: list[Future], result) -> Future:
    """A future that resolves to ``result`` once every one of ``futs`` is done (first error)."""
    out: Future = Future()
    lock = threading.Lock()
    left = [len(futs)]
    errors: list[BaseException] = []

    def done_one(f: Future) -> None:
        with lock:
            if f.exception() is not None:
                errors.append(f.exception())
            left[0] -= 1
            last = left[0] == 0
        if last:
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(result)

    for f in futs:
        f.add_done_callback(done_one)
    return out


class DiskStore(Store):
    """Tensors in files under ``path``, one file per tensor, moved by background threads.

    Reads land in preallocated host tensors (``os.preadv`` straight into their memory, no extra
    copy); writes go out with ``os.pwritev``. Operations on the same key run in issue order; on
    different keys they run concurrently. A small ``index.json`` (written by `flush` and `close`)
    lets another process reopen the store with ``DiskStore(path)``.

    Args:
        path: directory for the files; created if missing. If it holds an ``index.json`` the
            tensors listed there are reopened (see `keys`, `get`).
        max_bytes: byte budget for the store; ``None`` means the free space of the disk.
        threads: background read threads (writes get half as many, at least one). Reads of
            8 MiB or more are split across them. More threads help fast NVMe drives with many
            tensors in flight.
        page_cache: keep the files' pages in the OS page cache (the default). ``False`` drops
            them after each read and write (``posix_fadvise(DONTNEED)``, after a data sync for
            writes): a model bigger than RAM then does not evict everything else from the
            cache, and every read really comes from the disk; writes cost a sync each.

    Raises:
        PermissionError: ``path`` cannot be created or written.
        StoreFullError: from `put`/`alloc` when the budget or the disk is full.

    Example:
        >>> store = DiskStore(tmp_path / "weights")            # doctest: +SKIP
        >>> h = store.put("w", torch.ones(4, 4))               # doctest: +SKIP
        >>> store.read(h).result().sum().item()                # doctest: +SKIP
        16.0
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_bytes: int | None = None,
        threads: int = 4,
        page_cache: bool = True,
    ) -> None:
        super().__init__(max_bytes=max_bytes)
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe-{os.getpid()}-{threading.get_ident()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            raise PermissionError(
                f"DiskStore path {str(self.path)!r} is not writable ({e.strerror or e}); pass a"
                " directory you can write to, e.g. on a local disk with free space"
            ) from e
        # NOTE: plain data (no handles, which point back at the store) so the finalizer that
        # writes the index does not keep the store alive.
        self._entries: dict[str, dict] = {}
        self._pending: dict[str, Future] = {}
        self._meta = {"counter": 0}
        self.page_cache = page_cache
        self._stats = {"bytes_read": 0, "bytes_written": 0, "read_busy_s": 0.0, "reads": 0,
                       "writes": 0, "write_busy_s": 0.0, "read_write_overlap_s": 0.0}
        self._active_reads = 0
        self._active_writes = 0
        self._read_since = 0.0
        self._write_since = 0.0
        self._both_since = 0.0
        # NOTE: reads and writes get their own threads: a read (usually a prefetch that compute
        # will wait for) never queues behind gradient or state writes, which nobody waits for
        # right away; fewer write threads also leave the disk to the reads more often.
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="hr-disk")
        self._wpool = ThreadPoolExecutor(max_workers=max(1, self._threads // 2),
                                         thread_name_prefix="hr-disk-w")
        self._closed = False
        self._load_index()
        # NOTE: persist the index if the store is garbage-collected without close().
        self._finalizer = weakref.finalize(
            self, DiskStore._write_index_files, self.path, self._entries, self._meta
        )

    def __repr__(self) -> str:
        return f"DiskStore({str(self.path)!r}, used={self._used}, max_bytes={self.max_bytes})"

    # ------------------------------------------------------------------ index
    def _load_index(self) -> None:
        index = self.path / _INDEX
        if not index.exists():
            return
        data = json.loads(index.read_text())
        for key, e in data["tensors"].items():
            handle = Handle.of(key, tuple(e["shape"]), _DTYPES[e["dtype"]], self)
            file = self.path / e["file"]
            if not file.exists() or file.stat().st_size < handle.nbytes:
                raise FileNotFoundError(
                    f"DiskStore index lists {key!r} in {file}, which is missing or truncated;"
                    " the store was not closed cleanly — delete the directory and rebuild it"
                )
            self._handles[key] = handle
            self._used += handle.nbytes
            self._entries[key] = dict(e)
        self._meta["counter"] = int(data.get("counter", len(self._entries)))

    @staticmethod
    def _write_index_files(path: Path, entries: dict, meta: dict) -> None:
        data = {"version": 1, "counter": meta["counter"], "tensors": dict(entries)}
        try:
            tmp = path / (_INDEX + ".tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path / _INDEX)
        except OSError:  # pragma: no cover - directory removed before exit
            pass

    # ------------------------------------------------------------------ I/O plumbing
    def _file(self, handle: Handle) -> str:
        self._check(handle)
        return os.path.join(self.path, self._entries[handle.key]["file"])

    def _submit_parts(self, key: str, parts: list[tuple], result, *,
                      write: bool = False) -> Future:
        """Run ``fn(*args)`` of every part concurrently, after the previous operation on ``key``.

        One part: its own future. Several: a future that resolves to ``result`` when all are
        done (or to the first error).
        """
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        with self._lock:
            prev = self._pending.get(key)

            def run(fn, args):
                if prev is not None:
                    prev.exception()  # wait; its error was reported to its own caller
                return fn(*args)

            # NOTE: no deadlock across the two pools: a task waits only for an operation
            # submitted before it, and each pool starts its tasks in submission order.
            pool = self._wpool if write else self._pool
            futs = [pool.submit(run, fn, args) for fn, args in parts]
            fut = futs[0] if len(futs) == 1 else _all_of(futs, result)
            self._pending[key] = fut
        fut.add_done_callback(lambda f, k=key: self._settle(k, f))
        return fut

    def _submit_io(self, handle: Handle, kind: str, t: torch.Tensor,
                   extents: list[tuple[int, int, int]]) -> Future:
        path = self._file(handle)
        pieces = [extents]
        if kind == "read":
            # NOTE: a large read goes out as several smaller ones at once: the disk then has
            # more requests in flight (measured here: a virtual disk reads 16 MiB files 1.2-1.4x
            # faster with 4 requests in flight than with one), and a prefetch of one big
            # tensor no longer waits behind a single thread.
            pieces = _split(extents, self._threads)
        return self._submit_parts(
            handle.key, [(self._io_job, (kind, path, t, p)) for p in pieces], t,
            write=kind == "write")

    def _settle(self, key: str, fut: Future) -> None:
        with self._lock:
            if self._pending.get(key) is fut:
                del self._pending[key]

    @staticmethod
    def _io_error(e: OSError, path: str) -> OSError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreFullError(
                f"disk full while writing {path}; free space there or give DiskStore a"
                " directory on a larger disk"
            )
        return e

    def stats(self) -> dict[str, float]:
        """I/O counters since creation: ``bytes_read``, ``bytes_written``, ``reads``,
        ``writes``, ``read_busy_s`` / ``write_busy_s`` (wall seconds during which at least one
        read / write was in flight, so ``bytes_read / read_busy_s`` is the achieved read
        throughput) and ``read_write_overlap_s`` (seconds with both in flight: reads sharing
        the disk with writes)."""
        with self._lock:
            return dict(self._stats)

    def _busy(self, kind: str, delta: int, nbytes: int = 0) -> None:
        """Count one read or write starting (``delta=1``) or ending (``-1``)."""
        now = time.perf_counter()
        with self._lock:
            both = self._active_reads > 0 and self._active_writes > 0
            if kind == "read":
                if delta > 0 and self._active_reads == 0:
                    self._read_since = now
                self._active_reads += delta
                if delta < 0 and self._active_reads == 0:
                    self._stats["read_busy_s"] += now - self._read_since
            else:
                if delta > 0 and self._active_writes == 0:
                    self._write_since = now
                self._active_writes += delta
                if delta < 0 and self._active_writes == 0:
                    self._stats["write_busy_s"] += now - self._write_since
            now_both = self._active_reads > 0 and self._active_writes > 0
            if now_both and not both:
                self._both_since = now
            elif both and not now_both:
                self._stats["read_write_overlap_s"] += now - self._both_since
            if delta < 0:
                self._stats["bytes_read" if kind == "read" else "bytes_written"] += nbytes
                self._stats["reads" if kind == "read" else "writes"] += 1


    def _drop_cache(self, fd: int, offset: int, length: int, written: bool) -> None:
        if self.page_cache:
            return
        if written:
            os.fdatasync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _io_job(self, kind: str, path: str, t: torch.Tensor,
                extents: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """Read into / write from ``t``: ``extents`` are ``(byte in t, byte in file, length)``.

        NOTE: one job for whole tensors and for row runs alike, so both count the same way in
        `stats` and drop the page cache the same way.
        """
        write = kind == "write"
        n = sum(length for _, _, length in extents)
        self._busy(kind, 1)
        try:
            fd = os.open(path, os.O_WRONLY if write else os.O_RDONLY)
            try:
                mv = _view(t)
                for pos, offset, length in extents:
                    if write:
                        _pwrite_from(fd, mv[pos:pos + length], offset)
                    else:
                        _pread_into(fd, mv[pos:pos + length], offset)
                    self._drop_cache(fd, offset, length, write)
            finally:
                os.close(fd)
        except OSError as e:
            self._busy(kind, -1)
            if write:
                raise self._io_error(e, path) from e
            raise
        self._busy(kind, -1, n)
        return None if write else t

    # ------------------------------------------------------------------ protocol
    def alloc(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *, zero: bool = True
    ) -> Handle:
        handle = Handle.of(key, shape, dtype, self)
        if str(dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"DiskStore cannot keep dtype {dtype} ({key!r})")
        free = shutil.disk_usage(self.path).free
        if handle.nbytes > free:
            raise StoreFullError(
                f"disk full: {key!r} needs {handle.nbytes} bytes, {free} free under"
                f" {self.path}; free space or use a directory on a larger disk"
            )
        self._reserve(handle)
        with self._lock:
            self._meta["counter"] += 1
            name = f"{self._meta['counter']:06d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)[:80]}.bin"
            self._entries[key] = {
                "file": name, "shape": list(handle.shape),
                "dtype": str(dtype).removeprefix("torch."),
            }
        path = os.path.join(self.path, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                # NOTE: reserve the blocks now so a full disk fails here, early, rather than in
                # a background write halfway through training. Reserved blocks read as zeros.
                if handle.nbytes:
                    os.posix_fallocate(fd, 0, handle.nbytes)
            finally:
                os.close(fd)
        except OSError as e:
            with self._lock:
                del self._entries[key]
            self._release(handle)
            raise self._io_error(e, path) from e
        del zero  # fallocated blocks are already zero-filled
        return handle

    def read(self, handle: Handle, out: torch.Tensor | None = None) -> Future:
        out = self._out(handle, out, handle.shape)
        if handle.nbytes == 0:
            return done(out)
        return self._submit_io(handle, "read", out, [(0, 0, handle.nbytes)])

    def write(self, handle: Handle, src: torch.Tensor) -> Future:
        self._check_src(handle, src, handle.shape)
        if src.device.type != "cpu" or not src.is_contiguous():
            raise ValueError(f"write to {handle.key!r} needs a contiguous host (cpu) tensor")
        if handle.nbytes == 0:
            return done(None)
        return self._submit_io(handle, "write", src, [(0, 0, handle.nbytes)])

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
        extents = self._extents(handle, rows)
        if not extents:
            return done(out)
        return self._submit_io(handle, "read", out, extents)

    def write_rows(self, handle: Handle, rows: slice | torch.Tensor, src: torch.Tensor) -> Future:
        rows = self._check_rows(handle, rows)
        self._check_src(handle, src, self._rows_shape(handle, rows))
        if src.device.type != "cpu" or not src.is_contiguous():
            raise ValueError(f"write to {handle.key!r} needs a contiguous host (cpu) tensor")
        extents = self._extents(handle, rows)
        if not extents:
            return done(None)
        return self._submit_io(handle, "write", src, extents)

    def file_of(self, handle: Handle) -> Path:
        """The file that holds ``handle`` (for inspection and benchmarks)."""
        return Path(self._file(handle))

    def free(self, handle: Handle) -> None:
        self._check(handle)
        with self._lock:
            prev = self._pending.get(handle.key)
        if prev is not None:
            prev.exception()
        with self._lock:
            name = self._entries.pop(handle.key)["file"]
            self._release(handle)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, name))

    def flush(self) -> None:
        """Wait for all pending reads and writes and write ``index.json``.

        Raises:
            OSError: the first error of a pending write that nobody waited for.
        """
        with self._lock:
            pending = list(self._pending.values())
        for fut in pending:
            fut.result()
        with self._lock:
            self._write_index_files(self.path, self._entries, self._meta)

    def close(self) -> None:
        """Flush, then stop the I/O threads. The files stay; reopen with ``DiskStore(path)``."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._wpool.shutdown(wait=True)
            self._finalizer.detach()
