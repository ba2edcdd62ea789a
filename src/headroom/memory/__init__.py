"""See where memory goes: live tracking by category, reports, plots."""

from headroom.memory._categories import CATEGORIES, Category, format_bytes
from headroom.memory._tracker import (
    DeviceStats,
    MemoryTracker,
    TimelineSample,
    annotate,
    resize_storage,
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
    "resize_storage",
    "track_memory",
]
