"""When offloaded parameters move: the forward and backward hooks of an offloaded model.

A group's forward pre-hook makes it resident and shows its device copies, its post-hook hides
and releases it; a hook on its outputs fetches it again before its backward, and it is released
once all its gradients (with frozen parameters, its input gradients too) are in.

[Note: resting state] Outside forward and backward an offloaded model's modules hold the masters
and no device copy holds memory, except blocks announced with `hr.prefetch` (resident, not shown;
dropped by failures, released before an optimizer step when they have a gradient). Every path
out of a forward or backward, failures included, returns there, so an optimizer step never
runs with stale device copies: at once where headroom sees the failure (the guarded root or a
block, `headroom.residency._guard`, or its backward hooks), else at the next forward or
``named_parameters()`` (`Offload.abort_forward`, `Offload.abort_backward`, `Offload.settle`).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from headroom.memory import annotate
from headroom.residency import _events
from headroom.residency._adopt import _LIVE, rescan, sync_masters
from headroom.residency._dtensor import refuse_conversion
from headroom.residency._group import Group, Residency, Slot, hide, show
from headroom.residency._meta import init_pending
from headroom.residency._packed import Packed, read_parts, state_entries
from headroom.residency._use import Use
from headroom.store import Store, StoreFullError, add_into, is_accelerator
from headroom.transfer import (
    GradSource,
    ParamBinding,
    StoreTensor,
    grad_ready,
    is_stored_grad,
    stored_view,
    stream_module,
    value_edits,
)

__all__ = ["Offload", "in_backward"]


def in_backward() -> bool:
    """True inside an autograd backward pass (e.g. during a checkpoint's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _outputs(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        # objects pytree does not know (some model-output classes): walked by hand
        leaves = []
        stack = [output]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                leaves.append(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif hasattr(x, "__dict__") and not isinstance(x, nn.Module):
                stack.extend(vars(x).values())
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class _AfterBackward(torch.autograd.Function):
    """Identity on a block's inputs whose backward reports that their gradients are done."""

    @staticmethod
    def forward(ctx, callback, *xs):
        ctx.callback = callback
        outs = tuple(x.view_as(x) for x in xs)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


@dataclass(eq=False, slots=True)
class _GroupRole:
    """A block's side of the guard protocol (`headroom.residency._guard.Role`)."""

    state: Offload
    block: Group

    def __deepcopy__(self, memo):
        return self  # see Offload.__deepcopy__

    def call_failed(self, module: nn.Module) -> None:
        self.state.abort_forward(self.block)

    def apply(self, module: nn.Module, fn: Any, recurse: bool, base: Any) -> nn.Module:
        return self.state.apply(module, fn, recurse, base)

    def settle(self) -> None:
        self.state.settle()


class Phase(enum.Flag):
    """Where an offloaded model is in its step ([Note: resting state]); ``FORWARD`` and
    ``BACKWARD`` can hold together (a recomputation inside a backward, and the reverse)."""

    RESTING = 0  # outside forward and backward: modules hold the masters
    FORWARD = enum.auto()  # the root's or some block's forward is running
    BACKWARD = enum.auto()  # a backward through the model has not ended


@dataclass
class _Held:
    """``slot``'s gradient summed on the device (``acc``, in the stored dtype) across backward
    passes, not yet in the store; ``fresh``: it replaces the stored one (cleared since), else
    is added; ``stream``: where it was formed (the hand-over is ordered after it)."""

    slot: Slot
    acc: torch.Tensor
    fresh: bool
    stream: Any = None


class Offload:
    """Per-model state: blocks, the mover and every hook (removed again by `unoffload`)."""

    def __deepcopy__(self, memo):
        # NOTE: a copied module (PEFT's modules_to_save) copies its hooks, whose arguments lead
        # here: shared, not copied with the store (guarded modules drop them, `_guard`).
        return self

    @property
    def phase(self) -> Phase:
        """The model's `Phase` now."""
        p = Phase.RESTING
        if self.in_forward:
            p |= Phase.FORWARD
        if self._bwd:
            p |= Phase.BACKWARD
        return p

    @property
    def in_forward(self) -> bool:
        """A forward of the root or of some block is running."""
        return bool(self._root_running or self._active)

    @property
    def busy(self) -> bool:
        """Inside a forward or a backward: not resting."""
        return bool(self._bwd or self._root_running or self._active)

    def __init__(self, model: nn.Module, device: torch.device, store: Store, prefetch: int,
                 compute_dtype: torch.dtype | None, grad_accumulation: str = "store") -> None:
        self.model = model
        self.device = device
        self.store = store
        self.res = Residency(device, store)
        self.prefetch = prefetch
        self.compute_dtype = compute_dtype
        self.plan = None  # the OffloadPlan applied (set by hr.offload)
        self.blocks: list[Group] = []
        self.rest = Group("(outside blocks)", None)
        self.slots: list[Slot] = []
        self.claims: set[str] = set()  # the store keys this model holds (claimed_keys)
        self.by_dev: dict[int, Slot] = {}
        self.by_param: dict[int, Slot] = {}
        self.packed: list[Packed] = []
        self.by_packed: dict[int, Packed] = {}  # by its master's and device copy's id
        self.adapters = "store"  # "device": adapters stay there, in `kept` (id -> parameter)
        self.kept: dict[int, nn.Parameter] = {}
        self.handles: list[Any] = []
        self.order: list[Group] = []  # forward order of the last forward
        self._order_now: list[Group] = []
        self._root_running = False
        self._active: list[list] = []  # [block, watched] of block forwards in progress
        self._bwd = False
        self._bwd_task = -1
        self._bwd_seen: set[int] = set()
        self._bypass: list[str] = []
        # [Note: uses outside a block] (_outside.py): groups read outside their forward, kept
        # until the backward ends; a forward with gradients awaiting its backward; masters only.
        self._outside: dict[int, Group] = {}
        self._awaiting = False
        self._masters_only = 0
        # device copies handed out by `use_outside`: id -> (slot, requires_grad then)
        self._handed: dict[int, tuple[Slot, bool]] = {}
        self.buffers: list[str] = []
        # modules with parameters or buffers created on meta and not filled yet (see _meta)
        self.pending_modules: dict[int, nn.Module] = {}
        self.module_names: dict[int, str] = {}
        # `hr.prefetch`'s blocks for the next forward: resident until a forward uses them, a
        # new announcement, an optimizer step that may change them, or a failure drops them
        self.announced: list[Group] = []
        self._marks: dict[int, tuple] = {}  # announced slot id -> `_mark` at its fetch
        self.used_listeners: list[Any] = []  # told the blocks a forward used (data_parallel)
        self.ddp_allowed = False  # set by hr.data_parallel: DDP may wrap this model
        self._refetch = False
        self.use = Use()  # one forward or backward at a time across threads
        self.grad_accumulation = grad_accumulation  # "device": sums held there (`_Held`)
        self._inert_warned = False  # `_warn_inert` said once
        self._held: dict[int, _Held] = {}
        self._held_lock = threading.Lock()
        # slots whose held sums were handed over since the last successful wait, and those
        # whose sum went down with a failed write (their stored gradient is stale)
        self._unconfirmed: set[int] = set()
        self._lost: dict[int, str] = {}
        self._streams = stream_module(device) if is_accelerator(device) else None
        # torch.autograd.grad over masters running (`_autograd`); slots hooked for captures
        self.captures_in_flight = 0
        self._capture_hooked: set[int] = set()
        self._capture_lock = threading.Lock()
        self._sparse_raw: dict[int, torch.Tensor] = {}  # as autograd hands them (`_keep_raw`)
        self._sparse_hooked: set[int] = set()
        _LIVE.add(self)

    def _prefetch(self, order: list[Group], start: int, step: int) -> None:
        i = start
        for _ in range(self.prefetch):
            i += step
            if not 0 <= i < len(order):
                return
            if step < 0 and id(order[i]) in self._bwd_seen:
                continue
            self.res.fetch(order[i])

    def _idle_release(self, b: Group) -> None:  # unless announced for the next forward
        if b not in self.announced:
            self.res.release(b)

    def announce(self, blocks: list[Group]) -> None:
        """The next forward uses ``blocks``: start fetching them, and drop older announcements."""
        # not taken inside this model's own backward, refused below
        taken = self.use.enter_short(wait_for_backward=True)
        try:
            if self.busy:
                raise RuntimeError(
                    "hr.prefetch was called during a forward or backward of the offloaded"
                    " model; announce the next batch's blocks between steps")
            old, self.announced = self.announced, []
            for b in old:
                if b not in blocks:
                    self.res.release(b)
            self.announced = list(dict.fromkeys(blocks))
            try:
                for b in self.announced:
                    self.res.fetch(b)
            except BaseException:
                self.drop_announced()
                raise
            self._note_marks()
        finally:
            if taken:
                self.use.exit_forward()

    def _mark(self, s: Slot) -> tuple:
        """What changes when ``s``'s master is written: the store's count of writes to it and,
        in host memory, its version counter and memory (in-place ops, ``.data =``)."""
        p = s.param
        edits = value_edits(self.store, s.binding.handle.key)
        if isinstance(p, StoreTensor) or p.device.type != "cpu":
            return (edits,)
        return (edits, p._version, p.data_ptr())

    def _note_marks(self) -> None:
        self._marks = {id(s): self._mark(s) for b in self.announced for s in b.slots}

    def _written_since_fetch(self, block: Group) -> bool:
        """Whether an announced block's masters were written since its fetch. On a CPU device
        the values are compared too: ``p.data`` in-place writes leave no other trace."""
        if any(self._marks.get(id(s)) != self._mark(s) for s in block.slots):
            return True
        if self.device.type != "cpu":
            return False
        self.res.ensure(block)
        return any(not isinstance(s.param, StoreTensor)
                   and not torch.equal(s.param.detach().to(s.dev.dtype), s.dev.detach())
                   for s in block.slots)

    def drop_announced(self) -> None:
        """Forget every announcement and release what it kept (values may change now)."""
        old, self.announced = self.announced, []
        for b in old:
            self.res.release(b, quiet=True)

    def init_pending(self, *, lost_ok: bool = False) -> None:
        """Adopt what joined the model (`_adopt`), then give values to what was created on
        meta (`_meta`); ``lost_ok``: leave adapters with lost values pending, not raise."""
        self._masters_only += 1  # initializers write the masters, never device copies
        try:
            rescan(self)
            if self.pending_modules:
                init_pending(self, lost_ok=lost_ok)
        finally:
            self._masters_only -= 1

    # ------------------------------------------------------------------ uses outside a block
    @property
    def reads_outside(self) -> bool:
        """Whether a module's read of a master now gets its device copy (`use_outside`)."""
        if self._masters_only:
            return False
        if self._root_running or self._active:
            return True
        if self._bwd:  # not once a backward broke off outside headroom's hooks
            return in_backward()
        return self._awaiting and torch.is_grad_enabled()

    def use_outside(self, value: Any) -> Any:
        """For a master read while the model is in use, its device copy, its group kept
        resident ([Note: uses outside a block]); anything else as it is."""
        slot = self.by_param.get(id(value))
        if slot is None:
            q = self.by_packed.get(id(value))
            if q is None or value is not q.param:
                return value
            self.res.ensure(q.group)
            self._keep_outside(q.group)
            return q.dev
        block = slot.group
        self.res.ensure(block)
        dev = slot.dev
        if dev.requires_grad != slot.param.requires_grad:
            dev.requires_grad_(slot.param.requires_grad)
        self._handed[id(dev)] = (slot, dev.requires_grad)
        self._keep_outside(block)
        return dev

    def keeps_place(self, old: torch.Tensor, new: torch.Tensor) -> bool:
        """Whether ``old``, a master of this model, stays in place of ``new`` (a ``meta``
        tensor ``Module._apply`` writes in; `_outside.ParamDict`)."""
        s = self.by_param.get(id(old)) or self.by_packed.get(id(old))
        if self.kept.get(id(old)) is old:
            pass  # an adapter kept on the device
        elif s is None or s.param is not old:
            return False  # not a master (a device copy being hidden: its master comes back)
        ours = (self.by_param, self.by_dev, self.by_packed)
        return not any(id(new) in d for d in ours) and tuple(old.shape) == tuple(new.shape) \
            and old.dtype == new.dtype

    def _keep_outside(self, block: Group) -> None:
        if id(block) not in self._outside:
            self._outside[id(block)] = block
            if torch.is_grad_enabled():
                for fn in self.used_listeners:  # hr.data_parallel syncs what was used
                    fn(block)
            if self._root_running and block is not self.rest and block not in self._order_now:
                self._order_now.append(block)  # prefetched there next time

    def _close_window(self) -> None:
        """The forward's reads outside their blocks are over: what was kept for them may go,
        and ``requires_grad_`` set on a device copy read then reaches its master."""
        self._outside = {}
        self._awaiting = False
        handed, self._handed = self._handed, {}
        for slot, rg in handed.values():
            if slot.dev.requires_grad != rg and slot.param.requires_grad == rg:
                slot.param.requires_grad_(slot.dev.requires_grad)

    # ------------------------------------------------------------------ failures
    def abort_forward(self, block: Group | None) -> None:
        """A forward (of the root when ``block`` is None) raised: back to the resting state. A
        block failing inside the root's forward releases itself (the caller may go on); else
        everything is released. Never raises (the error propagating is the one to report)."""
        if in_backward():
            # a recomputation (checkpointing; it may stop itself on purpose): the backward's
            # own clean-up covers it
            return
        if not self.use.try_enter():
            return  # another thread runs the model: this call failed before it started
        try:
            if block is not None:
                at = [i for i, (b, _) in enumerate(self._active) if b is block]
                found = bool(at)
                if found and self._active.pop(at[-1])[1]:  # its input gradients: not awaited
                    block.inputs_pending = max(0, block.inputs_pending - 1)
                hide(block)
                self.res.release(block, quiet=True)
                if self.in_forward:
                    if found:  # not exited by its post_forward yet
                        self.use.exit_forward()
                    return
            for b, watched in self._active:
                if watched:
                    b.inputs_pending = max(0, b.inputs_pending - 1)
            self._active = []
            self._root_running = False
            self._order_now = []
            self._drop_all()
        except BaseException as e:  # pragma: no cover - nothing above is expected to raise
            _warn_recovery(e)
        finally:
            self.use.exit_forward(whole=not self.in_forward)

    def abort_backward(self) -> None:
        """A backward broke off: release everything it held. Gradients already in the store
        stay visible, as in plain PyTorch. Never raises."""
        try:
            self._bwd = False
            self._bwd_task = -1
            self._bwd_seen = set()
            self._drop_all(pending=True)
            for _ in range(len(self.slots) + 1):  # let every gradient write in flight land
                try:
                    self.sync_grads()
                    break
                except Exception:
                    continue
        except BaseException as e:  # pragma: no cover - nothing above is expected to raise
            _warn_recovery(e)

    def _drop_all(self, *, pending: bool = False) -> None:
        """On a failure path: announcements forgotten, every group hidden and released
        (``pending``: its input gradients no longer awaited)."""
        self.announced = []
        self._close_window()
        for b in [*self.blocks, self.rest]:
            if pending:
                b.inputs_pending = 0
            hide(b)
            self.res.release(b, quiet=True)

    def _settle(self, *, keep_outside: bool = False) -> None:
        """Outside a backward: nothing of a forward or backward that broke off stays. Only
        leftovers are resident (e.g. `rest`, kept for a backward that never ran); a backward
        still to come re-fetches what it needs, but not what was read outside its block
        ([Note: uses outside a block]), kept with ``keep_outside``."""
        if self._bwd:  # one broke off without its final callback
            self.abort_backward()
            return
        keep = self._outside if keep_outside else {}
        self._close_window()
        self._outside = keep
        groups = [*self.blocks, self.rest]
        for b in [g for g in groups if id(g) not in keep] if keep else groups:
            self._idle_release(b)

    def settle(self) -> None:
        """Outside forward and backward: back to the resting state (a backward that broke off
        outside headroom's hooks, or never ran, is cleaned up)."""
        if in_backward() or not self.use.enter_short(wait_for_backward=True):
            return
        try:
            if not self.in_forward:
                self._settle(keep_outside=True)
        finally:
            self.use.exit_forward()

    def before_optimizer_step(self) -> None:
        """An optimizer is about to change masters: drop device copies a step would outdate."""
        # not waiting for a backward: HostOptimizer steps early in one, on its worker thread
        if not self.use.enter_short(wait_for_backward=False):
            return
        try:
            if self.busy:
                return  # mid-step (e.g. HostOptimizer stepping early on its worker thread)
            # a master rebound since (``p.data = t``) goes into the store now, or a step
            # through the store (HostOptimizer) would step the old value
            sync_masters(self)
            for b in [*self.blocks, self.rest]:
                # optimizers step only parameters with a gradient: an announced block
                # without any keeps valid device copies across the step
                if b in self.announced and not any(
                        s.param.grad is not None or s.binding.has_grad for s in b.slots):
                    continue
                self.res.release(b)
            self._refetch = True
        finally:
            self.use.exit_forward()

    def after_optimizer_step(self) -> None:
        """Fetch again what `before_optimizer_step` released of the announced blocks."""
        if not self.use.enter_short(wait_for_backward=False):
            return
        try:
            if not self._refetch or self.busy:
                return
            self._refetch = False
            for b in self.announced:
                self.res.fetch(b)
            self._note_marks()
        finally:
            self.use.exit_forward()

    # ------------------------------------------------------------------ guard protocol
    def call_failed(self, module: nn.Module) -> None:
        self.abort_forward(None)

    def apply(self, module: nn.Module, fn: Any, recurse: bool, base: Any) -> nn.Module:
        """``module._apply(fn)`` (``.to()``, ``.half()``, ...) on a guarded module: applied to
        what is not offloaded when it keeps the offloaded dtypes and device, else refused."""
        if self.busy:
            raise RuntimeError(
                "cannot move or convert an offloaded model during its forward or backward")
        refuse_conversion(fn, {s.binding.handle.dtype for s in self.slots}, self.device,
                          f"{type(module).__name__} is", "Use hr.offload(..., compute_dtype={})",
                          moves_ok=lambda d: _normalized(d) == self.device)
        keep = {id(t) for s in self.slots for t in (s.param, s.dev, s.param.grad, s.dev.grad)
                if t is not None}
        keep.update(i for q in self.packed for i in (id(q.param), id(q.dev)))
        # buffers still on meta stay pending: the move is to the offload's own device
        return base(module, lambda t: t if id(t) in keep or t.is_meta else fn(t), recurse)

    # ------------------------------------------------------------------ forward hooks
    def root_pre_forward(self, module, args, kwargs):
        if in_backward():
            self.res.ensure(self.rest)
            show(self.rest)
            return None
        self.use.enter_forward()  # waits while another thread runs the model
        self._settle()
        self.init_pending()
        _events.emit(_events.before_forward, self, module)
        self._root_running = True
        self._order_now = []
        self._active = []
        self.res.ensure(self.rest)
        show(self.rest)
        _sync_requires_grad(self.rest)  # requires_grad_() since hr.offload (freezing, PEFT)
        if torch.is_grad_enabled():
            for fn in self.used_listeners:
                fn(self.rest)
        self._prefetch(self.order or self.blocks, -1, 1)
        return None

    def root_post_forward(self, module, args, kwargs, output):
        if in_backward():
            return None
        self._root_running = False
        self.order = self._order_now or self.order
        outs = _outputs(output) if torch.is_grad_enabled() else []
        if not outs:
            self._close_window()
        for b in self.blocks:  # prefetched past the end, or skipped by this forward
            if id(b) not in self._outside and not (outs and b.free):  # else kept for backward
                self._idle_release(b)
        if outs:  # `rest` stays resident for backward; the modules hold the masters again
            hide(self.rest)
            self._awaiting = True
            hook = partial(self.pre_backward, self.rest)
            for t in outs:
                t.register_hook(hook)
        else:
            self.res.release(self.rest)
        self.use.exit_forward()
        return None

    def pre_forward(self, block: Group, module, args, kwargs):
        if in_backward():  # recomputation inside backward (activation checkpointing)
            self.res.ensure(block)
            show(block)
            return None
        self.use.enter_forward()  # nested in this thread's root forward, or waits
        # entered and listed together: the one exit is post_forward's or abort_forward's
        entry = [block, False]
        self._active.append(entry)
        if not self._root_running:  # called on its own, e.g. one head of a ModuleList
            _events.emit(_events.before_forward, self, module)
            if self._bwd:
                self.abort_backward()
            self.init_pending()
        if block in self.announced:
            self.announced.remove(block)  # the announcement is used up
            if self._written_since_fetch(block):
                self.res.release(block)  # fetched again below, with the written values
        if torch.is_grad_enabled():
            for fn in self.used_listeners:
                fn(block)
        self.res.ensure(block)
        show(block)
        _sync_requires_grad(block)
        self._order_now.append(block)
        order = self.order if block in self.order else self.blocks
        self._prefetch(order, order.index(block), 1)
        if torch.is_grad_enabled() and not block.free and (
                block.packed or any(not s.dev.requires_grad for s in block.slots)):
            new = self._watch_inputs(block, args, kwargs)
            entry[1] = new is not None
            return new
        return None

    def _watch_inputs(self, block: Group, args, kwargs):
        # With frozen parameters the block's backward is not over when its parameter gradients
        # are in (input gradients still need the frozen weights): held until those are done.
        idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.requires_grad]
        if not idx and not keys:
            return None
        block.inputs_pending += 1
        outs = _AfterBackward.apply(partial(self.inputs_done, block),
                                    *[args[i] for i in idx], *[kwargs[k] for k in keys])
        outs = outs if isinstance(outs, tuple) else (outs,)
        args = list(args)
        for j, i in enumerate(idx):
            args[i] = outs[j]
        kwargs = dict(kwargs)
        for j, k in enumerate(keys):
            kwargs[k] = outs[len(idx) + j]
        return tuple(args), kwargs

    def inputs_done(self, block: Group) -> None:
        block.inputs_pending = max(0, block.inputs_pending - 1)
        self._maybe_release(block)

    def _maybe_release(self, block: Group) -> None:
        if block is self.rest and (block.packed or any(not s.dev.requires_grad
                                                        for s in block.slots)):
            return  # frozen ones (a final norm under LoRA) may serve input gradients until the end
        if id(block) in self._bwd_seen and block.grads_left == 0 and block.inputs_pending == 0 \
                and id(block) not in self._outside:
            self.res.release(block)

    def post_forward(self, block: Group, module, args, kwargs, output):
        if in_backward():  # a recomputation: kept for its block's backward, which runs next
            return None
        found = False
        for i in range(len(self._active) - 1, -1, -1):
            if self._active[i][0] is block:
                del self._active[i]
                found = True
                break
        try:
            if torch.is_grad_enabled():
                hook = partial(self.pre_backward, block)
                for t in _outputs(output):
                    t.register_hook(hook)
            if id(block) in self._outside:
                pass  # kept for a use outside its forward
            elif block.free and torch.is_grad_enabled():
                hide(block)  # kept until the end of backward ([Note: shared device copies])
            else:
                self.res.release(block)
        finally:
            if found:
                self.use.exit_forward()
        return None

    # ------------------------------------------------------------------ backward hooks
    def pre_backward(self, block: Group, grad: torch.Tensor) -> None:
        try:
            self._pre_backward(block)
        except BaseException:
            self._abort_own_backward()
            raise

    def _pre_backward(self, block: Group) -> None:
        task = torch._C._current_graph_task_id()
        # keyed by the graph task: a backward that died half-way (no final callback) does not
        # leave the next one without its cleanup
        if not self._bwd or task != self._bwd_task:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "backward with create_graph=True (double backward, e.g. a gradient penalty)"
                    " through a model offloaded with hr.offload is not supported: device copies"
                    " are released after each block's backward, so the graph could not be"
                    " differentiated again. Use hr.unoffload, or a penalty with no second-order"
                    " gradient")
            # waits while another thread runs the model; the callback ends the use
            end = self.use.enter_backward(task, self.end_backward)
            if self._bwd:
                self.abort_backward()  # a backward that broke off without its final callback
            self._alloc_grads()
            self._bwd = True
            self._bwd_task = task
            self._bwd_seen = set()
            torch.autograd.Variable._execution_engine.queue_callback(end)
        if id(block) in self._bwd_seen:
            return
        self._bwd_seen.add(id(block))
        block.grads_left = sum(1 for s in block.slots if s.dev.requires_grad)
        self.res.ensure(block)
        # shown: checkpointing inside a block recomputes submodules without its pre-forward
        show(block)
        if block is not self.rest and block in self.order:
            self._prefetch(self.order, self.order.index(block), -1)

    def _abort_own_backward(self) -> None:
        """A hook of the running backward failed: clean up, if this backward runs the model
        (not one still waiting for another thread), and end its use."""
        task = torch._C._current_graph_task_id()
        if self.use.held_by(task):
            self.abort_backward()
            self.use.exit_backward(task)
        elif self.use.try_enter():  # failed before taking its turn, and nobody else runs
            try:
                self.abort_backward()
            finally:
                self.use.exit_forward()

    def _alloc_grads(self) -> None:
        """Room for every gradient this backward can produce, before any lands: a full store
        fails here with nothing written, not half-way."""
        with _masters_as_tensors():
            todo = [s for s in self.slots if s.dev.requires_grad and s.param.requires_grad
                    and s.binding.grad_handle is None]
        store = self.store
        try:
            store.reserve([s.binding.handle.numel * (s.binding.grad_dtype or s.binding.handle.dtype
                                                      ).itemsize for s in todo])
            for s in todo:
                s.binding.grad_handle = _grad_handle(store, s.binding)
        except StoreFullError as e:
            need = sum(s.binding.handle.nbytes for s in todo if s.binding.grad_handle is None)
            raise StoreFullError(
                f"no room for the gradients of this backward in {store!r}: {need} more bytes"
                f" needed ({e}). No gradient was written and the model is unchanged; free space"
                " or raise the store's max_bytes, then run the step again"
            ) from e

    def grad_hook(self, dev: torch.Tensor) -> None:
        try:
            with _masters_as_tensors():
                self._grad_hook(dev)
        except BaseException:
            self._abort_own_backward()
            raise

    def _grad_hook(self, dev: torch.Tensor) -> None:
        slot = self.by_dev[id(dev)]
        g = dev.grad
        dev.grad = None
        if g is None:
            return
        b = slot.binding
        p = slot.param
        if not p.requires_grad:
            # NOTE: frozen since forward: plain PyTorch's AccumulateGrad drops the gradient;
            # the device copy is the leaf here, so it is dropped here, bookkeeping going on
            self._grad_done(slot)
            return
        store = self.store
        self.adopt_grad(slot)  # a gradient assigned since: accumulate onto it, as torch does
        if b.grad_handle is None:
            b.grad_handle = _grad_handle(store, b)
        # a gradient on disk or in another dtype (fp32 for a bf16 parameter) cannot be
        # param.grad itself: that is a StoreTensor over the stored gradient
        host = store.host_tensor(b.grad_handle) if b.grad_handle.dtype == p.dtype else None
        cur = p.grad
        if isinstance(cur, StoreTensor) and not b.has_grad:
            cur = None  # our view of a stored gradient cleared since (a zero_ cut short)
        if g.is_sparse or (cur is not None and b.grad_sparse is not None):
            g = self._sparse_grad(slot, g, cur)  # a dense sum left to store, or None
            if g is not None:
                cur = None  # sparse + dense: the dense sum replaces the sparse gradient
        if g is None:
            pass  # kept in memory as a sparse gradient (`_sparse_grad`)
        elif host is None and self.grad_accumulation == "device":
            # held on the device: every read of the stored gradient hands the sum over first
            self._hold(slot, g, fresh=cur is None)
            b.has_grad = True
            if cur is None:
                p.grad = _stored_grad(p, b)
        else:
            if host is not None and self.grad_accumulation == "device" \
                    and not self._inert_warned:
                self._inert_warned = True
                _warn_inert(slot.name)
            self.res.push_grad(g, b, accumulate=cur is not None)
            if cur is None:  # zero_grad()'s None: overwritten, not accumulated
                p.grad = host if host is not None else _stored_grad(p, b)
        # post-accumulate-grad fires once per backward, after every use (tied weights too):
        # complete. Listeners are told (HostOptimizer may step at once), g dropped first.
        del g
        grad_ready(p)
        self._grad_done(slot)

    def watch_captures(self, slot: Slot) -> None:
        """Count ``slot``'s gradient as done when ``torch.autograd.grad`` captures it (its
        AccumulateGrad, and `_grad_hook`, do not run then)."""
        with self._capture_lock:  # one hook per device copy, whichever thread asks first
            if id(slot) in self._capture_hooked:
                return
            dev = slot.dev
            rg = dev.requires_grad
            dev.requires_grad_(True)
            self.handles.append(dev.register_hook(partial(self._captured, slot)))
            dev.requires_grad_(rg)
            self._capture_hooked.add(id(slot))

    def _captured(self, slot: Slot, grad: torch.Tensor | None) -> None:
        if not self.captures_in_flight or grad is None:
            return
        try:
            runs = torch._C._will_engine_execute_node(get_gradient_edge(slot.dev).node)
        except RuntimeError:  # NOTE: a captured leaf: no AccumulateGrad follows
            runs = False
        if not runs:
            self._grad_done(slot)

    def _grad_done(self, slot: Slot) -> None:
        """``slot``'s gradient of this backward is in: release its group once all are."""
        block = slot.group
        if id(block) in self._bwd_seen:
            block.grads_left -= 1
            if block.grads_left == 0 and any(s.dev.requires_grad for s in block.slots):
                self._maybe_release(block)

    def _sparse_grad(self, slot: Slot, g: torch.Tensor,
                     cur: torch.Tensor | None) -> torch.Tensor | None:
        """Accumulate a sparse gradient (``nn.Embedding(sparse=True)``) as autograd does;
        returns a dense sum still to be stored whole, else ``None``. It stays sparse in host
        memory (``binding.grad_sparse``, also ``param.grad``) in the parameter's dtype: a later
        sparse one is added in place, a dense one makes the sum dense; a dense stored gradient
        takes it in place."""
        # NOTE: not stored densely: torch's sparse steps differ bitwise from dense ones. How
        # `+=` lays out the sum depends on the tensor autograd handed over (a stored copy has
        # contiguous values): that one is kept for the sum (`_keep_raw`).
        b = slot.binding
        p = slot.param
        dtype = p.dtype
        raw = self._sparse_raw.pop(id(slot), None)
        if id(slot) not in self._sparse_hooked and g.is_sparse:
            slot.dev.register_hook(partial(self._keep_raw, id(slot)))
            self._sparse_hooked.add(id(slot))
        if b.grad_sparse is not None and cur is b.grad_sparse:
            if not g.is_sparse:  # sparse + dense: dense, as autograd sums them
                b.grad_sparse = None
                return g.to("cpu", dtype) + cur
            cur += (raw if raw is not None else g).to("cpu", dtype)
            return None
        g = g.to("cpu", dtype)
        if cur is None:
            b.grad_sparse = g
            b.has_grad = True
            b.grad_rows = None
            p.grad = g
            return None
        # a dense stored gradient: the sparse one is added into it, entry by entry
        self.flush_grads(slot)
        self._wait_landed()
        gh = b.grad_handle
        host = self.store.host_tensor(gh)
        with torch.no_grad():
            if host is not None:
                host.add_(g.to(gh.dtype))
            else:
                acc = self.store.read(gh).result()
                acc.add_(g.to(gh.dtype))
                self.store.write(gh, acc).result()
        return None

    def _keep_raw(self, key: int, g: torch.Tensor) -> None:
        """A device copy's tensor hook: keep a sparse gradient as autograd hands it over."""
        if g.is_sparse:
            self._sparse_raw[key] = g
        else:
            self._sparse_raw.pop(key, None)

    def _hold(self, slot: Slot, g: torch.Tensor, *, fresh: bool) -> None:
        """Add ``g`` to ``slot``'s sum held on the device (start it: ``fresh``, or none held),
        in the stored gradient's dtype: the sum the store would form."""
        dtype = slot.binding.grad_handle.dtype
        mod = self._streams
        stream = mod.current_stream(self.device) if mod is not None else None
        with self._held_lock:
            held = self._held.get(id(slot))
            if fresh:
                self._lost.pop(id(slot), None)  # the gradient starts afresh
            if held is None or fresh:
                if g.dtype == dtype and g.is_contiguous() and g._base is None:
                    acc = g  # autograd's, referenced nowhere else (not a view of a base)
                else:
                    acc = torch.empty(g.shape, dtype=dtype, device=g.device).copy_(g)
                annotate(acc, "gradients")  # a gradient, though no parameter's .grad
                self._held[id(slot)] = _Held(slot, acc, fresh, stream)
                return
            if stream is not None and held.stream is not stream:  # summed on another before
                stream.wait_stream(held.stream)
                held.acc.record_stream(stream)
                held.stream = stream
            with torch.no_grad():
                if held.acc.device.type == "cpu":
                    add_into(held.acc, g)  # bitwise add_, faster across dtypes
                else:
                    held.acc.add_(g)

    def flush_grads(self, slot: Slot | None = None) -> None:
        """Hand the sums held on the device (``slot``'s, or all) to the store, not waiting
        for them to land; one whose gradient was cleared since is dropped."""
        with self._held_lock:
            if slot is None:
                todo, self._held = list(self._held.values()), {}
            else:
                one = self._held.pop(id(slot), None)
                todo = [] if one is None else [one]
        for i, held in enumerate(todo):
            b = held.slot.binding
            if held.slot.param.grad is None or not b.has_grad or b.grad_handle is None:
                continue
            ctx = (self._streams.stream(held.stream) if held.stream is not None
                   else contextlib.nullcontext())
            try:
                with ctx:
                    self.res.push_grad(held.acc, b, accumulate=not held.fresh)
                with self._held_lock:
                    self._unconfirmed.add(id(held.slot))
            except BaseException:
                with self._held_lock:  # not handed over: held again, as they were
                    for h in todo[i:]:
                        self._held.setdefault(id(h.slot), h)
                raise

    def sync_grad_of(self, slot: Slot) -> None:
        """Wait until ``slot``'s gradient rests in the store, its held sum handed over first;
        raises if that sum was lost with a failed write (`_wait_landed`)."""
        self.flush_grads(slot)
        self._wait_landed()
        if id(slot) in self._lost:
            b = slot.binding
            if slot.param.grad is None or not b.has_grad:
                self._lost.pop(id(slot), None)  # cleared since: nothing to read
            else:
                raise RuntimeError(
                    f"the gradient of {slot.name!r} was lost: its sum held on the device"
                    f" failed to reach the store ({self._lost[id(slot)]}). Call zero_grad()"
                    " and run the iteration again")

    def _wait_landed(self) -> None:
        """`Mover.synchronize`, noting the held sums a failed write took with it (their
        stored gradients stay stale until cleared)."""
        try:
            self.res.mover.synchronize()
        except BaseException as e:
            with self._held_lock:
                gone, self._unconfirmed = self._unconfirmed, set()
            if gone:
                why = f"{type(e).__name__}: {e}"
                self._lost.update(dict.fromkeys(gone, why))
                if hasattr(e, "add_note"):
                    e.add_note(
                        f"headroom: {len(gone)} gradient sum(s) held on the device went with"
                        " the failed write: call zero_grad() and run the iteration again")
            raise
        with self._held_lock:
            self._unconfirmed.clear()

    def end_backward(self) -> None:
        self._bwd = False
        self._bwd_seen = set()
        self._close_window()
        for b in self.blocks:
            b.inputs_pending = 0
            self._idle_release(b)
        self.res.release(self.rest)
        self._wait_landed()  # what was handed over lands; what is held stays held
        if self._bypass:
            names, self._bypass = self._bypass, []
            raise RuntimeError(
                f"parameter(s) {sorted(set(names))} were used while the model was at rest"
                " (outside its forward, and not between a forward and its backward), so their"
                " gradient bypassed the store and is wrong. Read them from their module during"
                " the forward or before its backward, or call the module rather than holding"
                " the parameter object")

    def sync_grads(self) -> None:
        """Wait until every gradient so far rests in the store, held sums handed over first."""
        self.flush_grads()
        self._wait_landed()

    def read_grad(self, slot: Slot) -> torch.Tensor | None:
        """The slot's gradient as a host tensor (the store's own, or a copy from disk), or
        ``None``."""
        self.adopt_grad(slot)
        b = slot.binding
        if slot.param.grad is None or b.grad_handle is None:
            return None
        if b.grad_sparse is not None:
            raise NotImplementedError(
                f"the gradient of {slot.name!r} is sparse (nn.Embedding(sparse=True)), which"
                " hr.data_parallel does not average; use sparse=False for the offloaded"
                " modules of a data-parallel model")
        self.sync_grad_of(slot)  # only this one's: the others may still be summing
        host = self.store.host_tensor(b.grad_handle)
        return host if host is not None else self.store.read(b.grad_handle).result()

    def adopt_grad(self, slot: Slot) -> None:
        """Make the stored gradient what ``param.grad`` says if it changed since backward: an
        assigned tensor is stored; ``None`` clears it, with any sum held on the device."""
        b = slot.binding
        cur = slot.param.grad
        if cur is None:
            if b.has_grad:
                with self._held_lock:
                    self._held.pop(id(slot), None)
                b.has_grad = False
                b.grad_rows = None
                b.grad_sparse = None
            return
        if is_stored_grad(cur, b):
            return
        with self._held_lock:  # replaced whole: a sum held on the device is dropped
            self._held.pop(id(slot), None)
        self.put_grad(slot, cur.detach())

    def put_grad(self, slot: Slot, value: torch.Tensor) -> None:
        """Make ``value`` (a host tensor) the slot's whole gradient, as a backward leaves it."""
        b = slot.binding
        p = slot.param
        self.flush_grads(slot)  # replaced whole: its held sum (if any) is read already
        self._wait_landed()
        if value.is_sparse:  # kept sparse, as torch keeps it (see `_sparse_grad`)
            b.grad_sparse = value.to("cpu", p.dtype)
            b.has_grad = True
            b.grad_rows = None
            p.grad = b.grad_sparse
            return
        b.grad_sparse = None
        if b.grad_handle is None:
            b.grad_handle = _grad_handle(self.store, b)
        gh = b.grad_handle
        host = self.store.host_tensor(gh)
        if host is not None:
            if host.data_ptr() != value.data_ptr():
                host.copy_(value)
        else:
            self.store.write(gh, value.to("cpu", gh.dtype).contiguous()).result()
        b.has_grad = True
        b.grad_rows = None
        if host is not None and gh.dtype == p.dtype:
            p.grad = host
        elif p.grad is None or not is_stored_grad(p.grad, b):
            p.grad = _stored_grad(p, b)

    def bypass_hook(self, name: str, p: torch.Tensor) -> None:
        self._bypass.append(name)

    # ------------------------------------------------------------------ state dict
    def state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        if self.pending_modules:  # once per module: not the whole-model check of init_pending
            init_pending(self, lost_ok=True)
        for attr, t in module._parameters.items():
            key = prefix + attr
            slot = self.by_dev.get(id(t)) or self.by_param.get(id(t))
            q = self.by_packed.get(id(t))
            if key not in state_dict:
                continue
            # (a packed master over the store's own memory gave its values already)
            if q is not None and any(self.store.host_tensor(h) is None
                                     for h in q.handles.values()):
                state_dict.update(state_entries(q, read_parts(q, self.store), prefix, attr))
            if slot is None:
                continue
            sync_masters(self, [slot])
            h = slot.binding.handle
            if not slot.binding.has_value:  # no value anywhere (see _meta): not made up
                state_dict[key] = torch.empty(h.shape, dtype=h.dtype, device="meta")
                continue
            host = self.store.host_tensor(h)
            state_dict[key] = host if host is not None else self.store.read(h).result()

    def load_state_dict_pre_hook(self, module, state_dict, prefix, *args) -> None:
        if any(id(t) in self.by_packed and prefix + a in state_dict
               for a, t in module._parameters.items()):
            # the loader writes the master's parts, the store's: prefetched copies go stale
            self.drop_announced()
            self.res.mover.wait_reads()
        for attr, t in module._parameters.items():
            slot = self.by_dev.get(id(t)) or self.by_param.get(id(t))
            key = prefix + attr
            if slot is None or key not in state_dict:
                continue
            value = state_dict[key]
            h = slot.binding.handle
            if tuple(value.shape) != h.shape:
                continue  # the default loader reports the mismatch
            if self.announced:
                self.drop_announced()  # their device copies would hold the old values
            self.res.mover.wait_reads()  # a fetch ahead may still read the master
            self.store.write(h, value.detach().to("cpu", h.dtype).contiguous()).result()
            slot.binding.has_value = True
            # the default loader then copies into what the module holds: made a no-op
            cur = module._parameters[attr]
            if cur.device.type == "meta":
                state_dict[key] = torch.empty(h.shape, dtype=h.dtype, device="meta")
            else:
                state_dict[key] = cur.detach()


