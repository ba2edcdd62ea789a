"""The checkpoint file: a safetensors header with checksums, temporary files, checked reading.

The header's headroom JSON holds the CRC32C of every tensor's bytes and of the header itself
(format version 2; its own eight hex digits read as ``0``), written as placeholders of the same
width and filled in (`Seal`) once the data is written. `Reader` checks what it can before
handing out tensors verified against their checksums.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import crc32c
import torch

from headroom.store import (
    MAX_HEADER_BYTES,
    Handle,
    HeaderError,
    Store,
    open_regular,
    parse_header,
    safetensors_dtypes,
)

__all__ = [
    "DTYPES",
    "FORMAT",
    "PLACEHOLDER",
    "VERSION",
    "CheckpointCorruptError",
    "Reader",
    "available_memory",
    "build_header",
    "fsync_dir",
    "remove_stale_temps",
    "seal_header",
    "store_slices",
    "write_file",
    "write_tensors",
]

FORMAT = "headroom-checkpoint"
VERSION = 2
_ALIGN = 8
_PIECE = 16 << 20  # a tensor is checksummed in pieces of this size (a stop is seen between)
DTYPES = {dtype: code for code, dtype in safetensors_dtypes().items()}
# The header's own checksum is the first field of the headroom JSON, which is the first
# value of the header, so its eight hex digits sit at a fixed offset: `load` checks the raw
# header bytes before parsing them, and `save` fills the digits in without moving anything.
_HEAD = b'{"__metadata__":{"headroom":"{\\"header_crc32c\\": \\"'
PLACEHOLDER = "00000000"


class CheckpointCorruptError(ValueError):
    """A checkpoint file is damaged: truncated, an unreadable header, or a checksum mismatch."""


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, as safetensors stores them (C order)."""
    flat = t.detach().reshape(-1) if t.dim() else t.detach().reshape(1)
    return memoryview(flat.view(torch.uint8).numpy())


class Checksums:
    """CRC32C of each tensor's bytes as written, computed on a helper thread."""
    # NOTE: crc32c releases the GIL. Buffers made for this save are summed while the main thread
    # writes them; the model's own tensors (alive anyway) while it waits for the fsync. One
    # worker keeps a tensor's chunks in order (chunk i+1's CRC continues from chunk i's).

    def __init__(self, enabled: bool) -> None:
        self.values: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hr-crc") if enabled else None
        self._pending: deque[Future] = deque()
        self._temporary: deque[Future] = deque()
        self._later: list[tuple[str, torch.Tensor]] = []

    def begin(self, name: str) -> None:
        """Start ``name``'s checksum (that of no bytes, for a tensor with no elements)."""
        self.values.setdefault(name, 0)

    def add(self, name: str, t: torch.Tensor, *, temporary: bool) -> None:
        """Extend ``name``'s checksum by ``t`` (unchanged until done; ``temporary``: made for
        this save, freed once written)."""
        self.begin(name)
        if self._pool is None or t.numel() == 0:
            return
        if not temporary:
            self._later.append((name, t))
            return
        fut = self._submit(name, t)
        self._temporary.append(fut)
        # Bounded: streamed slices are not kept alive faster than they are summed.
        while len(self._temporary) > 2:
            self._temporary.popleft().result()

    def _submit(self, name: str, t: torch.Tensor) -> Future:
        def run() -> None:
            self.values[name] = crc32c.crc32c(byte_view(t), value=self.values[name])

        fut = self._pool.submit(run)
        self._pending.append(fut)
        return fut

    def start(self) -> None:
        """Start the checksums of the model's own tensors (call before waiting on the disk)."""
        if self._pool is not None:
            for name, t in self._later:
                self._submit(name, t)
        self._later = []

    def finish(self) -> dict[str, int]:
        """Wait for all checksums; the CRC32C of every tensor seen, by name."""
        self.start()
        try:
            while self._pending:
                self._pending.popleft().result()
        finally:
            self.close()
        return self.values

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# ------------------------------------------------------------------------- temporary files
_HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
_OURS: set[str] = set()  # tokens of this process's saves in progress
_OURS_LOCK = threading.Lock()


