"""Local shards of FSDP2 units on a `DiskStore`: read into host memory for each all-gather.

Each rank's *unpadded* local shard of every parameter of the chosen units rests in the store
under its qualified name, the unit on FSDP2's host path. Between uses the FSDPParam's padded
shard is a placeholder without memory and the DTensor's local tensor a `StoreTensor` over the
stored shard (`DiskShards.rest`). FSDP2 reads shards only in a group's ``unshard`` and
``wait_for_unshard``, wrapped on the instance: ``unshard`` first reads the group's shards into
fresh host buffers (or takes those read ahead), dropped once ``wait_for_unshard`` returns, or at
``reset_iter_state`` after an exception. Read afresh for every all-gather, a shard is stepped
where it rests (`HostOptimizer` finds it bound). Gradient shards stay where FSDP2 puts them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from headroom.memory import annotate
from headroom.store import Handle, Store, is_accelerator
from headroom.transfer import HandleSource, StoreTensor, unbind

__all__ = ["DiskShards", "placeholder", "release"]


@dataclass
class _Shard:
    """One parameter's local shard on disk."""

    key: str  # also the parameter's name in the model's state dict
    fp: object  # the FSDPParam
    handle: Handle
    length: int  # rows of the unpadded local shard along the shard dimension
    resident: bool = False


def placeholder(fp) -> torch.Tensor:
    """A 1-D tensor of the padded shard's size, to `release` once viewed (a tensor without
    memory cannot be viewed)."""
    return torch.empty(fp.padded_sharded_param_size.numel(), dtype=fp._sharded_param_data.dtype)