# NOTE: masters catch torch.autograd.grad in __torch_function__ (see _autograd), which every
# read and op of theirs goes through; headroom's own reads skip it.
_masters_as_tensors = torch._C.DisableTorchFunctionSubclass


def _sync_requires_grad(group: Group) -> None:
    """Give the group's device copies their masters' ``requires_grad``."""
    with _masters_as_tensors():
        for s in group.slots:
            if s.dev.requires_grad != s.param.requires_grad:
                s.dev.requires_grad_(s.param.requires_grad)


def _stored_grad(p: torch.Tensor, b: ParamBinding) -> torch.Tensor:
    """``p.grad`` for a gradient that rests on disk or in another dtype than ``p``."""
    return stored_view(GradSource(b), tuple(p.shape), dtype=p.dtype, device=p.device)


def _grad_handle(store: Store, b: ParamBinding):
    """The store's gradient tensor for ``b`` (in ``b.grad_dtype``), existing or new."""
    h = b.handle
    key = f"{h.key}.grad"
    dtype = b.grad_dtype or h.dtype
    if key in store:
        gh = store.get(key)
        if gh.dtype == dtype:
            return gh
        store.free(gh)  # allocated for another dtype and not in use (b.grad_handle was None)
    return store.alloc(key, h.shape, dtype)


def _normalized(device: torch.device) -> torch.device:
    if device.type not in ("cpu", "meta") and device.index is None:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def _warn_recovery(e: BaseException) -> None:  # pragma: no cover - defensive
    warnings.warn(
        f"headroom could not fully restore an offloaded model after a failed forward/backward"
        f" ({type(e).__name__}: {e}); call hr.unoffload(model) and offload it again",
        RuntimeWarning,
        stacklevel=3,
    )


def _warn_inert(name: str) -> None:
    warnings.warn(
        f"hr.offload(grad_accumulation='device'): the gradient of {name!r} (and any like it) is"
        " summed in host memory all the same: param.grad is that host tensor, whose reads"
        " cannot wait for a sum held elsewhere. Sums are held on the device for gradients on a"
        " DiskStore, and the fp32 gradients hr.HostOptimizer keeps for bf16/fp16 parameters",
        UserWarning, stacklevel=4)
