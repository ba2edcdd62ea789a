"""A CPU model of accelerator stream semantics, to test the ordering of the transfer layer in CI.

`StreamModel` stands in for an accelerator's device module (``torch.cuda`` and the like): side
streams, events, the per-thread current stream and its ``stream(s)`` context, host waits. Every
tensor operation runs at once on the CPU (values are exact), and is also logged, through a torch
dispatch mode, as an access to the storages it reads and writes on the stream it was issued to:

* an operation on host memory only (page-locked buffers, and tensors a test declares host
  memory) runs on the host, as a host copy or an optimizer step does on a real machine;
* any other runs on the current stream: ``s`` inside a ``stream(s)`` context, else the compute
  stream; one between host and device memory that is not ``non_blocking`` also makes the host
  wait for it, as a blocking copy does.

Ordering is tracked with vector clocks. Each stream (and the host) counts its own operations and
knows, per other stream, up to which operation it is ordered after it. ``event.record(s)``
snapshots what ``s`` knows; ``s.wait_event(e)`` merges the snapshot into ``s``;
``e.synchronize()``, ``s.synchronize()`` and a ``query()`` that returns true merge into the host;
anything the host knows flows into a stream when the host issues work to it. Every storage
remembers its last write and the reads since, each as (stream, count). An access on a stream
that is not ordered after them raises `StreamOrderError` at once (a read after a write, a write
after a read or a write), which is what ``TORCH_CUDA_SANITIZER=1`` reports on a device. Freeing
device memory (the last reference going away, or ``UntypedStorage.resize_(0)``) counts as a
write on the stream that allocated it, issued by the host at that moment: a copy on a side stream
still reading or writing it is a use after free. Likewise allocating device memory counts as a
write on the current stream (the caching allocator hands a block freed by that stream's pending
work straight back to it), so another stream must be ordered after the allocation to use it.
Host memory is exempt from the free check: torch's caching host allocator keeps a page-locked
block until the copies using it are done, and copies with pageable memory are synchronous;
except headroom's own page-locked slabs (`headroom.store._pinned.Slab`), which go back to the
system when released: every copy that used a slab must be known to the host to be done by then.

``torch.get_device_module("cpu")`` returns the model, ``is_accelerator`` says yes for the CPU,
``pin_memory=True`` allocations and ``Tensor.pin_memory()`` work (the model remembers which
storages are page-locked, for ``is_pinned()``), and ``Tensor.record_stream(s)`` makes a free
wait for ``s``'s work issued so far. Operations on other threads are not logged (the
dispatch mode is per thread), except on the host optimizer's worker thread and the threads the
mover hands work to (its landing thread, disk I/O threads issuing copies out of staging); their
host operations share the host's clock, which may hide a race between two host threads but
reports none that is not there.

For mutation testing, `StreamModel.skip` holds call sites ``(file name, line)`` whose
``wait_event``, ``record`` or ``synchronize`` is then ignored, as if the line were deleted: an
event never recorded is one that a wait passes at once, as on a device.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StreamModel", "StreamOrderError", "stream_model"]


class StreamOrderError(AssertionError):
    """An access not ordered after an earlier access to the same memory on another stream."""


HOST = "host"


class _Clock:
    def __init__(self, name: str) -> None:
        self.name = name
        self.vc: dict[str, int] = {name: 0}

    def tick(self) -> int:
        self.vc[self.name] += 1
        return self.vc[self.name]

    def knows(self, stream: str, t: int) -> bool:
        return stream == self.name or self.vc.get(stream, 0) >= t

    def merge(self, snap: dict[str, int]) -> None:
        for k, v in snap.items():
            if v > self.vc.get(k, 0):
                self.vc[k] = v


def _site() -> tuple[str, int]:
    f = sys._getframe(2)
    return os.path.basename(f.f_code.co_filename), f.f_lineno


class Stream:
    def __init__(self, model: StreamModel, name: str) -> None:
        self.model = model
        self.clock = _Clock(name)
        self.name = name

    def __repr__(self) -> str:
        return f"Stream({self.name})"

    def wait_event(self, ev: Event) -> None:
        m = self.model
        with m.lock:
            if _site() in m.skip:
                m.skipped.append(_site())
                return
            m.sites.add(_site())
            self.clock.merge(m.host.vc)
            if ev.snap is not None:
                self.clock.merge(ev.snap)

    def wait_stream(self, other: Stream) -> None:
        with self.model.lock:
            self.clock.merge(other.clock.vc)

    def record_event(self, ev: Event | None = None) -> Event:
        ev = ev or Event(self.model)
        ev.record(self)
        return ev

    def synchronize(self) -> None:
        m = self.model
        with m.lock:
            if _site() in m.skip:
                m.skipped.append(_site())
                return
            m.sites.add(_site())
            m.host.merge(self.clock.vc)

    def query(self) -> bool:
        m = self.model
        with m.lock:
            if not m.query_done:
                return all(m.host.knows(s, t) for s, t in self.clock.vc.items())
            m.host.merge(self.clock.vc)
        return True


class Event:
    def __init__(self, model: StreamModel, **kwargs) -> None:
        self.model = model
        self.snap: dict[str, int] | None = None

    def record(self, stream: Stream | None = None) -> None:
        m = self.model
        with m.lock:
            if _site() in m.skip:
                m.skipped.append(_site())
                return
            m.sites.add(_site())
            stream = stream if stream is not None else m.current_stream()
            stream.clock.merge(m.host.vc)
            self.snap = dict(stream.clock.vc)

    def wait(self, stream: Stream | None = None) -> None:
        (stream if stream is not None else self.model.current_stream()).wait_event(self)

    def query(self) -> bool:
        m = self.model
        with m.lock:
            if not m.query_done:  # done only once the host knows it is
                return self.snap is None or all(m.host.knows(s, t) for s, t in self.snap.items())
            if self.snap is not None:
                m.host.merge(self.snap)
        return True

    def synchronize(self) -> None:
        m = self.model
        with m.lock:
            if _site() in m.skip:
                m.skipped.append(_site())
                return
            m.sites.add(_site())
            if self.snap is not None:
                m.host.merge(self.snap)


class _Buf:
    __slots__ = ("alloc", "host", "recs", "label", "recorded")

    def __init__(self, alloc: str, host: bool, label: str) -> None:
        self.alloc = alloc  # the stream whose memory it is (freeing it is a write there)
        self.host = host  # host memory: operations on it run on the host
        # Accesses per byte range, [lo, hi, stream, count, is_write]: tensors carved out of one
        # storage (a slab of page-locked memory) are separate memory as far as ordering goes.
        self.recs: list[list] = []
        self.label = label
        self.recorded: dict[str, int] = {}  # record_stream: the allocator waits for these

    def wrote(self, stream: str, t: int, lo: int = 0, hi: int | None = None) -> None:
        hi = hi if hi is not None else (1 << 62)
        # Accesses inside the range are ordered before this write (checked first): a later
        # access that is ordered after the write is ordered after them too.
        self.recs = [r for r in self.recs if not (lo <= r[0] and r[1] <= hi)]
        self.recs.append([lo, hi, stream, t, True])

    def read(self, stream: str, t: int, lo: int, hi: int) -> None:
        for r in self.recs:
            if not r[4] and r[0] == lo and r[1] == hi and r[2] == stream:
                r[3] = t
                return
        self.recs.append([lo, hi, stream, t, False])


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor (view) covers, as [lo, hi)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    if t.numel() == 0:
        return lo, lo
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)
    return lo, lo + (last + 1) * size


# Operations that change a tensor's metadata only, although their schema marks ``self`` written.
_METADATA = {"set_", "resize_", "detach_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
             "transpose_", "requires_grad_", "_coalesced_"}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y


class _Mode(TorchDispatchMode):
    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        m = self.model
        name = func._schema.name.split("::")[-1]
        if name == "is_pinned":
            return m.is_pinned(args[0])
        pin = False
        if name in ("empty", "empty_strided") and kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
            pin = True
        if name == "_pin_memory":
            out = args[0].clone()
            m.register(out, host=True, pinned=True)
            return out
        if name in _METADATA or any(r.alias_info is not None and not r.alias_info.is_write
                                    for r in func._schema.returns):
            return func(*args, **kwargs)  # a view or a change of metadata: no data access
        reads, writes = [], []
        for i, a in enumerate(func._schema.arguments):
            v = args[i] if i < len(args) else kwargs.get(a.name)
            is_write = a.alias_info is not None and a.alias_info.is_write
            for t in _tensors(v):
                (writes if is_write else reads).append(t)
        out = func(*args, **kwargs)
        if pin:
            m.register(out, host=True, pinned=True)
            return out
        inputs = {m.key(t) for t in (*reads, *writes)}
        fresh = [t for t in _tensors(out if isinstance(out, (list, tuple)) else [out])
                 if m.key(t) not in inputs]
        non_blocking = bool(kwargs.get("non_blocking")) or (
            name == "copy_" and len(args) > 2 and bool(args[2]))
        m.access(name, reads, writes, fresh, non_blocking)
        return out


class StreamModel:
    """Streams, events and the bookkeeping of who touched which memory when (module docstring).

    Args:
        query_done: what ``Event.query()`` answers for a recorded event: true (the work is
            done; the host learns it), or false: work is done only once the host waited for it
            (a slow device).
    """

    def __init__(self, *, query_done: bool = True) -> None:
        self.lock = threading.RLock()
        self.query_done = query_done
        self.host = _Clock(HOST)
        self.compute = Stream(self, "compute")
        self._n = 0
        self._all: list[Stream] = [self.compute]
        self._tls = threading.local()
        self._bufs: dict[int, _Buf] = {}
        self._pinned: set[int] = set()
        self.skip: set[tuple[str, int]] = set()
        self.skipped: list[tuple[str, int]] = []
        self.sites: set[tuple[str, int]] = set()
        self.deferred: list[str] = []  # frees found unordered inside a finalizer
        self.accesses = 0

    # -------------------------------------------------------------- the device module's face
    def Stream(self, device=None, priority: int = 0) -> Stream:  # noqa: N802
        with self.lock:
            self._n += 1
            s = Stream(self, f"side{self._n}")
            self._all.append(s)
            return s

    def Event(self, **kwargs) -> Event:  # noqa: N802
        return Event(self, **kwargs)

    def current_stream(self, device=None) -> Stream:
        stack = getattr(self._tls, "stack", None)
        return stack[-1] if stack else self.compute

    def default_stream(self, device=None) -> Stream:
        return self.compute

    @contextlib.contextmanager
    def stream(self, s: Stream | None):
        stack = self._tls.__dict__.setdefault("stack", [])
        stack.append(s if s is not None else self.current_stream())
        try:
            yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def on_host(self):
        """Host code: tensors it creates from nothing are host memory."""
        self._tls.on_host = getattr(self._tls, "on_host", 0) + 1
        try:
            yield
        finally:
            self._tls.on_host -= 1

    def synchronize(self, device=None) -> None:
        with self.lock:
            for s in self._all:  # all work issued so far is done
                self.host.merge(s.clock.vc)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    # -------------------------------------------------------------- memory bookkeeping
    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.key(t) in self._pinned

    def register(self, t: torch.Tensor, *, host: bool, pinned: bool = False,
                 stream: str | None = None) -> _Buf:
        """Start tracking ``t``'s storage as new memory: host memory if ``host`` (page-locked
        if ``pinned``), else device memory of ``stream`` (default: the current one)."""
        return self._register(t.untyped_storage(), f"{tuple(t.shape)} {t.dtype}",
                              host=host, pinned=pinned, stream=stream)

    def _register(self, s: torch.UntypedStorage, label: str, *, host: bool, pinned: bool,
                  stream: str | None) -> _Buf:
        k = s._cdata
        with self.lock:
            if pinned:
                self._pinned.add(k)
            alloc = HOST if host else (stream or self.current_stream().name)
            b = self._bufs[k] = _Buf(alloc, host, label)
        weakref.finalize(s, self._freed, k, b)
        return b

    def refilled(self, s: torch.UntypedStorage) -> None:
        """``s`` got new device memory (``resize_(n)``): an allocation on the current stream."""
        with self.lock:
            cur = self.current_stream().clock
            cur.merge(self.host.vc)
            b = self._register(s, f"storage of {s.nbytes()} bytes", host=False, pinned=False,
                               stream=cur.name)
            b.wrote(cur.name, cur.tick())

    def host_memory(self, *ts: torch.Tensor) -> None:
        """Declare tensors host memory (pageable): operations on them run on the host."""
        for t in ts:
            self.register(t, host=True)

    def host_op(self, tensors) -> bool:
        bufs = [self._bufs.get(self.key(t)) for t in tensors]
        return any(b is not None and b.host for b in bufs)

    def _buf(self, t: torch.Tensor) -> _Buf | None:
        if t.untyped_storage().nbytes() == 0:
            return None
        k = self.key(t)
        b = self._bufs.get(k)
        if b is None:
            b = self.register(t, host=False, stream="compute")
        return b

    def _freed(self, k: int, b: _Buf) -> None:
        with self.lock:
            if self._bufs.get(k) is b:
                del self._bufs[k]
                self._pinned.discard(k)
            if not b.host:
                msg = self._check_free(b)
                if msg:
                    self.deferred.append(msg)

    def _check_free(self, b: _Buf) -> str | None:
        # The allocator hands the memory to later work on its stream, issued after the host's
        # present knowledge: earlier uses on other streams must be ordered before both.
        clock = self.compute.clock if b.alloc == "compute" else None
        known = dict(self.host.vc)
        if clock is not None:
            for s, v in clock.vc.items():
                known[s] = max(known.get(s, 0), v)
        for _, _, s, t, _ in b.recs:
            if s != b.alloc and known.get(s, 0) < t and b.recorded.get(s, 0) < t:
                return (f"free of {b.label} (memory of {b.alloc}) while {s} may still use it"
                        f" (its access {t}, {b.alloc} ordered up to {known.get(s, 0)})")
        return None

    def free_storage(self, s: torch.UntypedStorage) -> None:
        """``s`` is about to lose its memory (``resize_(0)``)."""
        with self.lock:
            b = self._bufs.pop(s._cdata, None)
            if b is not None and not b.host and s.nbytes():
                msg = self._check_free(b)
                if msg:
                    raise StreamOrderError(msg)

    def free_host(self, t: torch.Tensor) -> None:
        """Host memory ``t`` is given back to the system now (a slab of page-locked memory
        released): every copy that used it must be known to the host to be done."""
        with self.lock:
            b = self._bufs.get(self.key(t))
            if b is None:
                return
            for _, _, s, n, _ in b.recs:
                if not self.host.knows(s, n):
                    raise StreamOrderError(
                        f"release of host memory {b.label} while {s} may still use it (its"
                        f" access {n}; the host knows up to {self.host.vc.get(s, 0)})")

    def record_stream(self, t: torch.Tensor, stream: Stream) -> None:
        """``t.record_stream(stream)``: freeing ``t`` waits for ``stream``'s work issued so
        far (the allocator does it on a device, with an event)."""
        with self.lock:
            b = self._buf(t)
            if b is not None:
                b.recorded[stream.name] = stream.clock.vc[stream.name]

    def raise_deferred(self) -> None:
        if self.deferred:
            msg, self.deferred[:] = self.deferred[0], []
            raise StreamOrderError(msg)

    def access(self, op: str, reads, writes, fresh, non_blocking: bool = False) -> None:
        with self.lock:
            self.raise_deferred()
            cur = self.current_stream()
            bufs = [(b, False, _span(x)) for x in reads if (b := self._buf(x)) is not None]
            bufs += [(b, True, _span(x)) for x in writes if (b := self._buf(x)) is not None]
            blocking = False
            if (bufs or getattr(self._tls, "on_host", 0)) and all(b.host for b, _, _ in bufs):
                # An operation on host memory only runs on the host, and so does one without
                # inputs in host code (the host optimizer's own scalars and buffers).
                clock = self.host
            elif any(b.host for b, _, _ in bufs) and not non_blocking:
                # A blocking copy between host and device: it runs on the current stream and
                # the host waits for it.
                clock, blocking = cur.clock, True
                clock.merge(self.host.vc)
            else:
                clock = cur.clock
                clock.merge(self.host.vc)  # the host issued it after all it knows of
            t = clock.tick()
            if blocking:
                self.host.merge(clock.vc)
            self.accesses += 1
            for b, w, span in bufs:
                self._check(op, clock, b, w, span)
            for b, w, (lo, hi) in bufs:
                if w:
                    b.wrote(clock.name, t, lo, hi)
                else:
                    b.read(clock.name, t, lo, hi)
            for o in fresh:
                if o.untyped_storage().nbytes():
                    nb = self.register(o, host=clock is self.host, stream=clock.name)
                    nb.wrote(clock.name, t)

    def _check(self, op: str, clock: _Clock, b: _Buf, write: bool,
               span: tuple[int, int]) -> None:
        lo, hi = span
        for rlo, rhi, s, t, w in b.recs:
            if rlo >= hi or lo >= rhi or clock.knows(s, t) or not (w or write):
                continue
            what = f"{b.label} [{lo}, {hi})" if (lo, hi) != (0, 1 << 62) else b.label
            raise StreamOrderError(
                f"{op} {'writes' if write else 'reads'} {what} on {clock.name}, not ordered"
                f" after its {'write' if w else 'read'} on {s} (access {t}; {clock.name} ordered"
                f" up to {clock.vc.get(s, 0)})")


@contextlib.contextmanager
def stream_model(monkeypatch, *, query_done: bool = True):
    """Run the accelerator code paths on the CPU under a `StreamModel` (yielded)."""
    import headroom.store._store as store_mod

    model = StreamModel(query_done=query_done)
    real_is_acc = store_mod.is_accelerator
    real_get = torch.get_device_module

    def is_accelerator(device) -> bool:
        return torch.device(device).type != "meta"

    def get_device_module(device=None):
        d = torch.device(device) if device is not None else torch.device("cpu")
        return model if d.type == "cpu" else real_get(device)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("headroom") and \
                getattr(mod, "is_accelerator", None) is real_is_acc:
            monkeypatch.setattr(mod, "is_accelerator", is_accelerator)
    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    # What the transfer layer keeps per process (page-locked pools, shared stashes with their
    # streams) starts afresh under each model, and is put back afterwards.
    import headroom.transfer._rows as rows_mod
    import headroom.transfer._stash as stash_mod

    monkeypatch.setattr(rows_mod, "_shared_pool", None)
    monkeypatch.setattr(stash_mod, "_host_shared", {})
    real_resize = torch.UntypedStorage.resize_

    def resize_(self, n):
        if n == 0:
            model.free_storage(self)
        out = real_resize(self, n)
        if n:
            model.refilled(self)
        return out

    monkeypatch.setattr(torch.UntypedStorage, "resize_", resize_)
    # The host optimizer's worker thread (its step and copy-back) is checked too; its host
    # operations share the host's clock, which may hide a race between the two threads but
    # reports none that is not there.
    import headroom.optim._overlap as overlap_mod

    real_submit = overlap_mod.Overlap.submit

    def logged(fn):
        def run(*args, **kwargs):
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

            if any(isinstance(m, _Mode) for m in _get_current_dispatch_mode_stack()):
                return fn(*args, **kwargs)  # already watched (run at once on this thread)
            with _Mode(model):
                return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(overlap_mod.Overlap, "submit",
                        lambda self, fn: real_submit(self, logged(fn)))
    # Page-locked slabs go back to the system when released (unlike blocks of torch's caching
    # host allocator, which waits for their copies): a release is checked like a free.
    import headroom.store._pinned as pinned_mod

    real_release = pinned_mod.Slab.release

    def release(self):
        if self.tensor is not None:
            model.free_host(self.tensor)
        real_release(self)

    monkeypatch.setattr(pinned_mod.Slab, "release", release)
    # The host optimizer's step is host code (its state scalars are host memory: on a device
    # they would not make the host wait for the computing stream).
    import headroom.optim._host_optimizer as host_opt_mod

    real_step_entries = host_opt_mod.HostOptimizer._step_entries

    def step_entries(self, *args, **kwargs):
        with model.on_host():
            return real_step_entries(self, *args, **kwargs)

    monkeypatch.setattr(host_opt_mod.HostOptimizer, "_step_entries", step_entries)
    # So are the mover's landing thread and the I/O threads that issue its copies out of
    # disk staging (what it hands to other threads goes through `Mover._bg`).
    import headroom.transfer._mover as mover_mod

    monkeypatch.setattr(mover_mod.Mover, "_bg", staticmethod(logged))
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, stream: model.record_stream(t, stream))
    with _Mode(model):
        yield model
    model.raise_deferred()
