"""Page-locked host memory: slabs counted as the runtime spends them, one budget for the
process, and arenas that carve many tensors out of a few slabs.

torch's caching host allocator rounds each allocation up to a power of two and keeps freed
blocks cached, so pinning each tensor on its own costs up to 2x its bytes and freeing gives
nothing back. Here page-locked memory comes in slabs: on CUDA, host memory of exactly the
slab's size registered with ``cudaHostRegister`` (unregistered, and given back, on release);
on other accelerators, the caching allocator's power-of-two blocks, its cache emptied on
release; without an accelerator runtime, plain memory carved and counted the same way, so CI
runs that logic. Every slab counts against one process-wide budget (half of physical memory
unless `set_pinned_limit` says otherwise).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import weakref

import numpy as np
import torch

from headroom.store._store import StoreFullError

__all__ = ["PinnedArena", "Slab", "alloc_slab", "pinned_bytes", "release_all", "set_pinned_limit",
           "spent"]

_MIN_SLAB = 1 << 20
ALIGN = 64  # carved tensors start on a cache line, as torch's own host allocations do
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def default_pinned_budget() -> int:
    """Half of physical memory: page-locked memory cannot be swapped, so leave the OS room."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


class _Ledger:
    """Page-locked bytes this process holds through headroom, against a limit."""

    def __init__(self) -> None:
        # Reentrant: finalizers release slabs, perhaps in a thread that is inside `take`.
        self.lock = threading.RLock()
        self.spent = 0
        self.limit: int | None = None  # None: default_pinned_budget(), read when first needed

    def take(self, n: int) -> None:
        with self.lock:
            limit = self.limit if self.limit is not None else default_pinned_budget()
            if self.spent + n > limit:
                raise StoreFullError(
                    f"page-locked memory full: {self.spent} bytes pinned, {n} more needed, limit"
                    f" {limit}; raise it with headroom.store.set_pinned_limit(bytes), free pinned"
                    " stores (close(), hr.unoffload), or keep tensors on disk (DiskStore)")
            self.spent += n

    def give(self, n: int) -> None:
        with self.lock:
            self.spent -= n


_LEDGER = _Ledger()


def pinned_bytes() -> int:
    """Bytes of page-locked host memory headroom holds now, as the runtime spends them."""
    return _LEDGER.spent


def set_pinned_limit(nbytes: int | None) -> None:
    """Limit the page-locked memory headroom may hold (``None``: half of physical memory).

    Raises:
        ValueError: a negative limit.
    """
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"the pinned limit must be >= 0 or None, got {nbytes}")
    _LEDGER.limit = nbytes


def _backend(pin: bool, device: torch.device | None) -> str:
    """How a slab is made: ``register`` (CUDA), ``cache`` (other accelerators, ROCm included),
    ``stand-in`` (no accelerator runtime) or ``plain`` (not pinning); see the module docstring."""
    if not pin:
        return "plain"
    if device is not None and device.type == "cuda" and torch.version.cuda is not None \
            and torch.cuda.is_available():
        return "register"
    if torch.accelerator.is_available():
        return "cache"
    return "stand-in"


