"""The row streamer: row slices of host tensors to the device, gradient rows back, overlapped
(used by the huge classifier head, whose weight is streamed slice by slice)."""

from __future__ import annotations

import math

import torch

from headroom.store import PinnedPool, add_into, as_bytes, is_accelerator
from headroom.transfer._device import stream_module

__all__ = ["RowStreamer"]

_shared_pool: dict[torch.device, PinnedPool] | None = None

# Staging is cached across passes (pinning is slow), dropped at a pass's end past this many
# bytes so that slice sizes changing with the batch do not pile up. Not a hard limit.
_ROW_STAGING_CACHE = 1 << 30


def _row_staging_pool(device: torch.device) -> PinnedPool:
    # One per device: the device's own context pins its staging (cuda:1 never touches GPU 0).
    global _shared_pool
    if _shared_pool is None:
        _shared_pool = {}
    pool = _shared_pool.get(device)
    if pool is None:
        pool = _shared_pool[device] = PinnedPool(pin=True, device=device)
    return pool


class RowStreamer:
    """Streams row slices of host tensors to the device, and gradient rows back, overlapped.

    `stream` yields slice ``i`` on the device while slices ``i+1 .. i+prefetch`` are copied on a
    side stream; the compute stream waits (an event) only for the slice it uses. Pageable host
    tensors go through ``prefetch + 1`` page-locked staging buffers reused in a ring. `push`
    does the reverse for gradient slices, landing each (copy or add into the destination rows)
    when its ring slot is next needed, or in `finish`. On the CPU the same calls run at once.

    Args:
        device: the compute device.
        prefetch: slices copied ahead of the one computing (``1`` overlaps each copy with one
            slice of compute; more absorbs jitter, at one more slice of device memory and
            staging each; ``0``: no overlap).
        pool: page-locked staging pool (default: one shared per process and device).

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
        # Tests set a list here to check the ring's ordering (refills, copies, landings).
        self._trace: list | None = None
        if is_accelerator(self.device):
            self._use_streams(stream_module(self.device),
                              pool if pool is not None else _row_staging_pool(self.device))

    def _use_streams(self, mod, pool: PinnedPool) -> None:
        # Separate so tests can drive it on the CPU with a stand-in device module.
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

        Each yielded tensor is valid until the next slice is asked for (the ring reuses its
        memory). Once the iteration ends (or is closed) the host may write ``tensors`` again.

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
        # Contiguous page-locked rows go straight to the device; the rest through staging.
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
            if any(t is not None and dev_bufs[c][k] is None for c, t in enumerate(tensors)):
                for c, t in enumerate(tensors):
                    if t is not None and dev_bufs[c][k] is None:
                        dev_bufs[c][k] = torch.empty(max_rows * row_elems[c], dtype=t.dtype,
                                                     device=self.device)
                # Allocated on the compute stream, whose queued kernels may still use that
                # memory: the side stream's first copies into it wait for them.
                fresh = mod.Event()
                fresh.record(compute)
                self._h2d.wait_event(fresh)
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
                dst = dev_bufs[c][k][:n].view(shape)
                with mod.stream(self._h2d):
                    # After the compute that last read this slot (release) or allocated it.
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
        # No autograd context across the yield (it would leak); the tensors are detached.
        try:
            for i, (start, stop) in enumerate(bounds):
                if i > 0:
                    # Kernels reading slice i-1 are enqueued: its next copy waits for them.
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
            # One host wait at the end, so a host write after the pass cannot race the last
            # copies; copies finish in issue order, so this also orders freeing the device
            # buffers and pooling the staging after every copy (undelivered ones included).
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
        """A device buffer to compute the next slice pushed under ``key`` into (ring-reused;
        blocks only while the copy out of this slot, ``max(2, prefetch + 1)`` pushes ago, runs)."""
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

        In the background on an accelerator (`finish` before reading ``dst``); ``src`` may be
        dropped at once; pushes under one ``key`` land in order.
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
                    dst.copy_(src, non_blocking=True)  # into a pinned store directly
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
            if accumulate:  # cast, then added (exact either way when dst's dtype is wider)
                wider = torch.promote_types(dst.dtype, staging.dtype) == dst.dtype
                add_into(dst, staging if wider else staging.to(dst.dtype))
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
