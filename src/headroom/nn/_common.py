"""Helpers shared by the memory-saving layers: shape stand-ins, PyTorch's nodes under our
saved-tensor hooks, the pending activations that decide late, and the ReLU consumer registry."""

from __future__ import annotations

import functools
import operator
import threading
import types
import weakref
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
# records_graph() runs at every converted layer's call, so it reads what
# torch.compiler.is_compiling() combines (two Python calls) directly: torch.export's flag, and
# is_dynamo_compiling(), which Dynamo evaluates to True while it traces (one call, False in
# eager). Where a torch lacks either, is_compiling() itself.
if hasattr(torch.compiler, "_is_compiling_flag") and hasattr(torch.compiler, "is_dynamo_compiling"):
    _flags = torch.compiler
    _dynamo_compiling = torch.compiler.is_dynamo_compiling
else:  # pragma: no cover - older torch
    _flags = types.SimpleNamespace(_is_compiling_flag=False)
    _dynamo_compiling = torch.compiler.is_compiling
# Whether torch.fx.symbolic_trace runs: torch 2.14 keeps it per thread (read by
# _get_is_fx_tracing), older ones in a module flag.
_fx_tracing = getattr(_fx, "_get_is_fx_tracing", None) or (lambda: _fx._is_fx_tracing_flag)


def records_graph() -> bool:
    """Whether this forward records a plain eager autograd graph: grad mode on, not being
    traced by ``torch.compile`` or ``torch.jit.trace``, and not inside a ``torch.func``
    transform. Raises a clear error inside ``torch.fx.symbolic_trace``.
    """
    # Under torch.compile, AOTAutograd builds the backward graph itself and decides what
    # it saves, so headroom's layers trace PyTorch's own forward: their hooks, registry and
    # Functions are eager-mode machinery (Dynamo would trace them into the graph or break it).
    # Inside torch.func.grad/vjp/vmap the tensors are functorch wrappers without a storage of
    # their own (the ReLU registry and the C kernels need one), so PyTorch's forward runs there
    # too. torch.jit.trace records the ops of one call and checks a second one against them;
    # PyTorch's forward gives the same ops every call.
    if (
        not _grad_enabled()
        or _flags._is_compiling_flag
        or _dynamo_compiling()
        or _jit_tracing()
        or _functorch_level() is not None
    ):
        return False
    if _fx_tracing():
        # FX treats torch.nn modules as leaves and traces into headroom's, whose flag
        # checks (and batch norm's own input checks) cannot run on proxies.
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
    # PyTorch's ``once_differentiable`` is not enough here. It makes the gradient's graph
    # end in an error node that only raises if a later backward runs through it, and
    # ``torch.autograd.grad(..., inputs=x)`` runs only the nodes on a path to ``x``: when another
    # path reaches ``x`` (a ReLU's own saved output does), the second-order terms through these
    # layers would be silently missing. Backward runs with grad mode on exactly when
    # ``create_graph=True``, so that is refused at once, with the fix in the message.

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
    # Several aten backward kernels (``convolution_backward`` for one of its two grads,
    # ``max_pool2d_with_indices_backward``, ``avg_pool2d_backward``, the padding backwards) take a
    # full tensor but read only its sizes, strides and dtype (a few also read values that only
    # feed gradients we do not request). We keep exactly those and hand the kernel an
    # uninitialized tensor with the same strides, so it takes the same code path (same backend
    # choice, same memory format) and gives bitwise the same result. On CPU that tensor is a view
    # of a shared buffer whose pages are never touched (no RAM); on an accelerator it is a
    # transient allocation that lives only inside this backward call.

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
            # Only a double backward (create_graph=True) unpacks with grad mode on; a
            # stand-in holds no values, so refuse instead of differentiating garbage.
            raise RuntimeError(
                "A headroom.nn layer kept only the shape of a tensor that this double backward "
                "(create_graph=True) needs. Run the model unconverted for gradient penalties."
            )
        return self.empty()

    def empty(self) -> torch.Tensor:
        # While headroom's memory tracker runs, a stand-in is a fresh allocation as on an
        # accelerator, so the tracker charges it to the backward step that uses it instead of
        # counting a long-lived shared buffer (virtual memory on CPU) as live bytes.
        if self.device is not None or is_tracking():
            device = "cpu" if self.device is None else self.device
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=device)
        # On CPU every stand-in is a view of one shared buffer per dtype that no kernel
        # ever reads for its values or writes, so its pages are never touched (virtual memory
        # only). A fresh large allocation per backward call would cost an mmap/munmap pair
        # each time. The views are cached by layout (every step asks for the same ones), which
        # spares a view per call.
        size, stride = self.size, self.stride
        key = (size, stride, self.dtype)
        view = _standin_views.get(key)
        if view is not None:
            return view
        need = 1
        for n, st in zip(size, stride, strict=True):
            if n == 0:
                need = 0
                break
            need += (n - 1) * st
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


