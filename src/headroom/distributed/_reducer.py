"""All-reduce of store-resident gradients: only those some rank used, bucketed, overlapped.

The exchange is docs/data_parallel.md, "What is communicated, and when"; `StoreReducer` relays
the gradient-ready signal (`relay_done`) once a gradient is averaged. A bucket carries a count
per parameter of the ranks that had a gradient, so a parameter no rank's backward reached
keeps ``None``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from headroom.residency import Group, Offload, Slot
from headroom.transfer import relay_done

__all__ = ["CollectiveError", "StoreReducer"]


class CollectiveError(RuntimeError):
    """A collective of ``hr.data_parallel`` failed or timed out: another rank failed or stopped."""


class _ReducedGrad:
    __slots__ = ("state", "slot", "index", "numel", "dtype", "pending", "local", "bucket")

    def __init__(self, state: Offload, slot: Slot, index: int) -> None:
        self.state = state
        self.slot = slot
        self.index = index
        self.numel = slot.dev.numel()
        self.dtype = slot.binding.handle.dtype  # the gradient's; see `StoreReducer._layout`
        self.pending = False  # its gradient is expected from this backward
        self.local = False  # this rank contributes a gradient
        self.bucket: _Bucket | None = None


class _Bucket:
    __slots__ = ("entries", "waiting", "buffer", "work", "launched")

    def __init__(self, entries: list[_ReducedGrad]) -> None:
        self.entries = entries
        self.waiting = sum(1 for e in entries if e.pending)
        for e in entries:
            e.bucket = self
        self.buffer: torch.Tensor | None = None
        self.work: Any = None
        self.launched = False

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)


class StoreReducer:
    """Averages the gradients of store-resident parameters across the ranks of ``group``.

    Args:
        states: the offload states whose parameters take part.
        group: a process group used by nothing else, so its collectives keep one order on
            every rank.
        bucket_bytes: bytes of gradient per all-reduce.
        timeout: how long a collective may wait for the other ranks.
    """

    def __init__(self, states: list[Offload], group: Any, *, bucket_bytes: int,
                 timeout: timedelta) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.entries: list[_ReducedGrad] = []
        # Backward runs roughly in reverse parameter order: so do the buckets.
        for state in reversed(states):
            for slot in reversed(state.slots):
                if slot.param.requires_grad and slot.param.is_floating_point():
                    self.entries.append(_ReducedGrad(state, slot, len(self.entries)))
        self._by_param = {id(e.slot.param): e for e in self.entries}
        self._used: set[int] = set()
        self._syncing = False  # this step's backward all-reduces
        self._bitmap: torch.Tensor | None = None
        self._reset()
        self.bytes_reduced = 0  # bytes handed to all-reduce by this reducer, all steps
        self.last_step_bytes = 0
        for e in self.entries:
            if e.slot.binding.relay is not None:
                raise RuntimeError(
                    f"offloaded parameter {e.slot.name!r} is already all-reduced by another"
                    " hr.data_parallel wrapper; call its close() first, or keep using it"
                )
        for state in states:
            state.used_listeners.append(self._on_use)
        for e in self.entries:
            e.slot.binding.relay = self._on_grad

    def close(self) -> None:
        """Stop relaying: gradients go straight to the optimizer again."""
        for e in self.entries:
            e.slot.binding.relay = None
            if self._on_use in e.state.used_listeners:
                e.state.used_listeners.remove(self._on_use)

    # ------------------------------------------------------------------ forward
    def begin_forward(self, sync: bool) -> None:
        """A forward starts; ``sync``: its backward all-reduces (not inside ``no_sync``)."""
        if self._in_backward or (self._buckets is not None and self._next < len(self._buckets)):
            # the previous backward broke off (or never ran): every rank resets the same way
            self._reset()
        self._used = set()
        self._syncing = sync and torch.is_grad_enabled()

    def _on_use(self, group: Group) -> None:
        self._used.add(id(group))

    def end_forward(self, outputs: list[torch.Tensor]) -> None:
        """A forward ended: launch the used-bitmap all-reduce and watch for backward."""
        if not self._syncing:
            return
        bitmap = torch.zeros(len(self.entries), dtype=torch.int32)
        for e in self.entries:
            e.pending = id(e.slot.group) in self._used
            # A gradient kept from no_sync micro-batches is contributed even if unused now.
            e.local = e.pending or e.slot.param.grad is not None
            bitmap[e.index] = int(e.local)
        self._bitmap = bitmap
        self._bitmap_work = dist.all_reduce(bitmap, group=self.group, async_op=True)
        self._buckets = None
        self._next = self._done = 0
        self.last_step_bytes = bitmap.nbytes
        self.bytes_reduced += self.last_step_bytes
        fired = [False]

        def started(grad):
            if not fired[0]:
                fired[0] = True
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            return None

        for t in outputs:
            t.register_hook(started)

    # ------------------------------------------------------------------ backward
    def _on_grad(self, p: torch.Tensor) -> None:
        e = self._by_param.get(id(p))
        if e is None or not self._syncing:
            relay_done(p)  # inside no_sync (or not ours): the gradient is final as it is
            return
        if not self._in_backward:
            raise RuntimeError(
                "hr.data_parallel did not see this backward start from the model's outputs, so"
                " offloaded gradients would not be all-reduced: run backward through the wrapped"
                " model's outputs, once per forward"
            )
        self._layout()
        if e.bucket is None:
            raise RuntimeError(
                f"hr.data_parallel: offloaded parameter {e.slot.name!r} got a gradient, but no"
                " rank's forward used its block (so no all-reduce): use its parameters only"
                " through the block's forward"
            )
        if e.bucket.launched:
            raise RuntimeError(
                f"hr.data_parallel: offloaded parameter {e.slot.name!r} got a second gradient"
                " after its all-reduce; run one backward per forward (no_sync() to accumulate)"
            )
        if e.pending:  # (one used although its block's forward was not seen was not counted)
            e.bucket.waiting -= 1
        e.pending = e.local = True
        self._launch_ready()
        self._finish_ready(block=False)

    def _layout(self) -> None:
        if self._buckets is not None:
            return
        self._wait(self._bitmap_work, "the exchange of used parameters")
        self._bitmap_work = None
        used = [e for e in self.entries if self._bitmap[e.index] > 0]
        for e in self.entries:
            e.bucket = None
            # An optimizer built after the wrapper may have asked for fp32 gradients.
            b = e.slot.binding
            e.dtype = b.grad_dtype or b.handle.dtype
        buckets: list[_Bucket] = []
        cur: list[_ReducedGrad] = []
        size = 0
        for e in used:
            nbytes = e.numel * e.dtype.itemsize
            if cur and (size + nbytes > self.bucket_bytes or cur[0].dtype != e.dtype):
                buckets.append(_Bucket(cur))
                cur, size = [], 0
            cur.append(e)
            size += nbytes
        if cur:
            buckets.append(_Bucket(cur))
        self._buckets = buckets

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].waiting <= 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bk: _Bucket) -> None:
        n = bk.numel
        dtype = bk.entries[0].dtype
        buf = torch.zeros(n + len(bk.entries), dtype=dtype)
        off = 0
        scale = 1.0 / self.world
        for i, e in enumerate(bk.entries):
            g = e.state.read_grad(e.slot) if e.local else None
            if g is not None:
                # Divided while packed, as DistributedDataParallel does (then summed).
                torch.mul(g.reshape(-1), scale, out=buf[off:off + e.numel])
                buf[n + i] = 1
            off += e.numel
        bk.buffer = buf
        bk.launched = True
        bk.work = dist.all_reduce(buf, group=self.group, async_op=True)
        self.last_step_bytes += buf.nbytes
        self.bytes_reduced += buf.nbytes

    def _finish_ready(self, *, block: bool) -> None:
        while self._done < self._next:
            bk = self._buckets[self._done]
            if not block and not bk.work.is_completed():
                return
            self._wait(bk.work, "the all-reduce of offloaded gradients")
            self._unpack(bk)
            self._done += 1

    def _unpack(self, bk: _Bucket) -> None:
        buf = bk.buffer
        n = bk.numel
        off = 0
        for i, e in enumerate(bk.entries):
            if buf[n + i] > 0:
                e.state.put_grad(e.slot, buf[off:off + e.numel].view(e.slot.dev.shape))
                relay_done(e.slot.param)
            off += e.numel
        bk.buffer = None
        bk.work = None

    def _finish(self) -> None:
        """End of backward: launch what is left (missing gradients count as zeros), wait."""
        self._in_backward = False
        self._layout()
        for bk in self._buckets[self._next:]:
            bk.waiting = 0
        self._launch_ready()
        self._finish_ready(block=True)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as err:
            self._reset()
            raise CollectiveError(
                f"hr.data_parallel: {what} failed on rank {self.rank} of {self.world}: another"
                f" rank failed, stopped, or did not reach this backward within"
                f" {self.timeout.total_seconds():g} s ({type(err).__name__}: {err}). The process"
                " group is unusable: restart every rank from the last checkpoint (hr.load)"
            ) from err

    def _reset(self) -> None:
        self._in_backward = False
        self._buckets: list[_Bucket] | None = None
        self._bitmap_work: Any = None
        self._next = self._done = 0  # next bucket to launch, to finish

