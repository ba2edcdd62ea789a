"""Helpers shared by the memory-saving layers: shape stand-ins, PyTorch's nodes under our
saved-tensor hooks, the pending activations that decide late, and the ReLU consumer registry."""

from __future__ import annotations

import functools
import operator
import threading
import types
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.fx import _symbolic_trace as _fx
from torch.multiprocessing.reductions import StorageWeakRef

from headroom.memory import is_tracking

if TYPE_CHECKING:
    from torch import nn


_is_compiling = torch.compiler.is_compiling
_jit_tracing = torch._C._is_tracing
_functorch_level = getattr(torch._C._functorch, "peek_interpreter_stack", lambda: None)
_grad_enabled = torch.is_grad_enabled
# records_graph() runs at every layer call: it reads the two flags torch.compiler.is_compiling()
# combines directly (torch.export's, and Dynamo's), or calls it where this torch lacks either.
if hasattr(torch.compiler, "_is_compiling_flag") and hasattr(torch.compiler, "is_dynamo_compiling"):
    _flags = torch.compiler
    _dynamo_compiling = torch.compiler.is_dynamo_compiling
else:  # pragma: no cover - older torch
    _flags = types.SimpleNamespace(_is_compiling_flag=False)
    _dynamo_compiling = torch.compiler.is_compiling
# Whether torch.fx.symbolic_trace runs: per thread from torch 2.14, a module flag before.
_fx_tracing = getattr(_fx, "_get_is_fx_tracing", None) or (lambda: _fx._is_fx_tracing_flag)


def records_graph() -> bool:
    """Whether this forward records a plain eager autograd graph (grad mode on, not traced by
    torch.compile or torch.jit.trace, not in a torch.func transform); raises inside FX tracing.
    """
    # Elsewhere PyTorch's own forward runs: AOTAutograd decides what a compiled graph saves, and
    # our hooks and Functions are eager machinery; torch.func's wrappers have no storage of their
    # own (the ReLU registry and the C kernels need one); jit.trace wants the same ops each call.
    if (
        not _grad_enabled()
        or _flags._is_compiling_flag
        or _dynamo_compiling()
        or _jit_tracing()
        or _functorch_level() is not None
    ):
        return False
    if _fx_tracing():
        # FX traces into headroom's layers (not torch.nn leaves): flag checks fail on proxies.
        raise RuntimeError(
            "torch.fx.symbolic_trace traced into a headroom.nn layer, which cannot be traced "
            "symbolically. Trace the unconverted model, or use a tracer that keeps these layers "
            "as leaves: class Tracer(torch.fx.Tracer): def is_leaf_module(self, m, name): "
            "return type(m).__module__.startswith('headroom.nn') or "
            "super().is_leaf_module(m, name)"
        )
    return True


def first_order_only(backward):
    """Decorates the ``backward`` of a headroom ``autograd.Function``: refuse a double backward."""
    # Not once_differentiable: its error node raises only if a later backward runs through it,
    # and autograd.grad(..., inputs=x) skips nodes off the paths to x, so where another path
    # reaches x (a ReLU's saved output) second-order terms would silently go missing. Backward
    # runs with grad mode on exactly when create_graph=True: refused at once.

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "A headroom.nn layer cannot be differentiated twice: a backward with "
                "create_graph=True (a gradient penalty, a Hessian product) ran through one. "
                "Run those steps with the unconverted model (hr.convert(model) keeps the "
                "original modules unless inplace=True)."
            )
        return backward(ctx, *grads)

    return wrapper


