"""A training step run on ``meta`` tensors: what the estimator executes instead of the real step.

The step runs the model's own code, so every op PyTorch would run is seen with its real shapes
and dtypes, but no tensor holds data. Three things make a meta run behave like the target device:

- the model is copied onto ``meta`` without copying any data (the copy shares nothing with the
  original, so the dry run can never change the user's model);
- ``scaled_dot_product_attention`` on ``meta`` would take PyTorch's math path (which keeps the
  whole attention matrix); it is redirected to the fused kernel the target device would choose;
- the optimizer runs one step untracked first, so the tracked step is in steady state (its state
  already exists), like every step of a training run but the first.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import checkpoint as _ckpt
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from headroom.residency import is_packed, meta_like
from headroom.transfer import flat_tensors as _flat
from headroom.transfer import to_meta as to_meta  # the estimator's: `_dryrun.to_meta`

_SDPA = torch.nn.functional.scaled_dot_product_attention
_IS_AUTOCAST = torch.is_autocast_enabled


def _autocast_enabled(*args: Any) -> bool:
    if args and args[0] == "meta":
        return False
    return _IS_AUTOCAST(*args)


def meta_copy(model: nn.Module, *, memo: dict[int, Any] | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are ``meta`` tensors of the same shapes.

    Ties survive (a parameter shared by two modules is one parameter in the copy); no data is
    copied, so a model of any size is copied in milliseconds. ``memo`` maps ``id()`` of further
    objects to what stands for them in the copy (``copy.deepcopy``'s memo).

    Raises:
        TypeError: for a model that cannot be deep-copied.
    """
    memo = dict(memo or {})
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, name))
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        # a quantized weight: its class kept, over meta parts
        twin = meta_like(t, owners.get(id(t), ())) if is_packed(t) else None
        if twin is not None:
            m, stand_ins = twin
            memo.update(stand_ins)
        else:
            m = torch.empty_like(t, device="meta")
            if isinstance(t, nn.Parameter):
                m = nn.Parameter(m, requires_grad=t.requires_grad)
        memo[id(t)] = m
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:
        raise TypeError(
            f"the estimator could not copy the model onto the meta device ({type(e).__name__}:"
            f" {e}). Estimate the plain model (before changes that attach stores or threads)"
            " and pass the technique as an option instead."
        ) from e


