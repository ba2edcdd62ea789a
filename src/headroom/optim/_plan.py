"""Where a `HostOptimizer` entry's tensors rest and what protects them during a step.

[Note: the entry plan]
`HostOptimizer` takes these decisions here, and only here; its dry run (`_dry.py`, run by
`hr.estimate` and `hr.plan`) is the same optimizer over meta stores.

Where an entry rests (`plan_entry`, once per parameter):

==========================  =========================  ==========  =========================
the parameter               its master                 its step    its gradient
==========================  =========================  ==========  =========================
offloaded (hr.offload),     the store's host tensor    whole [1]   the binding's, in the
fp32/fp64, store in memory  (``STORE_VIEW``)                       store
offloaded, fp32/fp64,       the parameter's handle     sliced      the binding's
store on disk               (``STORE``)
offloaded, bf16/fp16        an fp32 handle beside the  sliced      the binding's, asked for
                            state (``STATE``, lowp)                in fp32
on the CPU in fp32/fp64     the parameter (``PARAM``)  whole [1]   ``param.grad``
anywhere else (accelerator  an fp32 (fp64) copy in     whole [1]   an fp32 copy in host
or bf16/fp16)               host memory (``OWN``)                  memory; copied back
==========================  =========================  ==========  =========================

[1] *whole*: by the wrapped optimizer in one call, state in its dict in host memory; but
*sliced* (`_sliced.SliceRunner`, state in handles) with a ``state_store`` or ``row_sparse``.

What protects each role in a step (`plan_step`, inputs in its Args; see [Note: all-or-nothing
step]): the master (``"p"``), each state tensor, an offloaded bf16/fp16 value (``"lp"``).

* A whole step, or a sliced one that writes no disk: nothing, run last (`Run.LAST`); with
  ``keep_all``, a copy in memory instead.
* Any other sliced step, per role (the *disk*: the state store if the state rests on disk,
  else the offloaded parameter's store if on disk, else none):

  - on disk, every row written: ``SPARE`` for the optimizer's own tensors (handles swap when
    the step ends); ``EXCHANGE`` for the offloaded parameter's value, which the model reads
    through its handle (a spare exchanged into place), where its store can exchange;
  - in memory while there is a disk: an ``UNDO`` tensor on that disk, not a second copy in
    memory (a master in memory only if there is state);
  - otherwise ``UNDO`` in its own store if on disk (rows, or no exchange), else ``COPY``;
  - ``atomic=False``: no ``UNDO`` (``COPY`` while nothing rests in memory); a step updating
    host memory in place keeps no ``COPY`` either (`Run.BARE`), spares and exchanges still used.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

__all__ = ["Guard", "Home", "Kind", "Master", "Rest", "Run", "EntryPlan", "StepPlan",
           "may_write_disk", "plan_entry", "plan_step"]


class Kind(enum.StrEnum):
    """How the optimizer holds a parameter."""

    ALIAS = "alias"  # on the CPU in fp32/fp64: its own master, param.grad its gradient
    HOSTED = "hosted"  # elsewhere: a master and gradient of ours in host memory
    BOUND = "bound"  # offloaded by hr.offload: stepped through its store


class Rest(enum.Enum):
    """Where a store keeps a tensor: host memory handed out zero-copy, or not (a disk)."""

    MEMORY = "memory"
    DISK = "disk"


class Master(enum.Enum):
    """Where the fp32 (fp64) master that the step updates rests."""

    PARAM = "param"  # the parameter itself (ALIAS)
    OWN = "own"  # our copy in host memory (HOSTED)
    STORE_VIEW = "store-view"  # the offloaded parameter's host tensor in its store
    STORE = "store"  # the offloaded parameter's handle in a store on disk
    STATE = "state"  # an fp32 handle of ours beside the state (a bf16/fp16 parameter)

    @property
    def in_memory(self) -> bool:
        return self in (Master.PARAM, Master.OWN, Master.STORE_VIEW)


class Home(enum.Enum):
    """A store of an entry: its state store, or its offloaded parameter's store."""

    STATE = "state"
    PARAM = "param"


class Guard(enum.Enum):
    """What keeps a tensor's old values during a step, so that a failed step is undone."""

    NONE = "none"  # nothing: updated in place, unprotected (it runs last)
    COPY = "copy"  # the old slice copied into host memory
    UNDO = "undo"  # the old slice written to an undo tensor (a scratch key) in a store
    SPARE = "spare"  # new values to a spare of ours; the two swap handles when the step ends
    EXCHANGE = "exchange"  # new values to a spare in its store, exchanged into place at the end


class Run(enum.Enum):
    """Where a step runs in the transaction."""

    LAST = "last"  # after everything that can fail, with nothing kept (or copies if keep_all)
    KEPT = "kept"  # with its old values kept (sliced: spares, undo tensors, copies)
    BARE = "bare"  # atomic=False: spares and exchanges, nothing else kept


