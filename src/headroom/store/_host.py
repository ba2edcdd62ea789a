"""Host memory: a store of host tensors (page-locked slabs when feeding a device), and a pool
of reusable page-locked buffers."""

from __future__ import annotations

import math
import threading
import weakref
from concurrent.futures import Future

import torch

from headroom.store._handle import Handle
from headroom.store._pinned import PinnedArena, Slab, _backend, alloc_slab, release_all, spent
from headroom.store._store import Store, StoreFullError, done, is_accelerator

__all__ = ["HostStore", "PinnedPool", "add_into", "resolve_store"]

# Elements `add_into` converts at a time: 8 MiB of fp32, cache-sized, worth a thread per core.
_ADD_CHUNK = 1 << 21
_scratch = threading.local()


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.add_(src)``, bitwise, faster on the host when ``src`` is a narrower float.

    NOTE: a CPU ``add_`` across dtypes takes a path 5-7 times slower than a cast and a
    same-dtype add. When ``dst.dtype`` is the promoted dtype (the cast is exact), ``src`` is
    cast chunk by chunk through a scratch buffer of this thread's (no tensor-sized temporary).
    """
    if (dst.dtype == src.dtype or torch.promote_types(dst.dtype, src.dtype) != dst.dtype
            or dst.device.type != "cpu" or src.device.type != "cpu"
            or not (dst.is_contiguous() and src.is_contiguous()) or dst.shape != src.shape
            or dst.numel() <= _ADD_CHUNK // 8):
        dst.add_(src)
        return
    buf = getattr(_scratch, str(dst.dtype), None)
    if buf is None:
        buf = torch.empty(_ADD_CHUNK, dtype=dst.dtype)
        setattr(_scratch, str(dst.dtype), buf)
    d, s = dst.view(-1), src.view(-1)
    n = d.numel()
    for a in range(0, n, _ADD_CHUNK):
        b = min(n, a + _ADD_CHUNK)
        tmp = buf[:b - a]
        tmp.copy_(s[a:b])
        d[a:b].add_(tmp)


class PinnedPool:
    """Reusable host byte buffers, page-locked when ``pin`` is true, under a byte budget.

    Buffers are cached by size when given back, so steady-state training pins no new memory.
    Each is a slab of its own (see `headroom.store._pinned`), which `forget`, `clear` and the
    trimming under the budget give back to the system.

    Args:
        pin: allocate page-locked memory (plain memory where no accelerator runtime can pin).
        max_bytes: budget for all buffers handed out plus cached, as spent; ``None`` for no
            limit of its own (the process's page-locked budget still holds).
        device: the accelerator the buffers feed.
    """

    def __init__(self, *, pin: bool, max_bytes: int | None = None,
                 device: torch.device | None = None) -> None:
        self.pin = pin
        self.max_bytes = max_bytes
        self.device = device
        self._free: dict[int, list[torch.Tensor]] = {}
        self._slabs: dict[int, Slab] = {}  # data_ptr of a buffer handed out or cached -> slab
        self._total = 0
        self._lock = threading.Lock()
        # A pool dropped without `clear` gives its bytes back to the process budget all the same.
        weakref.finalize(self, release_all, self._slabs)

    @property
    def total_bytes(self) -> int:
        """Bytes held by the pool (in use plus cached), as the allocator spends them."""
        return self._total

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host buffer of exactly ``nbytes`` (contents undefined)."""
        with self._lock:
            cached = self._free.get(nbytes)
            if cached:
                return cached.pop()
            cost = spent(nbytes, _backend(self.pin, self.device))
            if self.max_bytes is not None and self._total + cost > self.max_bytes:
                self._trim(self._total + cost - self.max_bytes)
                if self._total + cost > self.max_bytes:
                    raise StoreFullError(
                        f"store full: budget {self.max_bytes} bytes, need {self._total + cost};"
                        " raise budget (max_bytes=) or use DiskStore")
            slab = alloc_slab(nbytes, pin=self.pin, device=self.device)
            buf = slab.tensor[:nbytes]
            self._slabs[buf.data_ptr()] = slab
            self._total += slab.spent
            return buf

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from `take` for reuse (the caller orders copies using it first)."""
        with self._lock:
            self._free.setdefault(buf.numel() * buf.element_size(), []).append(
                buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf)

    def forget(self, buf: torch.Tensor) -> None:
        """Drop a buffer from `take` entirely (its memory goes back to the system)."""
        with self._lock:
            self._release(buf)

    def _release(self, buf: torch.Tensor) -> None:
        slab = self._slabs.pop(buf.data_ptr(), None)
        if slab is not None:
            self._total -= slab.spent
            slab.release()

    def _trim(self, need: float) -> None:
        """Release cached buffers, largest first, until ``need`` bytes are freed."""
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and need > 0:
                buf = bufs.pop()
                before = self._total
                self._release(buf)
                need -= before - self._total
            if not bufs:
                del self._free[size]
            if need <= 0:
                return

    def clear(self) -> None:
        """Drop all cached buffers (their memory goes back to the system)."""
        with self._lock:
            self._trim(math.inf)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (any dtype)."""
    return t.reshape(-1).view(torch.uint8)


class HostStore(Store):
    """Tensors resting in host memory; reads and writes complete at once.

    A pinned store carves its tensors out of a few large page-locked slabs (a `PinnedArena`),
    counted against the process's page-locked budget (`headroom.store.pinned_bytes`) and given
    back to the system when a slab's tensors are freed or the store is garbage-collected. A
    store cannot be pickled or copied (`TypeError`).

    Args:
        pin: page-lock the tensors so copies to an accelerator run asynchronously on a side
            stream (costs pinning time once and memory the OS cannot swap); `resolve_store`
            turns it on for an accelerator. Without an accelerator runtime the slabs are plain
            memory, counted the same way.
        max_bytes: byte budget, on what the store's memory costs (whole slabs when pinned);
            ``None``: no limit of its own (the process's page-locked budget still holds).
        device: the accelerator a pinned store feeds (default: the current accelerator).

    Raises:
        StoreFullError: from `put`/`alloc` when the budget is exhausted.

    Example:
        >>> store = HostStore()
        >>> h = store.put("w", torch.ones(2, 3))
        >>> store.read(h).result().sum().item()
        6.0
    """

    def __init__(self, *, pin: bool = False, max_bytes: int | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__(max_bytes=max_bytes)
        self._pin = pin
        self._arena = None
        if pin:
            if device is None and torch.accelerator.is_available():
                device = torch.accelerator.current_accelerator()
            dev = torch.device(device) if device is not None else None
            if dev is not None and dev.type not in ("cpu", "meta") and dev.index is None:
                dev = torch.device(dev.type, torch.accelerator.current_device_index())
            self._arena = PinnedArena(pin=True, device=dev, max_bytes=max_bytes)
        self._tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"HostStore(pin={self._pin}, used={self._used}, max_bytes={self.max_bytes})"

    @property
    def pinned(self) -> bool:
        return self._pin

    @property
    def spent_bytes(self) -> int:
        """What the store's memory costs: its slabs when pinned, else its tensors' bytes."""
        return self._arena.spent_bytes if self._arena is not None else self._used

    def reserve(self, sizes) -> None:
        """Room for tensors of these byte sizes, allocated next, in one slab when pinned."""
        if self._arena is not None:
            self._arena.reserve(list(sizes))

    def alloc(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *, zero: bool = True
    ) -> Handle:
        handle = Handle.of(key, shape, dtype, self)
        self._reserve(handle)
        try:
            if not handle.nbytes:
                buf = None
            elif self._arena is not None:
                buf = self._arena.take(handle.nbytes)
            else:
                buf = torch.empty(handle.nbytes, dtype=torch.uint8)
        except BaseException:
            self._release(handle)
            raise
        t = buf.view(dtype).view(handle.shape) if buf is not None else torch.empty(
            shape, dtype=dtype)
        if zero:
            t.zero_()
        with self._lock:
            self._tensors[key] = (t, buf)
        return handle

    def host_tensor(self, handle: Handle) -> torch.Tensor:
        self._check(handle)
        return self._tensors[handle.key][0]

    def read(self, handle: Handle, out: torch.Tensor | None = None) -> Future:
        t = self.host_tensor(handle)
        if out is None:
            return done(t.clone())
        self._out(handle, out, handle.shape).copy_(t)
        return done(out)

    def write(self, handle: Handle, src: torch.Tensor) -> Future:
        t = self.host_tensor(handle)
        self._check_src(handle, src, handle.shape)
        t.copy_(src)
        return done(None)

    def read_rows(
        self, handle: Handle, rows: slice | torch.Tensor, out: torch.Tensor | None = None
    ) -> Future:
        t = self.host_tensor(handle)
        rows = self._check_rows(handle, rows)
        dst = self._out(handle, out, self._rows_shape(handle, rows))
        if isinstance(rows, slice):
            dst.copy_(t[rows])
        else:
            torch.index_select(t, 0, rows, out=dst)
        return done(dst)

    def write_rows(self, handle: Handle, rows: slice | torch.Tensor, src: torch.Tensor) -> Future:
        t = self.host_tensor(handle)
        rows = self._check_rows(handle, rows)
        self._check_src(handle, src, self._rows_shape(handle, rows))
        if isinstance(rows, slice):
            t[rows].copy_(src)
        else:
            t.index_copy_(0, rows, src)
        return done(None)

    def free(self, handle: Handle) -> None:
        """Forget the tensor (copies using it must have finished); an empty slab is released."""
        self._check(handle)
        with self._lock:
            _, buf = self._tensors.pop(handle.key)
            self._release(handle)
            if buf is not None and self._arena is not None:
                self._arena.give(buf)

    def close(self) -> None:
        with self._lock:
            for key in list(self._tensors):
                self.free(self._handles[key])
            if self._arena is not None:
                self._arena.close()


def resolve_store(store: str | Store, device: str | torch.device | None = None) -> Store:
    """Turn the ``store=`` argument of the public API into a `Store`.

    Args:
        store: ``"cpu"`` for host memory (a `HostStore`, page-locked when ``device`` is an
            accelerator), or a `Store` instance (e.g. ``DiskStore(path)``), returned as is.
        device: the compute device the store feeds.

    Raises:
        ValueError: an unknown store name.
    """
    if isinstance(store, Store):
        return store
    if isinstance(store, str) and store in ("cpu", "host"):
        dev = torch.device(device) if device is not None else torch.device("cpu")
        acc = is_accelerator(dev)
        return HostStore(pin=acc, device=dev if acc else None)
    raise ValueError(f"unknown store {store!r}: use 'cpu' (host memory) or a store object such"
                     " as headroom.DiskStore(path)")
