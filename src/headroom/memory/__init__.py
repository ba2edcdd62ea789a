"""See where memory goes: live tracking by category, reports, plots."""

from headroom.memory._categories import CATEGORIES, Category, format_bytes
from headroom.memory._estimate import Estimate, estimate
from headroom.memory._records import DeviceStats, TimelineSample
from headroom.memory._tracker import (
    MemoryTracker,
    annotate,
    is_tracking,
    note_resting,
    track_memory,
)

__all__ = [
    "CATEGORIES",
    "Category",
    "DeviceStats",
    "Estimate",
    "MemoryTracker",
    "TimelineSample",
    "annotate",
    "estimate",
    "format_bytes",
    "is_tracking",
    "note_resting",
    "track_memory",
]