# --- PyTorch's own autograd node, keeping less --------------------------------------------------
#
# A Python ``autograd.Function`` costs tens of microseconds per call on CPU (apply, ctx, a
# Python backward), a noticeable share of a small CNN step. Where PyTorch's own op computes
# exactly what we want and only saves too much, it is cheaper to run that op under
# saved-tensor hooks that replace what is not needed by a stand-in (or a bit mask) at save time:
# the backward stays PyTorch's C++ node, with the same kernel and arguments. Used only when this
# thread has no saved-tensor hooks of its own (checkpointing, activation offloading, the memory
# tracker): ours would hide the tensors from them, so those runs take the autograd.Function path.
#
# NOTE: PyTorch has no public way to ask whether saved-tensor hooks are active; its private query
# exists from torch 2.8 on (headroom/__init__.py refuses an older torch). Pushing and popping go
# through the public torch.autograd.graph.saved_tensors_hooks; ``_saved_tensors_hooks_is_enabled``
# reads what the public ``torch.autograd.graph.disable_saved_tensors_hooks`` sets.
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


# The unpack hook of every fast-path save: ``packed.unpack()``, called from C without a Python
# frame of its own (it runs once per saved tensor in every backward).
_unpack = operator.methodcaller("unpack")


def run_saving_less(pack, fn, *args):
    """``fn(*args)`` with every tensor its autograd node saves replaced by ``pack(tensor)``.

    ``pack`` returns an object whose ``unpack()`` gives backward its tensor back
    (:class:`Kept`, :class:`TensorMeta`, or a bit mask). The caller checks :func:`hooks_free`.
    """
    with saved_tensors_hooks(pack, _unpack):
        return fn(*args)


def save_less(saved, pack) -> None:
    """Replace one tensor that PyTorch's node has saved already (``saved``: its
    ``grad_fn._raw_saved_<name>``) by ``pack(tensor)``, whose ``unpack()`` gives backward its
    tensor back. The caller checks :func:`hooks_free`."""
    # Cheaper than run_saving_less where a node saves several tensors and one is to go
    # (a frozen convolution's input, not its weight) or where the layer has the node's output
    # at hand anyway (an activation's holder): PyTorch calls ``pack`` once, here, with the
    # interpreter lock held, rather than from inside the op for every tensor the node saves.
    # It gives ``pack`` a tensor without the autograd graph (a detached alias, or for a saved
    # output the alias the node holds), so a holder keeping it makes no reference cycle, and the
    # saves left alone keep PyTorch's own checks.
    saved.register_hooks(pack, _unpack)


