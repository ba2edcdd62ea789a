"""Where class-weight slices come from and where their gradients go: a tensor on the compute
device (views), a host tensor streamed to an accelerator (`RowStreamer`), or a store.

Streamed slices are copies of the same rows, so results are bitwise the unstreamed path's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Protocol

import torch

from headroom.store import is_accelerator
from headroom.transfer import RowStreamer


def slice_bounds(num_classes: int, slice_size: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(num_classes)`` in steps of ``slice_size``."""
    return [(s, min(s + slice_size, num_classes)) for s in range(0, num_classes, slice_size)]


def host_streamer(
    src_device: torch.device, device: torch.device, *, prefetch: int
) -> RowStreamer | None:
    """A streamer when rows resting on ``src_device`` (host) feed an accelerator, else ``None``."""
    # the one switch between views and streamed rows: tests replace it to stream on the CPU
    if src_device.type != "cpu" or not is_accelerator(device):
        return None
    return RowStreamer(device, prefetch=prefetch)


@contextmanager
def landing(sink: GradSink | None) -> Iterator[None]:
    """Wait for every gradient ``sink`` was handed, when the block ends or raises (the first
    error is reported)."""
    # NOTE: none may land later, after the caller has cleared the gradients to start over
    try:
        yield
    except BaseException:
        if sink is not None:
            with suppress(Exception):
                sink.finish()
        raise
    if sink is not None:
        sink.finish()


class SliceSource(Protocol):
    """Rows of a ``(num_classes, in_features)`` weight and an optional bias, slice by slice."""

    num_classes: int

    def slices(
        self, bounds: list[tuple[int, int]]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """Yield ``(start, stop, weight_rows, bias_rows)`` on the compute device."""
        ...


class GradSink(Protocol):
    """Receives the gradient of weight (and bias) rows, slice by slice."""

    def out(self, start: int, stop: int) -> torch.Tensor:
        """A ``(stop - start, in_features)`` tensor in the accumulation dtype to write into."""
        ...

    def commit(
        self, start: int, stop: int, grad_w: torch.Tensor | None, grad_b: torch.Tensor | None
    ) -> None:
        """Take the finished gradient of rows ``start:stop`` (``grad_w`` is what ``out`` gave)."""
        ...

    def finish(self) -> None:
        """Return once every committed gradient has landed."""
        ...


class TensorSlices:
    """Slices of an in-memory weight (and bias), on ``device`` in ``dtype``: views where it
    already is, streamed ``prefetch`` ahead from host memory to an accelerator."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 device: torch.device, dtype: torch.dtype, prefetch: int = 1) -> None:
        self.weight, self.bias, self.device, self.dtype = weight, bias, device, dtype
        self.num_classes = weight.shape[0]
        self.streamer = host_streamer(weight.device, device, prefetch=prefetch)

    def _move(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype, non_blocking=True)

    def slices(
        self, bounds: list[tuple[int, int]]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        if self.streamer is not None:
            stream = self.streamer.stream([self.weight, self.bias], bounds, dtype=self.dtype)
            yield from ((start, stop, w, b) for start, stop, (w, b) in stream)
            return
        for start, stop in bounds:
            w = self._move(self.weight[start:stop])
            b = None if self.bias is None else self._move(self.bias[start:stop])
            yield start, stop, w, b


class TensorGradSink:
    """Writes (with ``accumulate``, adds) slice gradients into the full gradient tensors
    ``grad_weight`` and ``grad_bias`` (``None``: not wanted): views of them where device and
    dtype allow (no copy), streamed back in the background from an accelerator to host ones."""

    def __init__(self, grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None, *,
                 device: torch.device, dtype: torch.dtype, prefetch: int = 1,
                 accumulate: bool = False) -> None:
        self.grad_weight, self.grad_bias, self.accumulate = grad_weight, grad_bias, accumulate
        full = grad_weight if grad_weight is not None else grad_bias
        assert full is not None
        self.streamer = host_streamer(full.device, device, prefetch=prefetch)
        self._direct = (
            grad_weight is not None and not accumulate and grad_weight.device == device
            and grad_weight.dtype == dtype and self.streamer is None
        )
        self._device = device
        self._dtype = dtype
        self._tmp: torch.Tensor | None = None

    def out(self, start: int, stop: int) -> torch.Tensor:
        assert self.grad_weight is not None
        if self._direct:
            return self.grad_weight[start:stop]
        n, d = stop - start, self.grad_weight.shape[1]
        if self.streamer is not None:
            return self.streamer.out("w", (n, d), self._dtype)
        if self._tmp is None or self._tmp.numel() < n * d:
            self._tmp = torch.empty(n * d, device=self._device, dtype=self._dtype)
        return self._tmp[: n * d].view(n, d)

    def commit(
        self, start: int, stop: int, grad_w: torch.Tensor | None, grad_b: torch.Tensor | None
    ) -> None:
        for name, full, g in (("w", self.grad_weight, None if self._direct else grad_w),
                              ("b", self.grad_bias, grad_b)):
            if g is None or full is None:
                continue
            dst = full[start:stop]
            if self.streamer is not None:
                self.streamer.push(name, dst, g, accumulate=self.accumulate)
            elif self.accumulate:
                dst.add_(g.to(device=dst.device, dtype=dst.dtype))
            else:
                dst.copy_(g)

    def finish(self) -> None:
        if self.streamer is not None:
            self.streamer.finish()


class ParamSlices(Protocol):
    """Where the weight (and bias) slices come from and where their gradients go."""

    one_pass: bool
    versioned: tuple[torch.Tensor | None, ...]

    def source(self, slice_size: int) -> SliceSource: ...

    def sink(self, slice_size: int, *, weight: bool, bias: bool) -> GradSink: ...

    def landed(
        self, sink: GradSink, *, weight: bool, bias: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gradients autograd gets for weight and bias (``None`` where they went elsewhere)."""
        ...


class TensorParams:
    """A weight (and bias) tensor, sliced with `TensorSlices`, gradients in `TensorGradSink`."""

    # NOTE: gradients go to this call's own tensors, so forward can form them; a store's must
    # not change before backward (``one_pass = False`` there)
    one_pass = True

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, device: torch.device,
        dtype: torch.dtype, prefetch: int,
    ) -> None:
        self.weight, self.bias = weight, bias
        self.device, self.dtype, self.prefetch = device, dtype, prefetch
        self.versioned = (weight, bias)

    def source(self, slice_size: int) -> SliceSource:
        return TensorSlices(self.weight, self.bias, device=self.device, dtype=self.dtype,
                            prefetch=self.prefetch)

    def sink(self, slice_size: int, *, weight: bool, bias: bool) -> GradSink:
        return TensorGradSink(
            torch.empty_like(self.weight) if weight else None,
            torch.empty_like(self.bias) if (bias and self.bias is not None) else None,
            device=self.device, dtype=self.dtype, prefetch=self.prefetch)

    def landed(
        self, sink: GradSink, *, weight: bool, bias: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert isinstance(sink, TensorGradSink)
        return sink.grad_weight, sink.grad_bias
