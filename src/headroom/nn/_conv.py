"""Convolutions that keep the input only if the weight trains, the weight only if the input
needs a gradient (PyTorch keeps both: pytorch/pytorch#133566); backward is the same
``aten.convolution_backward`` call, so gradients are bitwise equal."""

from __future__ import annotations

import torch
from torch import nn

from headroom.nn._common import (
    TensorMeta,
    _hooks_enabled,
    _pending,
    _relu_outputs,
    _top_hooks,
    first_order_only,
    note_consumer,
    per_dimension,
    records_graph,
    save_less,
    settle_pending,
    trains,
)
from headroom.nn._pad import pad as _pad


class _ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, transposed, out_padding, groups):
        out = torch.ops.aten.convolution(
            x, weight, bias, stride, padding, dilation, transposed, out_padding, groups
        )
        need_x, need_w, _ = ctx.needs_input_grad[:3]
        # grad_input needs the weight and the input's shape; grad_weight the input and the
        # weight's shape; grad_bias neither.
        ctx.save_for_backward(x if need_w else None, weight if need_x else None)
        ctx.x_meta = None if need_w else TensorMeta(x)
        ctx.w_meta = None if need_x else TensorMeta(weight)
        ctx.bias_sizes = None if bias is None else [bias.shape[0]]
        ctx.args = (stride, padding, dilation, transposed, out_padding, groups)
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if x is None:
            x = ctx.x_meta.empty()
        if weight is None:
            weight = ctx.w_meta.empty()
        mask = list(ctx.needs_input_grad[:3])
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad, x, weight, ctx.bias_sizes, *ctx.args, mask
        )
        return gx, gw, gb, None, None, None, None, None, None


def _conv_node_type() -> type:
    # From one tiny convolution, whatever modes or default device the importer runs under.
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros(1, 1, 1, device="cpu", requires_grad=True)
        return type(torch.nn.functional.conv1d(x, torch.zeros(1, 1, 1, device="cpu")).grad_fn)


_CONV_NODE = _conv_node_type()


def _save_shapes(out: torch.Tensor, input_shape: bool, weight_shape: bool) -> torch.Tensor:
    """Replace what ``out``'s ``ConvolutionBackward0`` saved of the input and/or the weight by
    its shape (see _ConvFunction); returns ``out``."""
    node = out.grad_fn
    if type(node) is not _CONV_NODE:
        # An unbatched input: aten batches it, convolves and squeezes the batch dimension
        node = node.next_functions[0][0] if node.next_functions else None
        if type(node) is not _CONV_NODE:
            return out  # not PyTorch's convolution (a tensor subclass's): its saves stay
    saved_input, saved_weight = node._raw_saved_input, node._raw_saved_weight
    if input_shape:
        save_less(saved_input, TensorMeta)
    if weight_shape:
        save_less(saved_weight, TensorMeta)
    return out


_any_autocast = torch._C._is_any_autocast_enabled  # cheaper than parsing a device type


def _fast(input: torch.Tensor) -> bool:
    # PyTorch's own node with :func:`_save_shapes`: hooks_free() (inlined) and no autocast,
    # whose casted copies would not be recognized.
    return (
        _top_hooks(False) is None
        and _hooks_enabled()
        and not (_any_autocast() and torch.is_autocast_enabled(input.device.type))
    )


def _autocast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # Autocast's rule for convolutions, which it applies to conv*d, not aten.convolution.
    if t is None or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


def _needs_graph(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # records_graph() first: it raises its clear error under FX before a proxy test
    return records_graph() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )


def _same_padding(
    x: torch.Tensor, weight: torch.Tensor, dilation: tuple[int, ...]
) -> tuple[torch.Tensor, list[int]]:
    # As aten does for padding="same": symmetric, and a padded copy for an odd remainder.
    dims = weight.dim() - 2
    left, extra = [], [0] * (2 * dims)
    for i in range(dims):
        total = dilation[i] * (weight.shape[i + 2] - 1)
        lo = total // 2
        left.append(lo)
        extra[2 * (dims - 1 - i) + 1] = total - 2 * lo
    if any(extra):
        x = torch.constant_pad_nd(x, extra, 0)
    return x, left