class TensorMeta:
    """What a backward kernel needs of a tensor it only reads the shape of: size, stride, dtype."""
    # Convolution (for one of its grads), pool and pad backwards read no values of this tensor
    # that feed a requested gradient: an uninitialized one with the same strides takes the same
    # code path (backend, memory format), so the result is bitwise the same.

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        # None on CPU: ``t.device`` builds a device object (and its type a string) per call
        self.device = None if t.is_cpu else t.device

    def unpack(self) -> torch.Tensor:
        """The stand-in, as a saved-tensor unpack hook returns it (see :func:`run_saving_less`)."""
        if torch.is_grad_enabled():
            # Only a double backward unpacks with grad mode on: a stand-in holds no values.
            raise RuntimeError(
                "A headroom.nn layer kept only the shape of a tensor that this double backward "
                "(create_graph=True) needs. Run the model unconverted for gradient penalties."
            )
        return self.empty()

    def empty(self) -> torch.Tensor:
        # Under the memory tracker a fresh allocation, charged to the backward step using it
        # rather than a long-lived shared buffer (virtual memory on CPU) counted as live.
        if self.device is not None or is_tracking():
            device = "cpu" if self.device is None else self.device
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=device)
        # On CPU a view of one shared buffer per dtype whose pages are never touched (a fresh
        # large allocation would cost an mmap/munmap per call); views are cached by layout.
        size, stride = self.size, self.stride
        key = (size, stride, self.dtype)
        view = _standin_views.get(key)
        if view is not None:
            return view
        need = 0 if 0 in size else 1 + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
        # No lock: dict reads and writes are atomic under the GIL, and two threads that
        # both grow the buffer only leave the smaller one to the views already taken from it.
        buf = _standins.get(self.dtype)
        if buf is None or buf.numel() < need:
            buf = _standins[self.dtype] = torch.empty(need, dtype=self.dtype)
            _standin_views.clear()  # views of the smaller buffer would keep it alive
        if len(_standin_views) > 1024:
            _standin_views.clear()
        view = _standin_views[key] = buf.as_strided(size, stride)
        return view


_standins: dict[torch.dtype, torch.Tensor] = {}
_standin_views: dict[tuple, torch.Tensor] = {}


class ShapeOnlyFunction(torch.autograd.Function):
    """``fwd(x, *args) -> out`` or ``(out, indices)``; backward ``bwd(grad, x, *bwd_args)``,
    with ``indices`` last where there are, reading x's shape only (pools, pads)."""

    @staticmethod
    def forward(ctx, x, fwd, args, bwd, bwd_args):
        out = fwd(x, *args)
        if isinstance(out, tuple):  # (out, indices)
            ctx.mark_non_differentiable(out[1])
            ctx.save_for_backward(out[1])
        ctx.meta, ctx.bwd, ctx.bwd_args = TensorMeta(x), bwd, bwd_args
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, grad, *_grad_indices):
        gx = ctx.bwd(grad, ctx.meta.empty(), *ctx.bwd_args, *ctx.saved_tensors)
        return gx, None, None, None, None


def channels_last_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense in channels-last order (and so packs in memory order)."""
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


# --- PyTorch's own autograd node, keeping less --------------------------------------------------
#
# A Python autograd.Function costs tens of microseconds per call on CPU: where PyTorch's op only
# saves too much, it runs under saved-tensor hooks that swap what is not needed for a stand-in or
# a mask. Only where this thread has no saved-tensor hooks (checkpointing, activation offload,
# the memory tracker), from which ours would hide the tensors.
#
# NOTE: no public query for active saved-tensor hooks; these exist from torch 2.8 (required).
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled


def hooks_free() -> bool:
    """Whether no saved-tensor hooks are active here, so :func:`run_saving_less` may run."""
    return _top_hooks(False) is None and _hooks_enabled()


class Kept:
    """A saved tensor kept as is, with PyTorch's check that it was not modified in place."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        return unchanged(self.tensor, self.version)


