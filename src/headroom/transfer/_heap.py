"""Giving freed host memory back to the operating system when large buffers churn.

glibc's ``malloc`` serves a large request with ``mmap`` and returns it with ``munmap`` on free,
until the first such free: then it raises its threshold to that size (up to 32 MiB) and serves
later requests of that size from the heap, where freed memory mostly stays with the process.
Offloading on the CPU frees a block's worth of parameters after every use and allocates it again
for the next, so after the first step the process's resident memory grows well past what is
live (``benchmarks/rss_disk_training.py`` measures it). `HeapTrimmer` returns it
(``malloc_trim``) once enough bytes were freed since the last time, at the moments the caller
knows a large buffer was freed. Elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

__all__ = ["HeapTrimmer", "trim_heap"]

_libc = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _libc.malloc_trim  # noqa: B018 - glibc only (musl has none)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        _libc = None


def trim_heap() -> bool:
    """Return the free memory of every malloc arena to the OS; False where unsupported."""
    if _libc is None or os.environ.get("HEADROOM_TRIM_HEAP", "1") == "0":
        return False
    _libc.malloc_trim(0)
    return True


class HeapTrimmer:
    """Counts freed host bytes; trims the heap each time ``threshold`` bytes were freed.

    Args:
        threshold: bytes freed between trims (a trim costs about as much as unmapping them).
    """

    def __init__(self, threshold: int = 8 << 20) -> None:
        self.threshold = threshold
        self._freed = 0
        self._lock = threading.Lock()

    def freed(self, nbytes: int) -> None:
        """Note ``nbytes`` of host memory just freed; trims when enough has been."""
        with self._lock:
            self._freed += nbytes
            if self._freed < self.threshold:
                return
            self._freed = 0
        trim_heap()
