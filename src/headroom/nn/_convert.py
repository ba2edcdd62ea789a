"""``convert(model)``: swap ``torch.nn`` layers for their memory-saving ``headroom.nn`` twins."""

from __future__ import annotations

import copy

from torch import nn

from headroom.nn import _activation, _conv, _dropout, _linear, _norm, _pad, _pool
from headroom.nn._common import seed_consumer

# NOTE: exact classes only. A user subclass of nn.Conv2d (LoRA wrappers, parametrized modules,
# quantized stubs) may override forward, and swapping its class would silently drop that code.
_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: _conv.Conv1d,
    nn.Conv2d: _conv.Conv2d,
    nn.Conv3d: _conv.Conv3d,
    nn.ConvTranspose1d: _conv.ConvTranspose1d,
    nn.ConvTranspose2d: _conv.ConvTranspose2d,
    nn.ConvTranspose3d: _conv.ConvTranspose3d,
    nn.BatchNorm1d: _norm.BatchNorm1d,
    nn.BatchNorm2d: _norm.BatchNorm2d,
    nn.BatchNorm3d: _norm.BatchNorm3d,
    nn.LayerNorm: _norm.LayerNorm,
    nn.GroupNorm: _norm.GroupNorm,
    nn.ReLU: _activation.ReLU,
    nn.LeakyReLU: _activation.LeakyReLU,
    nn.Hardtanh: _activation.Hardtanh,
    nn.ReLU6: _activation.ReLU6,
    nn.Dropout: _dropout.Dropout,
    nn.MaxPool1d: _pool.MaxPool1d,
    nn.MaxPool2d: _pool.MaxPool2d,
    nn.MaxPool3d: _pool.MaxPool3d,
    nn.AdaptiveMaxPool1d: _pool.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d: _pool.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d: _pool.AdaptiveMaxPool3d,
    nn.AvgPool1d: _pool.AvgPool1d,
    nn.AvgPool2d: _pool.AvgPool2d,
    nn.AvgPool3d: _pool.AvgPool3d,
    nn.AdaptiveAvgPool1d: _pool.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d: _pool.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d: _pool.AdaptiveAvgPool3d,
    nn.ReflectionPad1d: _pad.ReflectionPad1d,
    nn.ReflectionPad2d: _pad.ReflectionPad2d,
    nn.ReflectionPad3d: _pad.ReflectionPad3d,
    nn.ReplicationPad1d: _pad.ReplicationPad1d,
    nn.ReplicationPad2d: _pad.ReplicationPad2d,
    nn.ReplicationPad3d: _pad.ReplicationPad3d,
    nn.Linear: _linear.Linear,
}


def _shallow_copy(module: nn.Module) -> nn.Module:
    new = copy.copy(module)
    for key, value in list(new.__dict__.items()):
        if isinstance(value, dict | set | list):
            # NOTE: containers (parameters, buffers, children, hooks) are copied one level deep:
            # the copy holds the very same Parameter, buffer and hook objects, but adding or
            # removing one on either model does not change the other.
            new.__dict__[key] = copy.copy(value)
    return new


def _copy_tree(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    new = _shallow_copy(module)
    memo[id(module)] = new
    for name, child in module._modules.items():
        new._modules[name] = None if child is None else _copy_tree(child, memo)
    return new


def convert(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """Swap ``torch.nn`` layers for ``headroom.nn`` layers that save only what backward needs.

    Each converted layer decides in every forward, from which of its input and parameters
    require grad, what its backward will need, and saves only that; outputs and gradients stay
    bitwise equal to the unconverted model (same aten kernels). Only layers whose class is
    exactly one of the ``torch.nn`` classes listed in ``headroom.nn.__all__`` are swapped;
    subclasses are left alone because they may override ``forward``. The new classes subclass
    the ``torch.nn`` ones, so ``isinstance`` checks, ``state_dict`` keys, parameters, buffers and
    hooks are unchanged. Converting a converted model changes nothing.

    Args:
        model: the model (or a single layer) to convert.
        inplace: ``False`` (default) returns a new module tree whose modules hold the *same*
            Parameter and buffer objects and hooks as ``model`` (so an optimizer built on
            ``model.parameters()`` trains both, and no parameter memory is duplicated) and
            leaves ``model`` itself unchanged. ``True`` changes the classes of ``model``'s own
            modules and returns ``model``: no copy at all, but the original is converted.

    Returns:
        The converted model. ``model`` itself when ``inplace=True`` or when nothing needed
        converting.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.

    Example:
        >>> import torch, headroom as hr
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
        >>> fast = hr.convert(model)
        >>> type(fast[0]).__module__
        'headroom.nn._conv'

    Note:
        Converted layers support one backward per forward graph, like most custom autograd
        functions: double backward (``create_graph=True`` through them) raises an error.
        A ReLU learns which layers consume its output by watching forwards; inside an
        ``nn.Sequential`` it knows from the start. Until it knows (the first forward of a ReLU
        in a custom ``forward``) it keeps its output as PyTorch does: never more memory than
        PyTorch, but the savings start from the second step.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"convert() expects a torch.nn.Module, got {type(model).__name__}; "
            "pass the model (or layer) itself."
        )
    if not any(type(m) in _SWAPS for m in model.modules()):
        return model
    root = model if inplace else _copy_tree(model, {})
    for m in root.modules():
        target = _SWAPS.get(type(m))
        if target is not None:
            m.__class__ = target
    _seed_sequential_consumers(root)
    return root


def _seed_sequential_consumers(root: nn.Module) -> None:
    # NOTE: nn.Sequential's forward feeds each child's output to the next child, so the layer
    # after a ReLU is its consumer; knowing it lets the ReLU keep a 1-bit mask from the very
    # first forward instead of learning it during that forward.
    for m in root.modules():
        if type(m) is not nn.Sequential:
            continue
        children = [c for c in m._modules.values() if c is not None]
        for relu, nxt in zip(children, children[1:], strict=False):
            if type(relu) is _activation.ReLU and hasattr(nxt, "_hr_saves_input"):
                seed_consumer(relu, nxt)
