"""A model of PyTorch's CUDA caching allocator, for estimates on CUDA-like devices.

Requests round up to 512 bytes; up to 1 MiB they come from 2 MiB segments (the small pool),
larger ones from a free cached block (best fit, split when the rest is worth keeping) or a
segment of their own (20 MiB under 10 MiB, else rounded up to 2 MiB). Freed blocks merge with
free neighbours and stay ``reserved`` (a training step never calls ``empty_cache()``).

Not modelled: several streams, ``PYTORCH_CUDA_ALLOC_CONF`` settings (``expandable_segments``,
``max_split_size_mb``, ``roundup_power2_divisions``), the CUDA context and library workspaces,
and kernels' scratch memory outside tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

_ROUND = 512
_SMALL = 1 << 20  # largest request served by the small pool
_SMALL_SEGMENT = 2 << 20
_MIN_LARGE_ALLOC = 10 << 20
_LARGE_SEGMENT = 20 << 20
_ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """The block size the allocator uses for a request of ``nbytes``."""
    return _ROUND * max(1, -(-nbytes // _ROUND))


def segment_size(size: int) -> int:
    """The size of a new segment the allocator maps for a block of ``size`` bytes."""
    if size <= _SMALL:
        return _SMALL_SEGMENT
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_SEGMENT
    return _ROUND_LARGE * -(-size // _ROUND_LARGE)


@dataclass(slots=True, eq=False)
class _Block:
    segment: int
    small: bool
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocatorModel:
    """Replays allocations and frees; keeps ``allocated`` and ``reserved`` and their peaks."""

    def __init__(self) -> None:
        # free blocks per pool, sorted by (size, segment, offset) for best fit
        self._free: dict[bool, list[tuple[int, int, int, _Block]]] = {True: [], False: []}
        self._live: dict[int, _Block] = {}
        self._segments = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments_peak = 0

    def malloc(self, key: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        size = round_size(nbytes)
        small = size <= _SMALL
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            block = pool.pop(i)[3]
        else:
            seg = segment_size(size)
            self._segments += 1
            block = _Block(self._segments, small, 0, seg)
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.segments_peak = max(self.segments_peak, self._segments)
        rest = block.size - size
        # split a small block if at least 512 bytes remain, a large one if more than 1 MiB
        if (small and rest >= _ROUND) or (not small and rest > _SMALL):
            tail = _Block(block.segment, small, block.offset + size, rest)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert(tail, small)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        small = block.small
        block.free = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove(other, small)
                if other is block.prev:
                    _absorb(other, block)
                    block = other
                else:
                    _absorb(block, other)
        self._insert(block, small)

    def _insert(self, block: _Block, small: bool) -> None:
        bisect.insort(self._free[small], (block.size, block.segment, block.offset, block))

    def _remove(self, block: _Block, small: bool) -> None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (block.size, block.segment, block.offset))
        if i < len(pool) and pool[i][3] is block:
            pool.pop(i)
        else:  # pragma: no cover - pools are kept consistent above
            pool[:] = [e for e in pool if e[3] is not block]


def _absorb(left: _Block, right: _Block) -> None:
    """Merge free ``right`` into its neighbour ``left``."""
    left.size += right.size
    left.next = right.next
    if right.next is not None:
        right.next.prev = left
