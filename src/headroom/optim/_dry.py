"""`hr.HostOptimizer` in a dry run: its entries, gradient hand-offs and step, on ``meta`` tensors.

The same decisions as `headroom.optim.HostOptimizer`: a parameter on the CPU in fp32 is its own
master (*alias*); a parameter offloaded by `hr.offload` is stepped through its store (*bound*;
its master is the store's host tensor, or on disk); any other gets an fp32 master and gradient
in host memory, where its gradient goes as soon as it is complete (*hosted*). Masters held in
memory are stepped by PyTorch's own optimizer class; the others, and all of them when the state
rests on a store, take the sliced step, which here is `headroom.optim._sliced.SliceRunner`
itself, reading from and writing to a `MetaStore`. Inside ``final_backward`` (``overlap``) a
bucket of parameters is stepped as soon as its gradients are complete, here at that moment on
the backward thread rather than on a worker beside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from headroom.optim._entries import ALIAS as _ALIAS
from headroom.optim._entries import BOUND as _BOUND
from headroom.optim._entries import HOSTED as _HOSTED
from headroom.optim._entries import MASTER_DTYPES as _MASTER_DTYPES
from headroom.transfer import MetaStore, Places, weak_post_accumulate_grad_hook


class _SimParam:
    __slots__ = ("param", "group", "kind", "master", "grad_host", "slot", "store", "streamed",
                 "state_handles", "small", "initialized", "count", "launched", "bucket",
                 "fired", "has_grad_host", "lowp", "master_handle", "sim")

    def __init__(self, param: torch.Tensor, group: int) -> None:
        self.param = param
        self.group = group
        self.kind = _ALIAS
        self.master: torch.Tensor | None = None
        self.grad_host: torch.Tensor | None = None  # hosted: the host gradient
        self.has_grad_host = False
        self.slot: Any = None  # bound: the offload dry run's slot
        self.store: MetaStore | None = None  # bound: the store of that slot
        self.streamed = False
        self.state_handles: dict[str, Any] = {}
        self.small: dict[str, Any] = {}
        self.initialized = False
        self.count = 0
        self.launched = False
        self.bucket: list[_SimParam] | None = None
        self.fired = False
        self.lowp = False  # bound and low precision: an fp32 master of its own in the state
        self.master_handle: Any = None  # store, fed back into the parameter (the shadow)
        self.sim: Any = None  # bound: the offload dry run holding its slot

    def has_grad(self) -> bool:
        if self.kind == _ALIAS:
            return self.param.grad is not None
        if self.kind == _BOUND:
            return self.slot.has_grad
        return self.has_grad_host

    def grad_tensor(self) -> torch.Tensor | None:
        if self.kind == _ALIAS:
            return self.param.grad
        if not self.has_grad():
            return None
        if self.kind == _BOUND:
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
            if e.kind == _BOUND:
                e.slot.listeners.append(self._on_grad)
            elif e.param.requires_grad:
                weak_post_accumulate_grad_hook(e.param, self._on_grad)  # see its NOTE

    def _entry(self, p: torch.Tensor, gi: int) -> _SimParam:
        e = _SimParam(p, gi)
        found = self._slots.get(id(p))
        if found is not None:
            sim, slot = found
            e.kind = _BOUND
            e.sim = sim
            e.slot = slot
            e.store = sim.store
            host = sim.store.host_tensor(slot.handle)
            if host is not None and host.dtype in _MASTER_DTYPES:
                e.master = host
            e.lowp = slot.handle.dtype not in _MASTER_DTYPES
            if e.lowp and slot.grad_handle is None:
                # as HostOptimizer asks the store (want_fp32_grad): an fp32 gradient
                slot.grad_dtype = torch.float32
        elif (self._cpu or self._places.where(p.untyped_storage()._cdata) == "host") \
                and p.dtype in _MASTER_DTYPES:
            # on the CPU in fp32 (an FSDP2 shard resting in host memory too): its own master
            e.master = p.detach()
        else:
            e.kind = _HOSTED
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            e.master = self._places.on_host(torch.empty(p.shape, dtype=dtype, device="meta"))
            e.grad_host = self._places.on_host(torch.empty(p.shape, dtype=dtype, device="meta"))
        e.streamed = not self._state_on_host or e.master is None
        return e

    def stores(self) -> list[MetaStore]:
        """The stores its step reads and writes (the state's, its host memory)."""
        return [s for s in (self._state_store, self._aux, self._host_store) if s is not None]

    # ------------------------------------------------------------------ gradients
    def _on_grad(self, p: torch.Tensor) -> None:
        e = self._entries.get(id(p))
        if e is None:
            return
        if e.kind == _HOSTED and p.grad is not None:
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
        elif e.kind == _BOUND and self._final:
            e.sim.flush(e.slot)  # its step starts now (grad_accumulation="device")
        e.count += 1
        if e.count == 1:
            self._arrival.append(e)
        if self._final and e.bucket is not None and not e.fired:
            e.fired = True
            if all(x.fired for x in e.bucket):
                for x in e.bucket:
                    x.launched = True
                self._step_entries(e.bucket)

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
        if self._arrival:
            self._last_arrival = self._arrival
        for e in self._order:
            e.count = 0
            e.launched = e.fired = False
            e.bucket = None
        self._arrival = []
        self._refresh_state_view()

    @torch.no_grad()
    def _step_entries(self, batch: list[_SimParam]) -> None:
        with self._places.host_code():
            self._step_on_host(batch)

    def _step_on_host(self, batch: list[_SimParam]) -> None:
        from headroom.optim._sliced import SlicedParam, probe_layout
        from headroom.optim._undo import Txn

        for e in batch:  # sums held on the device go to the store before the step reads them
            if e.kind == _BOUND:
                e.sim.flush(e.slot)

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
        if in_mem:
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
            # [Note: all-or-nothing step]), as HostOptimizer._undo_handles decides: copies in
            # host memory count here; what rests in host memory keeps its old values on a disk
            # the step writes anyway; state (and a bf16 parameter's fp32 master) on disk goes
            # to spares, and an offloaded parameter on disk to a spare exchanged into place
            # (one write of the new values, no undo copy); other disk tensors (rows of a lazy
            # step) to undo tensors.
            # atomic=False keeps nothing (spares only).
            txn = Txn() if self._atomic else None
            for (src, _, _), e in zip(items, streamed, strict=True):
                src.spare, src.undo = _undo_plan(src, e)
                if txn is None:
                    src.undo = {}
            with torch.device("meta"):  # its landing buffers too
                results = self._slicer.step_many(items, txn)
            if txn is not None:
                txn.end()
            for e, small in zip(streamed, results, strict=True):
                e.small = small
                e.initialized = True
        for e in in_mem + streamed:
            if e.kind == _HOSTED:
                e.param.detach().copy_(e.master)
                if not self._cpu:
                    self.link_bytes += e.param.numel() * e.param.element_size()

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
            if e.kind == _BOUND:
                e.slot.has_grad = False
            e.has_grad_host = False
            e.count = 0
        self._arrival = []


def _undo_plan(src: Any, e: _SimParam) -> tuple[dict, dict]:
    """``(spare, undo)`` of a dry sliced step: `HostOptimizer._undo_handles`'s choices over
    meta stores (a meta store without host tensors stands for a `DiskStore`, which can
    exchange). Spares and undo tensors are stood in for by the handles they mirror (same
    shape and dtype, so the same bytes move)."""
    st = src.state_store

    def on_disk(store: Any, h: Any) -> bool:
        return store.host_tensor(h) is None

    first = next(iter(src.state_handles.values()), None)
    disk = None
    if first is not None and on_disk(st, first):
        disk = st
    elif e.store is not None and on_disk(e.store, e.slot.handle):
        disk = e.store  # the parameter's own store
    want: dict[str, tuple[Any, Any]] = {}
    if src.master is None and not (src.shadow is not None and not src.initialized):
        want["p"] = (src.master_store, src.master_handle)
    for k, h in src.state_handles.items():
        want[k] = (st, h)
    if src.shadow is not None:
        want["lp"] = src.shadow
    if src.master is not None and disk is not None and first is not None:
        want["p"] = (disk, first)
    spare: dict[str, Any] = {}
    undo: dict[str, tuple[Any, Any]] = {}
    for name, (store, h) in want.items():
        where = store
        if name == "p" and src.master is not None:
            pass  # a master in memory: its old values on ``disk``
        elif not on_disk(store, h):
            if disk is None:
                continue  # kept in memory (the in-place step's copy)
            where = disk
        whole = where is store and src.rows is None
        if whole and (name in src.state_handles or (name == "p" and e.lowp)):
            spare[name] = h  # ours: new values to a spare, swapped in when the step ends
        elif whole and on_disk(store, h) and src.master is None:
            spare[name] = h  # the offloaded parameter's own tensor: exchanged into place
        else:
            undo[name] = (where, h)
    return spare, undo
