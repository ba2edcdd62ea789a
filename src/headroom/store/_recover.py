"""Reopening a `DiskStore`: finish the journal's story, verify checksums, decide what opens.

See [Note: DiskStore journal]. A write the previous process did not finish is checked against
the file: all new bytes (completed), all old (never started), or a mix (torn). A missing or
short file that was never written is recreated (it held zeros). Problems raise
`StoreCorruptError` before anything in the folder changes, unless ``recover``: then damaged
ranges are marked bad and unaccounted files are renamed ``NAME.unaccounted``, never deleted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import warnings
from concurrent.futures import Executor
from pathlib import Path

from headroom.store._ledger import Ledger, not_regular, open_file
from headroom.store._safetensors import crc_of_file
from headroom.store._segments import combine, crc_of_range, zeros_crc
from headroom.store._store import SCRATCH, StoreCorruptError, StoreFullError

__all__ = ["ASIDE", "file_crcs", "open_checks", "range_crc"]

_PIECE = 16 << 20  # a range is checksummed in pieces of this size, spread over the threads
_BUF = 4 << 20
ASIDE = ".unaccounted"  # recover=True renames a file it cannot account for with this suffix


def range_crc(path: str, start: int, length: int, page_cache: bool) -> int | None:
    """CRC32C of ``length`` bytes of ``path`` at ``start``; ``None`` if the file is shorter."""
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        c = crc_of_file(fd, start, length, memoryview(bytearray(min(length, _BUF))))
        if c is not None and not page_cache:
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return c


def file_crcs(ranges: list[tuple[str, int, int]], pool: Executor,
              page_cache: bool = True) -> list[int | None]:
    """CRC32C of each ``(file, start, end)`` range, read in parallel pieces; ``None``: short."""
    jobs = []
    for path, start, end in ranges:
        pieces = [(s, min(end, s + _PIECE)) for s in range(start, end, _PIECE)]
        jobs.append([(s, e, pool.submit(range_crc, path, s, e - s, page_cache))
                     for s, e in pieces])
    out: list[int | None] = []
    for pieces in jobs:
        c: int | None = 0  # the CRC of no bytes; combined with a piece's, that piece's
        for s, e, fut in pieces:
            part = fut.result()
            c = None if part is None or c is None else combine(c, part, e - s)
        out.append(c)
    return out


def _first10(items: list[str], sep: str = ", ") -> str:
    """The first 10 of ``items``, then how many more."""
    return sep.join(items[:10]) + (f" and {len(items) - 10} more" if len(items) > 10 else "")


def _resolve_unfinished(ledger: Ledger, keys) -> None:
    """The writes to ``keys`` in flight when the last process stopped count as not written."""
    for rid in [rid for rid, w in ledger.inflight.items() if w["k"] in keys]:
        ledger.resolve(rid, "none")


def _move_aside(path: Path, names: list[str]) -> list[str]:
    """Rename each file to ``NAME.unaccounted`` (``.1``, ``.2``... if taken); the new names."""
    out = []
    for name in names:
        new, k = name + ASIDE, 0
        while os.path.lexists(path / new):
            k += 1
            new = f"{name}{ASIDE}.{k}"
        os.rename(path / name, path / new)
        out.append(new)
    return out


def open_checks(ledger: Ledger, pool: Executor, *, verify: bool, recover: bool,
                page_cache: bool) -> None:
    """Check a store being opened; raise (nothing changed), or mark damage (``recover``)."""
    path = ledger.path
    unaccounted = ledger.unaccounted()
    if unaccounted and not recover:
        raise StoreCorruptError(
            f"DiskStore {str(path)!r}: {len(unaccounted)} tensor file(s) in the folder are"
            f" accounted for by neither index.json nor journal.jsonl: {_first10(unaccounted)}."
            " A tensor's index entry may be lost (damaged, or a power loss after the last"
            " flush()), or the file put there by hand. The folder was not changed. Restore"
            " index.json and journal.jsonl from their backup; or open with DiskStore(path,"
            f" recover=True), which renames each to NAME{ASIDE} (not deleted) and opens without"
            " them, then hr.load(checkpoint, model, optimizer); or start over with"
            " DiskStore(path, overwrite=True)", str(path))
    problems: list[tuple[str, int, int, str]] = []
    recreate: list[str] = []  # keys whose missing or short file is recreated (zero-filled)
    sizes: dict[str, int] = {}
    # Scratch keys of a stopped process are dropped after opening, unchecked.
    _resolve_unfinished(ledger, [w["k"] for w in ledger.inflight.values()
                                 if w["k"].startswith(SCRATCH)])
    for key, e in ledger.entries.items():
        if key.startswith(SCRATCH):
            continue
        f = path / e["file"]
        n = e["nbytes"]
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            size = -1
        else:
            if not stat.S_ISREG(st.st_mode):  # never read, written or replaced through
                raise not_regular(f, "is a symbolic link" if stat.S_ISLNK(st.st_mode) else
                               "is not a regular file", key)
            size = st.st_size
        sizes[key] = size
        if size >= n:
            continue
        never_written = e["segments"] == ([[0, n, zeros_crc(n)]] if n else []) and not any(
            w["k"] == key for w in ledger.inflight.values())
        recreate.append(key)
        if not never_written:
            why = "file missing" if size < 0 else f"file holds {size} of {n} bytes"
            problems.append((key, 0, n, why))
    lost = {k for k, *_ in problems}

    # Writes the last process started and did not finish.
    pending = [(rid, w) for rid, w in sorted(ledger.inflight.items()) if w["k"] not in lost]
    ranges = [(str(path / ledger.entries[w["k"]]["file"]), int(o), int(o) + int(ln))
              for _, w in pending for o, ln, _ in w["x"]]
    got = iter(file_crcs(ranges, pool, page_cache))
    for rid, w in pending:
        segs = ledger.entries[w["k"]]["segments"]
        found = [(next(got), x) for x in w["x"]]  # each extent's bytes now: new, old or torn
        new = all(c is not None and c == x[2] for c, x in found)
        old = all(c is not None and c != x[2] and c == crc_of_range(segs, x[0], x[0] + x[1])
                  for c, x in found)
        ledger.resolve(rid, "ok" if new else "none")
        if not (new or old):
            problems += [(w["k"], int(o), int(o) + int(ln),
                          "a write was in flight when the process stopped and only part of it"
                          " reached the file") for o, ln, _ in w["x"]]
    _resolve_unfinished(ledger, lost)

    if verify:
        known = [(k, s, t, c) for k, e in ledger.entries.items()
                 if k not in lost and k not in recreate and not k.startswith(SCRATCH)
                 for s, t, c in e["segments"] if isinstance(c, int)]
        crcs = file_crcs([(str(path / ledger.entries[k]["file"]), s, t)
                          for k, s, t, _ in known], pool, page_cache)
        for (k, s, t, c), now in zip(known, crcs, strict=True):
            if now != c:
                problems.append((k, s, t, "the bytes do not match their checksum" if now is not
                                 None else "the file is shorter than the tensor"))

    # Sizes come from the index and journal: checked against the free space before allocating.
    free = shutil.disk_usage(path).free
    dropped: list[str] = []
    for key in sorted(recreate, key=lambda k: ledger.entries[k]["nbytes"]):
        need = ledger.entries[key]["nbytes"] - max(sizes[key], 0)
        if need <= free:
            free -= need
        else:
            dropped.append(key)
    if dropped and not recover:
        shown = "; ".join(f"{k!r} ({ledger.entries[k]['file']}, {ledger.entries[k]['nbytes']}"
                          " bytes)" for k in dropped[:10])
        raise StoreFullError(
            f"DiskStore {str(path)!r}: the file of {len(dropped)} tensor(s) is missing or short"
            f" and the disk has {shutil.disk_usage(path).free} bytes free, too few to create it"
            f" again: {shown}. The folder was not changed. Free space there; or, if the sizes"
            " are damaged, open it with DiskStore(path, recover=True), which drops these"
            " tensors, or start over with DiskStore(path, overwrite=True)")
    text = _first10([f"{k!r} ({ledger.entries[k]['file']}, bytes {s}-{e}: {why})"
                     for k, s, e, why in problems], "; ")
    keys = tuple(dict.fromkeys(k for k, *_ in problems))
    if problems and not recover:
        raise StoreCorruptError(
            f"DiskStore {str(path)!r}: {len(keys)} tensor(s) do not hold what the store wrote:"
            f" {text}. The folder was not changed. Open it with DiskStore(path, recover=True)"
            " (these bytes raise until written again), then hr.load(checkpoint, model,"
            " optimizer); or start over with DiskStore(path, overwrite=True)", str(path), keys)
    _resolve_unfinished(ledger, dropped)
    for key in dropped:
        ledger.drop(key)
    for key in recreate:
        if key not in dropped:
            _recreate(path / ledger.entries[key]["file"], ledger.entries[key]["nbytes"],
                      sizes[key] < 0)
    for k, s, t, _ in problems:
        if k not in dropped:
            ledger.mark_bad(k, s, t)
    aside = _move_aside(path, unaccounted)
    if problems or dropped or aside or ledger.skipped is not None:
        gone = _first10([repr(k) for k in dropped], "; ")
        moved = _first10(aside)
        warnings.warn(
            f"DiskStore {str(path)!r} opened with recover=True;"
            + (f" damaged and unreadable until rewritten: {text}." if problems else "")
            + (f" dropped (file missing, and too large for the disk): {gone}." if dropped
               else "")
            + (f" tensor files nothing accounted for, moved aside (not deleted): {moved}."
               if aside else "")
            + (f" journal.jsonl record {ledger.skipped}, the last, was damaged and skipped"
               " (the change it recorded is lost)." if ledger.skipped is not None else "")
            + " Restore them, e.g. hr.load(checkpoint, model, optimizer)",
            UserWarning, stacklevel=3)
    elif not ledger.was_clean and ledger.had_writes:
        checked = "all checksums verified" if verify else \
            "writes in flight checked; verify=False skipped the other checksums"
        warnings.warn(
            f"DiskStore {str(path)!r} was not closed after changing tensors since its last"
            f" flush(). Each tensor holds its last completed write ({checked}), but a training"
            " step may have been partly applied: for an exact continuation resume from a"
            " checkpoint (hr.load)", UserWarning, stacklevel=3)


def _recreate(file: Path, n: int, new: bool) -> None:
    """Make ``file`` ``n`` zero bytes, blocks reserved (a new file is removed on failure)."""
    fd = open_file(file, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 0)
        if n:
            os.posix_fallocate(fd, 0, n)
    except OSError as e:
        os.close(fd)
        if new:
            with contextlib.suppress(OSError):
                os.unlink(file)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise StoreFullError(
                f"DiskStore {str(file.parent)!r}: no room to create {file.name} ({n} bytes)"
                " again; free space there, or open with recover=True") from e
        raise
    os.close(fd)
