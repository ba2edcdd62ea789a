"""`hr.HostOptimizer` in a dry run: its entries, gradient hand-offs and step, on ``meta`` tensors.

Where each parameter's tensors rest and what protects them during a step are
`headroom.optim.HostOptimizer`'s own decisions (`headroom.optim._plan`, see [Note: the entry
plan]), executed here over `MetaStore` s: masters held in memory are stepped by PyTorch's own
optimizer class, the others by `headroom.optim._sliced.SliceRunner` itself, with the spares,
undo tensors (stood in for by the handles they mirror: the same bytes move) and copies in
memory the plan names. Inside ``final_backward`` (``overlap``) a bucket of parameters is stepped
as soon as its gradients are complete, here at that moment on the backward thread rather than
on a worker beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from headroom.optim._entries import MASTER_DTYPES as _MASTER_DTYPES
from headroom.optim._plan import (
    EntryPlan,
    Guard,
    Home,
    Kind,
    Master,
    Planned,
    Rest,
    Run,
    StepPlan,
)
from headroom.optim._plan import may_write_disk as _may_write_disk
from headroom.optim._plan import plan_entry as _plan_entry
from headroom.optim._plan import plan_step as _plan_step
from headroom.store import MetaStore, Places
from headroom.transfer import weak_post_accumulate_grad_hook


class _SimParam(Planned):
    __slots__ = ("param", "group", "plan", "master", "grad_host", "slot", "store",
                 "state_handles", "small", "initialized", "count", "launched", "bucket",
                 "fired", "has_grad_host", "master_handle", "sim")

    def __init__(self, param: torch.Tensor, group: int, plan: EntryPlan) -> None:
        self.param = param
        self.group = group
        self.plan = plan
        self.master: torch.Tensor | None = None
        self.grad_host: torch.Tensor | None = None  # hosted: the host gradient
        self.has_grad_host = False
        self.slot: Any = None  # bound: the offload dry run's slot
        self.store: MetaStore | None = None  # bound: the store of that slot
        self.state_handles: dict[str, Any] = {}
        self.small: dict[str, Any] = {}
        self.initialized = False
        self.count = 0
        self.launched = False
        self.bucket: list[_SimParam] | None = None
        self.fired = False
        self.master_handle: Any = None  # store, fed back into the parameter (the shadow)
        self.sim: Any = None  # bound: the offload dry run holding its slot

    def has_grad(self) -> bool:
        if self.kind == Kind.ALIAS:
            return self.param.grad is not None
        if self.kind == Kind.BOUND:
            return self.slot.has_grad
        return self.has_grad_host

    def grad_tensor(self) -> torch.Tensor | None:
        if self.kind == Kind.ALIAS:
            return self.param.grad
        if not self.has_grad():
            return None
        if self.kind == Kind.BOUND:
            return self.store.host_tensor(self.slot.grad_handle)
        return self.grad_host


class HostOptimizerDryRun(torch.optim.Optimizer):
    """An `hr.HostOptimizer` with the given options, over a dry run's parameters.

    Args:
        params: the parameters (masters of offloaded ones), as the real one would get them.
        options: the real optimizer's `headroom.optim.HostOptimizerOptions` (its
            ``state_store`` is ``"cpu"`` or a store: here only whether it is host memory
            matters).
        places: where the dry run's tensors stand.
        offloaded: the offload dry runs, whose slots are the bound parameters.
        cpu: the target is ``cpu`` (fp32 parameters there are their own masters).
    """

    def __init__(self, params, options: Any, places: Places, offloaded: list[Any], *,
                 cpu: bool) -> None:
        from headroom.optim._sliced import SliceRunner

        self._cls = options.optimizer_class
        self._kwargs = dict(options.optimizer_kwargs)
        self._state_on_host = options.state_store == "cpu"
        self._overlap = bool(options.overlap)
        self._bucket_bytes = options.bucket_bytes
        self._atomic = getattr(options, "atomic", True)
        self._places = places
        self._cpu = cpu
        self._slots = {k: (sim, slot) for sim in offloaded for k, slot in sim.by_master.items()}
        self._state_store = None if self._state_on_host else MetaStore(places, host=False)
        self._aux = MetaStore(places, host=True)
        self._host_store = MetaStore(places, host=True)
        self._slicer = SliceRunner(self._cls, slice_bytes=options.slice_bytes)
        self._entries: dict[int, _SimParam] = {}
        self._order: list[_SimParam] = []
        self._arrival: list[_SimParam] = []
        self._last_arrival: list[_SimParam] = []
        self._final = False
        self._in_flight: list[torch.Tensor] = []
        self._in_flight_bytes = 0
        self.link_bytes = 0  # host <-> accelerator: gradients out, parameters back
        self._inner: torch.optim.Optimizer | None = None
        self._inner_index: dict[int, int] = {}
        self._layouts: dict[int, Any] = {}
        self._keep_early = False  # steps in final_backward keep copies (see HostOptimizer)
        self._txn: Any = None  # the undo record of the step in progress
        probe = torch.zeros(2, 3)  # a matrix: Muon takes nothing else
        defaults = dict(self._cls([probe], **self._kwargs).defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        entries = [self._entry(p, gi) for p in group["params"]]
        for e in entries:
            self._entries[id(e.param)] = e
            self._order.append(e)
        masters = [e.master for e in entries if not e.streamed]
        hp = {k: v for k, v in group.items() if k != "params"}
        if masters:
            if self._inner is None:
                self._inner = self._cls([{**hp, "params": masters}], **self._kwargs)
            else:
                self._inner.add_param_group({**hp, "params": masters})
            self._inner_index[gi] = len(self._inner.param_groups) - 1
        for e in entries:
            if e.kind == Kind.BOUND:
                e.slot.listeners.append(self._on_grad)
            elif e.param.requires_grad:
                weak_post_accumulate_grad_hook(e.param, self._on_grad)  # see its NOTE

    def _entry(self, p: torch.Tensor, gi: int) -> _SimParam:
        found = self._slots.get(id(p))
        sim, slot = found if found is not None else (None, None)
        host = None if slot is None else sim.store.host_tensor(slot.handle)
        rest = None if slot is None else Rest.MEMORY if host is not None else Rest.DISK
        plan = _plan_entry(
            store=rest,
            # (an FSDP2 shard resting in host memory is on the CPU too)
            on_cpu=self._cpu or self._places.where(
                getattr(p, "_local_tensor", p).untyped_storage()._cdata) == "host",
            master_dtype=(p.dtype if slot is None else slot.handle.dtype) in _MASTER_DTYPES,
            row_sparse=False, state_store=not self._state_on_host,
            exchange=rest is Rest.DISK,  # a meta store on "disk" stands for a DiskStore
            atomic=self._atomic)
        e = _SimParam(p, gi, plan)
        if plan.kind == Kind.BOUND:
            e.sim = sim
            e.slot = slot
            e.store = sim.store
            if plan.master is Master.STORE_VIEW:
                e.master = host
            if e.lowp and slot.grad_handle is None:
                # as HostOptimizer asks the store (want_fp32_grad): an fp32 gradient
                slot.grad_dtype = torch.float32
        elif plan.kind == Kind.ALIAS:
            e.master = p.detach()
        else:
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            e.master = self._places.on_host(torch.empty(p.shape, dtype=dtype, device="meta"))
            e.grad_host = self._places.on_host(torch.empty(p.shape, dtype=dtype, device="meta"))
        return e

    def stores(self) -> list[MetaStore]:
        """The stores its step reads and writes (the state's, its host memory)."""
        return [s for s in (self._state_store, self._aux, self._host_store) if s is not None]

    # ------------------------------------------------------------------ gradients
    def _on_grad(self, p: torch.Tensor) -> None:
        e = self._entries.get(id(p))
        if e is None:
            return
        if e.kind == Kind.HOSTED and p.grad is not None:
            g = p.grad
            with self._places.host_code(), torch.no_grad():
                if e.has_grad_host:
                    e.grad_host.add_(g)
                else:
                    e.grad_host.copy_(g)
            e.has_grad_host = True
            p.grad = None
            if not self._cpu:
                self.link_bytes += g.numel() * g.element_size()
                # on the device until the worker reaps the copies, a bucket's worth at a time
                self._in_flight.append(g)
                self._in_flight_bytes += g.numel() * g.element_size()
                if self._in_flight_bytes >= self._bucket_bytes:
                    self._in_flight, self._in_flight_bytes = [], 0
            del g
        elif e.kind == Kind.BOUND and self._final:
            e.sim.flush(e.slot)  # its step starts now (grad_accumulation="device")
        e.count += 1
        if e.count == 1:
            self._arrival.append(e)
        if self._final and e.bucket is not None and not e.fired:
            e.fired = True
            if all(x.fired for x in e.bucket):
                for x in e.bucket:
                    x.launched = True
                self._step_entries(e.bucket, early=True)

    @contextlib.contextmanager
    def final_backward(self, enabled: bool = True) -> Iterator[None]:
        """As `HostOptimizer.final_backward`: buckets stepped as their gradients complete."""
        if not enabled or not self._overlap:
            yield
            return
        order = self._last_arrival or list(reversed(self._order))
        for e in self._order:
            e.bucket, e.fired = None, False
        cur: list[_SimParam] = []
        size = 0
        for e in order:
            cur.append(e)
            e.bucket = cur
            size += e.param.numel() * 4
            if size >= self._bucket_bytes:
                cur, size = [], 0
        # as HostOptimizer: steps started now keep copies if step() may still fail (a disk)
        self._keep_early = self._atomic and any(
            _may_write_disk(e.plan, self._state_rest(e)) for e in self._order)
        self._final = True
        try:
            yield
        finally:
            self._final = False

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None) -> None:
        self._in_flight, self._in_flight_bytes = [], 0
        self._step_entries([e for e in self._order if not e.launched])
        if self._txn is not None:
            self._txn.end()  # what the step kept for an undo is dropped when it ends
            self._txn = None
        if self._arrival:
            self._last_arrival = self._arrival
        for e in self._order:
            e.count = 0
            e.launched = e.fired = False
            e.bucket = None
        self._arrival = []
        self._refresh_state_view()

    @torch.no_grad()
    def _step_entries(self, batch: list[_SimParam], *, early: bool = False) -> None:
        with self._places.host_code():
            self._step_on_host(batch, early=early)

    def _state_rest(self, e: _SimParam) -> Rest | None:
        """As `HostOptimizer._state_rest`."""
        h = next(iter(e.state_handles.values()), e.master_handle)
        if h is None:
            return None
        store = self._state_store or self._aux
        return Rest.MEMORY if store.host_tensor(h) is not None else Rest.DISK

    def _step_plan(self, e: _SimParam, keep_all: bool) -> StepPlan:
        return _plan_step(e.plan, state=self._state_rest(e) or Rest.MEMORY,
                          has_state=bool(e.state_handles), rows=False,
                          fresh=e.lowp and not e.initialized, keep_all=keep_all)

    def _step_on_host(self, batch: list[_SimParam], *, early: bool) -> None:
        from headroom.optim._sliced import SlicedParam, probe_layout
        from headroom.optim._undo import Txn

        for e in batch:  # sums held on the device go to the store before the step reads them
            if e.kind == Kind.BOUND:
                e.sim.flush(e.slot)

        keep_all = early and self._keep_early
        if self._txn is None:
            self._txn = Txn()
        txn = self._txn
        in_mem = [e for e in batch if not e.streamed and e.has_grad()]
        streamed = [e for e in batch if e.streamed and e.has_grad()]
        for e in streamed:
            if e.state_handles:
                continue
            lay = self._layouts.get(e.group)
            if lay is None:
                lay = self._layouts[e.group] = probe_layout(self._cls, self.param_groups[e.group])
            store = self._state_store or self._aux
            dtype = e.master.dtype if e.master is not None else (
                e.slot.handle.dtype if e.slot.handle.dtype in _MASTER_DTYPES else torch.float32)
            e.state_handles = {k: store.alloc(f"{id(e)}/{k}", tuple(e.param.shape), dtype)
                               for k in lay.shaped}
            if e.lowp:
                e.master_handle = store.alloc(f"{id(e)}/master", tuple(e.param.shape),
                                              torch.float32)
        if streamed:
            items = []
            for e in streamed:
                grad = e.grad_tensor()
                store = e.store
                if e.lowp:
                    master_store, master_handle = self._state_store or self._aux, e.master_handle
                elif e.master is None:
                    master_store, master_handle = store, e.slot.handle
                else:
                    master_store = master_handle = None
                items.append((SlicedParam(
                    master=e.master,
                    master_store=master_store,
                    master_handle=master_handle,
                    grad=grad,
                    grad_store=None if grad is not None else store,
                    grad_handle=None if grad is not None else e.slot.grad_handle,
                    grad_scale=None,
                    state_store=self._state_store or self._aux,
                    state_handles=e.state_handles,
                    small=e.small,
                    initialized=e.initialized,
                    shadow=(e.store, e.slot.handle) if e.lowp else None,
                ), e.group, {k: v for k, v in self.param_groups[e.group].items()
                             if k != "params"}))
            # The step keeps the old values of what it overwrites until it ends (see
            # [Note: all-or-nothing step]) as HostOptimizer's plan says (see [Note: the entry
            # plan]): spares and undo tensors are stood in for by the handles they mirror.
            plans = [self._step_plan(e, keep_all) for e in streamed]
            for (src, _, _), e, plan in zip(items, streamed, plans, strict=True):
                if plan.run is not Run.LAST:
                    src.spare, src.undo = self._guarded(e, src, plan)
            for run, t in ((Run.KEPT, txn), (Run.BARE, None), (Run.LAST, None)):
                todo = [(k, item) for k, (item, plan) in enumerate(zip(items, plans, strict=True))
                        if plan.run is run]
                if not todo:
                    continue
                with torch.device("meta"):  # its landing buffers too
                    results = self._slicer.step_many([item for _, item in todo], t)
                for (k, _), small in zip(todo, results, strict=True):
                    streamed[k].small = small
                    streamed[k].initialized = True
        if in_mem:
            for e in in_mem:
                if self._step_plan(e, keep_all).master is Guard.COPY:
                    txn.ram(e.master, None, e.master.clone())
                    for v in self._inner.state.get(e.master, {}).values():
                        if isinstance(v, torch.Tensor):
                            txn.ram(v, None, v.clone())
            groups = {gi: self._inner.param_groups[k] for gi, k in self._inner_index.items()}
            saved = {}
            for gi, inner in groups.items():
                for k, v in self.param_groups[gi].items():
                    if k != "params":
                        inner[k] = v
                saved[gi] = inner["params"]
                inner["params"] = [e.master for e in in_mem if e.group == gi]
            for e in in_mem:
                e.master.grad = e.grad_tensor()
            try:
                self._inner.step()
            finally:
                for e in in_mem:
                    e.master.grad = None
                for gi, inner in groups.items():
                    inner["params"] = saved[gi]
        for e in in_mem + streamed:
            if e.kind == Kind.HOSTED:
                e.param.detach().copy_(e.master)
                if not self._cpu:
                    self.link_bytes += e.param.numel() * e.param.element_size()

    def _guarded(self, e: _SimParam, src: Any, plan: StepPlan) -> tuple[dict, dict]:
        """``(spare, undo)`` of a sliced step, as `HostOptimizer._undo_handles` makes them
        from ``plan``, each stood in for by the handle it mirrors (same shape and dtype)."""
        stores = {Home.STATE: src.state_store, Home.PARAM: e.store}
        first = next(iter(src.state_handles.values()), None)
        roles = []
        if src.master is None:
            roles.append(("p", plan.master, plan.master_at, src.master_handle))
        elif first is not None:
            roles.append(("p", plan.master, plan.master_at, first))
        roles += [(k, plan.state, plan.state_at, h) for k, h in src.state_handles.items()]
        if src.shadow is not None:
            roles.append(("lp", plan.value, plan.value_at, src.shadow[1]))
        spare: dict[str, Any] = {}
        undo: dict[str, tuple[Any, Any]] = {}
        for name, guard, at, h in roles:
            if guard in (Guard.SPARE, Guard.EXCHANGE):
                spare[name] = h
            elif guard is Guard.UNDO:
                undo[name] = (stores[at], h)
        return spare, undo

    def _refresh_state_view(self) -> None:
        view: dict = {}
        inner = self._inner.state if self._inner is not None else {}
        for e in self._order:
            if not e.streamed:
                st = inner.get(e.master)
                if st:
                    view[e.param] = st
            elif e.initialized:
                st = dict(e.small)
                if self._state_store is None:
                    for k, h in e.state_handles.items():
                        st[k] = self._aux.host_tensor(h)
                view[e.param] = st
        self.state = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        for e in self._order:
            if e.param.grad is not None:
                e.param.grad = None
            if e.kind == Kind.BOUND:
                e.slot.has_grad = False
            e.has_grad_host = False
            e.count = 0
        self._arrival = []

