"""Activation offload: a saved-tensor keeper (`headroom._saved_hooks`) copies each saved
storage to a store (`headroom.transfer.Stash`), frees it once only autograd uses it (resized to 0
under the tensor, which keeps identity and version), and refills it in backward, with the ones
saved before it within a byte budget. docs/activation_offload.md says what is not moved."""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from headroom._saved_hooks import keeping
from headroom.memory import annotate, note_resting
from headroom.store import DiskStore, HeapTrimmer, Store, release_pages
from headroom.transfer import Stash, StashTicket, resize_storage

# the defaults of `offload_activations` and its dry run
DEFAULT_MIN_BYTES = 1 << 20
DEFAULT_PREFETCH = 256 << 20

_use_count = torch._C._storage_Use_Count


def _only_ours(e: _StashedStorage) -> bool:
    """Whether nothing but this entry uses the anchor and its storage (once the copy is out)."""
    # Referenced by the entry and getrefcount's argument, no C++ owner but its Python object,
    # and the only tensor on its storage (the anchor's and this call's storage objects).
    return (sys.getrefcount(e.anchor) <= 2 and e.anchor._use_count() <= 1
            and _use_count(e.anchor.untyped_storage()._cdata) <= 2)


def _parameter_like(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def _no_storage(t: torch.Tensor) -> bool:
    """Sparse and nested tensors, and subclasses without one storage of their own."""
    if t.layout != torch.strided or t.is_nested:
        return True
    try:
        t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return True
    return False


class _StashedStorage:
    """One storage whose bytes rest in the stash."""

    __slots__ = ("anchor", "ticket", "nbytes", "packs", "freed", "restored", "dead")

    def __init__(self, anchor: torch.Tensor, ticket: StashTicket) -> None:
        self.anchor = anchor  # the first saved tensor on the storage: holds storage and version
        self.ticket = ticket
        self.nbytes = ticket.nbytes
        self.packs = 0
        self.freed = False  # device storage resized to 0
        self.restored = False  # refilled (or being refilled) for backward
        self.dead = False


class _Ticket:
    """What autograd keeps for one saved tensor: its view of an entry's storage."""

    __slots__ = ("owner", "entry", "size", "stride", "offset", "dtype", "version", "whole")

    def __init__(self, owner: _Offloader, entry: _StashedStorage, t: torch.Tensor) -> None:
        self.owner = owner
        self.entry = entry
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.version = t._version
        self.whole = t is entry.anchor
        entry.packs += 1

    def __del__(self) -> None:
        self.owner._release(self.entry)


class _InstantStash:
    """The stash of a dry run: ``meta`` storages hold no bytes, so every copy is done when it
    starts. ``moved`` counts the bytes sent out."""

    def __init__(self) -> None:
        self.moved = 0

    def stash(self, storage: torch.UntypedStorage) -> StashTicket:
        self.moved += storage.nbytes()
        return StashTicket(storage.nbytes())

    def out_done(self, k: StashTicket) -> bool:
        return True

    def wait_out(self, *args) -> None:  # as every other step of a copy: done already
        pass

    prefetch = restore = drop = wait_out


class _Offloader:
    """The keeper: stashes saved tensors, frees their device memory, restores them ahead
    (``instant``: a dry run's stash)."""

    def __init__(self, store: Any, min_bytes: int, prefetch: int,
                 modules: list[nn.Module] | None, *, instant: _InstantStash | None = None) -> None:
        self.store = store
        self._instant = instant
        self._where = "host" if store is None else "disk"
        self._trimmer = HeapTrimmer()  # for what backward frees on the CPU, see `_release`
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self._stashes: dict[torch.device, Stash] = {}
        self._entries: dict[int, _StashedStorage] = {}  # storage key -> live entry
        self._order: list[_StashedStorage] = []  # live entries in the order they were saved
        self._pending: list[_StashedStorage] = []  # stashed, device memory not freed yet
        self._restored_bytes = 0  # restored for backward and not released yet
        self._closed = False
        self._depth = 0 if modules is not None else 1
        self._handles = []
        with _HOOK_LOCK:
            _install_global_hook()
            _ACTIVE.append(self)
        # NOTE: under torch.compile the scope hooks run outside the graphs (a graph break at
        # each scoped module's edges), so the depth is right when compiled saves are packed.
        # (Disabled here, not at import, which would import torch._dynamo.)
        for m in modules or ():
            self._handles.append(m.register_forward_pre_hook(
                torch.compiler.disable(self._enter_module)))
            self._handles.append(m.register_forward_hook(
                torch.compiler.disable(self._leave_module), always_call=True))

    # ------------------------------------------------------------------ scope
    def _enter_module(self, module, args) -> None:
        self._depth += 1

    def _leave_module(self, module, args, output) -> None:
        self._depth -= 1

    def _after_module(self) -> None:
        if self._pending and not self._closed:
            self._sweep()

    # ------------------------------------------------------------------ pack / unpack
    def pack(self, t: torch.Tensor) -> Any:
        self._sweep()
        if self._depth <= 0 or _parameter_like(t) or _no_storage(t) or (
                t.device.type == "meta" and self._instant is None):
            return t
        storage = t.untyped_storage()
        # Not resizable (memory NumPy or DLPack lent): it could not be freed after its copy.
        if storage.nbytes() < self.min_bytes or not storage.resizable():
            return t
        key = storage._cdata
        entry = self._entries.get(key)
        if entry is None:
            # A view keeps its base alive (and with it the storage): the base is the anchor.
            base = t._base if t._base is not None else t
            stash = self._stash(t.device)
            entry = _StashedStorage(base, stash.stash(storage))
            self._entries[key] = entry
            self._order.append(entry)
            self._pending.append(entry)
            if entry.ticket.host is not None:
                annotate(entry.ticket.host, "activations")  # resting in host memory
        return _Ticket(self, entry, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Ticket):
            return packed
        self._sweep()
        entry = packed.entry
        anchor = entry.anchor
        if anchor._version != packed.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{anchor.type()} {list(packed.size)}] is at version "
                f"{anchor._version}; expected version {packed.version} instead. (Saved while "
                "hr.offload_activations was active.)"
            )
        self._restore(entry)
        self._prefetch_before(entry)
        if packed.whole:
            return anchor
        out = torch.empty(0, dtype=packed.dtype, device=anchor.device)
        return out.set_(anchor.untyped_storage(), packed.offset, packed.size, packed.stride)

    # ------------------------------------------------------------------ device memory
    def _sweep(self) -> None:
        """Free the device memory of entries whose bytes are out and that only autograd uses;
        wait for the oldest copies in flight past ``prefetch`` bytes of them."""
        keep = []
        waiting = 0
        for e in self._pending:
            if e.dead:
                continue
            if self._stash(e.anchor.device).out_done(e.ticket):
                if _only_ours(e):
                    self._free(e)
                    continue
            else:
                waiting += e.nbytes
            keep.append(e)
        for e in keep:
            if waiting <= self.prefetch:
                break
            if e.ticket.source is None:
                continue  # out already; the forward still uses it
            self._stash(e.anchor.device).wait_out(e.ticket)
            waiting -= e.nbytes
            if _only_ours(e):
                self._free(e)
        self._pending = [e for e in keep if not e.freed]

    def _free(self, e: _StashedStorage) -> None:
        # On the CPU the saving is resident memory only: the pages go back to the OS before
        # the heap gets the storage (see `headroom.store._heap`).
        release_pages(e.anchor)
        resize_storage(e.anchor, 0)
        e.freed = True
        note_resting(self._where, "activations", e.nbytes)

    def _refill(self, e: _StashedStorage) -> None:  # the bytes follow
        resize_storage(e.anchor, e.nbytes)
        e.restored = True
        self._restored_bytes += e.nbytes
        note_resting(self._where, "activations", -e.nbytes)

    def _restore(self, e: _StashedStorage) -> None:
        if e in self._pending:  # never freed: its bytes are still where they were
            self._pending.remove(e)
            return
        if not e.freed:
            return
        if not e.restored:
            self._refill(e)
        self._stash(e.anchor.device).restore(e.ticket, e.anchor.untyped_storage())
        e.freed = False

    def _prefetch_before(self, e: _StashedStorage) -> None:
        """Start refilling entries saved before ``e``, newest first, within the budget."""
        i = self._order.index(e) if e in self._order else -1
        for prev in reversed(self._order[:max(i, 0)]):
            if self._restored_bytes + prev.nbytes > self.prefetch:
                return
            if not prev.freed or prev.restored:
                continue
            self._refill(prev)
            self._stash(prev.anchor.device).prefetch(prev.ticket, prev.anchor.untyped_storage())

    def _release(self, e: _StashedStorage) -> None:
        """A ticket autograd kept is gone; the last one takes the entry with it."""
        e.packs -= 1
        if e.packs or e.dead:
            return
        e.dead = True
        self._entries.pop(e.anchor.untyped_storage()._cdata, None)
        with contextlib.suppress(ValueError):
            self._order.remove(e)
        if e.restored:
            self._restored_bytes -= e.nbytes
            if e.anchor.device.type == "cpu":
                # Else what backward frees stays in the heap over the pages the forward gave
                # back, and resident memory creeps back to plain PyTorch's.
                self._trimmer.freed(e.nbytes)
        elif e.freed:  # never needed by a backward
            note_resting(self._where, "activations", -e.nbytes)
        self._stash(e.anchor.device).drop(e.ticket)
        e.anchor = None

    # ------------------------------------------------------------------ lifetime
    def _stash(self, device: torch.device) -> Stash | _InstantStash:
        if self._instant is not None:
            return self._instant
        s = self._stashes.get(device)
        if s is None:
            s = self._stashes[device] = Stash.shared(device, self.store)
        return s

    def finish(self) -> None:
        """The context ends: free what was saved after the last module's forward too, once
        its copy is out, unless something besides autograd holds it (the output)."""
        self._sweep()
        for e in list(self._pending):
            # NOTE: e.anchor is not bound to a local name: the reference counts are exact
            if e.dead or sys.getrefcount(e.anchor) > 2 or e.anchor._use_count() > 1:
                continue
            self._stash(e.anchor.device).wait_out(e.ticket)
            if _only_ours(e):
                self._free(e)
        self._pending = [e for e in self._pending if not (e.freed or e.dead)]

    def close(self) -> None:
        """No new tensors (those saved already are restored whenever backward runs)."""
        for h in self._handles:
            h.remove()
        with _HOOK_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if not _ACTIVE and _GLOBAL_HOOK is not None:
                _GLOBAL_HOOK.remove()  # module calls take the fast path again; the key is kept
        self._closed = True


