"""Giving freed host memory back to the operating system when large buffers churn.

glibc serves large requests with ``mmap`` until the first such free, then from the heap, where
freed memory mostly stays with the process: offloading on the CPU frees and reallocates a
block's parameters every use, so resident memory grows past what is live. `HeapTrimmer`
returns it (``malloc_trim``) once enough bytes were freed. A trim returns *every* free page,
each faulted in again at its next use; `release_pages` gives back exactly one buffer's pages
instead (``madvise(MADV_DONTNEED)``, Linux only). Elsewhere both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

import torch

__all__ = ["HeapTrimmer", "release_pages", "trim_heap"]

_libc = None
_madvise = None
if sys.platform.startswith("linux"):
    try:
        _any = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _madvise = _any.madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
        _any.malloc_trim  # noqa: B018 - glibc only (musl has none; madvise stays usable)
        _libc = _any
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        _libc = None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4  # Linux: private anonymous pages read as zeros afterwards, RSS drops now


def trim_heap() -> bool:
    """Return the free memory of every malloc arena to the OS; False where unsupported."""
    if _libc is None or os.environ.get("HEADROOM_TRIM_HEAP", "1") == "0":
        return False
    _libc.malloc_trim(0)
    return True


def release_pages(tensor: torch.Tensor | torch.UntypedStorage) -> bool:
    """Give the whole pages of a host storage (or a tensor's) back to the OS now.

    For a storage about to be freed or refilled: its bytes read as zeros afterwards. Only
    private memory of PyTorch's CPU allocator is released (not shared, lent or device storage).
    Returns False where nothing was released.
    """
    if _madvise is None or os.environ.get("HEADROOM_TRIM_HEAP", "1") == "0":
        return False
    storage = tensor if isinstance(tensor, torch.UntypedStorage) else tensor.untyped_storage()
    if storage.device.type != "cpu" or not storage.resizable() or storage.is_shared():
        return False
    ptr = storage.data_ptr()
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + storage.nbytes()) // _PAGE * _PAGE
    if end <= start:
        return False
    return _madvise(start, end - start, _MADV_DONTNEED) == 0


class HeapTrimmer:
    """Counts freed host bytes; trims the heap each time ``threshold`` bytes were freed."""

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
