"""Checksums of a file as byte segments: CRC32C per range, combined and trimmed as rows change.

A tensor file is covered by sorted, non-overlapping segments ``[start, end, crc]``: ``crc`` is
the CRC32C of those bytes, ``None`` when not known (the rest of a segment a row write cut
into), or `BAD` for bytes known wrong (a torn write, kept by ``recover=True``).
"""

from __future__ import annotations

import bisect
import threading

import crc32c as _crc32c

__all__ = ["BAD", "Segments", "combine", "crc", "crc_of_range", "put", "scan", "zeros_crc"]

BAD = "bad"
Crc = int | str | None
Segments = list[list]  # [[start, end, crc], ...]

_MASK = 0xFFFFFFFF


def crc(buf, value: int = 0) -> int:
    """CRC32C of ``buf`` (any buffer), continuing from ``value`` (a previous result)."""
    return _crc32c.crc32c(buf, value)


# ------------------------------------------------------------------ combining CRCs
# Appending zero bytes to the CRC register is linear over GF(2): crc(AB) = Z^len(B) crc(A) ^
# crc(B), where Z appends one zero byte (the pre/post inversions cancel). Z^(2^k) is kept as
# four byte-indexed tables, so combining costs a few hundred operations, not a pass over B.
_powers: list[tuple[list[int], ...]] = []
_powers_lock = threading.Lock()


def _tables(images: list[int]) -> tuple[list[int], ...]:
    """Byte-indexed lookup tables of the linear map with ``images[i]`` = map(1 << i)."""
    out = []
    for byte in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ images[byte * 8 + low.bit_length() - 1]
        out.append(t)
    return tuple(out)


def _apply(tables: tuple[list[int], ...], v: int) -> int:
    t0, t1, t2, t3 = tables
    return t0[v & 255] ^ t1[(v >> 8) & 255] ^ t2[(v >> 16) & 255] ^ t3[v >> 24]


def _power(k: int) -> tuple[list[int], ...]:
    """Tables of Z^(2^k): append 2^k zero bytes to a CRC."""
    if k < len(_powers):
        return _powers[k]
    with _powers_lock:
        if not _powers:
            zero = crc(b"\0")
            _powers.append(_tables([crc(b"\0", 1 << i) ^ zero for i in range(32)]))
        while len(_powers) <= k:
            prev = _powers[-1]
            _powers.append(_tables([_apply(prev, _apply(prev, 1 << i)) for i in range(32)]))
    return _powers[k]


def _shift(c: int, n: int) -> int:
    """Z^n c: the CRC register ``c`` after ``n`` more zero bytes (without the final ^ crc(0s))."""
    k = 0
    while n:
        if n & 1:
            c = _apply(_power(k), c)
        n >>= 1
        k += 1
    return c


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``."""
    return _shift(crc_a, len_b) ^ crc_b


def zeros_crc(n: int) -> int:
    """CRC32C of ``n`` zero bytes (what a freshly allocated, zero-filled file holds)."""
    return _shift(_MASK, n) ^ _MASK


# ------------------------------------------------------------------ segment lists
def _rest(c: Crc) -> Crc:
    """What is known about part of a segment with ``c``: a CRC does not split; bad stays bad."""
    return BAD if c == BAD else None


def _merge(a: list, b: list) -> list:
    if a[2] == BAD or b[2] == BAD:
        c: Crc = BAD
    elif a[2] is None or b[2] is None:
        c = None
    else:
        c = combine(a[2], b[2], b[1] - b[0])
    return [a[0], b[1], c]


def put(segs: Segments, start: int, end: int, c: Crc, cap: int) -> None:
    """Record that bytes ``[start, end)`` now have checksum ``c`` (in place).

    Segments cut by the new one keep their other parts, unknown (or still bad); unknown or bad
    neighbours are joined. Past ``cap`` segments, neighbours are merged pairwise (bad wins over
    unknown, unknown over known), so sparse row writes keep the index bounded.
    """
    if end <= start:
        return
    starts = [s[0] for s in segs]
    i = max(0, bisect.bisect_right(starts, start) - 1)
    j = i
    while j < len(segs) and segs[j][0] < end:
        j += 1
    new: Segments = []
    if i < len(segs) and segs[i][0] < start:
        new.append([segs[i][0], start, _rest(segs[i][2])])
    new.append([start, end, c])
    if j > i and segs[j - 1][1] > end:
        new.append([end, segs[j - 1][1], _rest(segs[j - 1][2])])
    segs[i:j] = new
    _join(segs, max(0, i - 1), min(len(segs), i + len(new) + 1))
    while len(segs) > cap:
        merged = [_merge(segs[k], segs[k + 1]) for k in range(0, len(segs) - 1, 2)]
        if len(segs) % 2:
            merged.append(segs[-1])
        segs[:] = merged
        _join(segs, 0, len(segs))


def _join(segs: Segments, lo: int, hi: int) -> None:
    """Join neighbours in ``segs[lo:hi]`` that are both unknown or both bad."""
    k = lo
    while k + 1 < min(hi, len(segs)):
        a, b = segs[k], segs[k + 1]
        if a[2] == b[2] and (a[2] is None or a[2] == BAD):
            a[1] = b[1]
            del segs[k + 1]
            hi -= 1
        else:
            k += 1


def scan(segs: Segments, ranges: list[tuple[int, int]]) -> tuple[list[list], list[list]]:
    """For sorted, disjoint ``ranges``: the known segments entirely inside one of them, and the
    bad segments overlapping any."""
    starts = [s[0] for s in segs]
    has_bad = any(s[2] == BAD for s in segs)
    covered: list[list] = []
    bad: list[list] = []
    for a, b in ranges:
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(segs) and segs[i][0] < b:
            s = segs[i]
            if has_bad and s[2] == BAD and s[1] > a:
                bad.append(s)
            elif s[0] >= a and s[1] <= b and isinstance(s[2], int):
                covered.append(s)
            i += 1
    return covered, bad


def crc_of_range(segs: Segments, start: int, end: int) -> int | None:
    """The CRC of ``[start, end)`` when known segments tile it exactly, else ``None``."""
    i = bisect.bisect_left([s[0] for s in segs], start)
    out, at = None, start
    while i < len(segs) and segs[i][1] <= end:
        s, e, c = segs[i]
        if s != at or not isinstance(c, int):
            return None
        out = c if out is None else combine(out, c, e - s)
        at, i = e, i + 1
    return out if at == end else None
