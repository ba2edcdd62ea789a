"""See where memory goes: live tracking by category, reports, plots."""

from headroom.memory._allocator import CachingAllocatorModel
from headroom.memory._categories import CATEGORIES, Category, format_bytes
from headroom.memory._records import DeviceStats, StorageInfo, TimelineSample
from headroom.memory._tracker import (
    MemoryTracker,
    annotate,
    is_tracking,
    note_resting,
    track_memory,
    track_this_thread,
)

__all__ = [
    "CATEGORIES",
    "CachingAllocatorModel",
    "Category",
    "DeviceStats",
    "MemoryTracker",
    "StorageInfo",
    "TimelineSample",
    "annotate",
    "format_bytes",
    "is_tracking",
    "note_resting",
    "track_memory",
    "track_this_thread",
]


def __getattr__(name: str):
    if name in ("estimate", "Estimate"):  # the estimator is a layer above: headroom.fit
        raise AttributeError(
            f"headroom.memory.{name} moved: use headroom.{name} (from headroom.fit)")
    raise AttributeError(f"module 'headroom.memory' has no attribute {name!r}")
