"""Anonymous tensors kept in a store for a while: stash the bytes away, bring them back later.

`Stash` moves a storage's bytes off the compute device into host memory or a `DiskStore` and
back (ahead of time with `prefetch`), knowing nothing of what they mean; activation offload is
built on it. Space is pooled by size, so a loop stashing the same sizes allocates on its first
step only.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from headroom.store import SCRATCH, DiskStore, Handle, PinnedPool, Store, is_accelerator
from headroom.transfer._device import stream_module

__all__ = ["Stash", "StashTicket"]

_KEY = SCRATCH + "stash"
_ids = itertools.count()

# `Stash.shared`: host ones by device; disk ones on their store, found again through this set.
_host_shared: dict[torch.device, Stash] = {}
_disks_shared: weakref.WeakSet = weakref.WeakSet()


@dataclass
class StashTicket:
    """Bytes of one storage, resting in a stash (see `Stash`)."""

    nbytes: int
    host: torch.Tensor | None = None  # host copy (pooled): the bytes, or staging for the disk
    handle: Handle | None = None  # where they rest on disk
    source: torch.Tensor | None = field(default=None, repr=False)  # kept until copied out
    out_event: object | None = None  # device -> host copy, on an accelerator
    out: Future | None = None  # a disk write still reading its source (the storage, or host)
    back: Future | None = None  # a disk read still landing
    back_event: object | None = None  # host -> device copy
    into: torch.Tensor | None = None  # the storage being refilled (uint8 view)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Stash:
    """Stash storages in a store and restore them.

    Args:
        device: the compute device the storages live on.
        store: a `DiskStore`, or ``None`` for host memory (page-locked, from a pool, when the
            device is an accelerator).

    Example:
        >>> s = Stash("cpu", None)
        >>> t = torch.arange(4.0)
        >>> k = s.stash(t.untyped_storage())
        >>> s.wait_out(k); t.untyped_storage().resize_(0)   # the device memory is free
        >>> t.untyped_storage().resize_(16); s.restore(k, t.untyped_storage()); t
        tensor([0., 1., 2., 3.])
    """

    def __init__(self, device: str | torch.device, store: Store | None) -> None:
        self.device = torch.device(device)
        self.disk = store if isinstance(store, DiskStore) else None
        self.accelerated = is_accelerator(self.device)
        self._pool = PinnedPool(pin=self.accelerated,
                                device=self.device if self.accelerated else None)
        self._handles: dict[int, list[Handle]] = defaultdict(list)
        self._prefix = f"{_KEY}/{next(_ids)}"
        self._made = 0
        # Host buffers a dropped ticket's side-stream copies may still use, with their events:
        # pooled again once those completed (a drop never waits).
        self._held: list[tuple[list[Any], torch.Tensor]] = []
        if self.accelerated:
            self._mod = stream_module(self.device)
            self._d2h = self._mod.Stream(self.device)
            self._h2d = self._mod.Stream(self.device)
            # One event per side stream, recorded on the compute stream again for each copy
            # (a wait takes it as recorded then); under one lock, for a shared stash's threads.
            self._out_ready = self._mod.Event()
            self._back_ready = self._mod.Event()
            self._ready_lock = threading.Lock()

    @classmethod
    def shared(cls, device: str | torch.device, store: Store | None) -> Stash:
        """The process's stash for ``device`` and ``store``, kept between users so a training
        loop reuses its page-locked buffers and files (`release_shared` frees them)."""
        device = torch.device(device)
        if isinstance(store, DiskStore):
            table = store._stashes
            _disks_shared.add(store)
        else:
            table = _host_shared
        s = table.get(device)
        if s is None:
            s = table[device] = cls(device, store)
        return s

    @staticmethod
    def release_shared() -> None:
        """Free what the shared stashes pooled. Bytes stashed and not dropped yet stay."""
        for s in list(_host_shared.values()):
            s.close()
        for store in list(_disks_shared):
            if store._closed:
                # Its scratch space and file handles went with it: nothing to free.
                _disks_shared.discard(store)
                continue
            for s in store._stashes.values():
                s.close()

    # ------------------------------------------------------------------ out
    def stash(self, storage: torch.UntypedStorage) -> StashTicket:
        """Start copying ``storage``'s bytes into the stash. The storage must stay allocated
        and unchanged until `out_done` says so or `wait_out` returns."""
        if self.disk is not None and self.disk._closed:
            raise RuntimeError(f"{self.disk!r} is closed: open a DiskStore to offload to")
        n = storage.nbytes()
        src = _bytes_of(storage)
        k = StashTicket(n, source=src)
        if self.disk is not None:
            k.handle = self._handle(n)
        if self.accelerated:
            self._reap()
            k.host = self._pool.take(n)
            self._after_compute(self._d2h, self._out_ready)  # which wrote the bytes
            with self._mod.stream(self._d2h):
                k.host.copy_(src, non_blocking=True)
                k.out_event = self._mod.Event()
                k.out_event.record(self._d2h)
        elif self.disk is not None:
            # The write reads straight from the storage, on the store's threads.
            k.out = self.disk.write(k.handle, src) if n else None
        else:
            k.host = self._pool.take(n)
            k.host.copy_(src)
            k.source = None
        return k

    def out_done(self, k: StashTicket, *, wait: bool = False) -> bool:
        """Whether the storage may be freed now (its bytes have left it); ``wait``: once
        they have."""
        if k.source is None:
            return True
        if k.out_event is not None:
            if wait:
                k.out_event.synchronize()
            elif not k.out_event.query():
                return False
            k.out_event = k.source = None
            if self.disk is not None and k.nbytes:
                # Staging -> disk on the store's threads; the staging buffer stays with the
                # ticket (a restore before the write is done copies from it, not the disk).
                k.out = self.disk.write(k.handle, k.host)
            return True
        if k.out is not None:
            if not wait and not k.out.done():
                return False
            fut, k.out = k.out, None
            fut.result()  # raises the write's error
        k.source = None
        return True

    def wait_out(self, k: StashTicket) -> None:
        """Wait until the storage may be freed (its bytes have left it)."""
        self.out_done(k, wait=True)

    # ------------------------------------------------------------------ back
    def prefetch(self, k: StashTicket, storage: torch.UntypedStorage) -> None:
        """Start copying the bytes back into ``storage`` (allocated, of the stashed size)."""
        if k.into is not None:
            return
        if storage.nbytes() != k.nbytes:
            raise ValueError(f"restoring {k.nbytes} stashed bytes into a storage of"
                             f" {storage.nbytes()}")
        if self.disk is not None and self.disk._closed and k.host is None:
            raise RuntimeError(
                f"the saved activations this backward needs rested in {self.disk!r}, which was"
                " closed (closing frees its scratch space). Close the store after backward, or"
                " run forward and backward again")
        self.wait_out(k)
        self._reap()
        k.into = _bytes_of(storage)
        if not k.nbytes:
            return
        if self.accelerated:
            if k.host is None:  # on disk only: read into staging first
                k.host = self._pool.take(k.nbytes)
                k.back = self.disk.read(k.handle, out=k.host)
            else:
                self._h2d_copy(k)
        elif self.disk is not None:
            k.back = self.disk.read(k.handle, out=k.into)
        else:
            k.into.copy_(k.host)

    def _after_compute(self, stream: Any, ev: Any) -> None:
        """Order side ``stream`` after the compute stream's work so far (``ev`` recorded anew)."""
        with self._ready_lock:
            ev.record(self._mod.current_stream(self.device))
            stream.wait_event(ev)

    def _h2d_copy(self, k: StashTicket) -> None:
        self._after_compute(self._h2d, self._back_ready)  # where the storage was (re)allocated
        with self._mod.stream(self._h2d):
            k.into.copy_(k.host, non_blocking=True)
            k.back_event = self._mod.Event()
            k.back_event.record(self._h2d)

    def restore(self, k: StashTicket, storage: torch.UntypedStorage) -> None:
        """The bytes are back in ``storage``, ready for the compute stream (prefetching them
        first if `prefetch` was not called)."""
        self.prefetch(k, storage)
        if k.back is not None:
            fut, k.back = k.back, None
            fut.result()
            if self.accelerated:
                self._h2d_copy(k)
        if k.back_event is not None:
            self._mod.current_stream(self.device).wait_event(k.back_event)
            k.back_event = None

    # ------------------------------------------------------------------ space
    def drop(self, k: StashTicket) -> None:
        """Give the stashed bytes' space back (pooled for the next stash of that size); a host
        buffer a side-stream copy may still use is pooled once its event completed."""
        for fut in (k.out, k.back):
            if fut is not None:
                fut.exception()  # an I/O still using the buffer must finish first
        k.out = k.back = None
        self._reap()
        busy = []
        if k.out_event is not None and not k.out_event.query():
            k.source.record_stream(self._d2h)  # the copy out still reads these device bytes
            busy.append(k.out_event)
        if k.back_event is not None and not k.back_event.query():
            k.into.record_stream(self._h2d)  # the copy back still writes these
            busy.append(k.back_event)
        k.out_event = k.back_event = None
        if k.host is not None:
            if busy:
                self._held.append((busy, k.host))
            else:
                self._pool.give(k.host)
            k.host = None
        if k.handle is not None:
            self._handles[k.nbytes].append(k.handle)
            k.handle = None
        k.source = k.into = None

    def _handle(self, n: int) -> Handle:
        free = self._handles[n]
        if free:
            return free.pop()
        self._made += 1
        return self.disk.alloc(f"{self._prefix}/{self._made}", (n,), torch.uint8, zero=False)

    @property
    def pooled_bytes(self) -> int:
        """Bytes the stash keeps for reuse: host buffers, and disk space when on disk."""
        disk = sum(n * len(hs) for n, hs in self._handles.items())
        return self._pool.total_bytes + disk

    def _reap(self) -> None:
        """Pool again the held buffers whose copies have completed."""
        if self._held:
            held, self._held = self._held, []
            for events, host in held:
                if all(e.query() for e in events):
                    self._pool.give(host)
                else:
                    self._held.append((events, host))

    def close(self) -> None:
        """Free what the stash pooled (its disk files too)."""
        if self.accelerated:
            # Copies back may still read pooled buffers, and dropped tickets' copies held
            # ones, all going back to the system: wait for this stash's own copies only.
            self._h2d.synchronize()
            held, self._held = self._held, []
            for events, host in held:
                for e in events:
                    e.synchronize()
                self._pool.give(host)
        if self.disk is not None:
            for hs in self._handles.values():
                for h in hs:
                    self.disk.free(h)
        self._handles.clear()
        self._pool.clear()