class AttentionAsOnDevice:
    """Runs ``scaled_dot_product_attention`` on ``meta`` through the fused kernel
    ``device_type`` would use.

    On ``cpu`` PyTorch picks its flash kernel for CPU; on CUDA-like devices the memory-efficient
    kernel (it takes masks and fp32; the flash kernel keeps the same-sized log-sum-exp). Both
    keep only the output and one float per query row for backward, not the attention matrix.
    Grouped-query attention (``enable_gqa`` with fewer key heads) runs the flash kernel in half
    precision without a mask (the key and value heads kept as given); otherwise it has no
    fused kernel on CUDA: the math path, as PyTorch runs it.
    With dropout, CUDA-like devices still run a fused kernel (it keeps the random generator's
    seed and offset, not a mask), while PyTorch's CPU kernel refuses dropout, so on ``cpu`` the
    math path is kept, as it is for nested tensors.

    The function is replaced in ``torch.nn.functional`` for the duration of the dry run (a
    ``TorchFunctionMode`` would not see calls made from inside other functional ops, such as
    ``multi_head_attention_forward``); calls on tensors that are not ``meta`` go to PyTorch's.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> AttentionAsOnDevice:
        F.scaled_dot_product_attention = self._call
        # Layers that ask whether autocast is on for their input's device would get an error
        # for "meta"; the dry run runs without autocast.
        torch.is_autocast_enabled = _autocast_enabled
        self._packed = _unpacked_on_meta()
        return self

    def __exit__(self, *exc: Any) -> None:
        F.scaled_dot_product_attention = _SDPA
        torch.is_autocast_enabled = _IS_AUTOCAST
        if self._packed is not None:
            module, original = self._packed
            module.find_packed_sequence_indices = original

    def _call(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self._fused(*args, **kwargs)
        return _SDPA(*args, **kwargs) if out is None else out

    def _fused(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if q.device.type != "meta" or q.is_nested or q.dim() != 4:
            return None
        if self.device_type == "cpu":
            if dropout_p or q.dtype not in (torch.float32, torch.float64, torch.bfloat16,
                                            torch.float16):
                return None
            mask = attn_mask
            if mask is not None and mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
        if enable_gqa and k.size(-3) != q.size(-3):
            # Grouped-query attention: of CUDA's fused kernels only flash (and cuDNN) take it,
            # in half precision, without a mask, heads up to 256 wide; otherwise PyTorch runs
            # the math path, which keeps the attention matrix for backward.
            if (q.dtype not in (torch.float16, torch.bfloat16) or attn_mask is not None
                    or q.size(-1) > 256):
                return None
            # flash keeps the key and value heads as given (not repeated), and the log-sum-exp
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        bias = attn_mask
        if bias is not None:
            if bias.dtype == torch.bool:
                bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device)
            bias = bias.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


def _unpacked_on_meta() -> tuple[Any, Callable] | None:
    """Make transformers' search for packed sequences answer "one sequence per row" for
    ``meta`` position ids; returns what to put back.

    NOTE: without a KV cache (``use_cache=False``, which gradient checkpointing forces)
    transformers' attention masks look for several sequences packed in one row by reading the
    position ids' values, which a dry run does not have. Generated position ids (``arange``)
    are one sequence per row, which is what the search finds for them on a real device.
    """
    import sys

    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "find_packed_sequence_indices", None)
    if original is None:
        return None

    @functools.wraps(original)
    def find(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        if isinstance(position_ids, torch.Tensor) and position_ids.device.type == "meta":
            return None
        return original(position_ids, *args, **kwargs)

    module.find_packed_sequence_indices = find
    return module, original


class FusedOnMeta:
    """Lets ``torch.optim``'s ``fused=True`` optimizers step ``meta`` parameters.

    Their constructors refuse devices outside a fixed list; PyTorch's fused Adam and AdamW
    kernels have ``meta`` implementations (in-place, nothing allocated), and `RealTensorsAsMeta`
    skips the others. The list is extended for the duration of the dry run.
    """

    def __enter__(self) -> FusedOnMeta:
        import torch.optim.optimizer as _optimizer

        self._module = _optimizer
        self._orig = _optimizer._get_fused_kernels_supported_devices
        orig = self._orig
        _optimizer._get_fused_kernels_supported_devices = lambda: [*orig(), "meta"]
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module._get_fused_kernels_supported_devices = self._orig


class ForeachOnMeta:
    """``torch.optim``'s default choice for a step on an accelerator: ``foreach`` (one list op
    for every tensor of a group, with list-sized temporaries: AdamW's ``sqrt`` of its second
    moments is a copy of the whole state's size). Its test of the parameters' device sees
    ``meta``; it is told ``meta`` stands for the target (``enabled``) for the dry run."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> ForeachOnMeta:
        import torch.optim.optimizer as _optimizer

        self._module = _optimizer
        self._orig = _optimizer._get_foreach_kernels_supported_devices
        if self.enabled:
            orig = self._orig
            _optimizer._get_foreach_kernels_supported_devices = lambda: [*orig(), "meta"]
        return self

    def __exit__(self, *exc: Any) -> None:
        self._module._get_foreach_kernels_supported_devices = self._orig