# --- deciding late -----------------------------------------------------------------------------
#
# [Note: deciding late]
# An activation's backward needs one bit per element of the tensor its PyTorch node saves (a
# ReLU's output, a LeakyReLU's input, ...). Keeping that tensor whole costs nothing when another
# saved tensor shares its storage (the next convolution keeps the same tensor for its weight's
# gradient, a squeeze-excitation product keeps it for its other factor), and 32x the mask
# otherwise. Which of the two holds is known only once the tensor's consumers have run, so the
# layer's pack hook keeps the tensor in a holder (headroom.nn._activation.Late) and decides
# later: when the storage's use count shows that nothing but the holder references it, the
# holder packs it to a bit mask and drops it, which frees the storage. Holders are settled at the
# start of each converted layer's forward (each holder at its next few layers, while its
# consumers run) and when the forward of a model converted by convert() returns (its root's
# forward hooks): from the very first forward, with no need to know the consumers. A holder that
# is still shared then keeps the tensor whole, as PyTorch does, which adds no byte.

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unshared_count() -> int | None:
    """The use count of a storage referenced by one tensor only, after ``untyped_storage()``
    was called on it (as a holder does), or None where torch lacks the function."""
    if _use_count is None:
        return None
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
    """This thread's undecided holders (:class:`headroom.nn._activation.Late`).

    A holder has ``tensor`` (None once decided), ``key`` (its storage's), ``checks`` (layer
    starts it was tried at), ``seq`` (this thread's count of holders when it was made),
    ``settle() -> bool`` (decided?) and ``drop_mask()``. It adds itself to ``made``; it watches
    the tensor it holds and, when that is freed while its storage is still shared, adds itself
    to ``young``.
    """

    def __init__(self) -> None:
        self.made: list[weakref.ref] = []  # weak undecided holders, settled at a root's end
        # weak holders whose tensor was freed while another reference still shared its
        # storage: that one may go at any time, so they are also tried at layer starts
        self.young: list[weakref.ref] = []
        self.seq = 0  # holders made on this thread so far
        self.roots: list[int] = []  # ``seq`` when each running converted root started


_pending = _Pending()


def settle_pending() -> None:
    """Try the young holders (called at the start of converted layers' forward; the callers
    check ``_pending.young`` first)."""
    st = _pending
    young = st.young
    if not young:
        return
    keep = []
    for ref in young:
        holder = ref()
        # The use count is read here rather than in settle(): most checks find a holder
        # decided already or still shared, and need no call.
        if holder is None or holder.tensor is None:
            continue
        if _use_count(holder.key) == UNSHARED and holder.settle(0, True):
            continue
        holder.checks += 1
        if holder.checks < _YOUNG_CHECKS:
            keep.append(ref)  # else it waits for its root's end
    st.young = keep


def _settle_root(start: int) -> list[weakref.ref]:
    """A converted root's forward, started at sequence ``start``, returned: settle every
    holder. Those made inside it that are still shared leave the pending lists and are
    returned (to be tried once more when backward starts); older ones stay pending."""
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


class _SettleAtBackward:
    """Tensor hook on a root's outputs: settle the holders left over at its forward's end when
    backward starts, once references held only until then (the forward's arguments and
    outputs, the caller's variables) are gone."""

    __slots__ = ("holders",)

    def __init__(self, holders: list[weakref.ref]) -> None:
        self.holders = holders

    def __call__(self, grad):
        holders, self.holders = self.holders, []
        for ref in holders:
            holder = ref()
            if holder is not None:
                holder.settle()


def _root_pre_hook(module, args) -> None:
    if _is_compiling() or _jit_tracing():
        return
    _pending.roots.append(_pending.seq)


