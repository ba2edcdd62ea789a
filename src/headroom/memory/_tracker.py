"""Live memory tracking: every tensor storage, per device, attributed to one category.

Allocations are seen through a ``TorchDispatchMode``, frees through weak references to storages,
roles through PyTorch's saved-tensor, post-accumulate-grad, optimizer-step and module hooks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from headroom._saved_hooks import observing
from headroom.memory import _report
from headroom.memory._categories import (
    ACTIVATIONS,
    BUFFERS,
    CATEGORIES,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
    STICKY,
    category_index,
)
from headroom.memory._devices import (
    allocator_active,
    allocator_bytes,
    device_name,
    inner_tensors,
    storage_of,
)
from headroom.memory._records import DeviceStats, Peak, SavedToken, StorageInfo, TimelineSample
from headroom.memory._rss import RSSWatch

_NCAT = len(CATEGORIES)
_ORIG_STORAGE_RESIZE = torch.UntypedStorage.resize_
_RESIZE_STORAGE_BYTES = torch.ops.inductor.resize_storage_bytes_.default

_active_lock = threading.Lock()
_active: MemoryTracker | None = None
_active_where = ""


def _weakly(ref: weakref.ref, method: str, arg: Any, *_: Any) -> None:
    """``tracker.<method>(arg)`` while the tracker ``ref`` lives: the callbacks of storages and
    autograd nodes, which may outlive it, hold it weakly (by name: a subclass's own method)."""
    tracker = ref()
    if tracker is not None:
        getattr(tracker, method)(arg)


def _reading(fn):
    """A property of the tracker's numbers: refused before the region ran, read under its lock."""

    def read(self: MemoryTracker):
        self._check_used()
        with self._lock:
            return fn(self)

    return property(functools.wraps(fn)(read))


def _listed(x: Any, cls: type, what: str, cls_name: str) -> list:
    out = [x] if isinstance(x, cls) else list(x or [])
    for o in out:
        if not isinstance(o, cls):
            raise TypeError(f"{what} must be {cls_name} or a list of them, got {type(o)}")
    return out


def _compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled code (``torch.compile(module)`` or ``module.compile()``)."""
    dynamo = sys.modules.get("torch._dynamo")  # torch.compile imports it
    if dynamo is None:
        return False
    return (isinstance(module, dynamo.eval_frame.OptimizedModule)
            or getattr(module, "_compiled_call_impl", None) is not None)


def _autocast_in_use(args: Any, kwargs: Any) -> torch.dtype | None:
    """The autocast dtype a forward runs in on its inputs' device (for the advice's dry runs)."""
    from torch.utils._pytree import tree_flatten

    t = next((a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), None)
    device_type = t.device.type if t is not None else "cpu"
    with contextlib.suppress(RuntimeError):
        if torch.amp.is_autocast_available(device_type) \
                and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


def is_tracking() -> bool:
    """Whether a :func:`track_memory` region is active (in any thread)."""
    return _active is not None


def track_this_thread() -> contextlib.AbstractContextManager:
    """Count this thread's tensor ops in the active tracker too (a no-op when none is active,
    or in the thread that entered it): its dispatch mode sees only that thread, so a worker
    computing for it (``HostOptimizer``'s steps overlapped with backward) enters it here.
    """
    tracker = _active
    if tracker is None or tracker._mode is None or tracker._owner == threading.get_ident():
        return contextlib.nullcontext()
    return _Mode(tracker)


class _Mode(TorchDispatchMode):
    """Sees every op: registers unseen input storages, new outputs, and size changes."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tracker = self.tracker
        tracker._op_start = tracker._seq
        tracker._see_inputs(args)
        if kwargs:
            tracker._see_inputs(kwargs.values())
        out = func(*args, **(kwargs or {}))
        if func is _RESIZE_STORAGE_BYTES:
            # a refilled parameter (offloaded, coming back) is one even if first seen created
            cat = PARAMETERS if isinstance(args[0], nn.Parameter) else OTHER
            tracker._see(args[0], cat, check_size=True)
        tracker._see_outputs(out)
        tracker._sample()
        return out


class MemoryTracker:
    """Tracks live tensor memory per device and attributes every byte to one category.

    Use it through :func:`track_memory`. Tracking only observes: results never change.

    Args:
        model, optimizer, max_samples, sample_allocator: as in :func:`track_memory`.

    Raises:
        RuntimeError: when entered while another tracker is active, or entered twice.
    """

    def __init__(
        self,
        *,
        model: nn.Module | Iterable[nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        max_samples: int = 50_000,
        sample_allocator: bool = True,
    ) -> None:
        if max_samples < 2:
            raise ValueError(f"max_samples must be at least 2, got {max_samples}")
        self._models = _listed(model, nn.Module, "model", "an nn.Module")
        self._optimizers = _listed(optimizer, torch.optim.Optimizer, "optimizer",
                                   "a torch.optim.Optimizer")
        self._max_samples = max_samples
        self._sample_allocator = sample_allocator
        self._lock = threading.RLock()
        self._infos: dict[int, StorageInfo] = {}
        self._current: dict[str, list[int]] = {}
        self._all = [0] * _NCAT  # per category, all devices
        self._max: dict[str, list[int]] = {}
        self._dev_peak: dict[str, Peak] = {}
        self._peak = Peak()
        self._total = 0
        self._seq = 0
        self._act_by_module: dict[str, int] = {}
        self._act_total = 0
        self._act_peak = 0
        self._act_pending = False
        self._act_at_peak: dict[str, int] = {}
        self._alloc_max: dict[str, list[int]] = {}
        self._samples: list[tuple] = []
        self._labels: list[str] = []
        self._label_index: dict[tuple[str, str], int] = {}
        self._dirty = False
        self._t0 = 0.0
        self._state = "new"  # new -> active -> done
        self._handles: list[Any] = []
        self._grad_hooked: set[int] = set()
        self._names: dict[int, str] = {}
        self._classes: dict[str, str] = {}  # a module's name -> its class's, for reports
        self._roots: list[weakref.ref] = []
        self._stack: list[str] = []
        self._bwd_module = ""
        self._hooked_nodes: set[int] = set()
        self._in_optimizer = 0
        self._op_start = 0
        self._mode: _Mode | None = None
        self._owner = 0  # the thread that entered the region (its dispatch mode)
        self._saved_hooks: Any = None
        self._rss = RSSWatch()
        # bytes headroom keeps in a store ("host", "disk") by (where, category), beside the device's
        self._resting: dict[tuple[str, str], int] = {}
        self._resting_max: dict[tuple[str, str], int] = {}
        self._resting_samples: list[tuple[float, int]] = []
        self._meta_as: str | None = None  # set by the estimator: what meta tensors stand for
        self._context: dict[str, Any] = {}  # the first forward's model, inputs: for advice
        self._warned_compiled = False  # said once per region that compiled code runs eagerly

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> MemoryTracker:
        global _active, _active_where
        if self._state != "new":
            raise RuntimeError(
                "this memory tracker was already used; create a new one with "
                "headroom.track_memory() for each tracked region"
            )
        with _active_lock:
            if _active is not None:
                raise RuntimeError(
                    "headroom.track_memory() is already active (entered at "
                    f"{_active_where}); nested tracking is not supported. Track the whole region "
                    "with the outer tracker, or exit it before entering a new one."
                )
            _active = self
            frame = traceback.extract_stack(limit=3)[0]
            _active_where = f"{frame.filename}:{frame.lineno}"
        self._state = "active"
        self._owner = threading.get_ident()
        self._t0 = time.perf_counter()
        self._rss.begin(self._t0)
        try:
            self._install()
        except BaseException:
            self._uninstall()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._sample(force=True)
        self._uninstall()
        self._rss.finish()

    def _install(self) -> None:
        for model in self._models:
            self._add_root(model)
        for opt in self._optimizers:
            self._see_optimizer(opt)
        self._handles.append(nn.modules.module.register_module_forward_pre_hook(self._pre_fw))
        self._handles.append(
            nn.modules.module.register_module_forward_hook(self._post_fw, always_call=True)
        )
        # a parameter created inside the region is first seen as a new tensor: its module says
        self._handles.append(nn.modules.module.register_module_parameter_registration_hook(
            lambda module, name, p: None if p is None else self._see_param(p, PARAMETERS, module)))
        self._handles.append(register_optimizer_step_pre_hook(self._pre_step))
        self._handles.append(register_optimizer_step_post_hook(self._post_step))
        tracker = self

        # NOTE: `UntypedStorage.resize_` (how offloading frees and refills parameters) is not an
        # op, so no dispatch mode sees it; PyTorch's own MemTracker wraps it too.
        def resize_(storage: torch.UntypedStorage, size: int):
            result = _ORIG_STORAGE_RESIZE(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._saved_hooks = observing(self)
        self._saved_hooks.__enter__()
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._sample(force=True)

    def _uninstall(self) -> None:
        global _active
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        torch.UntypedStorage.resize_ = _ORIG_STORAGE_RESIZE  # type: ignore[method-assign]
        for h in self._handles:
            h.remove()
        self._handles.clear()
        with self._lock:
            for p in self._peaks():
                self._snapshot(p)
            # Freeze the numbers; storages freed after exit must not change them.
            for info in self._infos.values():
                info.ref = None
            self._infos = {}
            self._state = "done"
        with _active_lock:
            if _active is self:
                _active = None

    # ------------------------------------------------------------------ registration
    def _see(
        self, t: Any, cat: int, *, check_size: bool = False, force: bool = False
    ) -> StorageInfo | None:
        st = storage_of(t)
        if st is None:
            return None
        key = st._cdata
        with self._lock:
            info = self._infos.get(key)
            if info is None:
                if self._state != "active":
                    return None
                if st.device.type == "meta":
                    # meta tensors stand for the device's only in a dry run (the estimator)
                    if self._meta_as is None:
                        return None
                    dev = self._meta_as
                else:
                    dev = device_name(t.device)
                self._seq += 1
                info = StorageInfo(key, dev, st.nbytes(), cat, self._seq)
                on_free = functools.partial(_weakly, weakref.ref(self), "_freed", info)
                info.ref = weakref.ref(st, on_free)
                self._infos[key] = info
                if cat == ACTIVATIONS:
                    info.module = self._module_label()
                    self._act_change(info.module, info.nbytes)
                self._add(info.device, cat, info.nbytes)
                return info
            if check_size:
                nbytes = st.nbytes()
                if nbytes != info.nbytes:
                    self._resize(info, nbytes)
            if force or (cat != info.cat and cat != OTHER and info.cat not in STICKY):
                self._reclass(info, cat)
            return info

    def _see_inputs(self, args: Iterable[Any]) -> None:
        infos = self._infos
        for a in args:
            for b in a if isinstance(a, (list, tuple)) else (a,):  # tensors, and lists of them
                if isinstance(b, torch.Tensor):
                    st = storage_of(b)
                    if st is not None and st._cdata not in infos:
                        self._see(b, PARAMETERS if isinstance(b, nn.Parameter) else OTHER)

    def _see_outputs(self, out: Any) -> None:
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor):
                self._see(o, OTHER, check_size=True)

    # ------------------------------------------------------------------ accounting
    def _add(self, device: str, cat: int, nbytes: int) -> None:
        cur = self._current.get(device)
        if cur is None:
            cur = self._current[device] = [0] * _NCAT
            self._max[device] = [0] * _NCAT
            self._dev_peak[device] = Peak()
        if nbytes < 0:
            self._decreased()  # snapshot pending peaks before the bytes leave
        cur[cat] += nbytes
        self._all[cat] += nbytes
        mx = self._max[device]
        if cur[cat] > mx[cat]:
            mx[cat] = cur[cat]
        self._total += nbytes
        self._dirty = True
        if nbytes <= 0:
            return
        dev_total = sum(cur)
        dp = self._dev_peak[device]
        if dev_total > dp.value:
            self._new_peak(dp, dev_total, device)
        if self._total > self._peak.value:
            self._new_peak(self._peak, self._total, None)

    def _new_peak(self, peak: Peak, value: int, device: str | None) -> None:
        peak.value = value
        peak.seq = self._seq
        peak.pending = True
        if self._sample_allocator:
            devices = [device] if device is not None else list(self._current)
            alloc = {}
            for d in devices:
                ab = allocator_bytes(d)
                if ab is not None:
                    alloc[f"{d}/allocated"], alloc[f"{d}/reserved"] = ab
                    mx = self._alloc_max.setdefault(d, [0, 0])
                    mx[0], mx[1] = max(mx[0], ab[0]), max(mx[1], ab[1])
            peak.allocator = alloc

    def _decreased(self) -> None:
        if self._peak.pending:
            # a peak inside an op (temporaries freed before it returns): sample it here
            self._sample(force=True)
        for p in self._peaks():
            self._snapshot(p)  # (those pending)

    def _peaks(self) -> list[Peak]:
        return [self._peak, *self._dev_peak.values()]

    def _snapshot(self, peak: Peak) -> None:
        if not peak.pending:
            return
        peak.pending = False
        device = None if peak is self._peak else next(
            d for d, p in self._dev_peak.items() if p is peak)
        peak.cats = list(self._all if device is None else self._current[device])
        peak.resting = {k: v for k, v in self._resting.items() if v}
        if self._sample_allocator:
            # "active" (blocks in use or waiting on other streams) costs a full stats query:
            # read once per local peak, not at every new maximum
            devices = list(self._current) if device is None else [device]
            for d in devices:
                active = allocator_active(d)
                if active is not None:
                    peak.allocator[f"{d}/active"] = active

    def _act_change(self, module: str, delta: int) -> None:
        if delta < 0 and self._act_pending:
            self._act_at_peak = {k: v for k, v in self._act_by_module.items() if v}
            self._act_pending = False
        self._act_by_module[module] = self._act_by_module.get(module, 0) + delta
        self._act_total += delta
        if self._act_total > self._act_peak:
            self._act_peak = self._act_total
            self._act_pending = True

    def _freed(self, info: StorageInfo) -> None:
        with self._lock:
            if self._infos.get(info.key) is not info:
                return
            del self._infos[info.key]
            self._seq += 1
            if info.cat == ACTIVATIONS:
                self._act_change(info.module, -info.nbytes)
            self._add(info.device, info.cat, -info.nbytes)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        with self._lock:
            info = self._infos.get(storage._cdata)
            if info is not None:
                nbytes = storage.nbytes()
                if nbytes != info.nbytes:
                    self._resize(info, nbytes)

    def _resize(self, info: StorageInfo, nbytes: int) -> None:
        self._seq += 1
        delta = nbytes - info.nbytes
        info.nbytes = nbytes
        info.seq = self._seq
        if info.cat == ACTIVATIONS:
            self._act_change(info.module, delta)
        self._add(info.device, info.cat, delta)

    def _reclass(self, info: StorageInfo, cat: int) -> None:
        old = info.cat
        if old == cat:
            return
        n = info.nbytes
        cur = self._current[info.device]
        cur[old] -= n
        cur[cat] += n
        self._all[old] -= n
        self._all[cat] += n
        mx = self._max[info.device]
        if cur[cat] > mx[cat]:
            mx[cat] = cur[cat]
        if old == ACTIVATIONS:
            self._act_change(info.module, -n)
        if cat == ACTIVATIONS:
            info.module = self._module_label()
            self._act_change(info.module, n)
        info.cat = cat
        self._dirty = True
        # A storage alive now and allocated before a peak was alive at that peak. If it had
        # its new role since birth (a gradient before AccumulateGrad hands it over, an output
        # saved by the op that made it), already-taken snapshots are corrected. A storage that
        # gained the role later (an input batch saved by a layer) keeps its old role in the past.
        if not info.retro or (cat == ACTIVATIONS and info.seq <= self._op_start):
            return
        for i in range(len(self._samples) - 1, -1, -1):
            sample = self._samples[i]
            if sample[2] < info.seq:
                break
            fixed = list(sample)
            fixed[3 + old] -= n
            fixed[3 + cat] += n
            self._samples[i] = tuple(fixed)
        for p in self._peaks():
            if p.pending or info.seq > p.seq:
                continue
            if p is not self._peak and self._dev_peak.get(info.device) is not p:
                continue
            p.cats[old] -= n
            p.cats[cat] += n

    # ------------------------------------------------------------------ roles
    def observe(self, t: torch.Tensor) -> SavedToken | None:
        """A tensor autograd saves: an activation (see `headroom._saved_hooks`)."""
        info = self._see(t, ACTIVATIONS)
        if info is not None and info.cat == ACTIVATIONS:
            with self._lock:
                info.saved += 1
            return SavedToken(info, self)
        return None

    def _unsave(self, info: StorageInfo) -> None:
        with self._lock:
            info.saved -= 1
            if info.saved == 0 and info.cat == ACTIVATIONS and self._infos.get(info.key) is info:
                # Leaving a role is not a discovery about the past: no retroactive correction.
                self._decreased()
                info.retro = False
                self._reclass(info, OTHER)

    def _see_param(self, p: torch.Tensor, cat: int, owner: nn.Module | None = None) -> None:
        for t in inner_tensors(p, owner):  # a quantized weight's bytes: its parts'
            self._see(t, cat, check_size=True)
        if cat == PARAMETERS and p.grad is not None:
            self._see(p.grad, GRADIENTS)
        if cat == PARAMETERS and p.requires_grad and id(p) not in self._grad_hooked:
            try:
                h = p.register_post_accumulate_grad_hook(self._grad_done)
            except RuntimeError:  # not a leaf
                return
            self._grad_hooked.add(id(p))
            self._handles.append(h)

    def _grad_done(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._see(p.grad, GRADIENTS, check_size=True)

    def _see_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                self._see_param(p, PARAMETERS)
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self._see(v, OPTIMIZER_STATE)

    def _pre_step(self, opt, args, kwargs) -> None:
        self._in_optimizer += 1
        if self._context and "optimizer" not in self._context:
            options = getattr(opt, "options", None)  # hr.HostOptimizer: its options
            self._context["optimizer"] = (options if hasattr(options, "optimizer_class")
                                          else type(opt))
        self._see_optimizer(opt)

    def _post_step(self, opt, args, kwargs) -> None:
        self._see_optimizer(opt)
        self._in_optimizer -= 1

    def _add_root(self, module: nn.Module) -> None:
        self._roots.append(weakref.ref(module))
        if self._meta_as is None and not self._context:
            self._handles.append(
                module.register_forward_pre_hook(self._remember_inputs, with_kwargs=True))
        multi = len(self._roots) > 1
        root_name = type(module).__name__
        for name, m in module.named_modules():
            if id(m) not in self._names:
                self._names[id(m)] = (
                    f"{root_name}.{name}" if (multi and name) else name or root_name
                )
                self._classes.setdefault(self._names[id(m)], type(m).__name__)
            self._see_module(m)

    def _see_module(self, m: nn.Module) -> None:
        for p in m.parameters(recurse=False):
            self._see_param(p, PARAMETERS, m)
        for b in m.buffers(recurse=False):
            self._see(b, BUFFERS)

    def _remember_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        ctx = self._context
        if ctx and not (ctx.get("partial") and ctx["model"]() is module):
            return
        if self._stack[:-1]:
            return
        from headroom.store import to_meta

        amp = _autocast_in_use(args, kwargs)
        args, kwargs = to_meta((tuple(args), dict(kwargs)))  # labels=ids: one tensor
        self._context = {"model": weakref.ref(module), "args": args, "kwargs": kwargs,
                         "autocast": amp}
        if ctx and "optimizer" in ctx:
            self._context["optimizer"] = ctx["optimizer"]

    def _pre_fw(self, module: nn.Module, args: Any) -> None:
        if not self._warned_compiled and _compiled(module):
            self._warned_compiled = True
            warnings.warn(
                f"hr.track_memory: {type(module).__name__} is compiled, but PyTorch runs compiled"
                " code eagerly under the tracker's dispatch mode, so this region was measured as"
                " the eager model. To measure the compiled run, read the allocator without the"
                " tracker (torch.cuda.max_memory_allocated(); the process RSS on the CPU)",
                UserWarning, stacklevel=2)
        if not self._stack and id(module) not in self._names:
            self._add_root(module)
            if self._meta_as is None and not self._context:
                # built inside the region: its own hook runs from its next call (with kwargs)
                self._remember_inputs(module, args, {})
                self._context["partial"] = True
        name = self._names.get(id(module))
        if name is None:
            name = self._names[id(module)] = type(module).__name__
            self._classes.setdefault(name, name)
            self._see_module(module)
        self._stack.append(name)

    def _post_fw(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        name = self._stack.pop()
        # A pre-hook on the output's node names the module whose backward runs; the innermost
        # module registers first, so outer containers do not overwrite it.
        node = getattr(output, "grad_fn", None) if isinstance(output, torch.Tensor) else None
        if node is not None and id(node) not in self._hooked_nodes:
            self._hooked_nodes.add(id(node))
            if len(self._hooked_nodes) > 100_000:
                self._hooked_nodes.clear()
            node.register_prehook(
                functools.partial(_weakly, weakref.ref(self), "_in_backward_of", name))

    def _in_backward_of(self, name: str) -> None:
        self._bwd_module = name

    def _phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        if self._stack:
            return "forward"
        return "other"

    def _module_label(self, phase: str | None = None) -> str:
        phase = phase or self._phase()
        if phase == "forward":
            return self._stack[-1]
        if phase == "backward":
            return self._bwd_module
        return ""

    # ------------------------------------------------------------------ timeline
    def _sample(self, force: bool = False) -> None:
        if not (self._dirty or force):
            return
        with self._lock:
            self._dirty = False
            phase = self._phase()
            label = (phase, self._module_label(phase))
            idx = self._label_index.get(label)
            if idx is None:
                idx = self._label_index[label] = len(self._labels)
                self._labels.append(f"{label[0]}:{label[1]}")
            self._samples.append((time.perf_counter() - self._t0, idx, self._seq, *self._all))
            if len(self._samples) > self._max_samples:
                self._decimate()

    def _decimate(self) -> None:
        s = self._samples  # pairs merged into the first of their larger (an odd last one kept)
        kept = [max(a, b, key=lambda x: sum(x[3:])) for a, b in zip(s[::2], s[1::2], strict=False)]
        self._samples = kept + s[2 * len(kept):]

    # ------------------------------------------------------------------ public numbers
    def _check_used(self) -> None:
        if self._state == "new":
            raise RuntimeError(
                "the tracker has not run yet: use it as `with headroom.track_memory() as mem:`"
            )

    def _peak_view(self, peak: Peak) -> tuple[int, dict[str, int]]:
        with self._lock:
            if peak.pending and self._state == "active":
                # read-only view of the pending snapshot: take it without clearing the flag
                self._snapshot(peak)
                peak.pending = True
            cats = dict(zip(CATEGORIES, peak.cats, strict=True))
            return peak.value, cats

    @_reading
    def peak(self) -> int:
        """Most bytes live at once, all tracked devices together."""
        return self._peak.value

    @_reading
    def rss(self) -> dict[str, int | None]:
        """The process's resident memory in bytes over the region: ``start``, ``peak``, ``end``
        (``None`` where unreadable; after the region ends). It includes the interpreter,
        libraries, memory the C allocator keeps and anything outside PyTorch."""
        return {"start": self._rss.start, "peak": self._rss.peak, "end": self._rss.end}

    @_reading
    def rss_timeline(self) -> list[tuple[float, int]]:
        """RSS samples ``(seconds since entry, bytes)``, a few milliseconds apart."""
        return list(self._rss.samples)

    @_reading
    def peak_by_category(self) -> dict[str, int]:
        """Bytes per category at the moment of :attr:`peak` (they sum to it)."""
        return self._peak_view(self._peak)[1]

    @_reading
    def max_by_category(self) -> dict[str, int]:
        """Each category's own maximum over the run (summed over devices per device maximum)."""
        per_device = zip([0] * _NCAT, *self._max.values(), strict=True)
        return dict(zip(CATEGORIES, map(sum, per_device), strict=True))

    @_reading
    def current(self) -> int:
        """Bytes live now; after exit, bytes that were live at exit."""
        return self._total

    @_reading
    def current_by_category(self) -> dict[str, int]:
        """Bytes per category now (or at exit)."""
        return dict(zip(CATEGORIES, self._all, strict=True))

    @property
    def devices(self) -> list[str]:
        """Devices on which tensors were seen, e.g. ``["cpu", "cuda:0"]``."""
        return list(self._current)

    @_reading
    def by_module(self) -> dict[str, int]:
        """Bytes saved for backward per module when activations peaked, largest first (``""``:
        outside any module, e.g. a loss function)."""
        if self._act_pending:
            by_module = {k: v for k, v in self._act_by_module.items() if v}
        else:
            by_module = dict(self._act_at_peak)
        return dict(sorted(by_module.items(), key=lambda kv: -kv[1]))

    def module_class(self, name: str) -> str | None:
        """The class of the module `by_module` calls ``name`` (``None`` if none was seen)."""
        return self._classes.get(name)

    @_reading
    def timeline(self) -> list[TimelineSample]:
        """Samples after each op that changed memory (merged in pairs past ``max_samples``)."""
        # a label is "phase:module"
        return [TimelineSample(s[0], *self._labels[s[1]].split(":", 1),
                               dict(zip(CATEGORIES, s[3:], strict=True))) for s in self._samples]

    def stats(self, device: str | torch.device | None = None) -> DeviceStats:
        """The numbers for one device, or for all devices together with ``device=None``.

        Args:
            device: e.g. ``"cpu"``, ``"cuda"`` (the current CUDA device) or ``"cuda:1"``.

        Raises:
            ValueError: if nothing was tracked on ``device``.
        """
        self._check_used()
        if device is None:
            peak, names = self._peak, list(self._alloc_max)
            mx, cur = self.max_by_category, self.current
        else:
            name = device_name(torch.device(device))
            if name not in self._dev_peak:
                seen = ", ".join(self._current) or "none"
                raise ValueError(f"no tensors were tracked on {name!r}; devices seen: {seen}")
            peak, names = self._dev_peak[name], [name] if name in self._alloc_max else []
            with self._lock:
                mx = dict(zip(CATEGORIES, self._max[name], strict=True))
                cur = sum(self._current[name])
        value, cats = self._peak_view(peak)
        alloc = dict(peak.allocator)
        for d in names:
            alloc[f"{d}/max_allocated"], alloc[f"{d}/max_reserved"] = self._alloc_max[d]
        return DeviceStats(value, cats, mx, cur, alloc)

    # ------------------------------------------------------------------ reports
    def report(self, *, file=None, top_modules: int = 10, advice: bool = True) -> str:
        """Print (to ``file``, default stdout) and return a readable table of the numbers.

        With ``advice`` (and the model still alive) it ends with what would cut the peak most:
        each technique's saving from a dry run (`headroom.estimate`) of the step seen.
        """
        text = _report.format_report(self, top_modules=top_modules, advice=advice)
        print(text, file=file)
        return text

    def to_dict(self) -> dict[str, Any]:
        """Everything the tracker measured, as plain JSON-ready data."""
        return _report.to_dict(self)

    def to_json(self, path) -> None:
        """Write :meth:`to_dict` as JSON to ``path``."""
        _report._atomic_write(path, json.dumps(self.to_dict(), indent=1).encode())

    def plot(self, path, *, title: str | None = None) -> None:
        """Write a PNG stacked timeline by category with the peak marked (needs matplotlib)."""
        _report.plot(self, path, title=title)

    # ------------------------------------------------------------------ resting in stores
    @staticmethod
    def _nested(table: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (where, cat), v in sorted(table.items()):
            out.setdefault(where, {})[cat] = v
        return out

    @_reading
    def resting(self) -> dict[str, dict[str, int]]:
        """Bytes headroom keeps off the compute device in a store now (or at exit), as
        ``{where: {category: bytes}}``, ``where`` ``"host"`` or ``"disk"``. Not part of
        :attr:`peak` (host copies do count on ``"cpu"`` when the compute device is the CPU)."""
        return self._nested(self._resting)

    @_reading
    def resting_at_peak(self) -> dict[str, dict[str, int]]:
        """:attr:`resting` at the moment of :attr:`peak`."""
        if self._peak.pending and self._state == "active":
            return self._nested({k: v for k, v in self._resting.items() if v})
        return self._nested(self._peak.resting)

    @_reading
    def resting_max(self) -> dict[str, dict[str, int]]:
        """Each entry of :attr:`resting` at its own maximum over the run."""
        return self._nested(self._resting_max)

    @_reading
    def resting_timeline(self) -> list[tuple[float, int]]:
        """``(seconds since entry, bytes resting in all stores)`` after each change."""
        return list(self._resting_samples)

    def _rest(self, where: str, category: str, delta: int) -> None:
        with self._lock:
            key = (where, category)
            v = self._resting[key] = self._resting.get(key, 0) + delta
            if v > self._resting_max.get(key, 0):
                self._resting_max[key] = v
            self._resting_samples.append(
                (time.perf_counter() - self._t0, sum(self._resting.values())))
            if len(self._resting_samples) > self._max_samples:
                self._resting_samples = self._resting_samples[::2]

    # ------------------------------------------------------------------ for other layers
    def annotate(self, tensor: torch.Tensor, category: str) -> None:
        """Attribute ``tensor``'s storage to ``category`` from now on (see :func:`annotate`)."""
        self._see(tensor, category_index(category), force=True, check_size=True)


def track_memory(
    *,
    model: nn.Module | Iterable[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    max_samples: int = 50_000,
    sample_allocator: bool = True,
) -> MemoryTracker:
    """Track live tensor memory per device while code runs, by category.

    Every storage created or used inside the block counts once until freed, in one of
    :data:`CATEGORIES`; results never change. What counts as what (and what under other
    saved-tensor hooks does not count as activations): see docs/memory.md, "What is counted, and
    how" and "Trade-offs and limits".

    Args:
        model: module(s) whose parameters, buffers and gradients count from entry (others
            are found when they run).
        optimizer: optimizer(s) whose state counts from entry (others when they step).
        max_samples: timeline bound; past it, samples merge in pairs keeping the larger, so
            peaks survive. Trade-off: finer plots, more memory.
        sample_allocator: also sample the accelerator allocator's allocated and reserved bytes
            (a cheap call per sample; shows fragmentation). Ignored on CPU.

    Returns:
        A :class:`MemoryTracker` to use as a context manager; read its numbers inside or after.

    Raises:
        RuntimeError: if another tracker is already active (nesting is not supported).

    Example:
        >>> with hr.track_memory(model=model, optimizer=opt) as mem:
        ...     model(x).sum().backward(); opt.step()
        >>> mem.peak, mem.peak_by_category["activations"]
        >>> mem.report(); mem.plot("memory.png")
    """
    return MemoryTracker(
        model=model, optimizer=optimizer, max_samples=max_samples, sample_allocator=sample_allocator
    )


def annotate(tensor: torch.Tensor, category: str) -> None:
    """Tell the active tracker (if any; else a no-op) which category ``tensor``'s storage is.

    Raises:
        ValueError: if ``category`` is not a known category.
    """
    category_index(category)
    tracker = _active
    if tracker is not None:
        tracker.annotate(tensor, category)


def note_resting(where: str, category: str, nbytes: int) -> None:
    """Tell the active tracker (if any; else a no-op) that ``nbytes`` of ``category`` now rest
    in a store (``where``: ``"host"`` or ``"disk"``); negative when they come back or are dropped.

    Raises:
        ValueError: if ``category`` is not a known category or ``where`` is not a store kind.
    """
    category_index(category)
    if where not in ("host", "disk"):
        raise ValueError(f"where must be 'host' or 'disk', got {where!r}")
    tracker = _active
    if tracker is not None and tracker._state == "active":
        tracker._rest(where, category, nbytes)
