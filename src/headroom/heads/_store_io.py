"""Class-weight slices read from a store, and slice gradients written back to it (the only
part of ``heads/`` that talks to a store).

A host store's resting tensors are sliced (or streamed) and written as any host tensors; a disk
store is read into two rotating buffers, the next slice's read in flight while the current one
computes, and gradients leave through two more whose writes complete in the background.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future

import torch

from headroom.heads import _slices
from headroom.store import Handle, Store


class _Ring:
    """Two reusable host buffers for row slices of one handle (plus the futures using them)."""

    def __init__(self, handle: Handle, max_rows: int) -> None:
        row = handle.numel // handle.shape[0] if handle.shape[0] else 0
        self.handle = handle
        self.row = row
        self.bufs = [torch.empty(max_rows * row, dtype=handle.dtype) for _ in range(2)]
        self.pending: list[Future | None] = [None, None]

    def take(self, i: int, n_rows: int) -> torch.Tensor:
        """Buffer ``i % 2`` viewed as ``n_rows`` rows, after the last use of it has finished."""
        k = i % 2
        fut = self.pending[k]
        if fut is not None:
            fut.result()
            self.pending[k] = None
        shape = (n_rows, *self.handle.shape[1:])
        return self.bufs[k][: n_rows * self.row].view(shape)

    def drain(self) -> None:
        for k, fut in enumerate(self.pending):
            if fut is not None:
                fut.result()
                self.pending[k] = None


class StoreSlices:
    """Weight (and bias) row slices of store-resident tensors, on ``device`` in ``dtype``;
    ``max_rows``, the largest slice, sizes the disk buffers."""

    def __init__(self, store: Store, weight: Handle, bias: Handle | None, *,
                 device: torch.device, dtype: torch.dtype, max_rows: int,
                 prefetch: int = 1) -> None:
        self.store, self.weight, self.bias, self.max_rows = store, weight, bias, max_rows
        self.device, self.dtype, self.prefetch = device, dtype, prefetch
        self.num_classes = weight.shape[0]

    def slices(
        self, bounds: list[tuple[int, int]]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        host_w = self.store.host_tensor(self.weight)
        host_b = None if self.bias is None else self.store.host_tensor(self.bias)
        if host_w is not None and (self.bias is None or host_b is not None):
            yield from _slices.TensorSlices(host_w, host_b, device=self.device,
                                            dtype=self.dtype, prefetch=self.prefetch
                                            ).slices(bounds)
            return
        rings = [_Ring(self.weight, self.max_rows)]
        if self.bias is not None:
            rings.append(_Ring(self.bias, self.max_rows))

        def issue(i: int) -> list[Future]:
            start, stop = bounds[i]
            for ring in rings:
                buf = ring.take(i, stop - start)
                ring.pending[i % 2] = self.store.read_rows(ring.handle, slice(start, stop),
                                                           out=buf)
            return [ring.pending[i % 2] for ring in rings]

        try:
            nxt = issue(0) if bounds else []
            for i, (start, stop) in enumerate(bounds):
                host = [f.result() for f in nxt]  # (`take` and `drain` wait on it again: done)
                # the next read, into the previous slice's buffer, before computing on this one
                nxt = issue(i + 1) if i + 1 < len(bounds) else []
                w, *b = (t.to(device=self.device, dtype=self.dtype, non_blocking=True)
                         for t in host)
                yield start, stop, w, (b[0] if b else None)
        finally:
            for ring in rings:
                ring.drain()


def store_grad_sink(store: Store, weight_grad: Handle | None, bias_grad: Handle | None, *,
                    accumulate: bool, device: torch.device, dtype: torch.dtype, max_rows: int,
                    prefetch: int = 1) -> _slices.GradSink:
    """A sink writing (with ``accumulate``, adding) slice gradients into the store's gradient
    tensors ``weight_grad`` and ``bias_grad`` (``None``: not wanted): a `TensorGradSink` into
    a host store's resting tensors, else a `StoreGradSink`."""
    handles = (weight_grad, bias_grad)
    host = [None if h is None else store.host_tensor(h) for h in handles]
    if any(t is not None for t in host) and all(
            (h is None) == (t is None) for h, t in zip(handles, host, strict=True)):
        return _slices.TensorGradSink(*host, device=device, dtype=dtype, prefetch=prefetch,
                                      accumulate=accumulate)
    return StoreGradSink(store, weight_grad, bias_grad, accumulate=accumulate, device=device,
                         dtype=dtype, max_rows=max_rows)


class StoreGradSink:
    """Writes (or with ``accumulate``, adds) slice gradients into the store's gradient
    tensors ``weight_grad`` and ``bias_grad`` (``None``: not wanted), through two rotating host
    buffers each."""

    def __init__(self, store: Store, weight_grad: Handle | None, bias_grad: Handle | None, *,
                 accumulate: bool, device: torch.device, dtype: torch.dtype,
                 max_rows: int) -> None:
        self.store, self.wg, self.bg, self.accumulate = store, weight_grad, bias_grad, accumulate
        self.device, self.dtype = device, dtype
        self._rings: dict[str, _Ring] = {}
        self._count = 0
        self._tmp: torch.Tensor | None = None
        self._max_rows = max_rows

    def out(self, start: int, stop: int) -> torch.Tensor:
        assert self.wg is not None
        n, d = stop - start, self.wg.shape[1]
        if self._tmp is None:
            self._tmp = torch.empty(self._max_rows * d, device=self.device, dtype=self.dtype)
        return self._tmp[: n * d].view(n, d)

    def _land(self, name: str, handle: Handle, start: int, stop: int, src: torch.Tensor) -> None:
        ring = self._rings.get(name)
        if ring is None:
            ring = self._rings[name] = _Ring(handle, self._max_rows)
        buf = ring.take(self._count, stop - start)
        if self.accumulate:
            self.store.read_rows(handle, slice(start, stop), out=buf).result()
            buf.add_(src.to(device="cpu", dtype=handle.dtype))
        else:
            buf.copy_(src)
        ring.pending[self._count % 2] = self.store.write_rows(handle, slice(start, stop), buf)

    def commit(
        self, start: int, stop: int, grad_w: torch.Tensor | None, grad_b: torch.Tensor | None
    ) -> None:
        if grad_w is not None and self.wg is not None:
            self._land("w", self.wg, start, stop, grad_w)
        if grad_b is not None and self.bg is not None:
            self._land("b", self.bg, start, stop, grad_b)
        self._count += 1

    def finish(self) -> None:
        for ring in self._rings.values():
            ring.drain()
