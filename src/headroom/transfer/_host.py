"""Host memory: a store of host tensors, page-locked from a budgeted pool when feeding a device."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import torch

from headroom.transfer._handle import Handle
from headroom.transfer._store import Store, StoreFullError, done

__all__ = ["HostStore", "PinnedPool", "default_pinned_budget"]


def default_pinned_budget() -> int:
    """Half of physical memory: page-locked memory cannot be swapped, so leave the OS room."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


class PinnedPool:
    """Reusable host byte buffers, page-locked when ``pin`` is true, under a byte budget.

    Buffers are cached by size when given back, so steady-state training allocates no new
    page-locked memory (pinning is slow: it maps and locks every page).

    Args:
        pin: allocate page-locked memory (needs an accelerator runtime).
        max_bytes: budget for all buffers handed out plus cached; ``None`` for no limit.
    """

    def __init__(self, *, pin: bool, max_bytes: int | None = None) -> None:
        self.pin = pin
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        """Bytes held by the pool (in use plus cached)."""
        return self._total

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host buffer of exactly ``nbytes`` (contents undefined)."""
        with self._lock:
            cached = self._free.get(nbytes)
            if cached:
                return cached.pop()
            if self.max_bytes is not None and self._total + nbytes > self.max_bytes:
                self._trim(self._total + nbytes - self.max_bytes)
                if self._total + nbytes > self.max_bytes:
                    raise StoreFullError(
                        f"store full: budget {self.max_bytes} bytes, need {self._total + nbytes};"
                        " raise budget (max_bytes=) or use DiskStore"
                    )
            self._total += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from `take` for reuse."""
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)

    def forget(self, buf: torch.Tensor) -> None:
        """Drop a buffer from `take` entirely (its memory goes back to the system)."""
        with self._lock:
            self._total -= buf.numel()

    def _trim(self, need: int) -> None:
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and need > 0:
                bufs.pop()
                self._total -= size
                need -= size
            if not bufs:
                del self._free[size]
            if need <= 0:
                return

    def clear(self) -> None:
        """Drop all cached buffers."""
        with self._lock:
            for size, bufs in self._free.items():
                self._total -= size * len(bufs)
            self._free.clear()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (any dtype)."""
    return t.reshape(-1).view(torch.uint8)


class HostStore(Store):
    """Tensors resting in host memory; reads and writes complete at once.

    Args:
        pin: page-lock the tensors so copies to an accelerator run asynchronously on a side
            stream. Costs pinning time once and memory the OS cannot swap; `resolve_store` turns
            it on when the compute device is an accelerator.
        max_bytes: byte budget; ``None`` means no limit when not pinned and half of physical
            memory when pinned.

    Raises:
        StoreFullError: from `put`/`alloc` when the budget is exhausted.

    Example:
        >>> store = HostStore()
        >>> h = store.put("w", torch.ones(2, 3))
        >>> store.read(h).result().sum().item()
        6.0
    """

    def __init__(self, *, pin: bool = False, max_bytes: int | None = None) -> None:
        if pin and max_bytes is None:
            max_bytes = default_pinned_budget()
        super().__init__(max_bytes=max_bytes)
        # The store enforces the budget itself (it knows keys for the message); the pool
        # only recycles the page-locked buffers of freed tensors.
        self._pool = PinnedPool(pin=pin)
        self._pin = pin
        self._tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"HostStore(pin={self._pin}, used={self._used}, max_bytes={self.max_bytes})"

    @property
    def pinned(self) -> bool:
        return self._pin

    def alloc(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *, zero: bool = True
    ) -> Handle:
        handle = Handle.of(key, shape, dtype, self)
        self._reserve(handle)
        try:
            buf = self._pool.take(handle.nbytes)
        except BaseException:
            self._release(handle)
            raise
        t = buf.view(dtype).view(handle.shape) if handle.nbytes else torch.empty(shape, dtype=dtype)
        if zero:
            t.zero_()
        with self._lock:
            self._tensors[key] = (t, buf)
        return handle

    def _tensor(self, handle: Handle) -> torch.Tensor:
        self._check(handle)
        return self._tensors[handle.key][0]

    def host_tensor(self, handle: Handle) -> torch.Tensor | None:
        return self._tensor(handle)

    def read(self, handle: Handle, out: torch.Tensor | None = None) -> Future:
        t = self._tensor(handle)
        if out is None:
            return done(t.clone())
        self._out(handle, out, handle.shape).copy_(t)
        return done(out)

    def write(self, handle: Handle, src: torch.Tensor) -> Future:
        t = self._tensor(handle)
        self._check_src(handle, src, handle.shape)
        t.copy_(src)
        return done(None)

    def read_rows(
        self, handle: Handle, rows: slice | torch.Tensor, out: torch.Tensor | None = None
    ) -> Future:
        t = self._tensor(handle)
        rows = self._check_rows(handle, rows)
        dst = self._out(handle, out, self._rows_shape(handle, rows))
        if isinstance(rows, slice):
            dst.copy_(t[rows])
        else:
            torch.index_select(t, 0, rows, out=dst)
        return done(dst)

    def write_rows(self, handle: Handle, rows: slice | torch.Tensor, src: torch.Tensor) -> Future:
        t = self._tensor(handle)
        rows = self._check_rows(handle, rows)
        self._check_src(handle, src, self._rows_shape(handle, rows))
        if isinstance(rows, slice):
            t[rows].copy_(src)
        else:
            t.index_copy_(0, rows, src)
        return done(None)

    def free(self, handle: Handle) -> None:
        self._check(handle)
        with self._lock:
            _, buf = self._tensors.pop(handle.key)
            self._release(handle)
        if handle.nbytes:
            if self._pin:
                self._pool.give(buf)
            else:
                self._pool.forget(buf)

    def close(self) -> None:
        with self._lock:
            for key in list(self._tensors):
                self.free(self._handles[key])
        self._pool.clear()
