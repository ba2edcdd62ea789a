"""See where memory goes: live tracking by category, reports, plots."""

from headroom.memory._categories import CATEGORIES, Category, format_bytes
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
    "MemoryTracker",
    "TimelineSample",
    "annotate",
    "format_bytes",
    "is_tracking",
    "note_resting",
    "track_memory",
]