def release(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _set_data(fp, flat: torch.Tensor, length: int) -> None:
    """Make ``flat`` (1-D, padded) the FSDPParam's shard and, in place, its DTensor's data."""
    dim = fp.fsdp_placement.dim
    fp._sharded_param_data = flat
    fp.sharded_param._local_tensor = flat.view(fp.padded_sharded_param_size).narrow(
        dim, 0, length)


def _wait_all(reads: list) -> None:
    """Wait for every read of ``[(shard, buffer, future)]``, failed or not (none may land in
    a buffer given back)."""
    for _, _, fut in reads:
        with contextlib.suppress(BaseException):
            fut.result()


class DiskShards:
    """The shards of a sharded model's units on a `DiskStore` and the hooks that read them;
    ``prefetch``: units read ahead of the one being unsharded."""

    def __init__(self, store: Store, device: torch.device, *, prefetch: int = 1) -> None:
        self.store = store
        self.device = device
        self.prefetch = prefetch
        self.shards: dict[str, _Shard] = {}
        self.by_group: dict[int, list[_Shard]] = {}
        self.groups: list[object] = []
        self.hooks: list = []
        self.resident_bytes = 0  # host bytes of shards read and not yet dropped
        self.peak_resident_bytes = 0
        self.reads = 0  # shard reads from the store (one per parameter per all-gather)
        self._pending: list[tuple[object, list[_Shard]]] = []  # (event, shards): accelerator
        self.epoch = 0  # [Note: sharded reads ahead]
        self._kind: str | None = None  # the pass the last unshard belonged to
        self._seq: list[object] = []  # groups unsharded so far in this pass, in order
        self._orders: dict[str, list[object]] = {}  # the same, of the last pass of each kind
        self._ahead: dict[int, tuple[int, list]] = {}  # group -> (epoch, reads in flight)
        self.ahead_used = 0  # groups whose all-gather found their shards read ahead

    # ------------------------------------------------------------------ setup
    def put(self, key: str, fp, group) -> Handle:
        """Write ``fp``'s unpadded local shard under ``key``; returns its handle."""
        if key in self.store:
            raise RuntimeError(
                f"{self.store!r} already holds {key!r} (a store of an earlier run): hr.offload"
                " of a sharded model writes its current shards. Give it an empty folder or"
                " DiskStore(path, overwrite=True); to resume, load a"
                " torch.distributed.checkpoint after hr.offload")
        local = fp.sharded_param._local_tensor
        dim = fp.fsdp_placement.dim
        length = local.size(dim) if local.numel() > 0 else 0
        h = self.store.put(key, local.detach())
        sh = _Shard(key, fp, h, length)
        self.shards[key] = sh
        self.by_group.setdefault(id(group), []).append(sh)
        if group not in self.groups:
            self.groups.append(group)
        return h

    def rest(self, sh: _Shard) -> None:
        """Between all-gathers the DTensor's local tensor is a `StoreTensor`: the user's reads
        of it (``p.norm()``, an EMA) come from the disk, in-place writes go there."""
        sh.fp.sharded_param._local_tensor = StoreTensor(
            HandleSource(self.store, sh.handle), tuple(sh.handle.shape),
            dtype=sh.handle.dtype, device=torch.device("cpu"))

    def wrap_all(self) -> None:
        """Wrap the parameter groups' ``unshard`` and ``wait_for_unshard`` (see the module doc)."""
        for g in self.groups:
            g._reset_sharded_params = True  # ours are padded: FSDP2's lazy init must not
            self._wrap(g)

    def _wrap(self, group) -> None:
        shards = self.by_group[id(group)]
        unshard, wait = group.unshard, group.wait_for_unshard

        def read_then_unshard(async_op: bool = False):
            self._reap()
            if group._all_gather_result is None and not group.is_unsharded:
                self._load_group(group)
            return unshard(async_op)

        def wait_then_drop():
            out = wait()
            if group._all_gather_result is None:  # the shards were copied (or never read)
                self._drop_after_copy(shards)
            return out

        group.unshard = read_then_unshard
        group.wait_for_unshard = wait_then_drop
        reset = getattr(group, "_reset_iter_state", None)
        if reset is None:  # torch 2.11: read shards stay until the unit's next all-gather
            return

        def reset_then_drop():  # after an exception: shards of an unfinished all-gather go
            reset()
            self.new_epoch()
            self._settle(shards)
            self.drop(shards)

        group._reset_iter_state = reset_then_drop

    def unwrap(self) -> None:
        for g in self.groups:
            for name in ("unshard", "wait_for_unshard", "_reset_iter_state"):
                g.__dict__.pop(name, None)
        for h in self.hooks:
            h.remove()
        self.hooks = []

    # ------------------------------------------------------------------ reads ahead
    # [Note: sharded reads ahead]
    # When FSDP2 unshards a unit, the next ``prefetch`` units of the same pass (in the order of
    # the previous pass of that kind) are read in the background, used only in that pass (an
    # *epoch*; shards change between passes). A new epoch starts at each forward, when unshards
    # switch direction, and at reset_iter_state.
    def new_epoch(self) -> None:
        """Close the pass in progress: discard what was read ahead for it."""
        if self._kind is not None and self._seq:
            self._orders[self._kind] = self._seq
        self._kind, self._seq = None, []
        self.epoch += 1
        for gid in list(self._ahead):
            self._discard(gid)

    def _discard(self, gid: int) -> None:
        _, reads = self._ahead.pop(gid)
        _wait_all(reads)
        self.resident_bytes -= sum(flat.nbytes for _, flat, _ in reads)

    def _load_group(self, group) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        state = group._training_state
        kind = ("f" if state == TrainingState.FORWARD else
                "b" if state == TrainingState.PRE_BACKWARD else None)
        if kind is None or kind != self._kind:
            self.new_epoch()
            self._kind = kind
        if kind is not None:
            self._seq.append(group)
        shards = self.by_group[id(group)]
        ahead = self._ahead.get(id(group))
        if ahead is not None and ahead[0] == self.epoch:
            del self._ahead[id(group)]
            self._settle(shards)
            self._land(ahead[1], counted=True)
            self.ahead_used += 1
        else:
            if ahead is not None:
                self._discard(id(group))
            self.load(shards)
        if kind is None or self.prefetch <= 0:
            return
        order = self._orders.get(kind, [])
        at = next((i for i, g in enumerate(order) if g is group), None)
        if at is None:
            return
        for g in order[at + 1:at + 1 + self.prefetch]:
            gid = id(g)
            if gid in self._ahead or g.is_unsharded or g._all_gather_result is not None:
                continue
            reads = self._issue(self.by_group[gid])
            self._ahead[gid] = (self.epoch, reads)
            self._count(sum(flat.nbytes for _, flat, _ in reads))

    # ------------------------------------------------------------------ reads and drops
    def _issue(self, shards: list[_Shard]) -> list:
        """Start reading ``shards`` into fresh host buffers: ``[(shard, buffer, future)]``."""
        pin = is_accelerator(self.device)
        reads = []
        try:
            for sh in shards:
                fp = sh.fp
                flat = torch.empty(fp.padded_sharded_param_size.numel(),
                                   dtype=sh.handle.dtype, pin_memory=pin)
                annotate(flat, "parameters")  # the shard itself, for as long as it is read
                view = flat.view(fp.padded_sharded_param_size)
                dim = fp.fsdp_placement.dim
                view.narrow(dim, sh.length, view.size(dim) - sh.length).zero_()
                reads.append((sh, flat, self.store.read(
                    sh.handle, out=view.narrow(dim, 0, sh.length))))
        except BaseException:
            _wait_all(reads)
            raise
        return reads

    def _land(self, reads: list, *, counted: bool = False) -> None:
        try:
            for _, _, fut in reads:
                fut.result()
        except BaseException:
            _wait_all(reads)
            if counted:
                self.resident_bytes -= sum(flat.nbytes for _, flat, _ in reads)
            raise
        for sh, flat, _ in reads:
            if sh.resident:  # read again (an all-gather that never completed): replaced
                self.resident_bytes -= sh.fp._sharded_param_data.nbytes
            if not counted:
                self._count(flat.nbytes)
            _set_data(sh.fp, flat, sh.length)
            sh.resident = True
            self.reads += 1

    def load(self, shards: list[_Shard]) -> None:
        self._settle(shards)
        self._land(self._issue(shards))

    def _count(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def drop(self, shards: list[_Shard]) -> None:
        for sh in shards:
            if sh.resident:
                self.resident_bytes -= sh.fp._sharded_param_data.nbytes
                ph = placeholder(sh.fp)
                _set_data(sh.fp, ph, sh.length)
                release(ph)
                self.rest(sh)
                sh.resident = False

    def _drop_after_copy(self, shards: list[_Shard]) -> None:
        if not is_accelerator(self.device):
            self.drop(shards)
            return
        # the copy to the device may still read the pinned buffers: dropped after it
        ev = torch.Event(device=self.device)
        ev.record()
        self._pending.append((ev, shards))
        self._reap()

    def _reap(self) -> None:
        keep = []
        for ev, shards in self._pending:
            if ev.query():
                self.drop(shards)
            else:
                keep.append((ev, shards))
        self._pending = keep

    def _settle(self, shards: list[_Shard]) -> None:
        ids = {id(s) for s in shards}
        for ev, pend in self._pending:
            if any(id(s) in ids for s in pend):
                ev.synchronize()
        self._reap()

    def drop_all(self) -> None:
        self.new_epoch()
        for ev, _ in self._pending:
            ev.synchronize()
        self._reap()
        self.drop(list(self.shards.values()))

    def forward_pre_hook(self, module, args) -> None:
        self.new_epoch()

    # ------------------------------------------------------------------ state dict
    def state_dict_hook(self, module, state_dict, prefix, local_metadata) -> None:
        for sh in self.shards.values():
            name = prefix + sh.key
            if name in state_dict:
                local = self.store.read(sh.handle).result()
                state_dict[name] = sh.fp.to_sharded_dtensor(local)

    def load_state_dict_pre_hook(self, module, state_dict, prefix, *args) -> None:
        self.new_epoch()  # all read into memory, written back by the post hook
        self.load(list(self.shards.values()))

    def load_state_dict_post_hook(self, module, incompatible_keys) -> None:
        try:
            for sh in self.shards.values():
                if sh.resident:
                    local = sh.fp.sharded_param._local_tensor
                    self.store.write(sh.handle, local.contiguous()).result()
        finally:
            self.drop_all()

    def hook(self, model: nn.Module) -> None:
        # (partial, not bound methods: torch marks the hook objects it is given)
        self.hooks.append(model.register_forward_pre_hook(  # a new pass, before FSDP2's hook
            partial(DiskShards.forward_pre_hook, self), prepend=True))
        self.hooks.append(model.register_state_dict_post_hook(
            partial(DiskShards.state_dict_hook, self)))
        self.hooks.append(model.register_load_state_dict_pre_hook(self.load_state_dict_pre_hook))
        self.hooks.append(model.register_load_state_dict_post_hook(
            self.load_state_dict_post_hook))

    # ------------------------------------------------------------------ undo
    def take_back(self, sh: _Shard) -> torch.Tensor:
        """The padded 1-D shard read from the store (`unoffload_sharded`); frees it."""
        self.load([sh])
        flat = sh.fp._sharded_param_data
        self.resident_bytes -= flat.nbytes
        sh.resident = False
        unbind(sh.fp.sharded_param)
        self.store.free(sh.handle)
        return flat