@dataclass(frozen=True)
class EntryPlan:
    """Where one entry's tensors rest (see [Note: the entry plan]).

    Attributes:
        sliced: stepped slice by slice, state in handles (else whole, state in a dict).
        store: where the offloaded parameter's store keeps it (``None``: not offloaded).
        state_store: the state goes to a `Store`, not host memory.
        exchange: the offloaded parameter's store can exchange tensors.
    """

    kind: Kind
    master: Master
    sliced: bool
    store: Rest | None
    state_store: bool
    exchange: bool
    atomic: bool

    @property
    def lowp(self) -> bool:
        """An offloaded bf16/fp16 parameter (its fp32 master rests beside the state)."""
        return self.master is Master.STATE


@dataclass(frozen=True)
class StepPlan:
    """What protects one entry's tensors in one step (see [Note: the entry plan]).

    Attributes:
        run: where the step runs in the transaction.
        master, state, value: the guard of the master, of each state tensor, of the
            low-precision value (``None``: no such tensor this step).
        master_at, state_at, value_at: the store of an ``UNDO`` tensor.
    """

    run: Run
    master: Guard | None
    state: Guard | None
    value: Guard | None
    master_at: Home | None = None
    state_at: Home | None = None
    value_at: Home | None = None


def plan_entry(*, store: Rest | None, on_cpu: bool, master_dtype: bool, row_sparse: bool,
               state_store: bool, exchange: bool = False, atomic: bool = True) -> EntryPlan:
    """Where an entry's tensors rest (arguments as `EntryPlan`'s attributes; ``on_cpu``: the
    parameter, not offloaded, is in host memory; ``master_dtype``: it, or its stored value,
    is fp32 or fp64)."""
    if store is not None:
        kind = Kind.BOUND
        if not master_dtype:
            master = Master.STATE
        else:
            master = Master.STORE_VIEW if store is Rest.MEMORY else Master.STORE
    elif on_cpu and master_dtype:
        kind, master = Kind.ALIAS, Master.PARAM
    else:
        kind, master = Kind.HOSTED, Master.OWN
    sliced = state_store or row_sparse or not master.in_memory
    return EntryPlan(kind, master, sliced, store, state_store, exchange and store is not None,
                     atomic)


def may_write_disk(plan: EntryPlan, state: Rest | None) -> bool:
    """Whether the entry's step may write a disk (``state``: `HostOptimizer._state_rest`;
    ``None``, no state yet, counts as a disk)."""
    return plan.store is Rest.DISK or (plan.sliced and plan.state_store
                                       and state is not Rest.MEMORY)


@functools.cache
def plan_step(plan: EntryPlan, *, state: Rest, has_state: bool, rows: bool, fresh: bool,
              keep_all: bool) -> StepPlan:
    """What protects the entry's tensors in one step.

    Args:
        state: where its state store keeps its tensors.
        has_state: it has state tensors (the class keeps per-element state).
        rows: the step touches some rows only (lazy Adam, a later sparse gradient).
        fresh: its fp32 master is made this step from its low-precision value.
        keep_all: a step started inside ``final_backward`` that keeps its old values (some
            entry writes a disk, so ``step()`` may still fail).
    """
    if not plan.sliced:
        guard = Guard.COPY if keep_all else Guard.NONE
        return StepPlan(Run.KEPT if keep_all else Run.LAST, guard, guard, None)
    state_disk = has_state and state is Rest.DISK
    master_home = Home.STATE if plan.lowp else Home.PARAM
    master_rest = None if plan.master.in_memory else (state if plan.lowp else plan.store)
    writes_disk = (master_rest is Rest.DISK or state_disk
                   or (plan.lowp and plan.store is Rest.DISK))
    value = Guard.NONE if plan.lowp else None
    if not keep_all and not writes_disk:
        return StepPlan(Run.LAST, Guard.NONE, Guard.NONE if has_state else None, value)
    in_place = rows or master_rest is not Rest.DISK or (has_state and state is Rest.MEMORY)
    run = Run.KEPT if plan.atomic or not in_place else Run.BARE
    left = Guard.COPY if run is Run.KEPT else Guard.NONE  # kept by the step itself, or not
    disk = Home.STATE if state_disk else Home.PARAM if plan.store is Rest.DISK else None

    def guard(home: Home, rest: Rest, owned: bool) -> tuple[Guard, Home | None]:
        if rest is Rest.MEMORY:
            if disk is None:
                return left, None
            home = disk  # old values on the disk the step writes anyway
        elif not rows and owned:
            return Guard.SPARE, None
        elif not rows and plan.exchange and home is Home.PARAM:
            return Guard.EXCHANGE, None
        return (Guard.UNDO, home) if plan.atomic else (left, None)

    if fresh:
        master, master_at = Guard.NONE, None  # made this step: nothing old to keep
    elif plan.master.in_memory:
        master, master_at = ((Guard.UNDO, disk) if disk is not None and has_state
                             and plan.atomic else (left, None))
    else:
        master, master_at = guard(master_home, master_rest, plan.lowp)
    st, st_at = guard(Home.STATE, state, True) if has_state else (None, None)
    lp, lp_at = guard(Home.PARAM, plan.store, False) if plan.lowp else (None, None)
    return StepPlan(run, master, st, lp, master_at, st_at, lp_at)
