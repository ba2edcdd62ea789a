"""`HostOptimizer`: optimizer state and the step off the device, overlapped with backward.

fp32 masters, gradients and optimizer state rest in host memory (state also on disk), where
PyTorch's own optimizer steps them, block by block as gradients arrive.
"""

from __future__ import annotations

import contextlib
import errno
import sys
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from headroom.memory import annotate
from headroom.optim import _state
from headroom.optim._entries import (
    ALIAS,
    BOUND,
    FUSED_DEFAULT,
    HOSTED,
    LAZY,
    MASTER_DTYPES,
    Entry,
    check_class,
    probe_cpu,
    want_fp32_grad,
)
from headroom.optim._follow import follow_, follow_stored, init_stored, written_mark
from headroom.optim._overlap import Overlap
from headroom.optim._plan import (
    Guard,
    Home,
    Master,
    Rest,
    Run,
    StepPlan,
    may_write_disk,
    plan_entry,
    plan_step,
)
from headroom.optim._sliced import (
    ELEMENTWISE,
    SPARSE_COALESCED,
    SlicedParam,
    SliceRunner,
    _rows_per_slice,
    ctor_kwargs,
    probe_shaped,
)
from headroom.optim._undo import DeferInterrupt, Txn
from headroom.store import SCRATCH, Handle, Store, StoreFullError, resolve_store
from headroom.transfer import (
    GradSource,
    ListenerHandle,
    Mover,
    ParamBinding,
    StoreTensor,
    adopt_grad,
    binding,
    flush_grad,
    is_stored_grad,
    sync_grad,
    value_edits,
    weak_method,
    weak_post_accumulate_grad_hook,
)

__all__ = ["HostOptimizer", "HostOptimizerOptions"]


