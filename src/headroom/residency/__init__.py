"""Parameters kept off the device: residency of groups of parameters, blocks, `offload`."""

from headroom.residency import _events as events
from headroom.residency._adopt import holds, rescan
from headroom.residency._autograd import OffloadedParameter, StoredParameter
from headroom.residency._blocks import find_blocks
from headroom.residency._dtensor import check_sharded
from headroom.residency._group import Group, Slot
from headroom.residency._guard import MODULE_ATTRS, guarded_state
from headroom.residency._meta import _lost_adapters as lost_adapters
from headroom.residency._meta import _own_slots as own_slots
from headroom.residency._meta import _still_unset as still_unset
from headroom.residency._meta import _unset as unset_tensor
from headroom.residency._offload import (
    describe,
    offload,
    offload_dry_run,
    offload_states,
    prefetch,
    state_of,
    unoffload,
)
from headroom.residency._packed import is_packed, meta_like, packed_nbytes
from headroom.residency._plan import OffloadPlan, plan_offload
from headroom.residency._quantize import quantize_block
from headroom.residency._schedule import Offload, Phase
from headroom.residency._schedule import _outputs as tensor_outputs

__all__ = [
    "MODULE_ATTRS",
    "OffloadPlan",
    "Group",
    "Offload",
    "OffloadedParameter",
    "Slot",
    "StoredParameter",
    "tensor_outputs",
    "Phase",
    "check_sharded",
    "describe",
    "events",
    "guarded_state",
    "holds",
    "lost_adapters",
    "own_slots",
    "rescan",
    "still_unset",
    "unset_tensor",
    "is_packed",
    "find_blocks",
    "meta_like",
    "offload",
    "offload_dry_run",
    "packed_nbytes",
    "offload_states",
    "plan_offload",
    "prefetch",
    "quantize_block",
    "state_of",
    "unoffload",
]
