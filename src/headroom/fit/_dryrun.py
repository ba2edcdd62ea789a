"""A training step run on ``meta`` tensors: what the estimator executes instead of the real step.

The model's own code runs on a ``meta`` copy sharing nothing with it, with attention on the
fused kernel and autocast the target device would use (`headroom.fit._autocast`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import checkpoint as _ckpt
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from headroom.fit._autocast import MetaAutocast
from headroom.residency import is_packed, meta_like
from headroom.store import flat_tensors as _flat
from headroom.store import known_values
from headroom.store import to_meta as to_meta  # the estimator's: `_dryrun.to_meta`

_SDPA = torch.nn.functional.scaled_dot_product_attention


def meta_copy(model: nn.Module, *, memo: dict[int, Any] | None = None,
              plain: Callable[[nn.Module], tuple[type, dict] | None] | None = None
              ) -> nn.Module:
    """A copy of ``model`` with ``meta`` parameters and buffers, ties kept, no data copied.

    ``memo`` is ``copy.deepcopy``'s for further objects; ``plain(module)`` gives a module's class
    and ``__dict__`` as before a wrapper (`hr.offload`, ``fully_shard``), or ``None`` to copy it
    as it is. A TypeError for a model that cannot be deep-copied.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")  # none exist before its import
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
        else:  # an FSDP2 shard: the whole parameter
            m = (torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                 if dtensor is not None and isinstance(t, dtensor.DTensor)
                 else torch.empty_like(t, device="meta"))
            if isinstance(t, nn.Parameter):
                m = nn.Parameter(m, requires_grad=t.requires_grad)
        memo[id(t)] = m
    shells = []
    for mod in model.modules() if plain is not None else ():
        before = plain(mod)
        if before is not None:
            memo[id(mod)] = shell = before[0].__new__(before[0])
            shells.append((shell, before[1]))
    try:
        for shell, d in shells:
            shell.__dict__.update(copy.deepcopy(d, memo))
        return copy.deepcopy(model, memo)
    except Exception as e:
        raise TypeError(
            f"the estimator could not copy the model onto the meta device ({type(e).__name__}:"
            f" {e}). Estimate the plain model (before changes that attach stores, threads or"
            " fully_shard; world_size=N estimates FSDP2) and pass the technique as an option"
            " instead."
        ) from e


