"""A training step run on ``meta`` tensors: what the estimator executes instead of the real step.

The step runs the model's own code, so every op PyTorch would run is seen with its real shapes
and dtypes, but no tensor holds data. Four things make a meta run behave like the target device:

- the model is copied onto ``meta`` without copying any data (the copy shares nothing with the
  original, so the dry run can never change the user's model);
- ``scaled_dot_product_attention`` on ``meta`` would take PyTorch's math path (which keeps the
  whole attention matrix); it is redirected to the fused kernel the target device would choose;
- autocast regions for ``"meta"`` (and the estimator's ``autocast=`` what-if) cast as the target
  device's autocast does (`headroom.fit._autocast`);
- the optimizer runs one step untracked first, so the tracked step is in steady state (its state
  already exists), like every step of a training run but the first.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
from collections.abc import Callable, Iterable
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
    Entering it also enters the target's autocast for ``meta`` tensors (`MetaAutocast`), which
    casts the attention's arguments as autocast would before the kernel is chosen.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def __enter__(self) -> AttentionAsOnDevice:
        F.scaled_dot_product_attention = self._call
        # autocast of the target device for meta tensors (regions for "meta", as layers open
        # them for their input's device, are the target's)
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
        return self._amp.region(dtype=dtype)

    def _call(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # autocast casts the arguments of scaled_dot_product_attention before any kernel
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
            mask = attn_mask
            if mask is not None and mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            if q.dim() == 3:
                # Inputs without a head dimension (which torch 2.14's CPU attention runs fused,
                # and 2.13's through the math path: the choice above is torch's own): the
                # kernel takes them as one batch of heads, and keeps them so for backward.
                if mask is not None and mask.dim() > 3:
                    return None
                one = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
                mask = mask.unsqueeze(0) if mask is not None and mask.dim() == 3 else mask
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    *one, 0.0, is_causal, attn_mask=mask, scale=scale)[0].squeeze(0)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
        if q.dim() != 4:
            return None
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


def _cpu_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> int:
    """The kernel PyTorch's CPU attention picks for these inputs (``SDPBackend``'s number:
    0 the math path, 1 flash), asked of PyTorch itself.

    NOTE: the choice reads shapes, dtypes, strides of the last dimension, dropout and which
    inputs require gradients (a mask that requires one, as T5's learned position bias, takes
    the math path: the CPU flash kernel has no gradient for it), never values; so it is asked
    with CPU stand-ins of one row each, broadcast to the inputs' shapes.
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
    """Make transformers' search for packed sequences answer "one sequence per row" for
    ``meta`` position ids of unknown values; returns what to put back.

    NOTE: without a KV cache (``use_cache=False``, which gradient checkpointing forces)
    transformers' attention masks look for several sequences packed in one row by reading the
    position ids' values. Given ones and generated ones (``arange``) have known values (see
    [Note: known values in a dry run]) and are searched as on a real device; others (from
    inputs given as ``meta`` tensors) are taken as one sequence per row.
    """
    import sys

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
    ``meta`` tensors they are skipped. Ops whose inputs have known values also run on those
    values (see [Note: known values in a dry run]).
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
# values (or are real) also runs on those values, on the CPU, below the tracker: the ``meta``
# result is still what the memory is counted from, the CPU one is its values. So do small
# results that read no values (``arange``, ``ones_like``: a backward's seed). Models read such
# values to choose their path (transformers skips an all-ones padding mask, builds a 4-D mask
# otherwise); a dry run then takes the path the real step takes, and an op that needs values
# (``.item()``, ``nonzero``) gets them. Values are never guessed: an op writing unknown values
# into a storage drops the values of every tensor on it.

# Values of results that read no values (factories, ``*_like``) are kept up to this size (the
# others up to `headroom.store.known_values`' ``max_bytes``): small ones (positions, a seed)
# are read; zeros the size of a parameter are only written over.
_MAX_FRESH_BYTES = 1 << 20

# Ops whose results read only the shape and dtype of their tensor argument.
_VALUE_FREE = {getattr(torch.ops.aten, name) for name in (
    "ones_like", "zeros_like", "full_like", "empty_like", "new_ones", "new_zeros", "new_full",
    "new_empty", "new_empty_strided") if hasattr(torch.ops.aten, name)}


def _real_inputs(func, args: tuple, kwargs: dict, flat: list[torch.Tensor]
                 ) -> tuple[tuple, dict, int] | None:
    """``args`` and ``kwargs`` with every ``meta`` tensor replaced by its known values and a
    ``meta`` device by the CPU, and the largest result whose values are kept; or ``None``
    when some ``meta`` input has no known values (or the op draws random numbers)."""
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
    """Run ``func`` on the known values of its inputs and keep the results as the values of
    its ``meta`` results (up to the size ``values`` gives); whether it did."""
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
    """The result of an op whose ``meta`` kernel needs values, from its result on the known
    values: ``meta`` tensors of the same layout (their values kept), or the result itself
    where the op asked for a real device (``.cpu()``) or returns no tensor (``.item()``)."""
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
    """Drop the known values of the ``meta`` storages ``func`` writes (its new values there
    are not known)."""
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
    """Wrap the forward of each named submodule in non-reentrant activation checkpointing, as
    `hr.plan` applies it.

    A checkpointed submodule called in training with a key/value cache (transformers'
    ``cache``, ``past_key_values``, ``past_key_value`` or ``layer_past``, and ``use_cache``)
    runs without it, as under transformers' own gradient checkpointing: backward's
    recomputation would append its keys and values to the cache again and attend over both
    (layers that declare ``_can_checkpoint_with_cache``, which only read it, keep it).

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