def spent(nbytes: int, backend: str) -> int:
    """What a slab of ``nbytes`` costs with ``backend``."""
    if nbytes <= 0:
        return 0
    if backend == "cache":
        return 1 << (nbytes - 1).bit_length()
    if backend == "register":
        return -(-nbytes // _PAGE) * _PAGE
    return nbytes


class Slab:
    """One allocation of host memory (a 1-D uint8 tensor), page-locked unless ``pinned`` is
    false, and what it costs; `release` gives it back."""

    __slots__ = ("tensor", "nbytes", "spent", "pinned", "backend", "_unregister", "__weakref__")

    def __init__(self, tensor: torch.Tensor, spent_bytes: int, pinned: bool, backend: str,
                 device: torch.device | None, unregister: weakref.finalize | None = None) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.spent = spent_bytes
        self.pinned = pinned  # really page-locked (false: plain memory standing in for it)
        self.backend = backend  # "plain" slabs are not counted in the page-locked budget
        self._unregister = unregister  # registered memory: run once, at release or when freed

    def release(self) -> None:
        """Give the memory back (idempotent); copies using it must have finished."""
        t, self.tensor = self.tensor, None
        if t is None:
            return
        if self._unregister is not None:
            self._unregister()
        elif self.backend != "plain":
            _LEDGER.give(self.spent)
        del t
        if self.backend == "cache" and self.pinned and torch.accelerator.is_available():
            # Only emptying the caching allocator's cache returns a freed block's memory.
            torch.accelerator.empty_host_cache()


def _unregister(ptr: int, cost: int, device: torch.device | None) -> None:
    _LEDGER.give(cost)
    with contextlib.suppress(Exception):  # the runtime may be gone at interpreter exit
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(ptr)


def _registered(nbytes: int, cost: int, device: torch.device | None) -> Slab:
    """``cost`` bytes (whole pages) page-locked with ``cudaHostRegister``, a slab of ``nbytes``.

    NOTE: the range starts on a page boundary, so its pages are this slab's alone (registering a
    page a neighbour's registration holds fails) and the storage starts where the registration
    does (``is_pinned`` asks about its first byte). It is unregistered before it is freed.
    """
    raw = np.empty(cost + _PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % _PAGE
    arr = raw[skip:skip + cost]
    ptr = arr.ctypes.data
    err = torch.cuda.cudart().cudaHostRegister(ptr, cost, 1)  # 1: portable
    if int(err) != 0:
        raise RuntimeError(
            f"page-locking {cost} bytes of host memory failed (cudaHostRegister: cudaError"
            f" {int(err)}); the system may limit locked memory (ulimit -l, a container's"
            " memlock limit) or be short of RAM: lower headroom's share with"
            " headroom.store.set_pinned_limit(bytes), or keep tensors on disk (DiskStore)")
    fin = weakref.finalize(arr, _unregister, ptr, cost, device)
    return Slab(torch.from_numpy(arr)[:nbytes], cost, True, "register", device, fin)


def device_guard(device: torch.device | None):
    """``device`` made current (its runtime's ``device`` context), or a null context on the CPU,
    ``meta``, or without its runtime."""
    mod = getattr(torch, device.type, None) if device is not None \
        and device.type not in ("cpu", "meta") else None
    if not hasattr(mod, "device") or not getattr(mod, "is_available", lambda: False)():
        return contextlib.nullcontext()
    return mod.device(device)


def alloc_slab(nbytes: int, *, pin: bool, device: torch.device | None = None) -> Slab:
    """A slab of at least ``nbytes`` host bytes, page-locked for ``device`` when ``pin``
    (taken from the process budget first; see the module docstring).

    Raises:
        StoreFullError: the page-locked budget cannot hold it.
    """
    backend = _backend(pin, device)
    cost = spent(nbytes, backend)
    if backend == "plain":
        return Slab(torch.empty(nbytes, dtype=torch.uint8), cost, False, backend, device)
    _LEDGER.take(cost)
    try:
        # Under the device's guard: a context this creates for cuda:1 must not be GPU 0's.
        with device_guard(device):
            if backend == "register":
                return _registered(nbytes, cost, device)
            size = cost if backend == "cache" else nbytes  # the allocator spends it anyway
            try:
                t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:
                if backend == "cache":
                    raise
                # No runtime to pin with: plain memory standing in for page-locked memory.
                return Slab(torch.empty(size, dtype=torch.uint8), cost, False, backend, device)
            return Slab(t, cost, True, backend, device)
    except BaseException:
        _LEDGER.give(cost)
        raise


class PinnedArena:
    """Host tensors carved out of a few large slabs: pinned bytes spent once per slab, and
    given back to the system when a slab has nothing carved out of it any more.

    `take` carves the first free span that fits (a new slab when none does), `give` merges a
    span back with its neighbours and releases a slab that became wholly free.

    Args:
        pin: page-lock the slabs (see `alloc_slab`).
        device: the accelerator the memory feeds (its context pins it).
        max_bytes: limit on the slabs' cost; ``None`` for none (the process budget still holds).
        slab_bytes: the largest ordinary slab; `reserve` makes one sized to a known total.

    Raises:
        StoreFullError: from `take`/`reserve` when a new slab would pass ``max_bytes`` or the
            process's page-locked budget.
    """

    def __init__(self, *, pin: bool, device: torch.device | None = None,
                 max_bytes: int | None = None, slab_bytes: int = 64 << 20) -> None:
        self.pin = pin
        self.device = device
        self.max_bytes = max_bytes
        self.slab_bytes = slab_bytes
        self._slabs: list[Slab] = []
        self._free: dict[int, list[list[int]]] = {}  # id(slab) -> sorted [start, end] spans
        self._carved: dict[int, tuple[Slab, int, int]] = {}  # data_ptr -> (slab, start, end)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, release_all, self._slabs)

    # ------------------------------------------------------------------ accounting
    @property
    def spent_bytes(self) -> int:
        """Bytes the slabs cost (what the allocator really holds for this arena)."""
        return sum(s.spent for s in self._slabs)

    @property
    def slab_count(self) -> int:  # for tests and benchmarks
        return len(self._slabs)

    @property
    def carved_bytes(self) -> int:
        """Bytes carved out and not given back (each tensor rounded up to the alignment)."""
        return sum(end - start for _, start, end in self._carved.values())

    # ------------------------------------------------------------------ carving
    def reserve(self, sizes) -> None:
        """Make room for tensors of these byte sizes, carved next, in one slab sized to them."""
        need = sum(max(_aligned(n), ALIGN) for n in sizes if n > 0)
        with self._lock:
            if need > 0 and need > max(
                    (e - s for spans in self._free.values() for s, e in spans), default=0):
                self._new_slab(need)

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of exactly ``nbytes`` carved from a slab (contents undefined)."""
        need = max(_aligned(nbytes), ALIGN)
        with self._lock:
            found = self._find(need)
            if found is None:
                # Slabs grow with the arena (1 MiB up to slab_bytes): a small store pins little.
                grow = min(self.slab_bytes, max(self.spent_bytes, _MIN_SLAB))
                self._new_slab(max(need, grow))
                found = self._find(need)
            slab, start = found
            t = slab.tensor[start:start + nbytes]
            self._carved[t.data_ptr()] = (slab, start, start + need)
            return t

    def give(self, t: torch.Tensor) -> None:
        """Give a tensor from `take` back; copies using it must have finished."""
        with self._lock:
            slab, start, end = self._carved.pop(t.data_ptr())
            spans = self._free[id(slab)]
            i = bisect.bisect_left(spans, [start, end])
            spans.insert(i, [start, end])
            if i + 1 < len(spans) and spans[i][1] == spans[i + 1][0]:
                spans[i][1] = spans.pop(i + 1)[1]
            if i > 0 and spans[i - 1][1] == spans[i][0]:
                spans[i - 1][1] = spans.pop(i)[1]
            if len(spans) == 1 and spans[0] == [0, _floor(slab.nbytes)]:
                self._drop(slab)

    def close(self) -> None:
        """Release every slab (tensors still carved keep their memory, perhaps no longer
        pinned: do not use them for copies)."""
        with self._lock:
            for s in list(self._slabs):
                self._drop(s)
            self._carved.clear()

    # ------------------------------------------------------------------ internals
    def _find(self, need: int) -> tuple[Slab, int] | None:
        for slab in self._slabs:
            spans = self._free[id(slab)]
            for j, (s, e) in enumerate(spans):
                if e - s >= need:
                    if e - s == need:
                        spans.pop(j)
                    else:
                        spans[j][0] = s + need
                    return slab, s
        return None

    def _new_slab(self, nbytes: int) -> None:
        backend = _backend(self.pin, self.device)
        cost = spent(nbytes, backend)
        if self.max_bytes is not None and self.spent_bytes + cost > self.max_bytes:
            raise StoreFullError(
                f"store full: budget {self.max_bytes} bytes, {self.spent_bytes} in use and"
                f" {cost} more needed for a slab of page-locked memory; raise budget"
                " (max_bytes=) or use DiskStore")
        slab = alloc_slab(nbytes, pin=self.pin, device=self.device)
        self._slabs.append(slab)
        self._free[id(slab)] = [[0, _floor(slab.nbytes)]]

    def _drop(self, slab: Slab) -> None:
        self._slabs.remove(slab)
        del self._free[id(slab)]
        slab.release()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _floor(n: int) -> int:
    return n // ALIGN * ALIGN


def release_all(slabs: list[Slab] | dict[int, Slab]) -> None:
    """Release the slabs of an arena or pool collected without ``close()`` (best effort)."""
    for s in list(slabs.values() if isinstance(slabs, dict) else slabs):
        with contextlib.suppress(Exception):
            s.release()
    slabs.clear()
