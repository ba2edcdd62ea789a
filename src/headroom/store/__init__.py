"""Where tensors rest: stores in host memory and on disk, and what they are made of.

`HostStore` (host memory, page-locked when it feeds an accelerator), `DiskStore` (files with an
index, journal and checksums) and `MetaStore` (a dry run's); also page-locked memory, heap
trimming, claims of keys and safetensors files read by byte range. Moving bytes between a
device and a store is `headroom.transfer`'s, the layer above.
"""

from headroom.store._claims import claimed_keys
from headroom.store._disk import DiskStore
from headroom.store._handle import Handle
from headroom.store._heap import HeapTrimmer, release_pages, trim_heap
from headroom.store._host import HostStore, PinnedPool, add_into, as_bytes, resolve_store
from headroom.store._meta import MetaStore, Places, flat_tensors, to_meta
from headroom.store._pinned import PinnedArena, device_guard, pinned_bytes, set_pinned_limit
from headroom.store._pools import owned_pool
from headroom.store._safetensors import (
    MAX_HEADER_BYTES,
    HeaderError,
    SafetensorsFile,
    TensorInfo,
    open_regular,
    parse_header,
    safetensors_dtypes,
)
from headroom.store._store import (
    SCRATCH,
    Store,
    StoreCorruptError,
    StoreFullError,
    is_accelerator,
)
from headroom.store._values import known_values

__all__ = [
    "DiskStore",
    "Handle",
    "HeaderError",
    "HeapTrimmer",
    "HostStore",
    "MAX_HEADER_BYTES",
    "MetaStore",
    "PinnedArena",
    "PinnedPool",
    "Places",
    "SCRATCH",
    "SafetensorsFile",
    "Store",
    "StoreCorruptError",
    "StoreFullError",
    "TensorInfo",
    "add_into",
    "as_bytes",
    "claimed_keys",
    "device_guard",
    "flat_tensors",
    "is_accelerator",
    "known_values",
    "open_regular",
    "owned_pool",
    "parse_header",
    "pinned_bytes",
    "release_pages",
    "resolve_store",
    "safetensors_dtypes",
    "set_pinned_limit",
    "to_meta",
    "trim_heap",
]