# Offloaders in use (nested contexts, other threads), served by one global module hook that
# sweeps when a module's forward ends. It takes every module call off nn.Module's fast path, so
# it is there only while a context is open, and keeps its key when put back: torch.compile
# guards on the key, so a new one each step would recompile every compiled module.
_ACTIVE: list[_Offloader] = []
_GLOBAL_HOOK: Any = None  # the hook's handle, kept (with its key) while the hook is out
_HOOK_LOCK = threading.Lock()


def _after_any_module(module, args, output) -> None:
    # NOTE: no reference to the output kept here while sweeping: `_only_ours` counts them.
    # Skipped while tracing: the next pack or module outside the graph sweeps anyway.
    del module, args, output
    if not _ACTIVE or torch.compiler.is_compiling():
        return
    for o in list(_ACTIVE):
        o._after_module()


def _install_global_hook() -> None:
    global _GLOBAL_HOOK
    if _GLOBAL_HOOK is None:
        _GLOBAL_HOOK = nn.modules.module.register_module_forward_hook(
            _after_any_module, always_call=True)
    elif _GLOBAL_HOOK.id not in nn.modules.module._global_forward_hooks:
        # put back under the key it had (see above)
        nn.modules.module._global_forward_hooks[_GLOBAL_HOOK.id] = _after_any_module
        nn.modules.module._global_forward_hooks_always_called[_GLOBAL_HOOK.id] = True