class AttentionAsOnDevice:
    """Runs ``scaled_dot_product_attention`` on ``meta`` through the fused kernel
    ``device_type`` would use (on ``meta`` PyTorch's math path keeps the attention matrix).

    ``cpu``: the kernel PyTorch's CPU attention picks. CUDA-like: the memory-efficient kernel
    (masks, fp32, dropout); grouped-query attention takes flash in half precision without a
    mask, else the math path, as PyTorch runs it.

    NOTE: the function is replaced in ``torch.nn.functional`` while entered: a
    ``TorchFunctionMode`` would not see calls from other functional ops
    (``multi_head_attention_forward``). Entering also enters the target's autocast for
    ``meta`` tensors (`MetaAutocast`), which casts the arguments before the kernel is chosen.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> AttentionAsOnDevice:
        F.scaled_dot_product_attention = self._call
        self._amp = MetaAutocast(self.device_type)
        self._amp.__enter__()
        self._packed = _unpacked_on_meta()
        return self

    def __exit__(self, *exc: Any) -> None:
        F.scaled_dot_product_attention = _SDPA
        self._amp.__exit__(*exc)
        if self._packed is not None:
            module, original = self._packed
            module.find_packed_sequence_indices = original

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
        """A region of the target's autocast in ``dtype`` (none for ``None``)."""
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("meta", dtype=dtype)  # while entered: the target's

    def _call(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        args, kwargs, _ = self._amp.cast_args(_SDPA, args, kwargs)
        out = self._fused(*args, **kwargs)
        return _SDPA(*args, **kwargs) if out is None else out

    def _fused(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if q.device.type != "meta" or q.is_nested or q.dim() not in (3, 4):
            return None
        if self.device_type == "cpu":
            if _cpu_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) != 1:
                return None  # PyTorch's math path, as on the CPU
            mask, heads = _float_mask(attn_mask, q), q.dim() == 4
            if not heads:
                # no head dimension (torch's choice above runs these fused from 2.14): the
                # kernel takes them as one batch of heads, and keeps them so for backward
                if mask is not None and mask.dim() > 3:
                    return None
                q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
                mask = mask.unsqueeze(0) if mask is not None and mask.dim() == 3 else mask
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
            return out if heads else out.squeeze(0)
        if q.dim() != 4:
            return None
        if enable_gqa and k.size(-3) != q.size(-3):
            # grouped-query attention: only flash (and cuDNN) take it, in half precision,
            # without a mask, heads up to 256 wide; it keeps the key and value heads as given
            if (q.dtype not in (torch.float16, torch.bfloat16) or attn_mask is not None
                    or q.size(-1) > 256):
                return None
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        bias = _float_mask(attn_mask, q)
        if bias is not None:
            bias = bias.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


def _float_mask(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    # a boolean mask as the additive one of q's dtype the kernels take (the same bytes shape)
    if mask is not None and mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
    return mask


def _cpu_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The kernel PyTorch's CPU attention picks (``SDPBackend``: 0 math, 1 flash).

    NOTE: the choice reads no values (shapes, dtypes, last strides, dropout, which inputs
    require gradients), so it is asked with CPU stand-ins of one row each, broadcast.
    """

    def stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        row = torch.zeros(t.shape[-1:], dtype=t.dtype, requires_grad=t.requires_grad)
        return row.as_strided(t.shape, (0,) * (t.dim() - 1) + (1,)[:t.dim()])

    with torch._C._DisableTorchDispatch():
        return int(torch._fused_sdp_choice(
            stand_in(q), stand_in(k), stand_in(v), stand_in(attn_mask), dropout_p, is_causal,
            scale=scale, enable_gqa=enable_gqa))


def _unpacked_on_meta() -> tuple[Any, Callable] | None:
    """Make transformers' search for packed sequences (it reads position ids' values) answer
    "one sequence per row" for ``meta`` ids of unknown values (see [Note: known values in a
    dry run]); returns what to put back.
    """
    module = sys.modules.get("transformers.masking_utils")
    original = getattr(module, "find_packed_sequence_indices", None)
    if original is None:
        return None

    @functools.wraps(original)
    def find(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        if isinstance(position_ids, torch.Tensor) and position_ids.device.type == "meta" \
                and known_values.get(position_ids) is None:
            return None
        return original(position_ids, *args, **kwargs)

    module.find_packed_sequence_indices = find
    return module, original


@contextlib.contextmanager
def kernels_on_meta(kind: str, enabled: bool = True) -> Iterator[None]:
    """Adds ``meta`` to the devices ``torch.optim``'s ``kind`` kernels take, while entered.

    ``"fused"``: ``fused=True`` optimizers step ``meta`` parameters (fused Adam and AdamW have
    ``meta`` kernels; `RealTensorsAsMeta` skips the others). ``"foreach"``, ``enabled`` for an
    accelerator: the default ``foreach`` path, with its list-sized temporaries, as there.
    """
    import torch.optim.optimizer as _optimizer

    getter = f"_get_{kind}_kernels_supported_devices"
    orig = getattr(_optimizer, getter)
    if enabled:
        setattr(_optimizer, getter, lambda: [*orig(), "meta"])
    try:
        yield
    finally:
        setattr(_optimizer, getter, orig)


class RealTensorsAsMeta(TorchDispatchMode):
    """Gives ops that mix ``meta`` tensors with real ones (a target a loss function closes
    over, a host buffer) ``meta`` stand-ins for the real ones.

    Entered below the tracker's mode, so the tracker still sees the real tensor used in the
    step. Fused optimizer kernels without a ``meta`` implementation allocate nothing: skipped.
    Ops on known values also run on them (see [Note: known values in a dry run]).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = sys.modules.get("torch.distributed.tensor")  # none exist before its import
        if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
            return NotImplemented  # its own dispatch comes back here with its local tensors
        kwargs = kwargs or {}
        flat = _flat([*args, *kwargs.values()])
        has_meta = any(a.device.type == "meta" for a in flat)
        if has_meta and func.overloadpacket in _FUSED_WITHOUT_META:
            return None
        try:
            out = self._meta(func, args, kwargs, flat, has_meta)
        except (NotImplementedError, RuntimeError):
            # an op that needs values (.item(), nonzero, a copy out of meta): known ones?
            values = _real_inputs(func, args, kwargs, flat) if has_meta else None
            if values is None or any(r.alias_info is not None for r in func._schema.returns):
                raise
            return _from_values(kwargs, func(*values[0], **values[1]))
        if _has_meta_output(out):
            values = _real_inputs(func, args, kwargs, flat)
            if values is not None and _keep_values(func, out, values):
                return out
        if has_meta and known_values:
            _forget_written(func, args, kwargs)
        return out

    @staticmethod
    def _meta(func, args, kwargs, flat, has_meta):
        if has_meta and any(a.device.type != "meta" and a.dim() > 0 for a in flat):
            args, kwargs = tree_map(_meta_stand_in, (args, kwargs))
        if has_meta:
            return _MetaResults.call(func, args, kwargs)
        return func(*args, **kwargs)


# [Note: known values in a dry run]
# The integer inputs of a step (ids, attention masks, labels) keep their values beside their
# meta stand-ins (`headroom.store.to_meta`), and every op whose tensor inputs all have known
# values (or are real), or that reads no values (``arange``, ``ones_like``), also runs on the
# CPU below the tracker: memory is counted from the ``meta`` result, values come from the CPU
# one. Models read such values to choose their path (transformers skips an all-ones padding
# mask), so a dry run takes the real step's path, and ``.item()`` or ``nonzero`` get values.
# Values are never guessed: an op writing unknown values into a storage drops its values.

# Values of results that read no values are kept up to this size (the others up to
# `known_values`' ``max_bytes``): positions and a seed are read, parameter-sized zeros are not.
_MAX_FRESH_BYTES = 1 << 20

_VALUE_FREE = {getattr(torch.ops.aten, name) for name in (
    "ones_like", "zeros_like", "full_like", "empty_like", "new_ones", "new_zeros", "new_full",
    "new_empty", "new_empty_strided") if hasattr(torch.ops.aten, name)}


def _real_inputs(func, args: tuple, kwargs: dict, flat: list[torch.Tensor]
                 ) -> tuple[tuple, dict, int] | None:
    """``args`` and ``kwargs`` on known values and the CPU, and the largest result whose values
    are kept; or ``None`` where a ``meta`` input has no known values (or for random ops)."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return None
    free = func.overloadpacket in _VALUE_FREE
    fresh = free or not flat
    for a in flat:
        if a.device.type == "meta" and known_values.get(a) is None and not (
                free and a.untyped_storage().nbytes() <= _MAX_FRESH_BYTES):
            return None

    def real(x: Any) -> Any:
        if isinstance(x, (torch.UntypedStorage, torch.TypedStorage)):
            raise _NoValues
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            v = known_values.get(x)
            return v if v is not None else torch.empty_strided(x.shape, x.stride(),
                                                               dtype=x.dtype)
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    try:
        real_args, real_kwargs = tree_map(real, (args, kwargs))
    except _NoValues:  # a storage argument (set_): its values are not known
        return None
    return real_args, real_kwargs, _MAX_FRESH_BYTES if fresh else known_values.max_bytes


class _NoValues(Exception):
    pass


def _has_meta_output(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return out.device.type == "meta"
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta"
               for t in tree_flatten(out)[0])


def _keep_values(func, out: Any, values: tuple[tuple, dict, int]) -> bool:
    """Whether ``func`` ran on known values, its results kept as those of ``out``."""
    metas = tree_flatten(out)[0]
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta"
           and t.untyped_storage().nbytes() > values[2] for t in metas):
        return False
    try:
        real = tree_flatten(func(*values[0], **values[1]))[0]
    except Exception:  # the values are not known, but the meta op ran: the step goes on
        return False
    if len(real) != len(metas):
        return False
    for m, r in zip(metas, real, strict=True):
        if isinstance(m, torch.Tensor) and m.device.type == "meta":
            if isinstance(r, torch.Tensor):
                known_values.put(m, r)
            else:
                known_values.forget(m)
    return True


def _from_values(kwargs: dict, real: Any) -> Any:
    """``real`` (an op's result on known values) as ``meta`` tensors with those values, or as it
    is where the op asked for a real device (``.cpu()``) or returns no tensor (``.item()``)."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "meta":
        return real

    def one(r: Any) -> Any:
        if not isinstance(r, torch.Tensor):
            return r
        m = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device="meta")
        known_values.put(m, r)
        return m

    return tree_map(one, real)


def _forget_written(func, args: tuple, kwargs: dict) -> None:
    """Drop the known values of the ``meta`` storages ``func`` writes."""
    written = _WRITTEN.get(func)
    if written is None:
        written = _WRITTEN[func] = tuple(
            (i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    for i, name, kwarg_only in written:
        x = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        for t in _flat([x]):
            if t.device.type == "meta":
                known_values.forget(t)


_WRITTEN: dict[Any, tuple[tuple[int, str, bool], ...]] = {}  # op -> the arguments it writes


_FUSED_WITHOUT_META = {torch.ops.aten._fused_sgd_, torch.ops.aten._fused_adagrad_}


class _MetaResults:
    """What ops on ``meta`` tensors return, remembered by the metadata of their arguments.

    NOTE: many ``meta`` kernels are Python (``torch._refs``) and a plan's dry runs repeat the
    same ops thousands of times; on ``meta`` a result depends only on its arguments' metadata.
    Remembered: ops returning one new tensor (not a view) or their in-place ``self``, never an
    op that failed.
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
    """The metadata of ``items`` a ``meta`` kernel sees; ``storages`` numbers storages."""
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


def block_names(model: nn.Module) -> list[str]:
    """The qualified names of the model's blocks (`headroom.residency.find_blocks`)."""
    from headroom.residency import find_blocks

    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in find_blocks(model) if id(b) in names]


def checkpoint_modules(model: nn.Module, names: Iterable[str]) -> None:
    """Wrap the forward of each named submodule in non-reentrant activation checkpointing, as
    `hr.plan` applies it.

    In training, a checkpointed submodule runs without a key/value cache (``cache``,
    ``past_key_values``, ``past_key_value``, ``layer_past``, ``use_cache``), as under
    transformers' gradient checkpointing: recomputation would append to it again (layers with
    ``_can_checkpoint_with_cache`` keep it).

    Raises:
        AttributeError: ``model`` has no submodule of one of the names.
    """
    for name in names:
        module = model.get_submodule(name)
        forward = module.forward
        module.forward = functools.partial(  # type: ignore[method-assign]
            _checkpointed, module, forward)


_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _checkpointed(module: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
    if module.training and torch.is_grad_enabled() \
            and not getattr(module, "_can_checkpoint_with_cache", False):
        for key in _CACHE_KWARGS:
            if kwargs.get(key) is not None:
                kwargs[key] = None
        cache = kwargs.get("cache")
        if cache is not None and hasattr(cache, "get_seq_length"):  # a key/value cache
            kwargs["cache"] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
    return _ckpt.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def default_loss(output: Any) -> torch.Tensor:
    """The loss without ``loss_fn``: ``output.loss``, else the sum of the first tensor output."""
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
    """What the time model (`headroom.fit._time`) prices: ``ops``, ``(flops, bytes, kind,
    in_step)`` per op, FLOPs from ``torch.utils.flop_counter``, ``kind`` ``"mm"``, ``"conv"``
    or ``""``, ``in_step`` inside ``optimizer.step()``."""

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