def _root_hook(module, args, output) -> None:
    # Registered with always_call=True: also runs when the forward raised an Exception.
    # A KeyboardInterrupt skips it; the holders of that forward are then settled at the next
    # root's end (they die with their graph anyway), and the stale start entry stays below.
    if _is_compiling() or _jit_tracing():
        return
    roots = _pending.roots
    leftover = _settle_root(roots.pop() if roots else 0)
    if leftover and output is not None:
        hook = _SettleAtBackward(leftover)
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
# Under saved-tensor hooks of the caller's (hr.track_memory, checkpointing) what a ReLU
# saves goes to those hooks at once, so it cannot decide late (see [Note: deciding late]) and
# must choose in its forward, before its consumer runs. Consumers that are headroom layers report
# themselves on that path: each looks its input's storage up in the registry below and records
# (ReLU module, call site) -> consumer; from the next such forward on, the ReLU asks those
# consumers whether they will save their input under the current ``requires_grad`` flags. Else
# it follows what its holder decided at the last forward without hooks (``calls``), else the
# layer ``convert`` found after it in an nn.Sequential, else it keeps its output as PyTorch does.


class Call:
    """One call site of an activation module, as its holders see it: ``keep`` is what the last
    holder made there decided late (None before any, True where the tensor stayed whole or is
    not decided yet, False where a mask was packed)."""

    __slots__ = ("keep",)

    def __init__(self) -> None:
        self.keep: bool | None = None


class ReLUSites:
    """What one converted ReLU module knows of the layers that consume its output."""
    # Kept outside the module (in ``_sites``, keyed by ``id(module)``, dropped when the
    # module dies) so that converted models still pickle, and a deep copy of a model starts
    # with no consumers rather than the original model's. Plain dicts and lists: single reads
    # and writes are atomic under the GIL; this runs on every forward of every ReLU, where a
    # WeakKeyDictionary and a lock would cost more.

    __slots__ = ("module", "sites", "seeds", "calls", "__weakref__")

    def __init__(self, module: nn.Module) -> None:
        key = id(module)
        self.module = weakref.ref(module, lambda _, key=key: _sites.pop(key, None))
        self.sites: dict[tuple, list[weakref.ref]] = {}  # call site -> weak consumers
        self.seeds: list[weakref.ref] = []  # weak consumers known from an nn.Sequential
        self.calls: dict[tuple, Call] = {}  # call site -> its late decisions

    def call(self, site: tuple) -> Call:
        """The :class:`Call` of call site ``site``."""
        got = self.calls.get(site)
        if got is None:
            if len(self.calls) > 64:  # call sites of many input shapes: keep the recent ones
                self.calls.clear()
            got = self.calls[site] = Call()
        return got


def activation_call(module: nn.Module, x: torch.Tensor) -> tuple[ReLUSites, tuple, Call]:
    """The record of activation ``module``, the call site of its call on ``x`` (the producing
    node's type and the shape without the batch dimension: one module used twice in a block,
    as torchvision's BasicBlock does, has two) and that site's :class:`Call`."""
    sites = _sites.get(id(module))
    if sites is None or sites.module() is not module:
        sites = relu_sites(module)
    site = (type(x.grad_fn), x.shape[1:])
    got = sites.calls.get(site)
    if got is None:
        got = sites.call(site)
    return sites, site, got


_sites: dict[int, ReLUSites] = {}
_registry_lock = threading.Lock()
# storage key -> (weak storage ref, the ReLU's sites, call-site key)
_relu_outputs: dict[int, tuple[StorageWeakRef, ReLUSites, tuple]] = {}


def weight_trains(module: nn.Module) -> bool:
    """``module.weight.requires_grad``, fast: this runs on every ReLU forward, and
    ``Module.__getattr__`` is slow. A parametrized or spectral-normed weight is not in
    ``_parameters``; those take the attribute."""
    weight = module._parameters.get("weight")
    if weight is None:
        weight = module.weight
    return weight is not None and weight.requires_grad


def relu_sites(module: nn.Module) -> ReLUSites:
    """The :class:`ReLUSites` of ReLU ``module``."""
    known = _sites.get(id(module))
    if known is None or known.module() is not module:
        known = _sites[id(module)] = ReLUSites(module)
    return known