class RealTensorsAsMeta(TorchDispatchMode):
    """Ops that mix ``meta`` tensors with real ones (a target tensor a loss function closes
    over, a mask built outside the model, an optimizer's state slice in a host buffer) get
    ``meta`` stand-ins for the real ones.

    Entered below the tracker's mode, so the tracker still sees the real tensor (as a measured
    run would: it is used inside the step) before it is swapped. Fused optimizer kernels that
    have no ``meta`` implementation update their arguments in place and allocate nothing: on
    ``meta`` tensors they are skipped.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _flat([*args, *kwargs.values()])
        has_meta = any(a.device.type == "meta" for a in flat)
        if has_meta and func.overloadpacket in _FUSED_WITHOUT_META:
            return None
        if has_meta and any(a.device.type != "meta" and a.dim() > 0 for a in flat):
            args, kwargs = tree_map(_meta_stand_in, (args, kwargs))
        if has_meta:
            return _MetaResults.call(func, args, kwargs)
        return func(*args, **kwargs)


_FUSED_WITHOUT_META = {getattr(torch.ops.aten, name)
                       for name in ("_fused_sgd_", "_fused_adagrad_")
                       if hasattr(torch.ops.aten, name)}


class _MetaResults:
    """What ops on ``meta`` tensors return, remembered by the metadata of their arguments.

    Many of PyTorch's ``meta`` kernels are Python (``torch._refs``): an optimizer's step on one
    slice of a parameter takes milliseconds of them, and the dry runs of a plan repeat the same
    ops on the same shapes thousands of times. On ``meta`` an op's result depends on nothing
    but the metadata of its arguments (there are no values), so an op seen before with the same
    metadata gets its result without the kernel: a new tensor of the remembered shape, strides
    and dtype (the same storage bytes), or for an in-place op its ``self``. Only such ops are
    remembered: one tensor returned, not a view, nothing written but an in-place ``self``.
    An op that fails is never remembered (its error repeats on the next call).
    """

    _kinds: dict[Any, str | None] = {}  # op -> "new", "self" or None (always the kernel)
    _seen: dict[tuple, Any] = {}
    _MAX = 1 << 14  # bounded for a process that estimates many models

    @classmethod
    def call(cls, func, args: tuple, kwargs: dict) -> Any:
        kind = cls._kinds.get(func, "?")
        if kind == "?":
            kind = cls._kinds[func] = _result_kind(func)
        if kind is None:
            return func(*args, **kwargs)
        try:
            storages: dict[int, int] = {}
            key = (func, _key(args, storages), _key(tuple(kwargs.items()), storages))
            seen = cls._seen.get(key)
        except TypeError:  # an argument that cannot be a key
            return func(*args, **kwargs)
        if seen is not None:
            if kind == "self":
                return args[0]
            shape, stride, dtype = seen
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if kind == "self":
            before = _layout(args[0])
            out = func(*args, **kwargs)
            if out is args[0] and _layout(out) == before:
                cls._remember(key, True)
            elif out is args[0]:  # it changes its self's layout (set_, resize_): always run
                cls._kinds[func] = None
            return out
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "meta" \
                and out.storage_offset() == 0 and not out._is_view() \
                and out.untyped_storage().nbytes() == _strided_nbytes(out):
            cls._remember(key, (tuple(out.shape), out.stride(), out.dtype))
        return out

    @classmethod
    def _remember(cls, key: tuple, value: Any) -> None:
        if len(cls._seen) >= cls._MAX:
            cls._seen.clear()
        cls._seen[key] = value


def _result_kind(func) -> str | None:
    schema = func._schema
    if func.is_view or len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor":
        return None
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    ret = schema.returns[0].alias_info
    if not written and ret is None:
        return "new"
    if len(written) == 1 and written[0] is schema.arguments[0] and not written[0].kwarg_only \
            and ret is not None and ret.is_write:
        return "self"
    return None


def _key(items: Any, storages: dict[int, int]) -> tuple:
    """The metadata of ``items`` that a ``meta`` kernel can see; ``storages`` numbers the
    storages in order of appearance, so that arguments sharing one share the number."""
    out = []
    for a in items:
        if isinstance(a, torch.Tensor):
            st = storages.setdefault(a.untyped_storage()._cdata, len(storages))
            out.append((a.device.type, a.dtype, tuple(a.shape), a.stride(),
                        a.storage_offset(), st, a.is_neg(), a.is_conj()))
        elif isinstance(a, (list, tuple)):
            out.append((type(a), _key(a, storages)))
        else:
            hash(a)  # TypeError for what cannot be a key
            out.append((type(a), a))
    return tuple(out)


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage()._cdata,
            t.untyped_storage().nbytes())


def _strided_nbytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) \
        * t.element_size()


def _meta_stand_in(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.dim() > 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


def checkpoint_modules(model: nn.Module, names: Iterable[str]) -> None:
    """Wrap the forward of each named submodule in non-reentrant activation checkpointing."""
    for name in names:
        module = model.get_submodule(name)
        forward = module.forward
        module.forward = functools.partial(_checkpointed, forward)  # type: ignore[method-assign]


def _checkpointed(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    return _ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def default_loss(output: Any) -> torch.Tensor:
    """What a step differentiates when no ``loss_fn`` is given: ``output.loss`` if the model
    returns one (Hugging Face models given labels), else the sum of the first tensor output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict):
        output = next(iter(output.values()), None)
    if isinstance(output, (list, tuple)) and output:
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.float().sum() if output.dtype != torch.float32 else output.sum()
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits.sum()
    raise TypeError(
        f"the model returned {type(output).__name__}, not a tensor: pass loss_fn=, a function"
        " from the model's output to a scalar loss tensor"
    )


