"""The mover: store -> device for parameters, device -> store for gradients.

This is the one place that knows about streams, events and page-locked staging buffers. On an
accelerator, copies run on side streams ordered with the compute stream by events, so a prefetch
overlaps compute. On the CPU the same calls run synchronously, except disk reads, which run on
the store's I/O threads and so overlap compute there too.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from headroom.transfer._binding import ParamBinding
from headroom.transfer._handle import Handle
from headroom.transfer._host import PinnedPool, as_bytes
from headroom.transfer._store import Store, is_accelerator

__all__ = ["Mover", "Ticket"]

# Bound the page-locked memory held by gradients in flight to the host; past it the
# oldest copies are waited for (they are long done by then in steady state).
_MAX_STAGED_BYTES = 256 << 20


@dataclass
class Ticket:
    """A fetch in flight; pass it to `Mover.wait` before using the destination."""

    dst: torch.Tensor
    future: Future | None = None
    event: object | None = None
    staging: torch.Tensor | None = None  # disk read landing zone (cast or copied to dst on wait)
    done: bool = False


# Streams and events come from the device's own module (torch.cuda, torch.xpu, ...)
# rather than the generic torch.Stream/torch.Event so that they mix with that module's
# stream context and current_stream() everywhere.


class Mover:
    """Moves bytes between a store and the compute device.

    Args:
        device: the compute device.
        store: the store the tensors rest in.

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
        self._grads: deque = deque()
        self._staged = 0
        self._disk_writes: deque = deque()
        self._writing = 0
        self._acc_pool: ThreadPoolExecutor | None = None
        if self.accelerated:
            self._mod = torch.get_device_module(self.device.type)
            self._h2d = self._mod.Stream(self.device)
            self._d2h = self._mod.Stream(self.device)
            self._pool = PinnedPool(pin=True)
            self._inflight: deque = deque()  # (event, staging) of H2D copies from staging

    # ------------------------------------------------------------------ store -> device
    def fetch(self, handle: Handle, dst: torch.Tensor) -> Ticket:
        """Start filling ``dst`` (on the device, storage allocated) with ``handle``'s value.

        Casts to ``dst.dtype`` if it differs (e.g. fp32 master to a bf16 compute copy). Does
        not bump ``dst``'s version counter, so autograd's saved references stay valid.
        """
        if tuple(dst.shape) != handle.shape:
            raise ValueError(f"fetch of {handle.key!r}: shape {handle.shape} into {dst.shape}")
        dst = dst.detach()
        host = self.store.host_tensor(handle)
        if not self.accelerated:
            if host is not None:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(dst):
                    dst.copy_(host)
                return Ticket(dst, done=True)
            if dst.dtype == handle.dtype and dst.is_contiguous():
                # Read straight into the parameter's memory on an I/O thread: the
                # prefetch overlaps compute even on the CPU.
                return Ticket(dst, future=self.store.read(handle, out=dst))
            return Ticket(dst, future=self.store.read(handle), staging=None)
        self._reclaim()
        if host is not None:
            ev = self._mod.Event()
            ev.record(self._mod.current_stream(self.device))
            self._h2d.wait_event(ev)
            with torch.no_grad(), self._mod.stream(self._h2d), \
                    torch.autograd._unsafe_preserve_version_counter(dst):
                dst.copy_(host, non_blocking=self.store.pinned)
                done_ev = self._mod.Event()
                done_ev.record(self._h2d)
            return Ticket(dst, event=done_ev)
        staging = self._pool.take(handle.nbytes).view(handle.dtype).view(handle.shape)
        return Ticket(dst, future=self.store.read(handle, out=staging), staging=staging)

    def wait(self, ticket: Ticket) -> None:
        """Order the compute stream after the fetch (or block until it is done on the CPU)."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.future is not None:
            result = ticket.future.result()
            if ticket.staging is None and result is ticket.dst:
                return
            src = result if ticket.staging is None else ticket.staging
            if not self.accelerated:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(ticket.dst):
                    ticket.dst.copy_(src)
                return
            ev = self._mod.Event()
            ev.record(self._mod.current_stream(self.device))
            self._h2d.wait_event(ev)
            with torch.no_grad(), self._mod.stream(self._h2d), \
                    torch.autograd._unsafe_preserve_version_counter(ticket.dst):
                ticket.dst.copy_(src, non_blocking=True)
                ticket.event = self._mod.Event()
                ticket.event.record(self._h2d)
            self._inflight.append((ticket.event, src))
        if ticket.event is not None:
            self._mod.current_stream(self.device).wait_event(ticket.event)

    def _reclaim(self) -> None:
        while self._inflight and self._inflight[0][0].query():
            _, staging = self._inflight.popleft()
            self._pool.give(as_bytes(staging))

    # ------------------------------------------------------------------ device -> store
    def push_grad(self, grad: torch.Tensor, b: ParamBinding, *, accumulate: bool) -> None:
        """Move a finished gradient into ``b.grad_handle``: add to it or overwrite it.

        The caller may drop ``grad`` at once; the mover keeps it alive until copied. Call
        `synchronize` before reading the stored gradient.
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
        ev = self._mod.Event()
        ev.record(self._mod.current_stream(self.device))
        self._d2h.wait_event(ev)
        staging = self._pool.take(grad.numel() * grad.element_size())
        staging = staging.view(grad.dtype).view(grad.shape)
        with self._mod.stream(self._d2h):
            staging.copy_(grad.detach(), non_blocking=True)
            done_ev = self._mod.Event()
            done_ev.record(self._d2h)
        self._grads.append((done_ev, grad, staging, gh, accumulate))
        self._staged += staging.numel() * staging.element_size()
        while self._staged > _MAX_STAGED_BYTES:
            self._finish_one()

    def _finish_one(self) -> None:
        ev, _grad, staging, gh, accumulate = self._grads.popleft()
        ev.synchronize()
        self._staged -= staging.numel() * staging.element_size()
        self._land(staging, gh, accumulate)
        self._pool.give(as_bytes(staging))

    def _land(self, grad: torch.Tensor, gh: Handle, accumulate: bool) -> None:
        store = self.store
        host = store.host_tensor(gh)
        with torch.no_grad():
            if host is not None:
                if accumulate:
                    host.add_(grad)
                else:
                    host.copy_(grad)
                return
            if accumulate:
                if self.accelerated:
                    grad = grad.clone()  # the staging buffer goes back to the pool now
                # Read-add-write on the mover's own thread, so backward does not wait
                # for the disk; one thread keeps pushes to the same gradient in order.
                self._grads_disk(self._accumulator().submit(self._accumulate, gh, grad),
                                 2 * gh.nbytes)
                return
            if grad.dtype != gh.dtype or not grad.is_contiguous() or self.accelerated:
                # On an accelerator `grad` is a pooled staging buffer that is about to be
                # reused, so the disk write gets its own copy.
                grad = grad.to(gh.dtype, copy=True).contiguous()
            self._grads_disk(store.write(gh, grad), gh.nbytes)

    def _accumulator(self) -> ThreadPoolExecutor:
        if self._acc_pool is None:
            self._acc_pool = ThreadPoolExecutor(1, thread_name_prefix="hr-grad-acc")
        return self._acc_pool

    def _accumulate(self, gh: Handle, grad: torch.Tensor) -> None:
        acc = self.store.read(gh).result()
        with torch.no_grad():
            acc.add_(grad)
        self.store.write(gh, acc).result()

    def _grads_disk(self, fut: Future, nbytes: int) -> None:
        # A pending write keeps its gradient alive; bound those bytes so host memory
        # stays at a few tensors however many parameters the model has.
        self._disk_writes.append((fut, nbytes))
        self._writing += nbytes
        while len(self._disk_writes) > 1 and self._writing > _MAX_STAGED_BYTES // 4:
            done_fut, n = self._disk_writes.popleft()
            self._writing -= n
            done_fut.result()

    def synchronize(self) -> None:
        """Wait until every gradient pushed so far rests in the store.

        Raises:
            OSError / StoreFullError: an error of a background write.
        """
        while self._grads:
            self._finish_one()
        while self._disk_writes:
            fut, n = self._disk_writes.popleft()
            self._writing -= n
            fut.result()
        if self.accelerated:
            self._h2d.synchronize()
            self._reclaim()
