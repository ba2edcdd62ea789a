"""What the memory tracker records: public results, and its bookkeeping per storage and peak."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headroom.memory._categories import CATEGORIES

if TYPE_CHECKING:
    from headroom.memory._tracker import MemoryTracker

_NCAT = len(CATEGORIES)


@dataclass(frozen=True)
class TimelineSample:
    """One point of the timeline: bytes per category (all devices) after an op.

    Attributes:
        time_s: seconds since the tracker was entered.
        phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``.
        module: qualified name of the module running (``""`` if none).
        by_category: bytes per category at that moment.
    """

    time_s: float
    phase: str
    module: str
    by_category: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    @property
    def label(self) -> str:
        return f"{self.phase}:{self.module}" if self.module else self.phase


@dataclass(frozen=True)
class DeviceStats:
    """Memory numbers for one device (or for all devices together).

    Attributes:
        peak: most bytes live at once.
        peak_by_category: bytes per category at the moment of ``peak``; they sum to ``peak``.
        max_by_category: each category's own maximum over the run.
        current: bytes live now (at exit, once the tracker has exited).
        allocator: for accelerators, the caching allocator's ``allocated`` and ``reserved``
            bytes (at the peak and their maxima); empty on CPU.
    """

    peak: int
    peak_by_category: dict[str, int]
    max_by_category: dict[str, int]
    current: int
    allocator: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False, weakref_slot=True)
class StorageInfo:
    """What the tracker knows of one live storage."""

    key: int
    device: str
    nbytes: int
    cat: int
    seq: int
    module: str = ""
    saved: int = 0
    ref: weakref.ref | None = None
    # may a role found later be applied to peaks already past? (see MemoryTracker._reclass)
    retro: bool = True


@dataclass(slots=True, eq=False)
class Peak:
    """A running peak whose per-category snapshot is taken lazily."""
    # Between a new peak and the next decrease nothing is freed, and any allocation would make a new
    # peak, so the set of live storages at the first decrease *is* the set at the peak. Taking the
    # snapshot then (not at every new maximum) keeps the hot path O(1), and role discoveries made in
    # between (an output turning out to be saved for backward) land in the right category.

    value: int = 0
    seq: int = -1
    pending: bool = False
    cats: list[int] = field(default_factory=lambda: [0] * _NCAT)
    allocator: dict[str, int] = field(default_factory=dict)
    resting: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class SavedToken:
    """Kept by autograd beside a saved tensor: its release (the graph freed) ends the tensor's
    count as an activation. It holds no tensor (activation offload may keep the bytes elsewhere).
    """

    info: StorageInfo
    tracker: MemoryTracker

    def __del__(self) -> None:
        self.tracker._unsave(self.info)
