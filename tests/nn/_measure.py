"""Bytes a forward creates and keeps, seen without headroom's hooks: a dispatch mode over the
storages ops create, and NumPy's buffers through ``tracemalloc``.

Used by ``tests/nn`` and by the benchmarks (``benchmarks/convert_memory.py``,
``benchmarks/selective_layers.py``), so both measure the same way.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class CreatedStorages(TorchDispatchMode):
    """Weak references to every storage an op creates while the mode is active.

    ``refs`` maps a storage key to ``(weak reference, nbytes)``; after the forward, the storages
    whose reference is alive are what the graph (or the caller) still holds. A storage that an
    op returns but that one of its arguments already had (an in-place op on a buffer, a view of
    the input) was not created there and is not recorded. With ``track_peak=True`` the mode
    also records ``peak``: the most bytes of created storages alive at once, checked after
    every op (the peak during the forward; O(live storages) per op, for measurements only).
    """

    def __init__(self, *, track_peak: bool = False) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.track_peak = track_peak
        self.peak = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = None
        for t in out if isinstance(out, tuple | list) else (out,):
            if not (isinstance(t, torch.Tensor) and t.layout == torch.strided):
                continue
            s = t.untyped_storage()
            key = s._cdata
            entry = self.refs.get(key)
            if entry is not None and not entry[0].expired():
                continue  # created earlier in the block (a view or an in-place result)
            if given is None:
                given = {
                    a.untyped_storage()._cdata
                    for a in pytree.tree_leaves((args, kwargs))
                    if isinstance(a, torch.Tensor) and a.layout == torch.strided
                }
            if key in given:
                continue  # an argument's storage: it existed before this op
            # (a key of a storage that died may come back for a new one: that one is recorded)
            self.refs[key] = entry = (StorageWeakRef(s), s.nbytes())
            if self.track_peak:
                self._live[key] = entry
        if self.track_peak:
            live = self._live
            for k in [k for k, (ref, _) in live.items() if ref.expired()]:
                del live[k]
            self.peak = max(self.peak, sum(n for _, n in live.values()))
        return out

    def live_bytes(self, skip: set[int] | frozenset[int] = frozenset()) -> int:
        """Bytes of the created storages still alive, except those whose key is in ``skip``."""
        return sum(n for k, (ref, n) in self.refs.items() if not ref.expired() and k not in skip)


class NumpyBuffers:
    """Bytes of NumPy-allocated buffers (NumPy reports them to ``tracemalloc`` in its own
    domain) that were allocated inside the ``with`` block and are still alive at its end:
    ``bytes`` after exit. Starts and stops ``tracemalloc`` if it was not running."""

    def __enter__(self) -> NumpyBuffers:
        import tracemalloc

        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        self._before = self._numpy_bytes()
        return self

    def __exit__(self, *exc) -> None:
        import tracemalloc

        self.bytes = max(0, self._numpy_bytes() - self._before)
        if self._started:
            tracemalloc.stop()

    @staticmethod
    def _numpy_bytes() -> int:
        import tracemalloc

        import numpy as np

        domain = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
        snap = tracemalloc.take_snapshot().filter_traces([domain])
        return sum(stat.size for stat in snap.statistics("filename"))


_warm = False


def forward_bytes(
    fn, exclude=(), *, track_peak: bool = True
) -> tuple[int, int, object]:
    """``(kept, peak, output)`` of ``fn()``, a forward: ``kept`` is the bytes of storages it
    created (dispatch mode) and NumPy buffers it allocated that are alive after it, ``peak`` the
    most bytes of created storages alive at once during it. The output's storage and those of
    ``exclude`` (parameters, buffers) are not counted."""
    global _warm
    if not _warm:
        # The first op under a dispatch mode imports half of torch (dynamo, sympy);
        # with tracemalloc on, that makes every later snapshot slow.
        with CreatedStorages():
            torch.ones(1).add(1)
        _warm = True
    mode = CreatedStorages(track_peak=track_peak)
    with NumpyBuffers() as np_bufs, mode:
        out = fn()
    outs = out if isinstance(out, tuple | list) else (out,)
    skip = {t.untyped_storage()._cdata for t in (*exclude, *outs) if isinstance(t, torch.Tensor)}
    return mode.live_bytes(skip) + np_bufs.bytes, mode.peak, out