def shape_of_floats(t: torch.Tensor) -> Kept | TensorMeta:
    """Pack hook of pools and pads: a floating-point saved tensor (their input) by its shape,
    anything else (max-pool indices) as is."""
    return TensorMeta(t) if t.is_floating_point() else Kept(t)


class KeepsNoInput:
    """Mixin of layers whose backward never reads their input's values, or only one bit of them
    (pools, pads, LeakyReLU and Hardtanh).

    ``forward`` runs the ``torch.nn`` twin's own forward when no graph is recorded. Otherwise,
    when this thread has no saved-tensor hooks of its own, it takes the layer's fast path
    (:meth:`_hr_fast`: activations keep their tensor in a holder that decides late whether a
    1-bit mask is cheaper), or runs the twin's forward under :func:`run_saving_less` with the
    pack hook :meth:`_hr_pack` returns (pools and pads: :func:`shape_of_floats`, keeping the
    input's shape); under the caller's hooks it calls ``_hr_forward``.
    """

    def _hr_saves_input(self) -> bool:
        return False

    def _hr_pack(self, input: torch.Tensor):
        """The pack hook of the fast path, or None where this call must take ``_hr_forward``."""
        return None

    def _hr_fast(self, input: torch.Tensor) -> torch.Tensor | None:
        """The output through a fast path of the layer's own, or None where the layer has none
        for this call (see headroom.nn._activation)."""
        return None

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
    # Single dict reads and writes need no lock (atomic under the GIL); only the pruning
    # pass above iterates, so only it takes the lock. These run once per layer call.
    _relu_outputs[storage._cdata] = (StorageWeakRef(storage), sites, site)


def note_consumer(consumer: nn.Module, x: torch.Tensor) -> None:
    """Called by headroom layers on their input: record ``consumer`` for the ReLU behind ``x``."""
    if not _relu_outputs or x.layout != torch.strided:
        return
    key = x.untyped_storage()._cdata
    entry = _relu_outputs.get(key)
    if entry is None or entry[0].expired() or entry[0].cdata != key:
        return
    consumers = entry[1].sites.setdefault(entry[2], [])
    for ref in consumers:
        if ref() is consumer:
            return
    consumers.append(weakref.ref(consumer))


def seed_consumer(relu: nn.Module, consumer: nn.Module) -> None:
    """Tell ``relu`` its consumer before any forward (known from an ``nn.Sequential``)."""
    relu_sites(relu).seeds[:] = [weakref.ref(consumer)]


def consumers_keep_output(sites: ReLUSites, site: tuple) -> bool:
    """Whether the ReLU of ``sites`` at ``site`` should keep its output rather than a bit mask,
    deciding in forward (under saved-tensor hooks of the caller's)."""
    consumers = sites.sites.get(site)
    if not consumers:
        # No consumer seen on this path at this call site yet: what a holder decided
        # late at the last fast-path forward, else the consumer convert() found in an
        # nn.Sequential, else keep the output exactly as PyTorch does.
        call = sites.calls.get(site)
        if call is not None and call.keep is not None:
            return call.keep
        consumers = sites.seeds
    if not consumers:
        return True
    for ref in consumers:
        c = ref()
        if c is None or c._hr_saves_input():
            return True
    return False


def per_dimension(module: str, base: type, torch_classes: tuple[type, ...], doc: str,
                  **attrs: object) -> tuple[type, ...]:
    """One class per torch class: ``base`` first, the torch class second, its name, and
    ``_hr_dims`` (1, 2, 3 in order) among ``attrs``. ``doc`` is each class's docstring, with
    ``{name}`` standing for the torch class's name. The classes belong to ``module`` (their
    ``__module__``), so they pickle and print as if written out one by one there."""
    return tuple(
        type(tc.__name__, (base, tc), {
            "__module__": module, "__qualname__": tc.__name__,
            "__doc__": doc.format(name=tc.__name__), "_hr_dims": n, **attrs})
        for n, tc in enumerate(torch_classes, 1))
