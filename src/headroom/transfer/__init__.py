"""How tensors move between the device and `headroom.store`'s stores: the mover, stash/restore,
parameter bindings, StoreTensor, the row streamer; the one layer that knows streams and events.
"""

from headroom.transfer._binding import (
    ListenerHandle,
    ParamBinding,
    adopt_grad,
    bind,
    binding,
    flush_grad,
    grad_ready,
    on_grad_ready,
    relay_done,
    sync_grad,
    unbind,
    value_edits,
    weak_method,
    weak_post_accumulate_grad_hook,
)
from headroom.transfer._device import check_device, stream_module
from headroom.transfer._mover import _MAX_STAGED_BYTES as MAX_STAGED_BYTES
from headroom.transfer._mover import Mover, Ticket
from headroom.transfer._pickle import keep_for_child
from headroom.transfer._rows import RowStreamer
from headroom.transfer._stash import Stash, StashTicket
from headroom.transfer._storage import resize_storage
from headroom.transfer._store_tensor import (
    GradSource,
    HandleSource,
    HeldSource,
    StoreTensor,
    is_stored_grad,
    stored_view,
)

__all__ = [
    "ListenerHandle",
    "MAX_STAGED_BYTES",
    "Mover",
    "ParamBinding",
    "RowStreamer",
    "Stash",
    "StashTicket",
    "GradSource",
    "HandleSource",
    "StoreTensor",
    "HeldSource",
    "Ticket",
    "adopt_grad",
    "bind",
    "binding",
    "check_device",
    "flush_grad",
    "is_stored_grad",
    "keep_for_child",
    "grad_ready",
    "on_grad_ready",
    "relay_done",
    "resize_storage",
    "stored_view",
    "stream_module",
    "sync_grad",
    "unbind",
    "value_edits",
    "weak_method",
    "weak_post_accumulate_grad_hook",
]
