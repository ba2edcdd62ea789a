"""`hr.HostOptimizer` in a dry run: `HostOptimizer` itself over ``meta`` tensors.

`hr.estimate` and `hr.plan` step the real optimizer (entries, plans, spares, undo tensors,
buckets) over `MetaStore` s with a mover that finishes every copy at once. What differs is
here only: stores are `MetaStore` s (host memory where `Places` says); steps run as host code,
landing buffers on ``meta``, and those of ``final_backward`` at once on the backward thread
(the tracker sees one thread); masters start as followed; a gradient sent to the host stays
on the device until a bucket's worth has gone or ``step()`` starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from headroom.optim._follow import written_mark
from headroom.optim._host_optimizer import HostOptimizer
from headroom.store import Handle, MetaStore, Places
from headroom.transfer import ParamBinding

__all__ = ["DryHostOptimizer"]


class _InstantMover:
    """`headroom.transfer.Mover` in a dry run: every copy done at once; counts the bytes over
    the host link (``link``)."""

    accelerated = True

    def __init__(self, places: Places, *, link: bool, bucket_bytes: int) -> None:
        self.places = places
        self.link = link
        self.bucket_bytes = bucket_bytes
        self.link_bytes = 0
        self.in_flight: list[torch.Tensor] = []  # device gradients whose copy is not reaped
        self._in_flight_bytes = 0

    def push_grad(self, grad: torch.Tensor, b: ParamBinding, *, accumulate: bool) -> None:
        b.has_grad = True
        host = b.store.host_tensor(b.grad_handle)
        with self.places.host_code(), torch.no_grad():
            host.add_(grad) if accumulate else host.copy_(grad)
        if self.link:
            nbytes = grad.numel() * grad.element_size()
            self.link_bytes += nbytes
            self.in_flight.append(grad)  # until reaped, a bucket's worth at a time
            self._in_flight_bytes += nbytes
            if self._in_flight_bytes >= self.bucket_bytes:
                self.reap()

    def reap(self) -> None:
        self.in_flight, self._in_flight_bytes = [], 0

    def fetch(self, handle: Handle, dst: torch.Tensor, *, after: Any = None) -> None:
        dst.copy_(handle.store.host_tensor(handle))
        if self.link:
            self.link_bytes += dst.numel() * dst.element_size()

    def _nothing(self, *args: Any) -> None:
        return None

    mark = synchronize = wait = wait_reads = close = _nothing


class DryHostOptimizer(HostOptimizer):
    """`HostOptimizer` with the real one's `HostOptimizerOptions` (a ``state_store`` other
    than ``"cpu"`` taken as a disk) over a dry run's ``params``, its tensors where ``places``
    says (``cpu``: the target is the CPU)."""

    def __init__(self, params: Any, options: Any, places: Places, *,
                 cpu: bool) -> None:
        self._places = places
        self._cpu = cpu
        state = options.state_store
        super().__init__(
            params, options.optimizer_class,
            state_store="cpu" if state in ("cpu", "host") else MetaStore(places, host=False),
            overlap=options.overlap, slice_bytes=options.slice_bytes,
            bucket_bytes=options.bucket_bytes, atomic=getattr(options, "atomic", True),
            **options.optimizer_kwargs)
        self._aux = MetaStore(places, host=True)
        self._overlap.submit = self._now  # NOTE: the tracker sees this thread's ops only
        for e in self._order:
            e.written = written_mark(e.param)

    @staticmethod
    def _now(fn: Callable[[], None]) -> None:
        fn()

    def _on_cpu(self, p: torch.Tensor) -> bool:  # (an FSDP2 shard in host memory too)
        return self._cpu or self._places.where(
            getattr(p, "_local_tensor", p).untyped_storage()._cdata) == "host"

    def _open_host(self, device: torch.device) -> None:
        if self._host is None:
            self._host = MetaStore(self._places, host=True)
            self._mover = _InstantMover(self._places, link=not self._cpu,
                                        bucket_bytes=self._bucket_bytes)

    def _step_entries(self, batch: list[Any], *, early: bool = False) -> None:
        with self._places.host_code():
            super()._step_entries(batch, early=early)

    def _sliced_step(self, todo: list[Any], hparams: dict[int, Any], txn: Any) -> None:
        with torch.device("meta"):  # its landing buffers too
            super()._sliced_step(todo, hparams, txn)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self._mover is not None:
            self._mover.reap()
        return super().step(closure)

    @property
    def link_bytes(self) -> int:
        """Bytes over the host link: gradients out, parameters back."""
        return 0 if self._mover is None else self._mover.link_bytes

    def stores(self) -> list[MetaStore]:
        """The stores its step reads and writes (the state's, its host memory)."""
        return [s for s in (self._state_store, self._aux, self._host) if s is not None]
