"""Where class-weight slices come from and where their gradients go.

The two passes of the sliced cross-entropy (``_linear_ce.py``) only ever ask for "the weight
(and bias) rows ``start:stop`` on the compute device, in the accumulation dtype" and hand back
"the gradient of rows ``start:stop``". This module hides where those rows rest: a tensor on the
compute device (views, no copy), a host tensor while the compute device is an accelerator
(streamed slice by slice by the transfer layer's `RowStreamer`, with prefetch), or a store
(``HugeClassifier``, read slice by slice).
"""

# Keeping this a tiny internal interface means the transfer layer's streamer (streams, events,
# pinned buffers) plugs in here without the numerics changing: streamed slices are copies of the
# same rows, so results are bitwise those of the unstreamed path.

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
    # The one switch between "views of a tensor on the compute device" and "streamed host
    # rows"; tests replace it to drive the streamed path on the CPU.
    if src_device.type != "cpu" or not is_accelerator(device):
        return None
    return RowStreamer(device, prefetch=prefetch)


@contextmanager
def landing(sink: GradSink | None) -> Iterator[None]:
    """Wait for every gradient ``sink`` was handed, when the block ends or raises.

    On an exception (Ctrl-C included) the writes already issued land before it propagates; the
    first error is the one reported.
    """
    # None may land later, after the caller has cleared the gradients (``zero_grad``) to start
    # over.
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
    has_bias: bool

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
    """Slices of an in-memory weight tensor, moved to ``device`` and cast to ``dtype`` if needed.

    When the weight is already on ``device`` in ``dtype`` the slices are views (no copy). When it
    rests in host memory and ``device`` is an accelerator, slices are streamed: the next
    ``prefetch`` slices are copied on a side stream while the current one computes.

    Args:
        weight: ``(num_classes, in_features)``.
        bias: ``(num_classes,)`` or ``None``.
        device: the compute device.
        dtype: the accumulation dtype the passes compute in.
        prefetch: slices copied ahead when streaming host rows.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 device: torch.device, dtype: torch.dtype, prefetch: int = 1) -> None:
        self.weight, self.bias, self.device, self.dtype = weight, bias, device, dtype
        self.num_classes, self.has_bias = weight.shape[0], bias is not None
        self.streamer = host_streamer(weight.device, device, prefetch=prefetch)

    def _move(self, t: torch.Tensor) -> torch.Tensor:
        # A no-op (no copy) when the tensor is already on the device in the dtype.
        return t.to(device=self.device, dtype=self.dtype, non_blocking=True)

    def slices(
        self, bounds: list[tuple[int, int]]
    ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        if self.streamer is not None:
            for start, stop, (w, b) in self.streamer.stream(
                [self.weight, self.bias], bounds, dtype=self.dtype
            ):
                yield start, stop, w, b
            return
        for start, stop in bounds:
            w = self._move(self.weight[start:stop])
            b = None if self.bias is None else self._move(self.bias[start:stop])
            yield start, stop, w, b


class TensorGradSink:
    """Writes slice gradients into full-size gradient tensors shaped like weight and bias.

    When the weight's gradient can be written in place (same device and dtype as the
    accumulation), ``out`` hands out a view of it and ``commit`` does nothing: no extra copy.
    For a host weight computed on an accelerator, gradient slices go back to host memory in the
    background (the transfer layer's `RowStreamer`) while the next slice computes.

    Args:
        weight: the weight the gradient is for (gives shape, dtype, device).
        bias: the bias or ``None`` (no bias gradient).
        device: the compute device.
        dtype: the accumulation dtype.
        need_weight: whether to make a weight gradient at all.
        prefetch: ring depth of the background copies for a host weight.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 device: torch.device, dtype: torch.dtype, need_weight: bool,
                 prefetch: int = 1) -> None:
        self.grad_weight = torch.empty_like(weight) if need_weight else None
        self.grad_bias = None if bias is None else torch.empty_like(bias)
        self.streamer = host_streamer(weight.device, device, prefetch=prefetch)
        self._direct = (
            need_weight and weight.device == device and weight.dtype == dtype
            and self.streamer is None
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
            if g is None:
                continue
            assert full is not None
            if self.streamer is not None:
                self.streamer.push(name, full[start:stop], g, accumulate=False)
            else:
                full[start:stop].copy_(g)

    def finish(self) -> None:
        if self.streamer is not None:
            self.streamer.finish()


class ParamSlices(Protocol):
    """Where the weight (and bias) slices come from and where their gradients go."""

    one_pass: bool
    # tensors an autograd Function saves, so that an in-place change of them before backward
    # is refused (backward would read the changed values)
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

    # Gradients go to tensors of this call's own, so they can be formed in forward (one pass)
    # and handed to autograd in backward; a store's gradient must not change before backward,
    # so a store head runs two passes (``one_pass = False``).
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
            self.weight, self.bias if bias else None, device=self.device, dtype=self.dtype,
            need_weight=weight, prefetch=self.prefetch,
        )

    def landed(
        self, sink: GradSink, *, weight: bool, bias: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        assert isinstance(sink, TensorGradSink)
        return sink.grad_weight, sink.grad_bias