def _tmp_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.tmp-"


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":  # pragma: no cover - no cheap liveness check: keep every file
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(path: str) -> list[str]:
    """Remove temporary files of ``path`` left by dead processes of this host; return them.

    ``.<name>.tmp-<host>-<pid>-<token>`` is stale when its host is this one and its process is
    gone (for this process's pid: not one of its saves in progress, as a container reuses
    pids). Files of other hosts and of live processes are never touched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _tmp_prefix(path)
    removed = []
    try:
        entries = [e.name for e in os.scandir(directory) if e.name.startswith(prefix)]
    except OSError:
        return removed
    for name in entries:
        parts = name[len(prefix):].rsplit("-", 2)
        if len(parts) != 3 or parts[0] != _HOST or not parts[1].isdigit():
            continue
        pid, token = int(parts[1]), parts[2]
        if pid == os.getpid():
            with _OURS_LOCK:
                stale = token not in _OURS
        else:
            stale = not _pid_alive(pid)
        if stale:
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:  # gone already, or not ours to remove
                pass
    return removed


@contextlib.contextmanager
def temp_path(path: str) -> Iterator[str]:
    """A new temporary file name next to ``path``, after removing stale ones (freeing space)."""
    remove_stale_temps(path)
    token = os.urandom(4).hex()
    directory = os.path.dirname(os.path.abspath(path))
    with _OURS_LOCK:
        _OURS.add(token)
    try:
        yield os.path.join(directory, f"{_tmp_prefix(path)}{_HOST}-{os.getpid()}-{token}")
    finally:
        with _OURS_LOCK:
            _OURS.discard(token)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the names in directory ``path`` durable (where the system lets a directory sync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - directories cannot be opened on some systems
        return
    try:
        with contextlib.suppress(OSError):  # nor fsynced on some
            os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Seal:
    """A file's header, rewritten once the checksums of the bytes written are known."""

    sums: Checksums
    build: Callable[[dict[str, int]], bytes]
    length: int

    def header(self) -> bytes:
        final = self.build(self.sums.finish())
        if len(final) != self.length:  # pragma: no cover - fixed-width digits
            raise AssertionError("safetensors header changed length when sealed")
        return final


_fdatasync = getattr(os, "fdatasync", os.fsync)


def write_file(path: str | os.PathLike, write: Callable[[BinaryIO], None],
               seal: Seal | None = None) -> None:
    """``write(f)`` into a temporary file next to ``path``, synced, then renamed to ``path``:
    readers find the old file or the new one, whole; a failure removes the temporary file.
    ``seal``: once ``write`` returns, its header is written over the bytes from byte 8 on."""
    with temp_path(os.fspath(path)) as tmp:
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                if seal is not None:
                    # The data syncs while the last checksums run; the header costs one page.
                    seal.sums.start()
                    os.fsync(f.fileno())
                    f.seek(8)
                    f.write(seal.header())
                    f.flush()
                    _fdatasync(f.fileno())
                else:
                    os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX and Windows
        except BaseException:
            if seal is not None:
                seal.sums.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def write_tensors(path: str | os.PathLike, header: Callable[[dict[str, int]], bytes],
                  tensors: Iterable[tuple[str, Iterable[tuple[torch.Tensor, bool]]]], *,
                  checksums: bool = True) -> None:
    """A safetensors file through `write_file`: ``header({})``, then each named tensor's
    chunks ``(contiguous host tensor, whether made for this write)``. With ``checksums``,
    ``header(crc32c by name)`` (the same length) replaces the first header before the rename."""
    # NOTE: the checksums are known once the bytes are written: the header goes out with zeros
    # in their place and is rewritten, the same length, before the file is synced and renamed.
    blob = header({})
    sums = Checksums(checksums)

    def write(f: BinaryIO) -> None:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, chunks in tensors:
            sums.begin(name)  # (a tensor with no rows yields no chunk)
            for t, temporary in chunks:
                sums.add(name, t, temporary=temporary)
                if t.numel():
                    f.write(byte_view(t))

    try:
        write_file(path, write, Seal(sums, header, len(blob)) if checksums else None)
    finally:
        sums.close()


