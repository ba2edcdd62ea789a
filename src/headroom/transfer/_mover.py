"""The mover: store -> device for parameters, device -> store for gradients.

This is the one place that knows about streams, events and page-locked staging buffers. On an
accelerator, copies run on side streams ordered with the compute stream by events, so a prefetch
overlaps compute. On the CPU the same calls run synchronously, except disk reads, which run on
the store's I/O threads and so overlap compute there too.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from headroom.transfer._binding import ParamBinding
from headroom.transfer._handle import Handle
from headroom.transfer._host import PinnedPool, as_bytes
from headroom.transfer._store import Store, is_accelerator

__all__ = ["Mover", "RowStreamer", "Ticket"]

# NOTE: bound the page-locked memory held by gradients in flight to the host; past it the
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


# NOTE: streams and events come from the device's own module (torch.cuda, torch.xpu, ...)
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
                # NOTE: read straight into the parameter's memory on an I/O thread: the
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
        if not self.accelerated or grad.device.type == "cpu":
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
                # NOTE: read-add-write on the mover's own thread, so backward does not wait
                # for the disk; one thread keeps pushes to the same gradient in order.
                self._grads_disk(self._accumulator().submit(self._accumulate, gh, grad),
                                 2 * gh.nbytes)
                return
            if grad.dtype != gh.dtype or not grad.is_contiguous() or self.accelerated:
                # NOTE: on an accelerator `grad` is a pooled staging buffer that is about to be
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
        # NOTE: a pending write keeps its gradient alive; bound those bytes so host memory
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


# ---------------------------------------------------------------------------------------------
# row slices of host tensors: streamed to the device with prefetch, gradient rows streamed back

_shared_pool: PinnedPool | None = None

# NOTE: staging buffers are cached across passes (pinning is slow); past this many bytes the
# cache is dropped at the end of a pass, so that slice sizes changing with the batch do not pile
# up page-locked memory. Not a hard limit: a pass takes what its ring needs.
_ROW_STAGING_CACHE = 1 << 30


def _row_staging_pool() -> PinnedPool:
    global _shared_pool
    if _shared_pool is None:
        _shared_pool = PinnedPool(pin=True)
    return _shared_pool


class RowStreamer:
    """Streams row slices of host tensors to the device, and gradient rows back, overlapped.

    `stream` yields slice ``i`` on the device while slices ``i+1 .. i+prefetch`` are copied on a
    side stream; the compute stream waits (an event, not the host) only for the slice it is
    about to use. A host tensor that is not page-locked is first copied into page-locked
    staging buffers, ``prefetch + 1`` of them reused in a ring; a buffer is refilled only after
    the device copy out of it has finished. `push` does the reverse for gradient slices: the copy
    to the host runs on a second side stream, and the host-side landing (copy or add into the
    destination rows) happens when that ring slot is next needed, or in `finish`.

    On the CPU (``device="cpu"``) the same calls run synchronously: slices are views (or casts)
    of the host rows and pushes copy or add at once.

    Args:
        device: the compute device.
        prefetch: slices copied ahead of the one computing. ``1`` overlaps each copy with one
            slice of compute; more absorbs jitter in copy or compute times at the cost of one
            more slice of device memory (and, for pageable sources, of page-locked staging)
            per step of depth; ``0`` copies on the side stream without overlap.
        pool: page-locked staging pool (default: one shared, budgeted pool per process).

    Raises:
        ValueError: ``prefetch < 0``.

    Example:
        >>> s = RowStreamer("cpu")
        >>> w = torch.arange(6.0).view(3, 2)
        >>> [rows[0].sum().item() for _, _, rows in s.stream([w], [(0, 2), (2, 3)])]
        [6.0, 9.0]
    """

    def __init__(
        self, device: str | torch.device, *, prefetch: int = 1, pool: PinnedPool | None = None
    ) -> None:
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.accelerated = False
        self._mod = None
        self._slots: dict[str, list] = {}  # push key -> ring of pending landings
        self._outs: dict[str, list] = {}  # push key -> ring of device buffers for `out`
        self._count: dict[str, int] = {}
        # NOTE: tests set a list here to check the ring's ordering (refills, copies, landings).
        self._trace: list | None = None
        if is_accelerator(self.device):
            self._use_streams(torch.get_device_module(self.device.type),
                              pool if pool is not None else _row_staging_pool())

    def _use_streams(self, mod, pool: PinnedPool) -> None:
        # NOTE: separate from __init__ so tests can drive the accelerator bookkeeping on the
        # CPU with a stand-in device module whose streams and events do nothing.
        self.accelerated = True
        self._mod = mod
        self._pool = pool
        self._h2d = mod.Stream(self.device)
        self._d2h = mod.Stream(self.device)

    # ------------------------------------------------------------------ host -> device
    def stream(
        self,
        tensors: list[torch.Tensor | None],
        bounds: list[tuple[int, int]],
        *,
        dtype: torch.dtype | None = None,
    ):
        """Yield ``(start, stop, [rows on the device or None, ...])`` for each ``bounds`` entry.

        Each yielded tensor is valid until the consumer asks for the next slice (its device
        memory is reused by the ring): use it, do not keep it. Once the iteration ends (or is
        closed) every copy out of ``tensors`` has finished, so the host may write them again.

        Args:
            tensors: host tensors with the same number of rows (``None`` entries stay ``None``).
            bounds: ``(start, stop)`` row ranges, in the order to deliver them.
            dtype: cast on the device to this dtype (``None``: keep each tensor's dtype).

        Raises:
            ValueError: a tensor that is not in host memory.
        """
        for t in tensors:
            if t is not None and t.device.type != "cpu":
                raise ValueError(f"RowStreamer streams host tensors, got one on {t.device}")
        tensors = [None if t is None else t.detach() for t in tensors]
        if not self.accelerated:
            for start, stop in bounds:
                yield start, stop, [None if t is None else
                                    t[start:stop].to(self.device, dtype or t.dtype)
                                    for t in tensors]
            return
        yield from self._stream_async(tensors, bounds, dtype)

    def _stream_async(self, tensors, bounds, dtype):
        mod, ring = self._mod, self.prefetch + 1
        compute = mod.current_stream(self.device)
        max_rows = max((stop - start for start, stop in bounds), default=0)
        # NOTE: rows of a contiguous page-locked tensor (a pinned host store) go to the device
        # straight from where they rest; anything else goes through page-locked staging.
        direct = [t is not None and t.is_contiguous() and t.is_pinned() for t in tensors]
        row_elems = [0 if t is None else t[:1].numel() for t in tensors]
        dev_bufs = [[None] * ring for _ in tensors]
        staging = [[None] * ring for _ in tensors]
        ready: dict[int, tuple] = {}
        release: list = [None] * ring  # compute finished with slot k's device buffers
        copied: list = [None] * ring  # device copy out of slot k's staging finished
        last: list = [None]  # the latest copy issued

        def issue(j: int) -> None:
            k, (start, stop) = j % ring, bounds[j]
            if release[k] is not None:
                self._h2d.wait_event(release[k])
                release[k] = None
            if copied[k] is not None:
                copied[k].synchronize()  # long done in steady state: a ring's worth ago
                copied[k] = None
            outs: list[torch.Tensor | None] = []
            staged = False
            for c, t in enumerate(tensors):
                if t is None:
                    outs.append(None)
                    continue
                n = (stop - start) * row_elems[c]
                shape = (stop - start, *t.shape[1:])
                src = t[start:stop]
                if not direct[c]:
                    if staging[c][k] is None:
                        nbytes = max_rows * row_elems[c] * t.element_size()
                        staging[c][k] = self._pool.take(nbytes).view(t.dtype)
                    buf = staging[c][k][:n].view(shape)
                    buf.copy_(src)
                    src, staged = buf, True
                    if self._trace is not None:
                        self._trace.append(("stage", j, k, buf.data_ptr()))
                if dev_bufs[c][k] is None:
                    dev_bufs[c][k] = torch.empty(max_rows * row_elems[c], dtype=t.dtype,
                                                 device=self.device)
                dst = dev_bufs[c][k][:n].view(shape)
                with mod.stream(self._h2d):
                    dst.copy_(src, non_blocking=True)
                outs.append(dst)
                if self._trace is not None:
                    self._trace.append(("h2d", j, k, dst.data_ptr()))
            ev = mod.Event()
            ev.record(self._h2d)
            ready[j] = (ev, outs)
            last[0] = ev
            if staged:
                copied[k] = ev

        issued = 0
        # NOTE: no autograd context is held across the yield (it would leak into the consumer's
        # code); the tensors are detached, so the copies record nothing anyway.
        try:
            for i, (start, stop) in enumerate(bounds):
                if i > 0:
                    # NOTE: every kernel reading slice i-1 is enqueued by now; the copy
                    # that will overwrite its buffers waits for them on the device.
                    ev = mod.Event()
                    ev.record(compute)
                    release[(i - 1) % ring] = ev
                while issued < len(bounds) and issued <= i + self.prefetch:
                    issue(issued)
                    issued += 1
                ev, outs = ready.pop(i)
                compute.wait_event(ev)
                if dtype is not None:
                    outs = [None if o is None else o.to(dtype) for o in outs]
                yield start, stop, outs
        finally:
            for ev, _ in ready.values():  # closed early: order freeing after the copies
                compute.wait_event(ev)
            # NOTE: a pinned source is read by the device with no host wait; wait once at the
            # end so that an optimizer step (or any host write) after the pass cannot race the
            # last copies. Copies finish in issue order on the one side stream.
            if last[0] is not None:
                last[0].synchronize()
            for bufs in staging:
                for b in bufs:
                    if b is not None:
                        self._pool.give(as_bytes(b))
            self._trim_pool()

    def _trim_pool(self) -> None:
        if self._pool.total_bytes > _ROW_STAGING_CACHE:
            self._pool.clear()

    # ------------------------------------------------------------------ device -> host
    def _ring(self) -> int:
        return max(2, self.prefetch + 1)

    def out(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A device buffer to compute the next slice pushed under ``key`` into (ring-reused).

        Blocks only if the copy out of this ring slot (``prefetch + 1`` pushes ago, at least
        two) has not finished yet.
        """
        n = math.prod(shape)
        k = self._count.get(key, 0) % self._ring()
        self._land(key, k)
        bufs = self._outs.setdefault(key, [None] * self._ring())
        if bufs[k] is None or bufs[k].numel() < n or bufs[k].dtype != dtype:
            bufs[k] = torch.empty(n, dtype=dtype, device=self.device)
        if self._trace is not None:
            self._trace.append(("out", key, k, bufs[k].data_ptr()))
        return bufs[k][:n].view(shape)

    def push(self, key: str, dst: torch.Tensor, src: torch.Tensor, *, accumulate: bool) -> None:
        """Copy (or add) device rows ``src`` into host rows ``dst`` (cast to ``dst.dtype``).

        In the background on an accelerator: call `finish` before reading ``dst``. ``src`` may be
        dropped at once (it is kept alive until copied); pushes under one ``key`` land in order.
        """
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"push {key!r}: rows of shape {tuple(src.shape)} into {dst.shape}")
        k = self._count.get(key, 0) % self._ring()
        self._count[key] = self._count.get(key, 0) + 1
        with torch.no_grad():
            if not self.accelerated:
                if accumulate:
                    dst.add_(src.to(dst.device, dst.dtype))
                else:
                    dst.copy_(src)
                return
            self._land(key, k)
            mod = self._mod
            ev = mod.Event()
            ev.record(mod.current_stream(self.device))
            self._d2h.wait_event(ev)
            staging = None
            with mod.stream(self._d2h):
                if not accumulate and dst.dtype == src.dtype and dst.is_contiguous() \
                        and dst.is_pinned():
                    dst.copy_(src, non_blocking=True)  # NOTE: into a pinned store directly
                else:
                    staging = self._pool.take(src.numel() * src.element_size())
                    staging = staging.view(src.dtype).view(src.shape)
                    staging.copy_(src, non_blocking=True)
                done = mod.Event()
                done.record(self._d2h)
        self._slots.setdefault(key, [None] * self._ring())[k] = (
            done, src, staging, dst, accumulate)
        if self._trace is not None:
            self._trace.append(("push", key, k, src.data_ptr()))

    def _land(self, key: str, k: int) -> None:
        slots = self._slots.get(key)
        if not slots or slots[k] is None:
            return
        done, src, staging, dst, accumulate = slots[k]
        slots[k] = None
        done.synchronize()
        if self._trace is not None:
            self._trace.append(("land", key, k, src.data_ptr()))
        if staging is None:
            return
        with torch.no_grad():
            if accumulate:
                dst.add_(staging.to(dst.dtype))
            else:
                dst.copy_(staging)
        self._pool.give(as_bytes(staging))

    def finish(self) -> None:
        """Land every pushed slice in its host destination (in push order per key)."""
        for key, slots in self._slots.items():
            start = self._count.get(key, 0)
            for off in range(len(slots)):
                self._land(key, (start + off) % len(slots))
        self._outs.clear()
        if self.accelerated:
            self._trim_pool()
