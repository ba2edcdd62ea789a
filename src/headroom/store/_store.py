"""The store protocol shared by host memory and disk."""

from __future__ import annotations

import abc
import sys
import threading
from concurrent.futures import Future
from typing import Any

import torch

from headroom.store._handle import Handle, check_rows, row_count

__all__ = ["Store", "StoreCorruptError", "StoreFullError", "done"]


# [Note: scratch keys] Keys under this prefix hold scratch bytes (activations between forward
# and backward), worth nothing once their process is gone or their store closed: a reopened
# DiskStore drops them unchecked, `DiskStore.close` frees them, `Store.keys` leaves them out,
# and a DiskStore writes them without checksums unless its reads verify them.
SCRATCH = "headroom-scratch/"


class StoreFullError(RuntimeError):
    """Raised when a store's byte budget (or the disk under it) cannot hold a new tensor."""


class StoreCorruptError(RuntimeError):
    """Raised when a store's files do not hold what it wrote (a checksum mismatch, a torn write,
    a missing file, broken metadata); the message names what and where, and how to recover.

    Attributes:
        path: the store's folder (``None`` when not known).
        keys: the keys of the tensors concerned (empty when the metadata itself is broken).
    """

    def __init__(self, message: str, path: str | None = None,
                 keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.path = path
        self.keys = tuple(keys)


def done(value: Any = None) -> Future:
    """A future that is already completed with ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


class Store(abc.ABC):
    """Where tensors rest between uses. Subclasses: `HostStore`, `DiskStore`.

    Every method that moves bytes returns a `concurrent.futures.Future`, completed at once (host
    memory) or from background threads (disk); operations on one key run in issue order.
    """

    def __init__(self, *, max_bytes: int | None) -> None:
        name = type(self).__name__
        if max_bytes is not None and (not isinstance(max_bytes, int)
                                      or isinstance(max_bytes, bool)):
            raise TypeError(
                f"{name} max_bytes must be an int number of bytes or None (no limit), got"
                f" {type(max_bytes).__name__} {max_bytes!r}; e.g. max_bytes=64 << 30 for 64 GiB")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"{name} max_bytes must be >= 0 or None (no limit), got {max_bytes}")
        self.max_bytes = max_bytes
        self._handles: dict[str, Handle] = {}
        self._used = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ what it is
    #: Whether the resting tensors occupy host memory (RAM): an estimate counts them there, and
    #: a host-memory store on a CPU-only machine saves nothing.
    holds_host_memory: bool = True
    #: Whether the resting tensors outlive the process (a file system): activation offload on a
    #: CPU-only machine and a restart after ``kill -9`` need one.
    durable: bool = False

    # ------------------------------------------------------------------ pickling
    def __reduce_ex__(self, protocol: int) -> Any:
        # NOTE: a store is this process's memory, files and threads, shared by whatever is
        # bound to it: no copy would be the same store, so pickle and deepcopy refuse it.
        raise TypeError(self._not_portable())

    def _not_portable(self) -> str:
        return (
            f"{self!r} cannot be pickled or copied: its tensors are this process's, shared by"
            " what is bound to them. Pass the model instead (an offloaded model pickles into a"
            " plain model holding its values), or the tensors (store.read(h).result())")

    # ------------------------------------------------------------------ bookkeeping
    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated to handles."""
        return self._used

    def keys(self) -> list[str]:
        """The keys of the tensors in the store; scratch keys (see [Note: scratch keys]) are not
        listed, `used_bytes` counts them."""
        with self._lock:
            return [k for k in self._handles if not k.startswith(SCRATCH)]

    def get(self, key: str) -> Handle:
        """The handle stored under ``key`` (`KeyError` naming the store if none)."""
        with self._lock:
            try:
                return self._handles[key]
            except KeyError:
                raise KeyError(f"no tensor {key!r} in {self!r}") from None

    def __contains__(self, key: str) -> bool:
        return key in self._handles

    def _reserve(self, handle: Handle) -> None:
        with self._lock:
            if handle.key in self._handles:
                raise KeyError(
                    f"{handle.key!r} is already in {self!r}; free() it first or pick another key")
            if self.max_bytes is not None and self._used + handle.nbytes > self.max_bytes:
                raise StoreFullError(
                    f"store full: budget {self.max_bytes} bytes, need {self._used + handle.nbytes}"
                    f" ({handle.nbytes} for {handle.key!r}); raise budget (max_bytes=) or use"
                    " DiskStore")
            self._handles[handle.key] = handle
            self._used += handle.nbytes

    def _release(self, handle: Handle) -> None:
        with self._lock:
            if self._handles.get(handle.key) != handle:
                raise KeyError(f"{handle.key!r} is not in {self!r} (already freed?)")
            del self._handles[handle.key]
            self._used -= handle.nbytes

    def _check(self, handle: Handle) -> None:
        if self._handles.get(handle.key) != handle:
            raise KeyError(f"{handle.key!r} is not in {self!r} (freed, or from another store)")

    @staticmethod
    def _check_src(handle: Handle, src: torch.Tensor, shape: tuple[int, ...],
                   host: str | None = None) -> None:
        """Check ``src``'s type, dtype and shape, and with ``host`` that it is host memory."""
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"expected a tensor for {handle.key!r}, got {type(src).__name__}")
        _check_plain(handle.key, src)
        if src.dtype != handle.dtype:
            raise TypeError(
                f"dtype mismatch for {handle.key!r}: stored as {handle.dtype}, got {src.dtype};"
                f" cast with .to({handle.dtype})")
        if tuple(src.shape) != shape:
            raise ValueError(
                f"shape mismatch for {handle.key!r}: expected {shape}, got {tuple(src.shape)}")
        if host and (src.device.type != "cpu" or not src.is_contiguous()):
            raise ValueError(f"{host} {handle.key!r} must be a contiguous host (cpu) tensor")

    @staticmethod
    def _out(handle: Handle, out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=handle.dtype)
        Store._check_src(handle, out, shape, "out for")
        return out

    @staticmethod
    def _rows_shape(handle: Handle, rows: slice | torch.Tensor) -> tuple[int, ...]:
        return (row_count(rows), *handle.shape[1:])

    # ------------------------------------------------------------------ protocol
    def put(self, key: str, tensor: torch.Tensor) -> Handle:
        """Allocate room for ``tensor`` under ``key`` and write it (complete on return).

        Raises:
            KeyError: ``key`` is taken. StoreFullError: over the byte budget.
        """
        _check_plain(key, tensor)
        handle = self.alloc(key, tuple(tensor.shape), tensor.dtype, zero=False)
        self.write(handle, tensor.detach().cpu().contiguous()).result()
        return handle

    @abc.abstractmethod
    def alloc(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *, zero: bool = True
    ) -> Handle:
        """Allocate a tensor (zero-filled unless ``zero=False``) under ``key``."""

    @abc.abstractmethod
    def read(self, handle: Handle, out: torch.Tensor | None = None) -> Future:
        """Read the whole tensor; the future's result is a host tensor (``out`` when given)."""

    @abc.abstractmethod
    def write(self, handle: Handle, src: torch.Tensor) -> Future:
        """Write the whole tensor from host tensor ``src`` (keep ``src`` unchanged until done)."""

    @abc.abstractmethod
    def read_rows(
        self, handle: Handle, rows: slice | torch.Tensor, out: torch.Tensor | None = None
    ) -> Future:
        """Read rows (a step-1 slice or sorted indices) of a tensor with at least one dimension."""

    @abc.abstractmethod
    def write_rows(self, handle: Handle, rows: slice | torch.Tensor, src: torch.Tensor) -> Future:
        """Write rows (a step-1 slice or sorted indices) from host tensor ``src``."""

    def host_tensor(self, handle: Handle) -> torch.Tensor | None:
        """The resting host tensor itself (zero-copy), or ``None`` when it rests elsewhere."""
        return None

    @abc.abstractmethod
    def free(self, handle: Handle) -> None:
        """Forget the tensor and give its space back."""

    #: Whether `exchange` is supported (tensors can swap contents by a change of metadata).
    can_exchange: bool = False

    def alloc_spare(self, handle: Handle, key: str) -> Handle:
        """A tensor under ``key`` of ``handle``'s shape and dtype, to be exchanged with it
        (`exchange`); contents undefined. `NotImplementedError` unless `can_exchange`."""
        raise NotImplementedError(f"{type(self).__name__} cannot exchange tensors")

    def exchange(self, pairs: list[tuple[Handle, Handle]]) -> None:
        """Swap the contents of each pair of tensors ``(a, b)`` (same shape and dtype) at once,
        in O(1) per pair, for every holder of either (only where `can_exchange`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot exchange tensors")

    def reserve(self, sizes) -> None:  # noqa: B027 - optional hook
        """A hint: tensors of these byte sizes are about to be allocated."""

    def reserve_writes(self, count: int) -> None:  # noqa: B027 - optional hook
        """Promise that the next ``count`` writes into allocated tensors cannot fail for lack
        of space: reserve what they need besides their bytes now, until `release_writes`.

        Raises:
            StoreFullError: the space is not there; nothing was reserved.
        """

    def release_writes(self) -> None:  # noqa: B027 - optional hook
        """End the promise of `reserve_writes`."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Wait for all pending operations (and persist metadata, where there is any)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Flush and release background resources."""

    @property
    def pinned(self) -> bool:
        """Whether host tensors this store hands out are page-locked."""
        return False

    _check_rows = staticmethod(check_rows)


def is_accelerator(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


def _check_plain(key: str, t: torch.Tensor) -> None:
    # A DTensor's storage is its shard's (or none): copied whole, it reads memory not its own.
    dt = sys.modules.get("torch.distributed.tensor")
    if dt is not None and isinstance(t, dt.DTensor):
        raise TypeError(
            f"{key!r} is a DTensor (a sharded tensor); a store holds plain tensors: store its"
            " local shard (t.to_local()), or hr.offload the fully_shard'ed model")
    if hasattr(type(t), "__tensor_flatten__"):
        # A wrapper subclass (torchao's quantized tensors) has no memory of its own.
        raise TypeError(
            f"{key!r} is a {type(t).__name__}, a tensor subclass whose values are its inner"
            " tensors; a store holds plain tensors: store each inner tensor (hr.offload keeps"
            " quantized parameters this way)")
