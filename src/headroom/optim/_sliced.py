"""Running a ``torch.optim`` optimizer slice by slice over tensors resting in a store.

Read a slice's master, gradient and state rows, step them with PyTorch's optimizer, write them
back; the next slice's reads and the last one's writes overlap the update. Exact for
element-wise optimizers: each element's update depends only on it and on per-tensor scalars
(step counts), which every slice carries as its own copy. A sparse gradient is sliced by rows
(`sparse_rows`); after the first step only the rows it names are read and written.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from headroom.memory import annotate
from headroom.optim._follow import follow_
from headroom.optim._undo import Txn, wait_all
from headroom.store import Handle, Store

__all__ = ["ELEMENTWISE", "SPARSE_COALESCED", "ProbeError", "SliceRunner", "probe_shaped",
           "probe_step", "sparse_rows"]

# Only element-wise updates may be sliced; others (Adafactor, Muon, LBFGS) are refused.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam",
                 "Adadelta", "ASGD", "Rprop", "SparseAdam")
    if hasattr(torch.optim, name)
)
# NOTE: Adagrad and SparseAdam coalesce a sparse gradient first, summing duplicate rows in an
# order slices would not repeat: they get slices of the coalesced whole. SGD adds the entries
# one by one, in their order: it gets them as they are.
SPARSE_COALESCED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adagrad, torch.optim.SparseAdam)


def ctor_kwargs(cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters of ``group`` that ``cls``'s constructor accepts."""
    names = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    return {k: v for k, v in group.items() if k in names}


class ProbeError(Exception):
    """``probe_step`` could not step the optimizer with a dense gradient nor a sparse one."""

    def __init__(self, dense: BaseException, sparse: BaseException) -> None:
        super().__init__(f"with a dense gradient {type(dense).__name__}: {dense}; with a sparse "
                         f"gradient {type(sparse).__name__}: {sparse}")
        self.dense = dense
        self.sparse = sparse


def probe_step(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
               ) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """``cls`` built over a small CPU matrix (Muon steps only matrices) and stepped once with a
    dense gradient, else a sparse one (SparseAdam), and the matrix. Raises `ProbeError` if
    neither steps, and what the constructor raises for these options."""
    errors = []
    for sparse in (False, True):
        p = torch.zeros(2, 3)
        p.grad = (torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.full((2, 3), 0.5),
                                          (2, 3), check_invariants=False)
                  if sparse else torch.full((2, 3), 0.5))
        opt = cls([p], **kwargs)
        try:
            opt.step()
            return opt, p
        except Exception as e:  # noqa: BLE001 - reported with the other try's error
            errors.append(e)
    raise ProbeError(*errors)


def probe_shaped(cls: type[torch.optim.Optimizer], group: dict[str, Any]) -> tuple[str, ...]:
    """The keys of ``cls``'s state tensors shaped like the parameter (sliced with it; the rest,
    step counts and scalars, stays in memory), from a one-step probe."""
    opt, p = probe_step(cls, ctor_kwargs(cls, group))
    return tuple(k for k, v in opt.state[p].items()
                 if isinstance(v, torch.Tensor) and tuple(v.shape) == (2, 3))