def make_optimizer(optimizer: Any, params: list[nn.Parameter],
                   kwargs: dict[str, Any]) -> torch.optim.Optimizer | None:
    """An optimizer over ``params`` like ``optimizer`` (a class, a factory or an instance)."""
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        options = getattr(optimizer, "options", None)  # hr.HostOptimizer: the class it runs
        cls = getattr(options, "optimizer_class", type(optimizer))
        defaults = dict(getattr(options, "optimizer_kwargs", None) or optimizer.defaults)
        accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        defaults = {k: v for k, v in defaults.items()
                    if k in accepted and k != "differentiable" and v is not None}
        return cls(params, **{**defaults, **kwargs})
    if callable(optimizer):
        opt = optimizer(params, **kwargs)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer= must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), an"
                f" instance, or a function of the parameters returning one; got {opt!r}"
            )
        return opt
    raise TypeError(
        f"optimizer= must be a torch.optim.Optimizer class, instance or factory, got {optimizer!r}"
    )


# Ops that only read metadata, or make views: no kernel runs, no bytes move.
_NO_WORK = {"detach", "view", "_unsafe_view", "alias", "as_strided", "expand", "t",
            "transpose", "permute", "unsqueeze", "squeeze", "slice", "select", "split",
            "split_with_sizes", "unbind", "chunk", "narrow", "reshape", "_reshape_alias",
            "resize_storage_bytes_", "set_", "lift_fresh", "empty", "empty_strided",
            "empty_like", "_to_copy_meta", "size", "stride", "numel", "dim", "is_contiguous"}


class OpCounter(TorchDispatchMode):
    """The work of every op of a dry run: FLOPs (PyTorch's own formulas,
    ``torch.utils.flop_counter``), bytes read and written, and whether it ran inside
    ``optimizer.step()``; what the planner's time model prices (`headroom.fit._time`).

    Attributes:
        ops: ``(flops, bytes, kind, in_step)`` per op; ``kind`` is ``"mm"`` (matmuls,
            attention), ``"conv"`` or ``""`` (element-wise and the rest).
    """

    def __init__(self, in_step: Callable[[], bool]) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.ops: list[tuple[int, int, str, bool]] = []
        self._registry = flop_registry
        self._in_step = in_step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _NO_WORK or func.is_view:
            return out
        flops = 0
        formula = self._registry.get(func.overloadpacket)
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not take these arguments: no FLOPs
                flops = 0
        nbytes = sum(t.numel() * t.element_size()
                     for t in _flat([*args, *kwargs.values(), *(
                         out if isinstance(out, (list, tuple)) else [out])]))
        kind = "conv" if "conv" in name else ("mm" if flops else "")
        self.ops.append((flops, nbytes, kind, self._in_step()))
        return out