def store_slices(store: Store, h: Handle, chunk: int) -> Iterator[torch.Tensor]:
    """``h``'s rows in slices of about ``chunk`` bytes, slice i+1 read while slice i is used."""
    per = max(1, chunk // max(1, h.row_nbytes))
    rows = h.shape[0]
    nxt = store.read_rows(h, slice(0, min(per, rows)))
    for a in range(0, rows, per):
        cur, b = nxt, min(a + per, rows)
        if b < rows:
            nxt = store.read_rows(h, slice(b, min(b + per, rows)))
        yield cur.result()


def build_header(metadata: dict[str, str], items: list[tuple]) -> bytes:
    """The safetensors header of ``items`` (``(name, dtype, shape, nbytes)`` in file order)
    under ``metadata``, padded with spaces to a multiple of 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in items:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r} in checkpoint")
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    if len(blob) > MAX_HEADER_BYTES:  # no reader (this one, safetensors) would open the file
        raise ValueError(f"the checkpoint's header would be {len(blob)} bytes, above the "
                         f"{MAX_HEADER_BYTES} safetensors allows: save fewer tensors per file, or "
                         "a smaller `extra`")
    return blob + b" " * (-len(blob) % _ALIGN)


def seal_header(blob: bytes) -> bytes:
    """``blob`` (a version 2 header) with its own checksum filled in."""
    if not blob.startswith(_HEAD):
        raise AssertionError("a version 2 header starts with its checksum")
    n = len(_HEAD)
    return blob[:n] + f"{header_crc(blob):08x}".encode() + blob[n + len(PLACEHOLDER):]


def header_crc(blob: bytes) -> int:
    """CRC32C of a version-2 header, its own checksum digits read as ``0``."""
    n = len(_HEAD)
    value = crc32c.crc32c(blob[:n])
    value = crc32c.crc32c(PLACEHOLDER.encode(), value=value)
    return crc32c.crc32c(blob[n + len(PLACEHOLDER):], value=value)


def _no_constant(name: str) -> None:
    # `save` writes non-finite floats as {"__float__": ...}, never as bare NaN / Infinity.
    raise ValueError(f"{name} is not JSON")


class Reader:
    """A checkpoint file, checked and memory-mapped: its metadata and its tensors by name.

    Length, header checksum, JSON and tensor table are checked on opening, before `load`
    changes anything. Tensors are zero-copy views of a private mapping, verified when asked for.
    """

    def __init__(self, path: str, *, verify: bool) -> None:
        self.path = path
        self.changed = False  # whether `load` has written anything yet (for error messages)
        self._mm: mmap.mmap | None = None
        self._mv: memoryview | None = None
        with open(open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                self._corrupt(f"it is {size} bytes long, too short for a safetensors header",
                              truncated=True)
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                self._corrupt(f"its header should be {n} bytes but only {size - 8} follow",
                              truncated=True)
            if n > MAX_HEADER_BYTES:  # checked before the header is read into memory
                self._corrupt(f"its header length field says {n} bytes, more than the "
                              f"{MAX_HEADER_BYTES} a safetensors header may have")
            raw = f.read(n)
            if len(raw) != n:
                self._corrupt(f"it ended while its header was read ({len(raw)} of {n} bytes)",
                              truncated=True)
            checked = raw.startswith(_HEAD)
            if checked:
                digits = raw[len(_HEAD):len(_HEAD) + 8]
                if not re.fullmatch(rb"[0-9a-f]{8}", digits) or int(digits, 16) != header_crc(
                        raw):
                    self._corrupt("its header (tensor table and metadata) does not match its "
                                  "checksum")
            self.meta, self.entries, data = self._parse(raw)
            self.version = self.meta.get("version", 0)
            if self.version >= 2 and not checked:
                self._corrupt("its header does not start with its checksum, as version "
                              f"{self.version} headers do")
            self.offset = 8 + n
            if size < self.offset + data:
                self._corrupt(f"it is {size} bytes long but its header describes "
                              f"{self.offset + data}", truncated=True)
            if size > self.offset + data:
                self._corrupt(f"it has {size - self.offset - data} bytes after the last tensor")
            self.crcs: dict[str, int] = {}
            if verify and self.version >= 2:
                self.crcs = self._checksums()
            self.data_bytes = data
            if data:
                # Copy-on-write: views are writable tensors, and never change the file.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._mv = memoryview(self._mm)
        self._verified: set[str] = set()
        self._ahead: _Ahead | None = None

    def _corrupt(self, what: str, *, truncated: bool = False, edited: bool = False) -> None:
        cause = ("the file is truncated (a copy or download cut short, or a full disk)"
                 if truncated else
                 "the file was edited or not written by hr.save" if edited else
                 "the file is damaged (a disk, copy or transfer error)")
        if not self.changed:
            state = "hr.load changed nothing"
            fix = "Load an earlier checkpoint, or copy this one again from its source"
        else:
            state = ("hr.load had already loaded the tensors stored before it (model first, then "
                     "optimizer state), not it nor those after: the model (and optimizer) now "
                     "mix old and new values")
            fix = ("Before training on, load an earlier checkpoint (it overwrites them all), or "
                   "copy this one again from its source and load it")
        raise CheckpointCorruptError(
            f"checkpoint {self.path!r} is corrupt: {what}; {cause}. {state}. {fix}"
        )

    def _parse(self, raw: bytes) -> tuple[dict[str, Any], dict[str, tuple], int]:
        try:
            md, tensors, length = parse_header(raw, 0)
        except HeaderError as e:
            self._corrupt(str(e))
        raw_meta = md.get("headroom")
        if raw_meta is None:
            raise ValueError(f"{self.path!r} is a safetensors file but not a headroom checkpoint")
        try:
            meta = json.loads(raw_meta, parse_constant=_no_constant)
        except RecursionError:
            self._corrupt("its headroom metadata is JSON nested too deeply")
        except ValueError as e:  # JSONDecodeError, NaN, an integer too long
            self._corrupt(f"its headroom metadata is not valid JSON ({e})")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{self.path!r}: unsupported checkpoint format "
                             f"{meta.get('format') if isinstance(meta, dict) else None!r}")
        version = meta.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise ValueError(f"{self.path!r}: checkpoint format version {version!r} is newer than "
                             f"this headroom reads ({VERSION}); upgrade headroom")
        entries = {name: (t.dtype, t.shape, t.offset, t.offset + t.nbytes)
                   for name, t in tensors.items()}
        return meta, entries, length

    def _checksums(self) -> dict[str, int]:
        table = self.meta.get("crc32c")
        if not isinstance(table, dict):
            self._corrupt("its metadata lacks the tensor checksums")
        crcs = {}
        for name in self.entries:
            value = table.get(name)
            if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{8}", value):
                self._corrupt(f"its metadata lacks a checksum for tensor {name!r}")
            crcs[name] = int(value, 16)
        return crcs

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple:
        try:
            return self.entries[name]
        except KeyError:
            self._corrupt(f"its metadata refers to tensor {name!r}, which it does not hold")

    def _crc(self, name: str, stop_event: threading.Event | None = None) -> int | None:
        """CRC32C of ``name``'s bytes, read in pieces (``None``: ``stop_event`` was set)."""
        _, _, start, stop = self._entry(name)
        a, b = self.offset + start, self.offset + stop
        if a < b and hasattr(self._mm, "madvise"):
            # Ask for the whole range at once: the kernel reads it ahead of the checksum's
            # page faults (~10% faster than faulting it in page by page here).
            page = (a // mmap.PAGESIZE) * mmap.PAGESIZE
            with contextlib.suppress(OSError):
                self._mm.madvise(mmap.MADV_WILLNEED, page, b - page)
        value = 0
        for s in range(a, b, _PIECE):
            if stop_event is not None and stop_event.is_set():
                return None
            value = crc32c.crc32c(self._mv[s:min(b, s + _PIECE)], value)
        return value

    def verify_ahead(self, names: list[str], window: int) -> None:
        """Verify ``names`` on a helper thread, in this order, ahead of their use, at most
        ``window`` bytes (or one tensor) ahead, so what it read is still in the page cache."""
        if self._ahead is None and self.crcs:
            planned = [n for n in names if n in self.crcs and n not in self._verified]
            self._ahead = _Ahead(self, planned, window)

    def verify(self, name: str) -> None:
        """Check ``name``'s bytes against their CRC32C (once), or raise naming the fix."""
        if name in self._verified or name not in self.crcs:
            return
        got = self._ahead.result(name) if self._ahead is not None else None
        if got is None:
            got = self._crc(name)
        if got != self.crcs[name]:
            _, _, start, stop = self._entry(name)
            self._corrupt(f"tensor {name!r} (file bytes {self.offset + start}-"
                          f"{self.offset + stop}) has CRC32C {got:08x}, its header recorded "
                          f"{self.crcs[name]:08x}")
        self._verified.add(name)

    def verify_all(self) -> None:
        """Check every tensor, in file order (reading the whole file into the page cache)."""
        for name in sorted(self.entries, key=lambda k: self.entries[k][2]):
            self.verify(name)

    def tensor(self, name: str) -> torch.Tensor:
        """``name`` as a view of the mapped file (verified first); clone what must outlive it."""
        dtype, shape, start, stop = self._entry(name)
        self.verify(name)
        if stop == start:
            return torch.empty(shape, dtype=dtype)
        n = (stop - start) // dtype.itemsize
        flat = torch.frombuffer(self._mm, dtype=dtype, count=n, offset=self.offset + start)
        return flat.view(shape)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.stop()  # before the mapping it reads goes
            self._ahead = None
        if self._mv is not None:
            self._mv.release()
            self._mv = None
        if self._mm is not None:
            # A view still alive somewhere keeps the mapping; it goes when that does.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ahead:
    """`Reader.verify_ahead`'s helper thread: checksums computed in a planned order."""

    def __init__(self, reader: Reader, names: list[str], window: int) -> None:
        self._reader = reader
        self._names = names
        self._pos = {n: i for i, n in enumerate(names)}
        self._sizes = [reader.entries[n][3] - reader.entries[n][2] for n in names]
        self._window = window
        self._crcs: dict[str, int] = {}
        self._used = 0  # names[:_used] have been asked for (or passed by one that was)
        self._done = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="headroom-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for i, name in enumerate(self._names):
                with self._cond:
                    while (not self._stop.is_set() and i > self._used
                           and sum(self._sizes[self._used:i + 1]) > self._window):
                        self._cond.wait()
                if self._stop.is_set():
                    return
                value = self._reader._crc(name, self._stop)
                if value is None:
                    return
                with self._cond:
                    self._crcs[name] = value
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def result(self, name: str) -> int | None:
        """The helper's CRC32C of ``name``; ``None``: not planned, or stopped (caller computes)."""
        i = self._pos.get(name)
        if i is None:
            return None
        with self._cond:
            self._used = max(self._used, i + 1)
            self._cond.notify_all()
            while name not in self._crcs and not self._done:
                self._cond.wait()
            return self._crcs.get(name)

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()


def available_memory() -> int:
    """Bytes this process can still fill without swapping (0 when unknown): ``MemAvailable``
    or the free pages, capped by a cgroup v2 memory limit."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = max(0, int(limit) - int(f.read()))
            avail = min(avail, room) if avail else room
    except (OSError, ValueError):
        pass
    return avail
