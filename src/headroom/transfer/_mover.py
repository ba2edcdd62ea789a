"""The mover: store -> device for parameters, device -> store for gradients.

On an accelerator, copies run on two side streams (``h2d``, ``d2h``) ordered with the computing
stream by events, so prefetches overlap compute and gradients leave while backward goes on. On
the CPU the same calls run synchronously, except disk reads (the store's I/O threads).

Threads: the forward/backward thread fetches and pushes gradients, an optimizer's worker may
fetch and wait for gradients, and the mover's landing thread adds staged gradients into the
store. The lock guarding queues and issuing is never held while the host waits for the device
or for I/O, so backward never stalls behind an optimizer waiting for its gradients.

[Note: copies in flight] On an accelerator every copy is issued on a side stream of
``transfer/``, ordered after the stream that produced what it reads or last used what it
overwrites (an event recorded there); the consumer's stream waits for the copy's completion
event, or the host waits before touching host memory the copy uses. Memory a copy may still use
is not freed before that: device memory goes to the caching allocator with ``record_stream`` or
is freed on a stream ordered after the copy; page-locked host memory goes back to a pool when
its next user is ordered after the copy, and to the system only after a host wait
(`Mover.synchronize`/``wait_reads``/``close``, ``Stash.close``, the end of a ``RowStreamer``
pass); a store tensor is freed only once the copies using it are done (``hr.unoffload``
synchronizes the mover first). No device-wide synchronization is added for ordering.
``tests/_streams.py`` checks all of this on the CPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from headroom.store import (
    Handle,
    PinnedPool,
    Store,
    add_into,
    as_bytes,
    device_guard,
    is_accelerator,
    owned_pool,
)
from headroom.transfer._binding import ParamBinding
from headroom.transfer._device import stream_module

__all__ = ["Mover", "Ticket"]

# Page-locked staging of gradients waiting to land; past it backward waits for the oldest
# landing (never for a gradient alone in it).
_MAX_STAGED_BYTES = 256 << 20


@dataclass(eq=False)
class _Batch:
    """Copies to the device issued together: one completion event for all of them."""

    event: object | None = None
    waited: set = field(default_factory=set)  # streams already ordered after ``event``


@dataclass(eq=False)
class Ticket:
    """A fetch in flight; pass it to `Mover.wait` before using the destination."""

    dst: torch.Tensor
    future: Future | None = None
    batch: _Batch | None = None  # the device copy (accelerator), once issued
    staging: torch.Tensor | None = None  # disk read landing zone (copied or cast to dst)
    issued: threading.Event | None = None  # the copy out of staging was issued (accelerator)
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class _Landing:
    """A gradient on its way into the store."""

    event: object  # the device -> host copy done (on the d2h stream)
    key: str
    staging: torch.Tensor | None = None  # None: copied straight into the store's tensor
    nbytes: int = 0  # staging bytes
    future: Future | None = None  # its landing on the landing thread


class Mover:
    """Moves bytes between a store and the compute device.

    Args:
        device: the compute device.
        store: the store the tensors rest in.

    Raises:
        RuntimeError: an accelerator without streams and events (`stream_module`).

    Example:
        >>> store = HostStore(); h = store.put("w", torch.ones(3))
        >>> mover = Mover("cpu", store)
        >>> dst = torch.empty(3); mover.wait(mover.fetch(h, dst)); dst.sum().item()
        3.0
    """

    def __init__(self, device: str | torch.device, store: Store) -> None:
        self.device = torch.device(device)
        self.store = store
        self.accelerated = is_accelerator(self.device)
        self._lock = threading.Lock()  # queues and issuing; never held across a wait
        self._sync_lock = threading.Lock()  # one waiter at a time retires landings
        self._disk_writes: deque = deque()
        self._writing = 0
        self._acc_pool: ThreadPoolExecutor | None = None
        self._landings: dict[int, _Landing] = {}
        self._serial = itertools.count()
        self._pending_keys: dict[str, int] = {}  # gradient key -> landings still to run
        self._staged: deque[_Landing] = deque()
        self._staged_bytes = 0
        if self.accelerated:
            self._mod = stream_module(self.device)
            self._h2d = self._mod.Stream(self.device)
            self._d2h = self._mod.Stream(self.device)
            self._pool = PinnedPool(pin=True, device=self.device)
            self._inflight: deque = deque()  # (event, staging) of H2D copies out of staging
            # One event per side stream, recorded again for each copy (a wait captures it).
            self._h2d_after = self._mod.Event()
            self._d2h_after = self._mod.Event()
            self._events: list = []  # done events of retired copies, for reuse

    # ------------------------------------------------------------------ store -> device
    def fetch(self, handle: Handle, dst: torch.Tensor, *, after: Iterable | None = None,
              batch: _Batch | None = None) -> Ticket:
        """Start filling ``dst`` (on the device, storage allocated) with ``handle``'s value.

        Casts to ``dst.dtype``; does not bump ``dst``'s version counter (autograd's saved
        references stay valid). ``after``: events to order the copy after instead of the
        current stream (a worker thread copying back what backward read on another stream).
        ``batch``: from `fetch_many`, copies sharing one completion event.
        """
        return self.fetch_many([(handle, dst)], after=after, batch=batch)[0]

    def fetch_many(self, items: list[tuple[Handle, torch.Tensor]], *,
                   after: Iterable | None = None, batch: _Batch | None = None) -> list[Ticket]:
        """`fetch` for several tensors (a block): copies from host memory are ordered after
        the computing stream by one event and signal completion with one event."""
        for handle, dst in items:
            if tuple(dst.shape) != handle.shape:
                raise ValueError(f"fetch of {handle.key!r}: shape {handle.shape} into {dst.shape}")
        items = [(h, d.detach()) for h, d in items]
        if not self.accelerated:
            return [self._fetch_cpu(h, d) for h, d in items]
        self._reclaim()
        tickets: list[Ticket] = []
        batch = batch if batch is not None else _Batch()
        staged: list[torch.Tensor] = []  # page-locked copies of pageable host tensors
        with self._lock:
            self._order_h2d(after)
            try:
                for handle, dst in items:
                    host = self.store.host_tensor(handle)
                    if host is None:  # on disk: read into staging, copied when it lands
                        tickets.append(Ticket(dst, staging=self._pool.take(
                            handle.nbytes).view(handle.dtype).view(handle.shape),
                            issued=threading.Event()))
                        continue
                    if not self.store.pinned:
                        # Pageable memory would make the host wait: stage it page-locked.
                        src = self._pool.take(handle.nbytes).view(handle.dtype).view(
                            handle.shape)
                        src.copy_(host)
                        staged.append(src)
                        host = src
                    with torch.no_grad(), self._mod.stream(self._h2d), \
                            torch.autograd._unsafe_preserve_version_counter(dst):
                        # After the computing stream, where the storage was (re)allocated.
                        dst.copy_(host, non_blocking=True)
                    tickets.append(Ticket(dst, batch=batch))
            finally:
                if any(t.batch is not None for t in tickets):
                    batch.event = self._event()
                    batch.event.record(self._h2d)
                    self._inflight.extend((batch.event, src) for src in staged)
                    if len(tickets) < len(items):
                        # Failed half-way: who frees these storages waits for copies issued.
                        self._mod.current_stream(self.device).wait_event(batch.event)
        try:
            for (handle, _), t in zip(items, tickets, strict=True):
                if t.staging is not None:
                    t.future = self.store.read(handle, out=t.staging)
                    # The device copy is issued as the read lands, on the thread completing it.
                    t.future.add_done_callback(
                        lambda _f, t=t: self._bg(self._issue_staged)(t))
        except BaseException:
            for t in tickets:  # nothing may land in a storage after its owner freed it
                if t.future is not None:
                    with contextlib.suppress(Exception):
                        self.wait(t)
            raise
        return tickets

    def _fetch_cpu(self, handle: Handle, dst: torch.Tensor) -> Ticket:
        host = self.store.host_tensor(handle)
        if host is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
                dst.copy_(host)
            return Ticket(dst, done=True)
        if dst.dtype == handle.dtype and dst.is_contiguous():
            # Straight into the parameter on an I/O thread: overlaps compute on the CPU too.
            return Ticket(dst, future=self.store.read(handle, out=dst))
        return Ticket(dst, future=self.store.read(handle))

    def _order_h2d(self, after: Iterable | None) -> None:
        """Order the h2d stream after ``after`` or after the current stream (lock held)."""
        if after is None:
            self._h2d_after.record(self._mod.current_stream(self.device))
            after = (self._h2d_after,)
        for ev in after:
            self._h2d.wait_event(ev)

    def _issue_staged(self, t: Ticket) -> None:
        """Copy a landed disk read from staging to the device (any thread)."""
        try:
            if t.future.exception() is not None:
                return
            with self._lock, torch.no_grad(), device_guard(self.device), \
                    self._mod.stream(self._h2d), \
                    torch.autograd._unsafe_preserve_version_counter(t.dst):
                # h2d was ordered after the computing stream when the fetch started.
                t.dst.copy_(t.staging, non_blocking=True)
                t.batch = _Batch(self._event())
                t.batch.event.record(self._h2d)
                self._inflight.append((t.batch.event, t.staging))
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            t.error = e
        finally:
            t.issued.set()

    def wait(self, ticket: Ticket) -> None:
        """Order the current stream after the fetch (or block until it is done on the CPU)."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.future is not None:
            result = ticket.future.result()  # raises the read's error
            if not self.accelerated:
                if result is not ticket.dst:
                    with torch.no_grad(), \
                            torch.autograd._unsafe_preserve_version_counter(ticket.dst):
                        ticket.dst.copy_(result)
                return
            ticket.issued.wait()
            if ticket.error is not None:
                raise ticket.error
        b = ticket.batch
        if b is not None and b.event is not None:
            cur = self._mod.current_stream(self.device)
            if cur not in b.waited:  # one wait per stream for a whole block
                b.waited.add(cur)
                cur.wait_event(b.event)

    def wait_reads(self) -> None:
        """Block until every copy to the device issued so far has read its host memory."""
        if self.accelerated:
            self._h2d.synchronize()
            self._reclaim()

    def mark(self, event: object | None = None) -> object | None:
        """An event (``event`` if given) recorded now on the current stream, for `fetch`'s
        ``after``; ``None`` on the CPU."""
        if not self.accelerated:
            return None
        ev = event if event is not None else self._mod.Event()
        ev.record(self._mod.current_stream(self.device))
        return ev

    def _reclaim(self) -> None:
        while True:
            with self._lock:
                if not self._inflight or not self._inflight[0][0].query():
                    return
                _, staging = self._inflight.popleft()
            self._pool.give(as_bytes(staging))

    def _event(self):
        return self._events.pop() if self._events else self._mod.Event()

    # ------------------------------------------------------------------ device -> store
    def push_grad(self, grad: torch.Tensor, b: ParamBinding, *, accumulate: bool) -> None:
        """Move a finished gradient into ``b.grad_handle``: add to it or overwrite it.

        The caller may drop ``grad`` at once; call `synchronize` before reading the stored
        gradient. On an accelerator the copy is ordered after the current stream and lands in
        the background: straight into a page-locked host gradient it overwrites, otherwise
        through staging, landed on the mover's landing thread.
        """
        gh = b.grad_handle
        if gh is None:
            raise ValueError(f"{b.handle.key!r} has no grad_handle to receive its gradient")
        if tuple(grad.shape) != gh.shape:
            raise ValueError(f"gradient for {gh.key!r}: shape {tuple(grad.shape)} != {gh.shape}")
        b.has_grad = True
        if not self.accelerated or not is_accelerator(grad.device):
            self._land(grad.detach(), gh, accumulate)
            return
        grad = grad.detach()
        host = self.store.host_tensor(gh)
        with self._lock:
            direct = (not accumulate and host is not None and self.store.pinned
                      and host.dtype == grad.dtype and not self._pending_keys.get(gh.key))
            nbytes = 0 if direct else grad.numel() * grad.element_size()
            staging = None if direct else self._pool.take(nbytes).view(grad.dtype).view(
                grad.shape)
            self._d2h_after.record(self._mod.current_stream(self.device))
            self._d2h.wait_event(self._d2h_after)
            with self._mod.stream(self._d2h):
                # Ordered after the stream that produced the gradient (the event above).
                (host if direct else staging).copy_(grad, non_blocking=True)
                ev = self._event()
                ev.record(self._d2h)
            # The allocator keeps the gradient's memory until the copy is done: no host wait.
            grad.record_stream(self._d2h)
            landing = _Landing(ev, gh.key, staging, nbytes)
            self._landings[next(self._serial)] = landing
            if not direct:
                self._pending_keys[gh.key] = self._pending_keys.get(gh.key, 0) + 1
                self._staged.append(landing)
                self._staged_bytes += nbytes
                landing.future = self._accumulator().submit(
                    self._bg(self._land_staged), landing, gh, accumulate)
        del grad
        # Bound the staging in flight, without waiting for a gradient that is alone in it.
        while True:
            with self._lock:
                if self._staged_bytes <= _MAX_STAGED_BYTES or len(self._staged) < 2:
                    return
                oldest = self._staged[0]
            oldest.future.exception()

    def _land_staged(self, landing: _Landing, gh: Handle, accumulate: bool) -> Future | None:
        """On the landing thread: wait for the copy into staging, then land it."""
        try:
            landing.event.synchronize()
            fut = self._land(landing.staging, gh, accumulate, staged=True)
            if fut is None:
                self._pool.give(as_bytes(landing.staging))
            else:  # a disk write still reading the staging buffer
                staging = landing.staging
                fut.add_done_callback(lambda _f: self._pool.give(as_bytes(staging)))
            return fut
        finally:
            with self._lock:
                n = self._pending_keys[landing.key] - 1
                if n:
                    self._pending_keys[landing.key] = n
                else:
                    del self._pending_keys[landing.key]
                self._staged.remove(landing)
                self._staged_bytes -= landing.nbytes

    def _land(self, grad: torch.Tensor, gh: Handle, accumulate: bool, *,
              staged: bool = False) -> Future | None:
        """Land a host gradient in the store; when ``staged``, a disk write in flight is
        returned (the caller keeps ``grad`` until it is done), else tracked here."""
        store = self.store
        host = store.host_tensor(gh)
        with torch.no_grad():
            if host is not None:
                if accumulate:
                    add_into(host, grad)
                else:
                    host.copy_(grad)
                return None
            if accumulate:
                if staged:
                    self._accumulate(gh, grad)  # already on the landing thread
                    return None
                # On the mover's one thread: backward does not wait for the disk, and pushes
                # to one gradient stay in order.
                self._grads_disk(self._accumulator().submit(self._accumulate, gh, grad),
                                 2 * gh.nbytes)
                return None
            if grad.dtype != gh.dtype or not grad.is_contiguous():
                grad = grad.to(gh.dtype, copy=True).contiguous()
            fut = store.write(gh, grad)
            if staged:
                return fut
            self._grads_disk(fut, gh.nbytes)
            return None

    def _accumulator(self) -> ThreadPoolExecutor:
        if self._acc_pool is None:
            self._acc_pool = owned_pool(self, 1, "hr-grad-acc")  # ends with the mover
        return self._acc_pool

    def _accumulate(self, gh: Handle, grad: torch.Tensor) -> None:
        acc = self.store.read(gh).result()
        with torch.no_grad():
            add_into(acc, grad)
        self.store.write(gh, acc).result()

    def _grads_disk(self, fut: Future, nbytes: int) -> None:
        # A pending write keeps its gradient alive: bound those bytes.
        with self._lock:
            self._disk_writes.append((fut, nbytes))
            self._writing += nbytes
        while True:
            with self._lock:
                if len(self._disk_writes) <= 1 or self._writing <= _MAX_STAGED_BYTES // 4:
                    return
                done_fut, n = self._disk_writes.popleft()
                self._writing -= n
            done_fut.result()

    @staticmethod
    def _bg(fn):
        """``fn`` as it runs on another thread (tests wrap it to watch that thread too)."""
        return fn

    def synchronize(self) -> None:
        """Wait until every gradient pushed so far rests in the store, holding no lock the
        pushing thread needs: backward goes on meanwhile.

        Raises:
            OSError / StoreFullError: an error of a background write.
        """
        with self._sync_lock:
            with self._lock:
                landings = list(self._landings.items())
                writes = list(self._disk_writes)
            err = None
            for _, landing in landings:
                try:
                    if landing.future is None:
                        landing.event.synchronize()
                    else:
                        fut = landing.future.result()
                        if fut is not None:
                            fut.result()
                except BaseException as e:  # noqa: BLE001 - the first is raised below
                    err = err or e
            for fut, _ in writes:
                try:
                    fut.result()
                except BaseException as e:  # noqa: BLE001
                    err = err or e
            with self._lock:
                for serial, landing in landings:
                    self._landings.pop(serial, None)
                    self._events.append(landing.event)
                for w in writes:
                    if w in self._disk_writes:
                        self._disk_writes.remove(w)
                        self._writing -= w[1]
            if err is not None:
                raise err

    def close(self) -> None:
        """Land what is in flight and give the staging memory back to the system."""
        try:
            self.synchronize()
            self.wait_reads()
        finally:
            if self._acc_pool is not None:
                self._acc_pool.shutdown(wait=True)
                self._acc_pool = None
            if self.accelerated:
                self._pool.clear()
