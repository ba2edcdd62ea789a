"""Where tensors rest and how they move: stores (host memory, disk) and the mover.

This layer is the only one that knows about streams, events, page-locked memory and file I/O.
"""

from headroom.transfer._binding import (
    ListenerHandle,
    ParamBinding,
    adopt_grad,
    bind,
    binding,
    flush_grad,
    grad_ready,
    note_value_edit,
    on_grad_ready,
    relay_done,
    sync_grad,
    unbind,
    value_edits,
    weak_method,
    weak_post_accumulate_grad_hook,
)
from headroom.transfer._claims import claimed_keys
from headroom.transfer._device import check_device, stream_module
from headroom.transfer._disk import DiskStore
from headroom.transfer._handle import Handle
from headroom.transfer._heap import HeapTrimmer, release_pages, trim_heap
from headroom.transfer._host import HostStore, PinnedPool, add_into, resolve_store
from headroom.transfer._meta import MetaStore, Places, flat_tensors, to_meta
from headroom.transfer._mover import _MAX_STAGED_BYTES as MAX_STAGED_BYTES
from headroom.transfer._mover import Mover, Ticket
from headroom.transfer._pickle import keep_for_child
from headroom.transfer._pinned import PinnedArena, pinned_bytes, set_pinned_limit
from headroom.transfer._pools import owned_pool, stop_pool
from headroom.transfer._rows import RowStreamer
from headroom.transfer._safetensors import (
    MAX_HEADER_BYTES,
    HeaderError,
    SafetensorsFile,
    TensorInfo,
    open_regular,
    parse_header,
    safetensors_dtypes,
)
from headroom.transfer._stash import Stash, StashTicket
from headroom.transfer._storage import resize_storage
from headroom.transfer._store import (
    Store,
    StoreCorruptError,
    StoreFullError,
    is_accelerator,
)
from headroom.transfer._store_tensor import (
    GradSource,
    HandleSource,
    HeldSource,
    Source,
    StoreTensor,
    is_stored_grad,
)
from headroom.transfer._values import known_values

__all__ = [
    "DiskStore",
    "Handle",
    "HeaderError",
    "HeapTrimmer",
    "HostStore",
    "MetaStore",
    "ListenerHandle",
    "MAX_HEADER_BYTES",
    "MAX_STAGED_BYTES",
    "Mover",
    "ParamBinding",
    "PinnedArena",
    "PinnedPool",
    "Places",
    "RowStreamer",
    "SafetensorsFile",
    "Stash",
    "StashTicket",
    "GradSource",
    "HandleSource",
    "Source",
    "Store",
    "StoreCorruptError",
    "StoreTensor",
    "HeldSource",
    "StoreFullError",
    "TensorInfo",
    "Ticket",
    "add_into",
    "adopt_grad",
    "bind",
    "binding",
    "check_device",
    "claimed_keys",
    "flat_tensors",
    "flush_grad",
    "is_accelerator",
    "is_stored_grad",
    "keep_for_child",
    "grad_ready",
    "note_value_edit",
    "on_grad_ready",
    "open_regular",
    "owned_pool",
    "parse_header",
    "pinned_bytes",
    "relay_done",
    "release_pages",
    "resize_storage",
    "resolve_store",
    "safetensors_dtypes",
    "set_pinned_limit",
    "stream_module",
    "stop_pool",
    "sync_grad",
    "to_meta",
    "known_values",
    "trim_heap",
    "unbind",
    "value_edits",
    "weak_method",
    "weak_post_accumulate_grad_hook",
]