def unchanged(t: torch.Tensor, version: int) -> torch.Tensor:
    """``t``, refused as PyTorch refuses a saved tensor changed in place since ``version``."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead."
        )
    return t


# The unpack hook of every fast-path save, called from C without a Python frame of its own.
_unpack = operator.methodcaller("unpack")


def run_saving_less(pack, fn, *args):
    """``fn(*args)`` with every tensor its node saves replaced by ``pack(tensor)``, whose
    ``unpack()`` gives it back. The caller checks :func:`hooks_free`."""
    with saved_tensors_hooks(pack, _unpack):
        return fn(*args)


def save_less(saved, pack) -> None:
    """:func:`run_saving_less` for one tensor the node saved already (``saved``: its
    ``grad_fn._raw_saved_<name>``)."""
    # Cheaper where one of several saves is to go (a frozen convolution's input) or the layer
    # has the node's output at hand: ``pack`` runs once, here, on an alias without the autograd
    # graph (a holder keeping it makes no reference cycle); other saves keep PyTorch's checks.
    saved.register_hooks(pack, _unpack)


# --- deciding late -----------------------------------------------------------------------------
#
# [Note: deciding late]
# An activation's backward needs one bit per element of the tensor its node saves (a ReLU's
# output, a LeakyReLU's input). Keeping the tensor whole costs nothing when another saved tensor
# shares its storage (the next convolution's, for its weight's gradient), and 32x the mask
# otherwise. Which holds is known only once its consumers ran, so the pack hook keeps the tensor
# in a holder (headroom.nn._activation.Late); when the storage's use count shows nothing else
# references it, the holder packs a bit mask and drops the tensor, freeing the storage. Holders
# are settled at the start of the next few converted layers' forwards and when a converted
# root's forward returns, from the first forward on; one still shared then keeps the tensor
# whole, as PyTorch does, adding no byte.

_use_count = torch._C._storage_Use_Count


def _unshared_count() -> int:
    """The use count of a storage referenced by one tensor only, after ``untyped_storage()``
    was called on it (as a holder does)."""
    t = torch.empty(1)
    held = t.detach()
    key = t.untyped_storage()._cdata
    del t
    count = _use_count(key)
    del held
    return count


UNSHARED = _unshared_count()
_YOUNG_CHECKS = 8  # checks at layer starts of a holder whose tensor was freed while shared


class _Pending(threading.local):
    """This thread's undecided holders (:class:`headroom.nn._activation.Late`)."""

    def __init__(self) -> None:
        self.made: list[weakref.ref] = []  # weak undecided holders, settled at a root's end
        # weak holders whose watched tensor was freed while the storage was still shared:
        # the sharer may go at any time, so they are also tried at layer starts
        self.young: list[weakref.ref] = []
        self.seq = 0  # holders made on this thread so far
        self.roots: list[int] = []  # ``seq`` when each running converted root started


_pending = _Pending()


def settle_pending() -> None:
    """Try the young holders (at converted layers' forward starts)."""
    st = _pending
    young = st.young
    if not young:
        return
    keep = []
    for ref in young:
        holder = ref()
        # The use count is read here: most checks find a holder decided or shared, no call.
        if holder is None or holder.tensor is None:
            continue
        if _use_count(holder.key) == UNSHARED and holder.settle(0, True):
            continue
        holder.checks += 1
        if holder.checks < _YOUNG_CHECKS:
            keep.append(ref)  # else it waits for its root's end
    st.young = keep


def _settle_root(start: int) -> list[weakref.ref]:
    """A converted root's forward started at ``start`` returned: settle every holder; return
    (to try when backward starts) those made inside it that are still shared."""
    st = _pending
    made, leftover = [], []
    for ref in st.made:
        holder = ref()
        if holder is None or holder.tensor is None or holder.settle():
            continue
        if holder.seq <= start:
            made.append(ref)
        else:
            holder.drop_mask()
            leftover.append(ref)
    st.made = made
    st.young = [
        ref
        for ref in st.young
        if (h := ref()) is not None and h.tensor is not None and h.seq <= start
    ]
    return leftover