def _remove_all(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()
    hooks.clear()

def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s values are (a DTensor's: its local shard's); -1: not in memory."""
    local = t._local_tensor if _is_dtensor(t) else t
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:
        return -1


def _sparse_state_keys(cls: type[torch.optim.Optimizer], hp: dict[str, Any], *,
                       unfused: bool) -> tuple[str, ...]:
    """The state keys ``cls`` keeps sparse for a sparse gradient under ``hp`` (from a tiny
    step); ``()`` also where it refuses sparse gradients (the step then raises its reason)."""
    kw = ctor_kwargs(cls, hp)
    if unfused and kw.get("fused"):
        kw["fused"] = False
    p = torch.zeros(2, 3)
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 3), (2, 3),
                                     check_invariants=False)
    try:
        opt = cls([p], **kw)
        opt.step()
    except Exception:  # noqa: BLE001 - the real step reports it
        return ()
    return tuple(k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.is_sparse)


def _is_dtensor(p: object) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(p, mod.DTensor)


class _Kept(Exception):  # noqa: N818 - carries an error raised with the step left as it is
    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


@dataclass(frozen=True)
class HostOptimizerOptions:
    """How a `HostOptimizer` was configured (``opt.options``), as data."""

    optimizer_class: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    state_store: str | Store
    overlap: bool
    slice_bytes: int
    bucket_bytes: int
    atomic: bool = True


class HostOptimizer(torch.optim.Optimizer):
    """A ``torch.optim`` optimizer whose state and step live in host memory (or on disk).

    Each parameter gets an fp32 master in host memory (a CPU fp32 parameter is its own);
    its gradient moves there as soon as autograd completes it; ``optimizer_class`` steps the
    master, bitwise as on CPU tensors, and the result is copied back (offloaded parameters:
    through their store). ``param.grad`` reads the host gradient the step uses (fp32, a
    `headroom.transfer.StoreTensor`), so ``clip_grad_norm_``, ``GradScaler`` and LR
    schedulers work as usual. See docs/host_optimizer.md.

    Args:
        params: parameters or parameter groups, as for any ``torch.optim`` optimizer. All on
            one device (store-resident parameters count as on their compute device).
        optimizer_class: any ``torch.optim.Optimizer`` subclass that runs on the CPU; Adam,
            AdamW and Adagrad without ``fused`` or ``foreach`` get the fused CPU kernel
            (bitwise ``fused=True``; torch's default only to rounding: ``fused=False`` for it).
        state_store: where optimizer state rests: ``"cpu"`` (host memory, the fastest), or a
            `Store` such as ``headroom.DiskStore(path)``, streamed through the step in slices
            (each state tensor read and written once per step; element-wise optimizers only).
        overlap: inside `final_backward` (the last backward before ``step()``), step each
            parameter on a worker thread as soon as its gradient is complete; ``step()``
            steps the rest. Bitwise ``overlap=False``; inside, gradients are final (no
            `clip_grad_norm_`, no further backward, hyperparameters set before backward).
        row_sparse: parameters (2-D or more: embeddings, huge classifiers) stepped by *lazy
            Adam* (Adam, AdamW): only rows with a non-zero gradient are read, updated and
            written; other rows' moments are not decayed and get no weight decay.
        slice_bytes: fp32 bytes of one slice in the sliced (disk) step. Larger slices amortize
            per-call costs; smaller ones bound the host memory in flight (about 8 slices).
        bucket_bytes: with ``overlap``, parameters are bucketed in last iteration's gradient
            order, about this many fp32 bytes each; a bucket steps once all its gradients are
            in. Smaller buckets overlap more; each costs a hand-off to the worker.
        atomic: a step that fails part-way (a disk error) is undone: what it overwrites in
            host memory keeps its old values (on a disk the step writes anyway) until it ends.
            ``False``: no such copies (bf16 parameters on a `DiskStore`, state in host memory:
            12 of 18 bytes written per parameter and step saved); a failure while host memory
            is updated then leaves a mix, and ``step()`` refuses until a checkpoint is loaded.
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr``, ``betas``, ...).

    Raises:
        TypeError: ``optimizer_class`` is not a ``torch.optim.Optimizer`` subclass.
        ValueError: parameters on more than one device; an optimizer that cannot run on the
            CPU (or refuses the options: torch's reason); ``differentiable=True``;
            ``state_store``/``row_sparse`` with an optimizer they cannot support.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        >>> with opt.final_backward():  # optional: step each parameter during backward
        ...     model(torch.randn(3, 4)).sum().backward()
        >>> opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        state_store: str | Store = "cpu",
        overlap: bool = True,
        row_sparse: Iterable[torch.Tensor] = (),
        slice_bytes: int = 16 << 20,
        bucket_bytes: int = 32 << 20,
        atomic: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        check_class(optimizer_class)
        kwargs = dict(optimizer_kwargs)
        if kwargs.get("differentiable"):
            raise ValueError(
                f"{optimizer_class.__name__}(differentiable=True) records its step in autograd's"
                " graph, to differentiate through it; HostOptimizer steps fp32 masters in host"
                " memory outside autograd, so there would be no graph. Drop differentiable=True,"
                " or use the torch optimizer itself for steps to differentiate through")
        # NOTE: the fused kernel refuses sparse gradients: where it was chosen here, not asked
        # for, they step in torch's default implementation (`_inner_step`, `SliceRunner`).
        self._unfuse_sparse = (optimizer_class in FUSED_DEFAULT and "fused" not in kwargs
                               and "foreach" not in kwargs)
        if self._unfuse_sparse:
            kwargs["fused"] = True
        defaults = probe_cpu(optimizer_class, kwargs)
        if slice_bytes <= 0 or bucket_bytes <= 0:
            raise ValueError(
                f"slice_bytes and bucket_bytes must be positive, got {slice_bytes}, {bucket_bytes}")
        if not isinstance(atomic, bool):
            raise TypeError(f"atomic must be True or False, got {atomic!r}")
        self.options = HostOptimizerOptions(
            optimizer_class, dict(kwargs), state_store if isinstance(state_store, Store) else "cpu",
            bool(overlap), slice_bytes, bucket_bytes, atomic)
        self._atomic = atomic
        self._bucket_bytes = bucket_bytes
        self._cls = optimizer_class
        self._kwargs = kwargs
        self._overlap = Overlap(lambda batch, **kw: self._step_entries(batch, **kw),
                                self._hparams, enabled=bool(overlap), bucket_bytes=bucket_bytes,
                                failed_backward=self._failed_backward)
        self._row_sparse_ids = {id(p) for p in row_sparse}
        if self._row_sparse_ids and optimizer_class not in LAZY:
            raise ValueError(
                f"row_sparse needs Adam or AdamW (lazy Adam), got {optimizer_class.__name__};"
                " drop row_sparse to step those parameters densely"
            )
        if isinstance(state_store, str):
            if state_store not in ("cpu", "host"):
                resolve_store(state_store)  # raises the standard message
            self._state_store: Store | None = None
        elif isinstance(state_store, Store):
            self._state_store = state_store
        else:
            raise TypeError(
                f"state_store must be 'cpu' or a store such as headroom.DiskStore(path), got"
                f" {state_store!r}"
            )
        if self._state_store is not None and optimizer_class not in ELEMENTWISE:
            raise ValueError(
                f"state_store={self._state_store!r} steps the state in slices, which is exact "
                f"only for element-wise optimizers ({', '.join(c.__name__ for c in ELEMENTWISE)})"
                f"; {optimizer_class.__name__} needs state_store='cpu'"
            )
        self._entries: dict[int, Entry] = {}
        self._order: list[Entry] = []
        self._device: torch.device | None = None
        self._inner: torch.optim.Optimizer | None = None
        self._inner_index: dict[int, int] = {}  # outer group -> inner group position
        self._host: Store | None = None  # host masters/gradients of HOSTED parameters
        self._aux: Store | None = None  # handle-based state when state_store is "cpu"
        self._mover: Mover | None = None
        self._tickets_lock = threading.Lock()  # copy-backs come from the worker thread too
        self._slicer = SliceRunner(optimizer_class, slice_bytes=slice_bytes,
                                   unfuse_sparse=self._unfuse_sparse)
        self._shaped_keys: dict[int, tuple[str, ...]] = {}
        self._arrival: list[Entry] = []  # first-gradient order in this iteration
        self._masters_loaded: set[int] = set()  # entries whose master load_state_dict set
        self._tickets: list[Any] = []
        self._hooks: list[Any] = []
        # an optimizer dropped without close() leaves no (dead) hooks on the parameters
        weakref.finalize(self, _remove_all, self._hooks)
        self._key_prefix = f"hr-opt-{id(self):x}"
        self._group_params: list[tuple[int, ...]] = []  # ids of each group's params, as added
        self._txn: Txn | None = None  # what the step in progress changed, see _undo.py
        self._defer: DeferInterrupt | None = None  # Ctrl-C handling of the running step()
        self._keep_early = False  # keep copies of in-memory state stepped in final_backward
        self._hosted_followed = False  # host masters followed their parameters this iteration
        self._torn: str | None = None  # a failed step could not be undone (the message)
        super().__init__(params, defaults)
        self.state = defaultdict(dict)  # a live view, filled by _refresh_state_view

    # ------------------------------------------------------------------ setup
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (same contract as ``torch.optim.Optimizer.add_param_group``)."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is not None and not isinstance(params, (torch.Tensor, set)):
            params = list(params)
            param_group = {**param_group, "params": params}
            if len({id(p) for p in params}) != len(params):
                raise ValueError(
                    "a parameter is listed twice in one parameter group; HostOptimizer would "
                    "step it once where torch.optim steps it twice. List each parameter once")
        if self._state_store is not None and params is not None and any(
                _is_dtensor(p) and self._binding(p) is None for p in params):
            raise NotImplementedError(
                f"state_store={self._state_store!r} with sharded (FSDP2) parameters in host"
                " memory is not supported; use state_store='cpu', or offload the shards to a"
                " disk too (hr.offload(model, store=hr.DiskStore(path)))")
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        entries = []
        try:
            self._reserve_host(group["params"])
            for p in group["params"]:
                entries.append(self._make_entry(p, gi, len(self._order) + len(entries)))
        except BaseException:
            self.param_groups.pop()
            for e in entries:  # give back the host masters already made
                if e.own is not None:
                    self._host.free(e.own.handle)
                    self._host.free(e.own.grad_handle)
            raise
        self._entries.update((id(e.param), e) for e in entries)
        self._order += entries
        masters = [e.master for e in entries if not e.streamed]
        hp = {k: v for k, v in group.items() if k != "params"}
        if masters:
            if self._inner is None:
                self._inner = self._cls([{**hp, "params": masters}], **self._kwargs)
            else:
                self._inner.add_param_group({**hp, "params": masters})
            self._inner_index[gi] = len(self._inner.param_groups) - 1
        self._group_params.append(tuple(id(p) for p in group["params"]))
        for e in entries:
            self._hook(e)

    def _hook(self, e: Entry) -> None:
        """Listen for ``e``'s completed gradients (once it can have any)."""
        if e.hooked:
            return
        if e.kind == BOUND and not e.sharded:
            # The offload layer, not autograd on this tensor, says when its gradient is in
            # the store (`on_grad_ready`). Held weakly, as the hook below: parameters outlive
            # an optimizer dropped and made again, and must not keep it alive.
            fn = weak_method(self._on_grad)
            e.bound.listeners.append(fn)
            self._hooks.append(ListenerHandle(e.bound, fn))
        elif e.param.requires_grad:
            self._hooks.append(weak_post_accumulate_grad_hook(e.param, self._on_grad))
        else:
            return  # frozen: no gradient (like torch.optim, it is skipped); hooked if unfrozen
        e.hooked = True

    def _check_groups(self) -> None:
        """Refuse parameter lists changed behind its back; hook parameters unfrozen since."""
        now = [tuple(id(p) for p in g["params"]) for g in self.param_groups]
        if now != self._group_params:
            pairs = zip(now, self._group_params, strict=False)
            gi = next((i for i, (a, b) in enumerate(pairs) if a != b),
                      min(len(now), len(self._group_params)))
            raise RuntimeError(
                f"param_groups[{gi}]['params'] was changed after the parameters were added "
                "(or groups were removed), which HostOptimizer cannot follow. Nothing was "
                "stepped. Use opt.add_param_group({'params': [...]}), or build a new "
                "HostOptimizer (moving state with state_dict())")
        for e in self._order:
            b = self._binding(e.param)
            if e.kind == ALIAS and b is None and _storage(e.master) != _storage(e.param):
                raise RuntimeError(
                    f"the data of a parameter of shape {tuple(e.param.shape)} was replaced"
                    " after this HostOptimizer was built (hr.offload of an FSDP2 model, or"
                    " p.data = ...): it would step the old data. Nothing was stepped; build"
                    " the HostOptimizer after the change")
            if (b is not None) != (e.kind == BOUND) or (b is not None and b is not e.bound):
                raise RuntimeError(
                    f"a parameter of shape {tuple(e.param.shape)} was "
                    + ("offloaded with hr.offload" if b is not None else "unoffloaded")
                    + " after this HostOptimizer was built, which planned its step for where"
                    " it rested then. Nothing was stepped; build the HostOptimizer after"
                    " hr.offload (and again after hr.unoffload), moving the state over with"
                    " new.load_state_dict(old.state_dict())")
            if not e.hooked:
                self._hook(e)

    def _reserve_host(self, params: list[torch.Tensor]) -> None:
        """Room for a group's HOSTED masters and gradients, from one page-locked slab."""
        hosted = [p for p in params if isinstance(p, torch.Tensor) and p.is_floating_point()
                  and self._binding(p) is None
                  and not (self._on_cpu(p) and p.dtype in MASTER_DTYPES)]
        devices = {p.device for p in hosted}
        if len(devices) != 1 or (self._device is not None and self._device not in devices):
            return  # nothing, or a mistake `_make_entry` reports
        self._open_host(hosted[0].device)
        self._host.reserve([p.numel() * (8 if p.dtype == torch.float64 else 4)
                            for p in hosted for _ in range(2)])

    # NOTE: the three seams a dry run (`headroom.optim._dry`) replaces: where a parameter is
    # bound to a store, whether it rests in host memory, and the host store with its mover.
    _binding = staticmethod(binding)

    @staticmethod
    def _on_cpu(p: torch.Tensor) -> bool:
        """Whether ``p`` (not offloaded) is in host memory."""
        return p.device.type == "cpu"

    def _open_host(self, device: torch.device) -> None:
        if self._host is None:
            self._host = resolve_store("cpu", device)
            self._mover = Mover(device, self._host)

    def _make_entry(self, p: torch.Tensor, gi: int, index: int) -> Entry:
        if not isinstance(p, torch.Tensor) or not p.is_floating_point():
            raise TypeError(f"HostOptimizer steps floating-point tensors, got {type(p)} "
                            f"{getattr(p, 'dtype', '')}")
        dev = p.device
        b = self._binding(p)
        if b is not None:
            pass  # store-resident: its master's device (host or meta) is not a compute device
        elif self._device is None:
            self._device = dev
        elif dev != self._device:
            raise ValueError(
                f"HostOptimizer got parameters on {self._device} and on {dev}: all must be on "
                "one device. Move the model to one device, or use one HostOptimizer per device")
        sparse = id(p) in self._row_sparse_ids
        if sparse and _is_dtensor(p):
            raise ValueError(
                "row_sparse is not supported for sharded (FSDP2) parameters; drop row_sparse")
        if sparse and p.dim() < 2:
            raise ValueError(f"row_sparse parameter of shape {tuple(p.shape)} has no rows; "
                             "pass only 2-D (or larger) parameters")
        host = None if b is None else b.store.host_tensor(b.handle)
        plan = plan_entry(
            store=None if b is None else Rest.MEMORY if host is not None else Rest.DISK,
            on_cpu=self._on_cpu(p),
            master_dtype=(p.dtype if b is None else b.handle.dtype) in MASTER_DTYPES,
            row_sparse=sparse, state_store=self._state_store is not None,
            exchange=b is not None and b.store.can_exchange, atomic=self._atomic)
        e = Entry(p, index, gi, plan)
        e.sparse = sparse
        if plan.kind == BOUND:
            e.bound = b
            # FSDP2 calls a shard's post-accumulate-grad hooks after its reduce-scatter.
            e.sharded = _is_dtensor(p)
            if plan.master is Master.STORE_VIEW:
                e.master = host
            if e.lowp:  # an fp32 master beside the state (`_allocate_state`), fp32 gradients
                want_fp32_grad(b)
        elif plan.kind == ALIAS:  # its own master; the gradient stays in param.grad
            e.master = p.detach()
        else:
            if _is_dtensor(p):
                raise NotImplementedError(
                    f"HostOptimizer cannot step a sharded (FSDP2) parameter of shape "
                    f"{tuple(p.shape)} ({p.dtype} on {dev}) that hr.offload did not offload (only"
                    " those, and fp32 shards on the CPU). Offload every FSDP2 unit"
                    " (hr.offload(model, ...)), or step the units left on the device with a"
                    " torch.optim optimizer of their own")
            self._open_host(dev)
            key = f"{self._key_prefix}/{e.index}"
            mdtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            mh = self._host.alloc(key + "/master", tuple(p.shape), mdtype, zero=False)
            gh = self._host.alloc(key + "/grad", tuple(p.shape), mdtype, zero=False)
            e.own = ParamBinding(store=self._host, handle=mh, grad_handle=gh,
                                 grad_sync=self._mover.synchronize)
            e.master = self._host.host_tensor(mh)
            with torch.no_grad():
                e.master.copy_(p.detach())
        if e.streamed and self._cls not in ELEMENTWISE:
            raise ValueError(f"{self._cls.__name__} cannot step parameters whose master rests"
                             " on disk (it is not element-wise); use one such as AdamW")
        return e

    # ------------------------------------------------------------------ gradients
    def _on_grad(self, p: torch.Tensor) -> None:
        e = self._entries.get(id(p))
        if e is None:
            return
        if e.launched:
            e.seen = e.grad_mark()  # reported here, not again by `_check_launched`
            raise RuntimeError(
                "a parameter received another gradient after its step had started inside "
                "HostOptimizer.final_backward(); declare only the last backward pass before "
                "step() final")
        if e.kind == HOSTED and p.grad is not None:
            self._take_grad(e, p.grad)
            # backward's uses of it are queued on this stream: its copy-back goes after this
            e.ready = self._mover.mark(e.ready)
        elif e.kind == BOUND and self._overlap.final:
            flush_grad(e.bound)  # its step starts now: a sum held on the device goes now
        e.count += 1
        if e.count == 1:
            self._arrival.append(e)
        self._overlap.gradient_complete(e)

    def _sync_grads(self, entries: list[Entry]) -> None:
        """Wait for the gradients of ``entries`` still on their way to the host or into a
        store, or held back on the device (``grad_accumulation="device"``)."""
        if self._mover is not None and any(e.kind == HOSTED for e in entries):
            self._mover.synchronize()
        syncs = {id(e.bound.grad_sync): e.bound for e in entries
                 if e.kind == BOUND and e.bound.grad_sync is not None}
        for b in syncs.values():
            flush_grad(b)  # every held-back sum on its way before waiting for any
        for b in syncs.values():
            sync_grad(b)

    def _take_grad(self, e: Entry, g: torch.Tensor) -> None:
        """Take ``g`` (a HOSTED ``param.grad``) as its gradient, unless it is the host one."""
        if g.is_sparse:  # stays where autograd sums it, read in fp32 (`Entry.grad_tensor`)
            e.own.has_grad = True
        elif not is_stored_grad(g, e.own):
            # Freed now (the mover keeps it until copied): only gradients in flight stay on
            # the device. It starts the gradient afresh, as in torch.
            p, b, mover = e.param, e.own, self._mover
            p.grad = None
            mover.push_grad(g, b, accumulate=False)
            # param.grad reads (and scales) the host gradient the step uses; a later backward
            # adds into it through the mover (which it holds, not this optimizer).
            src = GradSource(b, push=lambda x: mover.push_grad(x, b, accumulate=True))
            p.grad = StoreTensor(src, tuple(p.shape), dtype=p.dtype, device=p.device)

    def _take_assigned_grads(self) -> None:
        """Take what was done to ``param.grad`` since backward, as torch's optimizers see it:
        a tensor assigned replaces the gradient; ``None`` clears it (the step skips it)."""
        for e in self._order:
            if e.launched:
                continue
            # (an ALIAS steps param.grad itself; a shard, FSDP2's local tensor)
            if e.kind == BOUND and not e.sharded:
                adopt_grad(e.bound)  # the offload layer's gradient (see adopt_grad)
            elif e.kind == HOSTED and e.param.grad is None:
                e.own.has_grad = False  # a copy still on its way lands unread
            elif e.kind == HOSTED:
                self._take_grad(e, e.param.grad)

    def _check_launched(self) -> None:
        """Refuse a step whose early part used gradients changed since."""
        changed = [e for e in self._order if e.launched and e.grad_changed()]
        if changed:
            raise RuntimeError(
                f"param.grad of {len(changed)} parameter(s) was changed (assigned, set to None"
                " or changed in place, e.g. by torch.nn.utils.clip_grad_norm_) after their"
                " step had started inside HostOptimizer.final_backward(), which used them. To"
                " clip, unscale or change gradients, run the last backward outside"
                " final_backward()")

    def _wait(self) -> None:
        """Wait for the worker; on its first error, undo the step and re-raise."""
        try:
            self._overlap.wait()
        except BaseException as exc:
            self._abort(exc)  # a step started during final_backward failed: undo it all
            raise

    # ------------------------------------------------------------------ the step
    def _hparams(self, gi: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[gi].items() if k != "params"}

    @torch.no_grad()
    def _step_entries(self, batch: list[Entry], *, early: bool = False) -> None:
        """Step ``batch``, keeping what it changes in this step's undo record.

        See [Note: all-or-nothing step]: what can fail runs first, its old values kept;
        updates of host-memory state that keep no copies run last.
        """
        if not batch:
            return
        with self._tickets_lock:  # (the worker's steps and step()'s share one)
            txn = self._txn = self._txn or Txn()
        self._sync_grads(batch)
        snap = self._overlap.launched_hparams.__getitem__ if early else self._hparams
        hparams = {e.group: snap(e.group) for e in batch}
        in_mem = [e for e in batch if not e.streamed and e.has_grad()]
        streamed = [e for e in batch if e.streamed and e.has_grad()]
        self._check_sparse_sliced(streamed, hparams)
        self._allocate_state(streamed)
        self._follow_writes([e for e in in_mem + streamed
                             if not (e.kind == HOSTED and self._hosted_followed)])
        todo = [(e, self._source(e)) for e in streamed]
        todo = [(e, src) for e, src in todo if src is not None]
        # Steps started during final_backward while step() may still fail keep copies.
        keep_all = early and self._keep_early
        plans = {id(e): plan_step(e.plan, state=self._state_rest(e) or Rest.MEMORY,
                                  has_state=bool(e.state_handles), rows=src.rows is not None,
                                  fresh=src.shadow is not None and not src.initialized,
                                  keep_all=keep_all) for e, src in todo}
        ram = [(e, src) for e, src in todo if plans[id(e)].run is Run.LAST]
        kept = [(e, src) for e, src in todo if plans[id(e)].run is not Run.LAST]
        self._prepare_undo(kept, txn, plans)
        if kept:
            for e, src in kept:
                txn.entry(e)
                own = tuple(k for k in src.spare if k not in e.xspare)
                if own:
                    txn.on_commit(lambda e=e, keys=own: self._swap_spare(e, keys))
                for name, (store, _) in e.xspare.items():
                    if name in src.spare:
                        h = src.master_handle if name == "p" else src.shadow[1]
                        txn.exchange(store, h, src.spare[name])
            # Run.BARE (atomic=False): updates host memory in place, undoable no more
            spared = [(e, src) for e, src in kept if plans[id(e)].run is Run.KEPT]
            bare = [(e, src) for e, src in kept if plans[id(e)].run is Run.BARE]
            if spared:
                self._sliced_step(spared, hparams, txn)
            if bare:
                if not early and self._defer is not None:
                    self._defer.arm()
                txn.unprotected += len(bare)
                self._sliced_step(bare, hparams, None)
        if not early:
            if (ram or in_mem or txn.exchanging) and self._defer is not None:
                self._defer.arm()  # from here on the step completes; Ctrl-C waits for it
            txn.run_exchanges()  # before what cannot be undone
        if ram:
            txn.unprotected += len(ram)
            self._sliced_step(ram, hparams, None)
        if in_mem:
            if keep_all:  # (state not made yet is dropped)
                for e in in_mem:
                    txn.ram(e.master, None, e.master.clone())
                    st = self._inner.state.get(e.master)
                    if not st:
                        txn.after_undo(lambda m=e.master: self._inner.state.pop(m, None))
                        continue
                    for v in st.values():
                        if isinstance(v, torch.Tensor):
                            txn.ram(v, None, v.clone())
            else:  # last, uncopied: see [Note: all-or-nothing step]
                txn.unprotected += len(in_mem)
            self._inner_step(in_mem, hparams)
        for e in streamed + in_mem:
            if e.kind == HOSTED:
                txn.after_undo(lambda e=e: self._copy_back(e))
            e.stepped = True
        # from step(), copy-backs also go after what this thread queued (one event for all)
        now = None if early or self._mover is None else self._mover.mark()
        for e in streamed + in_mem:
            self._copy_back(e, now)

    def _check_sparse_sliced(self, entries: list[Entry],
                             hparams: dict[int, dict[str, Any]]) -> None:
        """Refuse sparse gradients that would make sparse state (SGD's momentum) in a sliced
        step (its state is dense)."""
        for gi in sorted({e.group for e in entries
                          if e.grad_tensor() is not None and e.grad_tensor().is_sparse}):
            keys = _sparse_state_keys(self._cls, hparams[gi], unfused=self._unfuse_sparse)
            if keys:
                hp = ", ".join(f"{k}={v!r}" for k, v in hparams[gi].items()
                               if k not in ("params", "foreach", "fused", "differentiable"))
                raise ValueError(
                    f"{self._cls.__name__} with {hp} keeps state for a sparse"
                    f" gradient as sparse tensors ({', '.join(keys)}), but a master or state"
                    " resting in a store steps over dense state. Keep both in host memory"
                    " (hr.offload(..., store='cpu') and state_store='cpu'), or use options"
                    " without that state (SGD: momentum=0)")

    def _sliced_step(self, todo: list[tuple[Entry, SlicedParam]],
                     hparams: dict[int, dict[str, Any]], txn: Txn | None) -> None:
        results = self._slicer.step_many(
            [(src, e.group, hparams[e.group]) for e, src in todo], txn)
        for (e, _), small in zip(todo, results, strict=True):
            e.small = small
            e.initialized = True
            e.grad_scale = None
            if e.value_mark is not None:
                old, e.value_seen = e.value_seen, e.value_mark
                old_written, e.written = e.written, written_mark(e.param)
                if txn is not None:  # undone: its master is compared again next time
                    txn.after_undo(lambda e=e, old=old, w=old_written: (
                        setattr(e, "value_seen", old), setattr(e, "written", w)))

    def _follow_writes(self, entries: list[Entry]) -> None:
        """Masters take what was written into their parameters since the last step (see
        _follow.py); those of store-resident bf16/fp16 parameters during the sliced step."""
        for e in entries:
            if e.kind == HOSTED:
                if e.written == written_mark(e.param):
                    continue  # nothing written since its step wrote it
                value = e.param.detach()
                follow_(e.master, value if value.device.type == "cpu" else value.to("cpu"))
            elif e.lowp and e.master_handle is not None and not e.sharded:
                self._follow_bound(e)

    def _follow_bound(self, e: Entry) -> None:
        b = e.bound
        store = self._state_store or self._aux
        e.value_mark = value_edits(b.store, b.handle.key)
        in_memory = b.store.host_tensor(b.handle) is not None
        if not e.initialized:
            e.follow = False  # its first step makes the master from the value
            if e.sparse:  # ... of the rows it steps: the others get theirs now
                init_stored(store, e.master_handle, b.store, b.handle)
            return
        e.follow = e.value_mark != e.value_seen or (
            in_memory and e.written != written_mark(e.param))
        if e.follow and e.sparse and not in_memory:
            # rows this step does not touch must follow the write on disk too
            follow_stored(store, e.master_handle, b.store, b.handle)
            e.follow = False

    def _state_rest(self, e: Entry) -> Rest | None:
        """Where ``e``'s state store keeps its tensors; ``None`` while it has none."""
        h = next(iter(e.state_handles.values()), e.master_handle)
        store = self._state_store or self._aux
        if h is None or store is None:
            return None
        return Rest.MEMORY if store.host_tensor(h) is not None else Rest.DISK

    def _inner_step(self, entries: list[Entry], hparams: dict[int, dict[str, Any]]) -> None:
        """Step in-memory masters with the wrapped optimizer in one call (sparse gradients in
        a second one, unfused)."""
        grads = {id(e): e.grad_tensor() for e in entries}
        sparse = [e for e in entries if grads[id(e)].is_sparse] if self._unfuse_sparse else []
        dense = [e for e in entries if not grads[id(e)].is_sparse] if sparse else entries
        if dense:
            self._inner_call(dense, grads, hparams)
        if sparse:
            self._inner_call(sparse, grads, hparams, unfused=True)

    def _inner_call(self, entries: list[Entry], grads: dict[int, torch.Tensor],
                    hparams: dict[int, dict[str, Any]], *, unfused: bool = False) -> None:
        # Only these masters: its per-call Python work scales with the batch, not the model.
        saved = {}
        # looked up each time: load_state_dict replaces those dicts
        inner_groups = {gi: self._inner.param_groups[k] for gi, k in self._inner_index.items()}
        for gi, inner in inner_groups.items():
            inner.update(hparams.get(gi, {}))
            saved[gi] = inner["params"]
            inner["params"] = [e.master for e in entries if e.group == gi]
            if unfused:
                inner["fused"] = False
        for e in entries:
            e.master.grad = grads[id(e)]
        try:
            self._inner.step()
        finally:
            for e in entries:
                e.master.grad = None
            for gi, inner in inner_groups.items():
                inner["params"] = saved[gi]
                if unfused:
                    inner["fused"] = True

    # ------------------------------------------------------------------ all or nothing
    def _undo_handles(self, e: Entry, src: SlicedParam,
                      plan: StepPlan) -> dict[str, tuple[Store, Handle]]:
        """Spares (into ``src.spare``) and undo tensors (returned) as ``plan`` guards ``e``'s
        sliced step; made once, reused every step."""
        stores = {Home.STATE: src.state_store,
                  Home.PARAM: None if e.bound is None else e.bound.store}
        first = next(iter(src.state_handles.values()), None)
        roles: list[tuple[str, Guard | None, Home | None, Store, Handle]] = []
        if src.master is None:
            roles.append(("p", plan.master, plan.master_at, src.master_store, src.master_handle))
        elif first is not None:  # a master in memory: an undo tensor of its shape and dtype
            roles.append(("p", plan.master, plan.master_at, src.state_store, first))
        roles += [(k, plan.state, plan.state_at, src.state_store, h)
                  for k, h in src.state_handles.items()]
        if src.shadow is not None:
            roles.append(("lp", plan.value, plan.value_at, *src.shadow))
        out = {}
        spare = {}
        for name, guard, at, store, h in roles:
            if guard is Guard.SPARE:  # ours: new values to a spare, handles swap at the end
                sp = e.spare.get(name)
                if sp is None or sp.key not in store or store.get(sp.key) is not sp:
                    # the two alternate between the state's key and the same key with "~"
                    other = h.key[:-1] if h.key.endswith("~") else h.key + "~"
                    sp = e.spare[name] = store.alloc(other, h.shape, h.dtype, zero=False)
                spare[name] = sp
            elif guard is Guard.EXCHANGE:  # the model's tensor: contents exchanged at the end
                spare[name] = self._scratch(e, e.xspare, "spare", name, store, h,
                                            lambda key, s=store, h=h: s.alloc_spare(h, key))[1]
            elif guard is Guard.UNDO:
                out[name] = self._scratch(e, e.undo, "undo", name, stores[at], h,
                                          lambda key, s=stores[at], h=h: s.alloc(
                                              key, h.shape, h.dtype, zero=False))
        src.spare = spare
        return out

    def _scratch(self, e: Entry, kept: dict[str, tuple[Store, Handle]], kind: str, name: str,
                 store: Store, h: Handle,
                 make: Callable[[str], Handle]) -> tuple[Store, Handle]:
        """``kept[name]``: a scratch tensor like ``h`` in ``store``, made by ``make(key)`` once
        and reused while the store holds it."""
        key = f"{SCRATCH}{self._key_prefix}/{kind}/{e.index}/{name}"
        x = kept.get(name)
        if x is None or x[0] is not store or key not in store or store.get(key) is not x[1] \
                or x[1].shape != h.shape or x[1].dtype != h.dtype:
            if key in store:
                store.free(store.get(key))
            x = kept[name] = (store, make(key))
        return x

    @staticmethod
    def _swap_spare(e: Entry, keys: tuple[str, ...]) -> None:
        """The step ended: the spares become current, the old tensors the spares."""
        handles = dict(e.state_handles)
        for k in keys:
            if k == "p":  # the fp32 master of a bf16/fp16 parameter
                e.master_handle, e.spare[k] = e.spare[k], e.master_handle
            else:
                handles[k], e.spare[k] = e.spare[k], handles[k]
        e.state_handles = handles

    def _prepare_undo(self, todo: list[tuple[Entry, SlicedParam]], txn: Txn,
                      plans: dict[int, StepPlan]) -> None:
        """Undo tensors and journal space for ``todo``, before any update (a full store fails
        here, with nothing changed)."""
        writes: dict[Store, int] = defaultdict(int)
        for e, src in todo:
            stores = [s for s in dict.fromkeys((src.state_store, src.master_store,
                                                src.shadow and src.shadow[0])) if s is not None]
            try:
                src.undo = self._undo_handles(e, src, plans[id(e)])
            except (StoreFullError, OSError) as ex:
                if not isinstance(ex, StoreFullError) and ex.errno not in (
                        errno.ENOSPC, errno.EDQUOT):
                    raise  # not a full store: its own error names the cause
                names = ", ".join(map(repr, stores))
                raise StoreFullError(
                    f"HostOptimizer.step() needs room in {names} for a second copy of what "
                    f"it updates (spares and undo copies, kept until the step ends): {ex}. "
                    "Nothing was updated; free space or raise max_bytes of the store, then "
                    "call step() again") from ex
            shape = src.master_handle.shape if src.master is None else tuple(src.master.shape)
            rows = (shape[0] if shape else 1) if src.rows is None else int(src.rows.numel())
            slices = -(-max(rows, 1) // _rows_per_slice(shape, self._slicer.slice_bytes)) \
                if shape else 1
            # per slice: every tensor, its undo copy, once more undone; exchanges: 2 records
            per = 3 * (len(src.state_handles) + 2) * slices + 2
            for store in stores:
                writes[store] += per
        for store, count in writes.items():
            store.reserve_writes(count)
            txn.stores.add(store)

    def _check_hparams(self) -> None:
        """Raise if a hyperparameter changed after steps started with it (final_backward)."""
        try:
            self._overlap.check_hparams()
        except RuntimeError as exc:
            txn = self._txn
            if txn is not None and txn.unprotected:  # cannot be undone: left as they are
                exc.add_note(
                    "headroom: the parameters stepped during final_backward() keep that step; "
                    "set the value back and call step() again to finish the step for the "
                    "others, or restore the last checkpoint (hr.load)")
                raise _Kept(exc) from exc
            raise

    def _failed_backward(self, exc: BaseException) -> None:
        """A final backward failed after some parameters took this step on the worker."""
        txn = self._txn
        if txn is not None and not txn.unprotected:
            self._abort(exc, backward=True)
        elif hasattr(exc, "add_note"):
            exc.add_note(
                "headroom: this backward failed inside HostOptimizer.final_backward() after "
                "some parameters (state in host memory, old values not kept) had already "
                "taken this step; step() finishes it for the others, or restore the last "
                "checkpoint (hr.load, then zero_grad()) to continue exactly")

    def _drop_step(self, undo: bool = False) -> tuple[list[BaseException], int]:
        """End the step in progress, undone (``undo``: returns what failed to go back and how
        many parameters were updated unprotected) or not (`load_state_dict` replaces it)."""
        self._overlap.settle()  # nothing may still be stepping on the worker
        with self._tickets_lock:
            txn, self._txn = self._txn, None
        if undo and self._mover is not None:
            with contextlib.suppress(BaseException):
                self._mover.synchronize()
        errors: list[BaseException] = []
        unprotected = 0
        if txn is not None:
            if undo:
                unprotected = txn.unprotected
                errors = txn.undo()
            txn.end()
        self._overlap.abort(self._order)
        for e in self._order:
            e.stepped = False
        return errors, unprotected

    def _abort(self, exc: BaseException, *, backward: bool = False) -> None:
        """A step failed: put the old values back and say on ``exc`` what it left."""
        errors, unprotected = self._drop_step(undo=True)
        if errors or unprotected:
            why = (f"putting the old values back failed ({type(errors[0]).__name__}: "
                   f"{errors[0]})" if errors else
                   f"the step of {unprotected} parameter(s) with state in host memory, updated in"
                   " place without a copy of their old values, had started")
            self._torn = (
                "an earlier HostOptimizer.step() failed part-way and could not be undone "
                f"({why}): parameters and optimizer state now mix old and new values. Load the "
                "last checkpoint (hr.load or load_state_dict) before training on")
            note = ("headroom: HostOptimizer.step() failed part-way and could not be undone "
                    f"({why}): parameters and optimizer state now MIX old and new values; "
                    "step() refuses until a checkpoint is loaded (hr.load or load_state_dict)")
        elif backward:
            note = ("headroom: this backward failed inside HostOptimizer.final_backward() "
                    "after some parameters had started this step; their step was undone. The "
                    "gradients are those of the failed backward: zero_grad() and run the "
                    "iteration again")
        else:
            note = ("headroom: HostOptimizer.step() was undone: parameters and optimizer "
                    "state are as before it, the gradients kept. Remove the cause and call "
                    "step() again")
        if hasattr(exc, "add_note"):
            exc.add_note(note)

    def _source(self, e: Entry) -> SlicedParam | None:
        """Where a sliced step finds ``e``'s master, gradient and state (None: no step)."""
        b = e.binding
        grad = e.grad_tensor()
        rows = None
        if e.sparse:
            rows = self._grad_rows(e, grad)
            if rows is not None and rows.numel() == 0:
                return None  # lazy Adam: a parameter without any gradient row takes no step
        elif grad is not None and grad.is_sparse:
            grad = grad.to(self._state_dtype(e))
            if self._cls in SPARSE_COALESCED:
                grad = grad.coalesce()  # what their step does first (see SPARSE_COALESCED)
            if e.initialized:  # only the rows named (the first step makes every row's state)
                rows = grad._indices()[0].unique(sorted=True)
        if e.lowp:
            master_store, master_handle = self._state_store or self._aux, e.master_handle
        elif e.master is None:
            master_store, master_handle = e.bound.store, e.bound.handle
        else:
            master_store = master_handle = None
        return SlicedParam(
            master=e.master,
            master_store=master_store,
            master_handle=master_handle,
            grad=grad,
            grad_store=None if grad is not None else b.store,
            grad_handle=None if grad is not None else b.grad_handle,
            grad_scale=e.grad_scale,
            state_store=self._state_store or self._aux,
            state_handles=e.state_handles,
            small=e.small,
            initialized=e.initialized,
            rows=rows,
            shadow=(e.bound.store, e.bound.handle) if e.lowp else None,
            follow=e.lowp and e.follow,
        )

    def _grad_rows(self, e: Entry, grad: torch.Tensor | None) -> torch.Tensor | None:
        b = e.binding
        if b is not None and b.grad_rows is not None:
            return b.grad_rows.to("cpu", torch.int64)
        if grad is None:
            grad = b.store.read(b.grad_handle).result()
        nz = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1)
        return torch.nonzero(nz).flatten()

    def _allocate_state(self, entries: list[Entry]) -> None:
        """Allocate the state of entries about to take their first sliced step, before any
        update: a full store fails the step whole (DiskStore reserves blocks at allocation)."""
        todo = [e for e in entries
                if not e.state_handles and not (e.lowp and e.master_handle is not None)]
        if not todo:
            return
        store = self._state_store
        if store is None:
            if self._aux is None:
                self._aux = resolve_store("cpu", "cpu")
            store = self._aux
        made: list[Handle] = []
        try:
            for e in todo:
                handles = {}
                for k in self._shaped(e.group):
                    h = store.alloc(f"{self._key_prefix}/{e.index}/{k}",
                                    e.shape, self._state_dtype(e), zero=True)
                    made.append(h)
                    handles[k] = h
                    host = store.host_tensor(h)
                    if host is not None:
                        annotate(host, "optimizer_state")
                if e.lowp:
                    e.master_handle = store.alloc(f"{self._key_prefix}/{e.index}/master",
                                                  e.shape, torch.float32,
                                                  zero=False)
                    made.append(e.master_handle)
                e.state_handles = handles
        except BaseException as ex:
            for h in made:
                store.free(h)
            for e in todo:
                e.state_handles = {}
                e.master_handle = None
            need = sum(
                e.numel * 4 * (len(self._shaped(e.group)) + e.lowp)
                for e in todo)
            if isinstance(ex, (StoreFullError, OSError)):
                raise StoreFullError(
                    f"optimizer state does not fit in {store!r}: this step needs {need} more "
                    f"bytes ({ex}). Nothing was updated; free space, raise max_bytes, or point "
                    "state_store at a larger disk"
                ) from ex
            raise

    @staticmethod
    def _state_dtype(e: Entry) -> torch.dtype:
        if e.master is not None:
            return e.master.dtype
        return e.bound.handle.dtype if e.bound.handle.dtype in MASTER_DTYPES else torch.float32

    def _shaped(self, gi: int) -> tuple[str, ...]:
        keys = self._shaped_keys.get(gi)
        if keys is None:
            keys = self._shaped_keys[gi] = probe_shaped(self._cls, self.param_groups[gi])
        return keys

    def _copy_back(self, e: Entry, now: object | None = None) -> None:
        if e.kind == ALIAS or e.kind == BOUND:
            return  # updated in place / written back to the store
        p = e.param
        if self._mover is not None and self._mover.accelerated:
            # after backward's last use of it (``e.ready``) and, from step(), what the calling
            # thread queued since (``now``); not the worker's own current stream
            after = [ev for ev in (e.ready, now) if ev is not None]
            t = self._mover.fetch(e.own.handle, p.data, after=after or None)
            with self._tickets_lock:
                self._tickets.append(t)
        else:
            with torch.no_grad():
                p.data.copy_(e.master)
        e.written = written_mark(p)  # `.data` writes leave the version counter as it is

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish the step: wait for the parameters already stepping, step the rest.

        Args:
            closure: re-evaluates the model and returns the loss (optional, as in torch.optim).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: a hyperparameter changed after some parameters already took this
                step (overlap), or a background step failed.
            StoreFullError: the state store cannot hold new state (nothing was updated).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._torn is not None:
            raise RuntimeError(self._torn)
        self._check_groups()
        self._take_assigned_grads()
        with DeferInterrupt() as defer:
            self._defer = defer
            try:
                self._overlap.wait()
                self._check_hparams()
                self._check_launched()
                # Entries stepped early are done; a bucket that never ran is stepped here.
                self._step_entries([e for e in self._order if not e.stepped])
                with self._tickets_lock:
                    txn = self._txn
                if txn is not None and txn.exchanging:  # all stepped early
                    defer.arm()
                    txn.run_exchanges()
            except _Kept as kept:
                raise kept.exc from None
            except BaseException as exc:
                defer.arm()  # the undo itself is not interrupted
                self._abort(exc)
                raise
            finally:
                self._defer = None
            defer.arm()
            self._finish_iteration()
        if defer.pending:
            exc = KeyboardInterrupt()
            exc.add_note("headroom: Ctrl-C came while HostOptimizer.step() could no longer be "
                         "undone: the step completed; parameters and state hold the new values")
            raise exc
        return loss

    def _finish_iteration(self) -> None:
        with self._tickets_lock:
            tickets, self._tickets = self._tickets, []
        for t in tickets:
            self._mover.wait(t)  # the next forward, on this stream, reads the new values
        with self._tickets_lock:
            txn, self._txn = self._txn, None
        if txn is not None:
            txn.commit()  # the spare state becomes current; the old values are dropped
        if self._arrival:
            self._overlap.last_arrival = self._arrival
        self._overlap.abort(self._order)
        for e in self._order:
            e.count = 0
            e.stepped = False
        self._arrival = []
        self._hosted_followed = False
        self._refresh_state_view()

    # ------------------------------------------------------------------ overlap
    @contextlib.contextmanager
    def final_backward(self, enabled: bool = True) -> Iterator[None]:
        """Declare the backward pass inside as the last one before ``step()``: each parameter's
        step starts as soon as its gradient is complete, overlapped with the rest of backward.

        Other backward passes only accumulate: bitwise ``overlap=False``. Inside, gradients
        are final: `clip_grad_norm_` afterwards, a further backward, or a hyperparameter
        changed before ``step()`` raise (docs: "Failure and recovery"). A no-op with
        ``overlap=False``.

        Args:
            enabled: ``False`` makes it a no-op, for loops that decide per micro-batch.

        Raises:
            RuntimeError: `clip_grad_norm_` was used by this optimizer (clipping needs every
                gradient before any step), or a final backward already ran since ``step()``.

        Example:
            >>> for i, (x, y) in enumerate(loader):                  # doctest: +SKIP
            ...     last = (i + 1) % accum == 0
            ...     with opt.final_backward(last):
            ...         (loss_fn(model(x), y) / accum).backward()
            ...     if last:
            ...         opt.step(); opt.zero_grad()
        """
        if enabled:
            self._check_groups()
            # early steps keep old values only where step() may still fail: a disk is written
            self._keep_early = self._atomic and any(
                may_write_disk(e.plan, self._state_rest(e)) for e in self._order)
            if self._overlap.enabled:
                # now: the worker reading a device parameter would wait for the backward
                self._follow_writes([e for e in self._order if e.kind == HOSTED])
                self._hosted_followed = True
        with self._overlap.final_backward(self._order, enabled):
            yield

    def _refresh_state_view(self) -> None:
        view: defaultdict = defaultdict(dict)
        inner_state = self._inner.state if self._inner is not None else {}
        for e in self._order:
            if not e.streamed:
                st = inner_state.get(e.master)
                if st:
                    view[e.param] = st
            elif e.initialized:
                st = dict(e.small)
                if self._state_store is None:
                    for k, h in e.state_handles.items():
                        st[k] = self._aux.host_tensor(h)
                view[e.param] = st
        self.state = view

    # ------------------------------------------------------------------ gradients API
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients wherever they rest (device, host or store).

        Raises:
            RuntimeError: some parameters already took this iteration's step inside
                `final_backward` and ``step()`` was not called.
        """
        self._wait()
        if self._mover is not None:
            self._mover.synchronize()  # queued copies would land in the next iteration's sum
        if any(e.launched for e in self._order):
            raise RuntimeError(
                "zero_grad() after some parameters already took this step inside "
                "final_backward(): call step() first to finish it, or to continue exactly "
                "restore the last checkpoint (hr.load, then zero_grad())")
        for e in self._order:
            p = e.param
            zeroed = False  # the stored gradient zeroed through param.grad (read nothing)
            if p.grad is not None:
                zeroed = isinstance(p.grad, StoreTensor) and not set_to_none
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()
            b = e.binding if e.kind != ALIAS else None
            if b is not None and b.grad_handle is not None and b.has_grad:
                if set_to_none:
                    b.has_grad = False
                    b.grad_rows = None
                    b.grad_sparse = None
                    flush_grad(b)  # a sum held on the device is dropped, its memory freed
                elif not zeroed and b.grad_sparse is None:
                    host = b.store.host_tensor(b.grad_handle)
                    if host is not None:
                        host.zero_()
                    else:
                        b.store.write(b.grad_handle, torch.zeros(
                            b.grad_handle.shape, dtype=b.grad_handle.dtype)).result()
            e.count = 0
            e.grad_scale = None
        self._arrival = []
        self._hosted_followed = False

    def grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The accumulated gradient of ``param`` as a host tensor (a copy if it rests on disk).

        Args:
            param: one of this optimizer's parameters.

        Raises:
            KeyError: ``param`` is not in this optimizer.
        """
        e = self._entries.get(id(param))
        if e is None:
            raise KeyError("parameter is not managed by this HostOptimizer")
        self._take_assigned_grads()
        self._wait()
        self._sync_grads([e])
        if not e.has_grad():
            return None
        g = e.grad_tensor()
        if g is None:
            b = e.binding
            g = b.store.read(b.grad_handle).result()
        if e.grad_scale is not None:
            g = g * e.grad_scale
        return g

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of all parameters by their total norm, wherever they rest.

        Bitwise ``torch.nn.utils.clip_grad_norm_`` on the same gradients. Gradients on disk
        are read once for the norm and scaled as the step reads them.

        Args:
            max_norm: largest allowed total norm.
            norm_type: the p of the p-norm (``float('inf')`` for the max norm).
            error_if_nonfinite: raise if the total norm is nan or inf.

        Returns:
            The total norm before clipping (a host tensor).

        Raises:
            RuntimeError: called after parameters already took this iteration's step inside
                `final_backward` (from then on `final_backward` refuses at once, before any
                step), or the norm is non-finite and ``error_if_nonfinite``.
        """
        self._check_groups()
        self._take_assigned_grads()
        self._wait()
        if any(e.sharded for e in self._order):
            raise RuntimeError(
                "HostOptimizer.clip_grad_norm_ sees only this rank's shards of sharded (FSDP2)"
                " parameters; use torch.nn.utils.clip_grad_norm_(model.parameters(), ...), which"
                " reduces the norm over the ranks")
        self._overlap.clips = True
        if any(e.launched for e in self._order):
            raise RuntimeError(
                "clip_grad_norm_() after final_backward(): some parameters already took this "
                "step with unclipped gradients; drop the `with opt.final_backward():` when "
                "clipping")
        self._sync_grads(self._order)
        grads = [(e, e.grad_tensor()) for e in self._order if e.has_grad()]
        if any(g is not None and g.is_sparse for _, g in grads):
            raise RuntimeError(
                "clip_grad_norm_ over sparse gradients (nn.Embedding(sparse=True)) is not "
                "supported, as in torch; nothing was clipped. Clip only the dense parameters' "
                "gradients, or use sparse=False")
        if not grads:
            return torch.tensor(0.0)
        norm_type = float(norm_type)
        in_mem = [g for _, g in grads if g is not None]
        # torch._foreach_norm is what torch.nn.utils.clip_grad_norm_ uses on CPU.
        mem_norms = iter(torch._foreach_norm(in_mem, norm_type) if in_mem else ())
        norms = [next(mem_norms) if g is not None else torch.linalg.vector_norm(
            e.binding.store.read(e.binding.grad_handle).result(), norm_type) for e, g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                "cannot be clipped; pass error_if_nonfinite=False to scale by it anyway"
            )
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if in_mem:
            torch._foreach_mul_(in_mem, coef)
        for e, g in grads:
            if g is None:  # on disk: scaled as the step reads it
                e.grad_scale = coef if e.grad_scale is None else e.grad_scale * coef
        return total

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """The same structure as ``optimizer_class(...).state_dict()`` for these parameters.

        State resting on disk is read into memory; `headroom.save` streams it instead.
        """
        self._wait()
        groups = [{**self._hparams(gi), "params": [e.index for e in self._order if e.group == gi]}
                  for gi in range(len(self.param_groups))]
        state = {e.index: st for e in self._order if (st := _state.index_state(self, e))}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from `state_dict` (or from the plain ``optimizer_class``).

        Raises:
            ValueError: the parameter groups do not match in number or size.
        """
        _state.load_state_dict(self, state_dict)

    def reload_params(self) -> None:
        """Re-read the master copies from the parameters after they changed outside ``step``.

        Only for parameters on an accelerator or not in fp32; writes between steps need it
        not (each step's masters follow them). `headroom.load` calls it. fp32 masters just
        loaded by `load_state_dict` are kept: more precise than the parameter.
        """
        self._wait()
        if self._mover is not None:
            self._mover.wait_reads()  # copy-backs still reading the masters
        loaded, self._masters_loaded = self._masters_loaded, set()
        with torch.no_grad():
            for e in self._order:
                if e.kind == HOSTED and id(e) not in loaded:
                    e.master.copy_(e.param.detach())

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Remove the gradient hooks and stop the worker thread (the state stays readable)."""
        self._wait()
        _remove_all(self._hooks)
        for e in self._order:  # the undo tensors (scratch space in the stores), the spares
            spares = [(self._state_store, h) for h in e.spare.values()]
            for store, h in [*e.undo.values(), *spares, *e.xspare.values()]:
                with contextlib.suppress(KeyError, RuntimeError, OSError):
                    store.free(h)
            e.undo, e.spare, e.xspare = {}, {}, {}
        self._overlap.close()
        if self._mover is not None:
            self._mover.close()  # lands what is in flight, gives the staging back

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "HostOptimizer cannot be pickled or deep-copied (it holds hooks and a worker "
            "thread); save it with headroom.save(path, model, optimizer) or state_dict()"
        )

    def __repr__(self) -> str:
        return (f"HostOptimizer({self._cls.__name__}, params={len(self._order)}, "
                f"state_store={self._state_store or 'cpu'!r}, overlap={self._overlap.enabled})")