class _ConvMixin:
    """Forward of ``nn.ConvNd``/``nn.ConvTransposeNd`` through :class:`_ConvFunction`."""

    _hr_dims: int

    def _hr_saves_input(self) -> bool:  # a tensor sharing the input's storage
        # (not an asymmetric padding="same": it convolves a padded copy, see _same_padding)
        return (
            trains(self)
            and self.padding_mode == "zeros"
            and not (self.padding == "same" and any(
                d * (k - 1) % 2 for d, k in zip(self.dilation, self.kernel_size, strict=True)))
        )

    def _hr_conv(self, x, weight, bias, padding, output_padding) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            x, weight, bias = (_autocast(t, dtype) for t in (x, weight, bias))
        unbatched = x.dim() == self._hr_dims + 1
        if unbatched:
            x = x.unsqueeze(0)
        out = _ConvFunction.apply(
            x,
            weight,
            bias,
            list(self.stride),
            list(padding),
            list(self.dilation),
            self.transposed,
            list(output_padding),
            self.groups,
        )
        return out.squeeze(0) if unbatched else out


class _Conv(_ConvMixin):
    def _conv_forward(self, input, weight, bias):
        if not _needs_graph(input, weight, bias):
            return super()._conv_forward(input, weight, bias)
        x_grad, w_grad = input.requires_grad, weight.requires_grad
        if _pending.young:
            settle_pending()
        if _relu_outputs:
            note_consumer(self, input)
        if self.padding_mode == "zeros":
            if x_grad and w_grad:  # PyTorch saves what we would, faster, double backward too
                return super()._conv_forward(input, weight, bias)
            if _fast(input):
                out = super()._conv_forward(input, weight, bias)
                return _save_shapes(out, not w_grad, not x_grad)
        zeros = [0] * self._hr_dims
        if self.padding_mode != "zeros":
            x = _pad(input, self._reversed_padding_repeated_twice, self.padding_mode)
            return self._hr_conv(x, weight, bias, zeros, zeros)
        if self.padding == "valid":
            return self._hr_conv(input, weight, bias, zeros, zeros)
        if self.padding == "same":  # (an unbatched input: _hr_conv batches it)
            x, left = _same_padding(input, weight, self.dilation)
            return self._hr_conv(x, weight, bias, left, zeros)
        return self._hr_conv(input, weight, bias, self.padding, zeros)


class _ConvTranspose(_ConvMixin):
    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if not _needs_graph(input, self.weight, self.bias):
            return super().forward(input, output_size)
        if self.padding_mode != "zeros":
            raise ValueError(
                f"Only `zeros` padding mode is supported for {type(self).__name__}; "
                f"got {self.padding_mode!r}. Use padding_mode='zeros'."
            )
        if _pending.young:
            settle_pending()
        if _relu_outputs:
            note_consumer(self, input)
        x_grad, w_grad = input.requires_grad, self.weight.requires_grad
        if x_grad and w_grad:
            return super().forward(input, output_size)  # saves what we would (see _Conv)
        if _fast(input):
            return _save_shapes(super().forward(input, output_size), not w_grad, not x_grad)
        output_padding = self._output_padding(
            input,
            output_size,
            self.stride,
            self.padding,
            self.kernel_size,
            self._hr_dims,
            self.dilation,
        )
        return self._hr_conv(input, self.weight, self.bias, self.padding, output_padding)


Conv1d, Conv2d, Conv3d = per_dimension(
    __name__, _Conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d),
    "``nn.{name}`` that keeps its input only if its weight trains (see module docstring).")
ConvTranspose1d, ConvTranspose2d, ConvTranspose3d = per_dimension(
    __name__, _ConvTranspose, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
    "``nn.{name}`` that keeps its input only if its weight trains.")