def _grad_tensors(output, depth: int = 0) -> list[torch.Tensor]:
    """The tensors requiring grad in a forward's output (tensors, sequences, mappings)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if depth > 2:
        return []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, list | tuple):
        return [t for item in output for t in _grad_tensors(item, depth + 1)]
    return []


def _settle_at_backward(holders: list[weakref.ref], grad) -> None:
    """Tensor hook on a root's outputs: settle the holders left over at its forward's end when
    backward starts (once: the first output's hook empties the list), once the forward's
    arguments and the caller's variables are gone."""
    refs, holders[:] = holders[:], []
    for ref in refs:
        holder = ref()
        if holder is not None:
            holder.settle()


def _root_pre_hook(module, args) -> None:
    if _is_compiling() or _jit_tracing():
        return
    _pending.roots.append(_pending.seq)


def _root_hook(module, args, output) -> None:
    # always_call=True: runs after an Exception too. A KeyboardInterrupt skips it: its holders
    # settle at the next root's end (or die with their graph), the stale start entry stays.
    if _is_compiling() or _jit_tracing():
        return
    roots = _pending.roots
    leftover = _settle_root(roots.pop() if roots else 0)
    if leftover and output is not None:
        hook = functools.partial(_settle_at_backward, leftover)
        for t in _grad_tensors(output):
            t.register_hook(hook)


def install_root_hooks(root: nn.Module) -> None:
    """Settle pending holders when ``root``'s forward returns (see [Note: deciding late])."""
    if any(h is _root_pre_hook for h in root._forward_pre_hooks.values()):
        return
    root.register_forward_pre_hook(_root_pre_hook)
    root.register_forward_hook(_root_hook, always_call=True)


# --- which layer consumes a ReLU's output (under a caller's saved-tensor hooks) ------------------
#
# Under the caller's saved-tensor hooks a ReLU's save goes to them at once, so it decides in
# forward: from the headroom consumers that found their input in the registry below at this call
# site, else its last late decision (``calls``), else the layer convert() found after it in an
# nn.Sequential, else it keeps its output as PyTorch does.


@dataclass(slots=True, eq=False)
class Call:
    """One call site of an activation: ``keep`` is what its last holder decided (None before
    any, True for kept whole or undecided, False for a packed mask)."""

    keep: bool | None = None


class ReLUSites:
    """What one converted ReLU module knows of the layers that consume its output."""
    # In ``_sites`` (by id), not the module: models pickle and deep copies start afresh. Plain
    # dicts and lists, atomic under the GIL: cheaper than a WeakKeyDictionary and a lock.

    __slots__ = ("module", "sites", "seeds", "calls", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        key = id(module)
        self.module = weakref.ref(module, lambda _, key=key: _sites.pop(key, None))
        self.sites: dict[tuple, list[weakref.ref]] = {}  # call site -> weak consumers
        self.seeds: list[weakref.ref] = []  # weak consumers known from an nn.Sequential
        self.calls: dict[tuple, Call] = {}  # call site -> its late decisions


def activation_call(module: nn.Module, x: torch.Tensor) -> tuple[ReLUSites, tuple, Call]:
    """The record of activation ``module``, the call site of its call on ``x`` (the producing
    node's type and the shape past the batch: a module used twice in a block has two) and its
    :class:`Call`."""
    sites = _sites.get(id(module))
    if sites is None or sites.module() is not module:
        sites = relu_sites(module)
    site = (type(x.grad_fn), x.shape[1:])
    got = sites.calls.get(site)
    if got is None:
        if len(sites.calls) > 64:  # call sites of many input shapes: keep the recent ones
            sites.calls.clear()
        got = sites.calls[site] = Call()
    return sites, site, got


_sites: dict[int, ReLUSites] = {}
_registry_lock = threading.Lock()
# storage key -> (weak storage ref, the ReLU's sites, call-site key)
_relu_outputs: dict[int, tuple[StorageWeakRef, ReLUSites, tuple]] = {}


def trains(module: nn.Module, name: str = "weight") -> bool:
    """``module.<name>.requires_grad`` (False for None), without the slow
    ``Module.__getattr__`` where the parameter is in ``_parameters`` (a parametrized one is not)."""
    param = module._parameters.get(name)
    if param is None:
        param = getattr(module, name)
    return param is not None and param.requires_grad


def relu_sites(module: nn.Module) -> ReLUSites:
    known = _sites.get(id(module))
    if known is None or known.module() is not module:
        known = _sites[id(module)] = ReLUSites(module)
    return known


def shape_of_floats(t: torch.Tensor) -> Kept | TensorMeta:
    """Pack hook of pools and pads: their input by its shape, max-pool indices as they are."""
    return TensorMeta(t) if t.is_floating_point() else Kept(t)


class KeepsNoInput:
    """Layers whose backward reads one bit of each input value or none (pools, pads, LeakyReLU,
    Hardtanh): :meth:`_hr_fast`, else :meth:`_hr_pack`'s hook, else (hooks) ``_hr_forward``."""

    def _hr_saves_input(self) -> bool:
        return False

    def _hr_pack(self, input: torch.Tensor):
        return None  # or the pack hook of the fast path

    def _hr_fast(self, input: torch.Tensor) -> torch.Tensor | None:
        return None  # or the output through a fast path of the layer's own

    def _hr_torch_forward(self, input: torch.Tensor):
        return super().forward(input)

    def forward(self, input: torch.Tensor):
        if not (records_graph() and input.requires_grad):
            return self._hr_torch_forward(input)
        if _pending.young:
            settle_pending()
        if _relu_outputs:
            note_consumer(self, input)
        if _top_hooks(False) is None and _hooks_enabled():  # hooks_free(), inlined
            out = self._hr_fast(input)
            if out is not None:
                return out
            pack = self._hr_pack(input)
            if pack is not None:
                return run_saving_less(pack, self._hr_torch_forward, input)
        return self._hr_forward(input)


class PoolOrPad(KeepsNoInput):
    """Pools and pads: PyTorch's node saves the input (replaced by its shape) and indices."""

    _hr_dims: int  # spatial dimensions, set by `per_dimension`

    def _hr_pack(self, input: torch.Tensor):
        return shape_of_floats


def register_relu_output(sites: ReLUSites, site: tuple, out: torch.Tensor) -> None:
    """Remember that ``out`` came from the ReLU of ``sites`` at call site ``site``."""
    storage = out.untyped_storage()
    if len(_relu_outputs) > 256:
        with _registry_lock:
            for k in [k for k, v in _relu_outputs.items() if v[0].expired()]:
                del _relu_outputs[k]
    # Single dict reads and writes are atomic under the GIL: only the pruning pass locks.
    _relu_outputs[storage._cdata] = (StorageWeakRef(storage), sites, site)


def note_consumer(consumer: nn.Module, x: torch.Tensor) -> None:
    """Record headroom layer ``consumer`` for the ReLU behind its input ``x``, if any."""
    if not _relu_outputs or x.layout != torch.strided:
        return
    key = x.untyped_storage()._cdata
    entry = _relu_outputs.get(key)
    if entry is None or entry[0].expired() or entry[0].cdata != key:
        return
    consumers = entry[1].sites.setdefault(entry[2], [])
    if all(ref() is not consumer for ref in consumers):
        consumers.append(weakref.ref(consumer))


def seed_consumer(relu: nn.Module, consumer: nn.Module) -> None:
    """Tell ``relu`` its consumer before any forward (known from an ``nn.Sequential``)."""
    relu_sites(relu).seeds[:] = [weakref.ref(consumer)]


def consumers_keep_output(sites: ReLUSites, site: tuple) -> bool:
    """Whether the ReLU of ``sites`` at ``site`` should keep its output rather than a bit mask,
    deciding in forward (see the section comment above)."""
    consumers = sites.sites.get(site)
    if not consumers:
        call = sites.calls.get(site)
        if call is not None and call.keep is not None:
            return call.keep
        consumers = sites.seeds
    return not consumers or any((c := ref()) is None or c._hr_saves_input() for ref in consumers)


def per_dimension(module: str, base: type, torch_classes: tuple[type, ...], doc: str,
                  **attrs: object) -> tuple[type, ...]:
    """``class <tc name>(base, tc)`` per torch class ``tc``, with ``_hr_dims`` 1, 2, 3, ``attrs``,
    ``doc`` (``{name}``: tc's name) and ``__module__`` ``module`` (so they pickle)."""
    return tuple(
        type(tc.__name__, (base, tc), {
            "__module__": module, "__qualname__": tc.__name__,
            "__doc__": doc.format(name=tc.__name__), "_hr_dims": n, **attrs})
        for n, tc in enumerate(torch_classes, 1))
