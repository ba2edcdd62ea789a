"""Where the tensors of a dry run stand: the compute device, host memory, or nowhere.

Every tensor of a dry run is a ``meta`` tensor, counted as the target device's unless `Places`
names its storage host memory (masters, optimizer state, a host step) or no memory at all (a
parameter whose value rests on disk). `MetaStore` is the store features rest in during a dry
run; `to_meta` and `flat_tensors` are helpers every dry run shares.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from headroom.store._handle import Handle
from headroom.store._store import Store, done
from headroom.store._values import keeps_values, known_values


def to_meta(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a ``meta`` tensor of the same shape and dtype.

    A tensor given twice (``labels=input_ids``) gets one stand-in. The values of integer and
    boolean tensors are kept beside their stand-ins (`headroom.store._values`).
    """
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            if id(t) in seen:
                return seen[id(t)][1]
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if keeps_values(t):
                # NOTE: unseen by dispatch modes: no tracker counts the copy as the step's memory
                with torch._C._DisableTorchDispatch():
                    known_values.put(out, t.detach().to("cpu", copy=True))
            seen[id(t)] = (t, out)  # t kept: its id stays its own while the map is made
            return out.requires_grad_(t.requires_grad)
        return t

    return tree_map(one, obj)


def flat_tensors(items: list[Any]) -> list[torch.Tensor]:
    """The tensors among ``items`` and inside the lists and tuples among them."""
    out = []
    for a in items:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


class Places:
    """Which ``meta`` storages of a dry run (by ``_cdata`` key, held for the whole dry run) are
    host memory, and which are no memory at all."""

    def __init__(self) -> None:
        self.host: set[int] = set()
        self.nowhere: set[int] = set()
        self.depth = 0  # > 0: code running on the host (an optimizer step there)
        self._keep: list[Any] = []
        self._made: dict[int, weakref.ref] = {}  # made by host code, while they live

    def on_host(self, t: torch.Tensor) -> torch.Tensor:
        return self._name(t, self.host)

    def no_memory(self, t: torch.Tensor) -> torch.Tensor:
        return self._name(t, self.nowhere)

    def _name(self, t: torch.Tensor, where: set[int]) -> torch.Tensor:
        st = t.untyped_storage()
        where.add(st._cdata)
        self._keep.append(st)
        return t

    @contextlib.contextmanager
    def host_code(self) -> Iterator[None]:
        """Tensors made inside are host memory (a step that runs on the host), also those the
        tracker sees only later: a dispatch mode notes every ``meta`` storage an op makes."""
        self.depth += 1
        try:
            with _MarkMade(self):
                yield
        finally:
            self.depth -= 1

    def where(self, key: int) -> str | None:
        """``"nowhere"``, ``"host"`` or ``None`` (the compute device) for a new storage."""
        if key in self.nowhere:
            return "nowhere"
        if key in self.host or self.depth > 0 or key in self._made:
            return "host"
        return None

    def _mark_made(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._made:
            self._made[key] = weakref.ref(st, lambda _, k=key: self._made.pop(k, None))


class _MarkMade(TorchDispatchMode):
    def __init__(self, places: Places) -> None:
        super().__init__()
        self.places = places

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        made = [t for t in outs if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        if made:
            # views and in-place results are the inputs' storages (a DTensor's: its shard's)
            given = {_local(t).untyped_storage()._cdata
                     for t in flat_tensors([*args, *(kwargs or {}).values()])}
            for t in made:
                if _local(t).untyped_storage()._cdata not in given:
                    self.places._mark_made(_local(t))
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


class MetaStore(Store):
    """A store for dry runs: ``host=True`` keeps ``meta`` tensors (standing for host memory),
    ``host=False`` keeps nothing (standing for a disk, which can exchange tensors). Reads and
    writes finish at once, counted in ``read_bytes`` and ``written_bytes`` (for the planner's
    time model). Code shared with real stores asks ``isinstance(store, MetaStore)`` where they
    differ: values given to it are known, and what rests on its disk is a `stand_in`.
    """

    def __init__(self, places: Places, *, host: bool) -> None:
        super().__init__(max_bytes=None)
        self.places = places
        self.host = host
        self._tensors: dict[str, torch.Tensor] = {}
        self.read_bytes = 0
        self.written_bytes = 0

    @property
    def holds_host_memory(self) -> bool:  # type: ignore[override]
        return self.host

    @property
    def can_exchange(self) -> bool:  # type: ignore[override]
        return not self.host

    def alloc(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, *,
              zero: bool = True) -> Handle:
        h = Handle.of(key, shape, dtype, self)
        self._handles[key] = h
        if self.host:
            make = torch.zeros if zero else torch.empty
            self._tensors[key] = self.places.on_host(make(shape, dtype=dtype, device="meta"))
        return h

    def free(self, h: Handle) -> None:
        self._handles.pop(h.key, None)
        self._tensors.pop(h.key, None)

    def alloc_spare(self, h: Handle, key: str) -> Handle:
        return self.alloc(key, h.shape, h.dtype, zero=False)

    def exchange(self, pairs: list[tuple[Handle, Handle]]) -> None:
        pass  # an index change: no bytes move

    def adopt(self, key: str, t: torch.Tensor) -> Handle:
        """Make ``t`` (a ``meta`` tensor) the host tensor kept under ``key``."""
        h = Handle.of(key, tuple(t.shape), t.dtype, self)
        self._handles[key] = h
        if self.host:
            self._tensors[key] = self.places.on_host(t)
        return h

    def put(self, key: str, t: torch.Tensor) -> Handle:
        """Keep ``t`` (a ``meta`` tensor: host memory, or at rest on disk, which is none)."""
        if not self.host:
            self.places.no_memory(t)
        return self.adopt(key, t)

    def host_tensor(self, h: Handle) -> torch.Tensor | None:
        return self._tensors.get(h.key)

    def stand_in(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``meta`` tensor, unseen by dispatch modes, for values resting here (no memory)."""
        with torch._C._DisableTorchDispatch():
            return self.places.no_memory(torch.empty(shape, dtype=dtype, device="meta"))

    def read(self, h: Handle, out: torch.Tensor | None = None) -> Future:
        self.read_bytes += h.nbytes
        if out is None:
            out = self._tensors.get(h.key)
            if out is None:  # a copy read from disk into new host memory
                out = self.places.on_host(torch.empty(h.shape, dtype=h.dtype, device="meta"))
        return done(out)

    def write(self, h: Handle, src: torch.Tensor) -> Future:
        self.written_bytes += h.nbytes
        return done(None)

    def read_rows(self, h: Handle, rows: Any, out: torch.Tensor | None = None) -> Future:
        self.read_bytes += _rows(h, rows) * h.row_nbytes
        if out is None:
            t = self._tensors.get(h.key)
            out = t[rows] if t is not None else None
        return done(out)

    def write_rows(self, h: Handle, rows: Any, src: torch.Tensor) -> Future:
        self.written_bytes += _rows(h, rows) * h.row_nbytes
        return done(None)


def _rows(h: Handle, rows: Any) -> int:
    if isinstance(rows, slice):
        return len(range(*rows.indices(h.shape[0])))
    return int(rows.numel())