def empty_cache() -> None:
    """Give back the host memory (and disk space) activation offload keeps for the next step;
    saved tensors that backward has not used yet keep theirs."""
    Stash.release_shared()


@contextlib.contextmanager
def offload_activations(
    store: str | DiskStore = "cpu",
    *,
    min_bytes: int = DEFAULT_MIN_BYTES,
    prefetch: int = DEFAULT_PREFETCH,
    modules: Iterable[nn.Module] | None = None,
) -> Iterator[None]:
    """Keep the tensors autograd saves for backward in a store, not on the compute device.

    Wrap forward and backward (or forward only). Each saved tensor's storage is copied to the
    store and its device memory freed once the forward no longer uses it; backward refills
    them just ahead of use, bitwise plain PyTorch. Storages that cannot be resized (memory
    lent by NumPy or DLPack, such as ``headroom.nn``'s bit masks) stay where they are.

    Args:
        store: ``"cpu"`` (host memory, page-locked on an accelerator) or a `DiskStore`. On a
            CPU-only machine only a `DiskStore` saves memory.
        min_bytes: storages smaller than this stay where they are (copying them costs more
            than it saves).
        prefetch: bytes of saved tensors refilled ahead of backward. More hides more transfer
            time behind compute; each byte is device memory during backward.
        modules: offload only what is saved inside the forward of these modules (e.g. every
            block but the last, whose tensors backward needs first); by default everything.

    Raises:
        ValueError: ``min_bytes`` or ``prefetch`` is negative, or ``store`` is not one of the
            above.
        TypeError: ``modules`` holds something that is not an ``nn.Module``.

    Example:
        >>> with hr.offload_activations(store=hr.DiskStore("/scratch/act")):   # doctest: +SKIP
        ...     loss = model(x).sum()
        ...     loss.backward()
    """
    if not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a byte count >= 0, got {prefetch!r}")
    if isinstance(store, str):
        if store not in ("cpu", "host"):
            raise ValueError(f"unknown store {store!r}: use 'cpu' (host memory) or a"
                             " headroom.DiskStore(path)")
        store = None
    elif not isinstance(store, Store) or store.holds_host_memory:
        raise ValueError(f"store must be 'cpu' or a headroom.DiskStore, got {store!r}")
    if store is None and not torch.accelerator.is_available():
        warnings.warn(
            "hr.offload_activations with a host-memory store on a machine without an"
            " accelerator saves no memory (the copy rests in the same RAM); it is meant for"
            " testing the mechanics. Use store=hr.DiskStore(path) on a CPU-only machine",
            UserWarning, stacklevel=3)
    if modules is not None:
        modules = list(modules)
        for m in modules:
            if not isinstance(m, nn.Module):
                raise TypeError("modules must be torch.nn.Module objects (the blocks whose"
                                f" saved tensors to offload), got {type(m).__name__}")
    with _offloading(_Offloader(store, min_bytes, prefetch, modules or None)):
        yield


@contextlib.contextmanager
def offload_activations_dry_run(*, min_bytes: int = DEFAULT_MIN_BYTES,
                                prefetch: int = DEFAULT_PREFETCH,
                                modules: Iterable[nn.Module] | None = None
                                ) -> Iterator[_InstantStash]:
    """`offload_activations` over a dry run's ``meta`` tensors (`hr.estimate`), copies done at
    once; yields the stash, whose ``moved`` counts the bytes sent to the store."""
    stash = _InstantStash()
    with _offloading(_Offloader(None, min_bytes, prefetch, list(modules) if modules else None,
                                instant=stash)):
        yield stash


@contextlib.contextmanager
def _offloading(offloader: _Offloader) -> Iterator[None]:
    try:
        with keeping(offloader):
            yield
        offloader.finish()
    finally:
        offloader.close()