def sparse_rows(g: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (a slice, or sorted indices) of a sparse COO gradient: its entries there
    in their order, coalesced if ``g`` is."""
    idx, vals = g._indices(), g._values()
    first = idx[0]
    if isinstance(rows, slice):
        n = rows.stop - rows.start
        keep = (first >= rows.start) & (first < rows.stop)
        at = first[keep] - rows.start
    else:
        n = int(rows.numel())
        pos = torch.searchsorted(rows, first)
        keep = (pos < n) & (rows[pos.clamp(max=max(n - 1, 0))] == first) if n else \
            torch.zeros_like(first, dtype=torch.bool)
        at = pos[keep]
    return torch.sparse_coo_tensor(torch.cat([at[None], idx[1:, keep]]), vals[keep],
                                   (n, *g.shape[1:]), is_coalesced=g.is_coalesced(),
                                   check_invariants=False)


def _is_sparse(t: torch.Tensor | None) -> bool:
    return t is not None and t.is_sparse


def _clone_small(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


@dataclass
class SlicedParam:
    """Where one parameter's master, gradient and state rest for a sliced step.

    One of ``master`` (in memory, updated in place) or ``master_handle`` is set; so for the
    gradient (cast to the master's dtype). A bf16/fp16 parameter's value rests at ``shadow``:
    its fp32 master is made from it on the first step, and it is rewritten from the master.
    """

    master: torch.Tensor | None
    master_store: Store | None
    master_handle: Handle | None
    grad: torch.Tensor | None
    grad_store: Store | None
    grad_handle: Handle | None
    grad_scale: torch.Tensor | None
    state_store: Store
    state_handles: dict[str, Handle]
    small: dict[str, Any]
    initialized: bool
    rows: torch.Tensor | None = None  # row-sparse mode: sorted rows to touch; None = all rows
    shadow: tuple[Store, Handle] | None = None  # the low-precision value the master feeds
    # by role ("p" master, state keys, "lp" value), see [Note: all-or-nothing step]: undo
    # tensors of what is kept, and spares the new values go to
    undo: dict[str, tuple[Store, Handle]] = field(default_factory=dict)
    spare: dict[str, Handle] = field(default_factory=dict)
    follow: bool = False  # the master follows a value written since (see _follow.py)


def _vector_lanes() -> int:
    """fp32 lanes of this CPU's widest kernel vector (16 up to AVX-512; SVE names its bits)."""
    bits = "".join(c for c in torch.backends.cpu.get_cpu_capability() if c.isdigit())
    return max(16, int(bits) // 32) if len(bits) >= 3 else 16


# NOTE: the fused CPU kernels step the tail of a tensor element by element, which rounds
# differently (fused multiply-adds): slices start at multiples of the vector width, so each
# element is stepped as in the whole tensor.
_ALIGN = _vector_lanes()


def _rows_per_slice(shape: tuple[int, ...], slice_bytes: int) -> int:
    row = math.prod(shape[1:])
    rows = max(1, slice_bytes // max(1, row * 4))
    step = _ALIGN // math.gcd(row, _ALIGN) if row else 1
    return max(step, rows // step * step)


class SliceRunner:
    """Steps parameters slice by slice with private instances of the optimizer class ``cls``
    (``slice_bytes``: fp32 bytes of a master slice)."""

    def __init__(self, cls: type[torch.optim.Optimizer], *, slice_bytes: int,
                 unfuse_sparse: bool = False) -> None:
        self.cls = cls
        self.slice_bytes = slice_bytes
        self.unfuse_sparse = unfuse_sparse
        self._opts: dict[int, torch.optim.Optimizer] = {}
        self._bufs: dict[tuple[str, int], torch.Tensor] = {}

    def _buf(self, name: str, parity: int, handle: Handle, n_rows: int) -> torch.Tensor:
        """A reusable landing buffer for ``n_rows`` rows of ``handle``."""
        shape = (n_rows, *handle.shape[1:])
        nbytes = math.prod(shape) * handle.dtype.itemsize
        buf = self._bufs.get((name, parity))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self._bufs[(name, parity)] = buf
        # working memory, whatever the slice holds (not parameters or gradients to a tracker)
        annotate(buf, "optimizer_state")
        return buf[:nbytes].view(handle.dtype).view(shape)

    def _optimizer(self, gi: int, group: dict[str, Any]) -> torch.optim.Optimizer:
        opt = self._opts.get(gi)
        if opt is None:
            placeholder = torch.zeros(1)
            opt = self.cls([placeholder], **ctor_kwargs(self.cls, group))
            opt.state.clear()
            opt._headroom_private = True  # hr.offload's global step hooks skip it
            self._opts[gi] = opt
        opt.param_groups[0].update(group)  # hyperparameters only (`_hparams`: no "params")
        return opt

    def _fresh_state(self, work: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        # A throwaway instance covers state made in the constructor (Adagrad) or in step();
        # on the CPU: under a dry run's meta default device, made-up tensors have no value.
        with torch.device("cpu"):
            tmp = self.cls([work], **ctor_kwargs(self.cls, group))
        return dict(tmp.state.get(work, {}))

    def step_many(
        self, items: list[tuple[SlicedParam, int, dict[str, Any]]], txn: Txn | None = None
    ) -> list[dict[str, Any]]:
        """Step several parameters as one pipeline of slices (the disk stays busy between
        parameters); returns their new small states. With ``txn``, each slice's old values
        are kept in it first (see [Note: all-or-nothing step]); on an exception every write
        issued has ended before it propagates.
        """
        results: list[dict[str, Any]] = [src.small for src, _, _ in items]
        slices: list[tuple[int, int, int]] = []  # (item, first row, end row)
        for k, (src, gi, group) in enumerate(items):
            shape = (src.master_handle.shape if src.master is None else tuple(src.master.shape))
            if not shape:  # 0-dim: one element, outside the pipeline
                results[k] = self._step_scalar(src, self._optimizer(gi, group), group, txn)
                continue
            n_rows = shape[0] if src.rows is None else int(src.rows.numel())
            if n_rows == 0 and (src.rows is None or _is_sparse(src.grad)):
                # an empty shard or sparse gradient: step counts advance, as in torch
                results[k] = self._step_empty(src, self._optimizer(gi, group), group,
                                              (0, *shape[1:]))
                continue
            per = _rows_per_slice(shape, self.slice_bytes)
            slices += [(k, a, min(a + per, n_rows)) for a in range(0, n_rows, per)]
        if not slices:
            return results
        pending_writes: list[list[Future]] = [[], []]

        def fetch(i: int) -> dict[str, Any]:
            k, a, b = slices[i]
            src = items[k][0]
            rows = slice(a, b) if src.rows is None else src.rows[a:b]
            par = i % 2
            got: dict[str, Any] = {"rows": rows}
            if src.shadow is not None and not src.initialized:
                got["p"] = self._load(None, *src.shadow, rows, ("lp", par, b - a))
            else:
                got["p"] = self._load(src.master, src.master_store, src.master_handle, rows,
                                      ("p", par, b - a))
            if _is_sparse(src.grad):
                got["g"] = sparse_rows(src.grad, rows)
            else:
                got["g"] = self._load(src.grad, src.grad_store, src.grad_handle, rows,
                                      ("g", par, b - a))
            if src.initialized:
                got["s"] = {
                    key: self._load(None, src.state_store, h, rows, ("s" + key, par, b - a))
                    for key, h in src.state_handles.items()
                }
                if src.shadow is not None and (src.follow or (
                        txn is not None and "lp" not in src.spare)):  # to follow, or to keep
                    got["lp"] = self._load(None, *src.shadow, rows, ("lp", par, b - a))
            if txn is not None:
                # host slices with an undo tensor on disk: written from the resting tensor now,
                # while an earlier slice is updated; this one's update waits (`_keep`)
                views = [] if src.shadow is not None and not src.initialized else [
                    ("p", got["p"])]
                views += [(k, v) for k, v in got.get("s", {}).items() if k not in src.spare]
                got["undo"] = {name: src.undo[name][0].write_rows(src.undo[name][1], rows, v.t)
                               for name, v in views
                               if isinstance(v, _InPlace) and name in src.undo}
                pending_writes[par].extend(got["undo"].values())  # waited for on an error
            return got

        nxt = None
        try:
            nxt = fetch(0)
            self._pipeline(items, slices, results, fetch, nxt, pending_writes, txn)
        except BaseException:
            # Nothing may still be writing when the caller puts the old values back.
            wait_all([f for ws in pending_writes for f in ws])
            raise
        return results

    def _pipeline(self, items, slices, results, fetch, nxt, pending_writes, txn) -> None:
        for i, (k, _, _) in enumerate(slices):
            src, gi, group = items[k]
            opt = self._optimizer(gi, group)
            cur = nxt
            if i + 1 < len(slices):
                # the other buffer's writes done, the next reads overlap this update
                for f in pending_writes[(i + 1) % 2]:
                    f.result()
                pending_writes[(i + 1) % 2] = []
                nxt = fetch(i + 1)
            work = _result(cur["p"])
            grad = _result(cur["g"])
            rows = cur["rows"]
            kept = [] if txn is None else self._keep(src, cur, rows, txn)
            if src.follow and src.initialized:  # after its old values are kept
                follow_(work, _result(cur["lp"]))
            if src.shadow is not None and not src.initialized:
                work = work.float()  # the fp32 master starts from the low-precision value
            owned = isinstance(cur["g"], Future)
            if grad.dtype != work.dtype:
                grad = grad.to(work.dtype)
                owned = True
            if src.grad_scale is not None:  # in place only in a landed copy
                grad = grad.mul_(src.grad_scale) if owned else grad.mul(src.grad_scale)
            resting = cur.get("s", {})
            state = self._run(opt, group, src, work, grad,
                              lambda s=resting: {key: _result(v) for key, v in s.items()})
            writes = pending_writes[i % 2]
            failed = None
            for fut, rec, ram in kept:
                # new values go out once the old ones are kept (a failed undo write stops
                # here; a host tensor already updated in place keeps them in memory)
                writes.append(fut)
                try:
                    fut.result()
                    rec()
                except BaseException as ex:  # noqa: BLE001 - re-raised below
                    failed = failed or ex
                    if ram is not None:
                        txn.ram(*ram)
            if failed is not None:
                raise failed
            for key, h in src.state_handles.items():
                t = state[key]
                v = resting.get(key)
                if isinstance(v, _InPlace) and t is v.t:
                    continue  # updated in place in the resting host tensor
                writes.append(src.state_store.write_rows(src.spare.get(key, h), rows,
                                                         t.contiguous()))
            fresh = src.shadow is not None and not src.initialized
            if fresh or isinstance(cur["p"], Future):
                writes.append(src.master_store.write_rows(
                    src.master_handle if fresh else src.spare.get("p", src.master_handle),
                    rows, work))
            elif src.rows is not None and src.master is not None:
                src.master.index_copy_(0, rows, work)
            if src.shadow is not None:
                sh_store, sh_handle = src.shadow
                host = sh_store.host_tensor(sh_handle) if isinstance(rows, slice) else None
                if host is not None:
                    host[rows].copy_(work)  # rounded as .to() rounds, with no temporary
                else:
                    writes.append(sh_store.write_rows(src.spare.get("lp", sh_handle), rows,
                                                      work.to(sh_handle.dtype)))
            results[k] = {key: state[key] for key in state if key not in src.state_handles}
        for ws in pending_writes:
            for f in ws:
                f.result()

    def _keep(self, src: SlicedParam, cur: dict[str, Any], rows: slice | torch.Tensor,
              txn: Txn) -> list[tuple[Future, Callable[[], None], tuple | None]]:
        """Keep the old values this slice overwrites: copies in ``txn``, or undo writes
        (returned, each with the record to add once it landed)."""
        pending: list[tuple[Future, Callable[[], None], tuple | None]] = []

        def keep(loaded: Any, mem: torch.Tensor | None, store: Store | None,
                 handle: Handle | None, name: str) -> None:
            undo = src.undo.get(name)
            early = cur.get("undo", {}).get(name)
            if early is not None:  # a host-memory slice, its old values already on their way
                early.result()  # raises before this slice changed
                txn.ram_from(loaded.t, None, undo, rows)
                return
            old = _result(loaded).clone()  # the update changes the landed slice in place
            # in place (a host tensor): updated before an undo write is known to have landed
            ram = (loaded.t, None, old) if isinstance(loaded, _InPlace) else None
            if undo is None:
                if ram is None and mem is not None:
                    ram = (mem, rows, old)
                if ram is not None:
                    txn.ram(*ram)
                else:
                    txn.stored_copy(store, handle, rows, old)
                return
            if mem is not None:  # a master in memory, its old values kept on a disk
                rec = functools.partial(txn.ram_from, *(ram[:2] if ram else (mem, rows)), undo,
                                        rows)
            else:
                rec = functools.partial(txn.stored, store, handle, rows, undo)
            pending.append((undo[0].write_rows(undo[1], rows, old), rec, ram))

        fresh = src.shadow is not None and not src.initialized
        # (a master made from the low-precision value is new: nothing to keep)
        if not fresh and "p" not in src.spare:
            keep(cur["p"], src.master, src.master_store, src.master_handle, "p")
        if src.initialized:
            for key, h in src.state_handles.items():
                if key not in src.spare:
                    keep(cur["s"][key], None, src.state_store, h, key)
        if src.shadow is not None and "lp" not in src.spare:
            keep(cur["p"] if fresh else cur["lp"], None, *src.shadow, "lp")
        return pending

    def _run(self, opt, group, src: SlicedParam, work: torch.Tensor, grad: torch.Tensor,
             shaped: Callable[[], dict[str, torch.Tensor]]) -> dict[str, Any]:
        """Step ``opt`` on one tensor; returns its new state (``shaped()``: the resting
        per-element state, once initialized)."""
        if src.initialized:
            state = shaped()
            state.update({k: _clone_small(v) for k, v in src.small.items()})
        else:
            state = self._fresh_state(work, group)
        group = opt.param_groups[0]
        fused = group.get("fused")
        if fused and self.unfuse_sparse and grad.is_sparse:
            group["fused"] = False
        group["params"] = [work]
        opt.state[work] = state
        work.grad = grad
        try:
            opt.step()
        finally:
            work.grad = None
            group["params"] = []
            if "fused" in group:
                group["fused"] = fused
            state = opt.state.pop(work, state)
        return state

    def _step_empty(self, src: SlicedParam, opt, group, shape: tuple[int, ...]
                    ) -> dict[str, Any]:
        """The new small state of a parameter with no elements."""
        dtype = src.master_handle.dtype if src.master is None else src.master.dtype
        work = torch.empty(shape, dtype=dtype)
        grad = sparse_rows(src.grad, slice(0, 0)) if _is_sparse(src.grad) else \
            torch.zeros_like(work)
        state = self._run(opt, group, src, work, grad.to(dtype), lambda: {
            k: torch.empty(shape, dtype=h.dtype) for k, h in src.state_handles.items()})
        return {k: state[k] for k in state if k not in src.state_handles}

    def _step_scalar(self, src: SlicedParam, opt, group, txn: Txn | None) -> dict[str, Any]:
        fresh = src.shadow is not None and not src.initialized
        if fresh:
            work = src.shadow[0].read(src.shadow[1]).result().float()
        else:
            work = (src.master if src.master is not None
                    else src.master_store.read(src.master_handle).result())
        if txn is not None:  # one element each: kept in memory
            if src.shadow is not None and "lp" not in src.spare:
                txn.stored_copy(*src.shadow, None, src.shadow[0].read(src.shadow[1]).result())
            if not fresh and src.master is not None:
                txn.ram(src.master, None, src.master.clone())
            elif not fresh and "p" not in src.spare:
                txn.stored_copy(src.master_store, src.master_handle, None, work.clone())
            if src.initialized:
                for key, h in src.state_handles.items():
                    if key not in src.spare:
                        txn.stored_copy(src.state_store, h, None,
                                        src.state_store.read(h).result())
        if src.follow and not fresh:
            follow_(work, src.shadow[0].read(src.shadow[1]).result())
        grad = src.grad if src.grad is not None else src.grad_store.read(src.grad_handle).result()
        if grad.dtype != work.dtype:
            grad = grad.to(work.dtype)
        if src.grad_scale is not None:
            grad = grad.mul(src.grad_scale)
        state = self._run(opt, group, src, work, grad, lambda: {
            k: src.state_store.read(h).result() for k, h in src.state_handles.items()})
        for k, h in src.state_handles.items():
            src.state_store.write(src.spare.get(k, h), state[k].contiguous()).result()
        if src.master is None:
            src.master_store.write(
                src.master_handle if fresh else src.spare.get("p", src.master_handle),
                work).result()
        if src.shadow is not None:
            src.shadow[0].write(src.spare.get("lp", src.shadow[1]),
                                work.to(src.shadow[1].dtype)).result()
        return {k: state[k] for k in state if k not in src.state_handles}

    def _load(
        self, mem: torch.Tensor | None, store: Store | None, handle: Handle | None,
        rows: slice | torch.Tensor, buf: tuple[str, int, int],
    ) -> Any:
        """A slice: a view of a tensor in memory or resting in a host store, or a read future."""
        if mem is not None:
            if isinstance(rows, slice):
                return _InPlace(mem[rows])
            return mem.index_select(0, rows)
        assert store is not None and handle is not None
        host = store.host_tensor(handle)
        if host is not None and isinstance(rows, slice):
            return _InPlace(host[rows])
        return store.read_rows(handle, rows, out=self._buf(buf[0], buf[1], handle, buf[2]))


class _InPlace:
    """A slice that is a view of the resting tensor: updating it updates the rest."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _result(x: Any) -> torch.Tensor:
    if isinstance(x, _InPlace):
        return x.t
    if isinstance(x, Future):
        return x.result()
    return x
