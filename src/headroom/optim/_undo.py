"""What one optimizer step changed, kept until the step ends so a failed step can be undone.

[Note: all-or-nothing step]
What rests on disk is not overwritten: the step writes a spare of the same shape in its store,
and the two trade places when the step ends (no undo, no extra I/O). The optimizer's own
tensors swap handles; an offloaded parameter's value, whose handle the model reads, swaps
contents (`Store.exchange`: one journal record per store, so after ``kill -9`` every parameter
of the step is old or every one new). Exchanges run once Ctrl-C is held back and before
anything that cannot be undone; one that fails is exchanged back. Until then the model reads
the old values whole, also during ``final_backward``.
Before a slice of any other tensor (host memory, rows of a row-sparse step) is overwritten,
its old values are kept: a copy in host memory, or, when a disk takes part, an undo tensor
(a scratch key, see [Note: scratch keys]) on that disk, so no second copy of the state sits in
memory. (Re-running the kernel instead would read as many bytes, and a failed read could not
be undone.) A slice's new values go out only once its old ones are kept. When the step
raises, kept slices are written back newest first and the scalars (step counts) restored:
all is as before, gradients too, and ``step()`` again redoes it.

What a step updates without touching a disk is not copied (tensors stepped whole in host
memory; sliced steps with master, state and value in host memory, where copies would cost 14
bytes per parameter): PyTorch's kernel on the resting tensors allocates nothing once the state
exists (a slice of temporaries at most), so it runs last, after everything that can fail,
Ctrl-C held back (`DeferInterrupt`). Steps started during ``final_backward`` copy those when a
disk may still fail in ``step()``. An error left that cannot be undone (in that kernel, e.g.
out of memory making the first state) is reported as a mix; ``step()`` refuses until a
checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["DeferInterrupt", "Txn"]


class Txn:
    """The undo record of one step (possibly started during ``final_backward``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[Callable[[], Any]] = []
        self._entries: dict[int, tuple] = {}
        self._after: list[Callable[[], None]] = []
        self._commit: list[Callable[[], None]] = []
        self._exchanges: list[tuple[Any, Any, Any]] = []  # (store, handle, spare), pending
        self.unprotected = 0  # parameters updated in place without a kept copy
        self.stores: set = set()  # stores holding a write reservation for this step

    # ------------------------------------------------------------------ recording
    def _add(self, fn: Callable[[], Any]) -> None:
        """``fn`` puts some old values back (undo runs these newest first)."""
        with self._lock:
            self._records.append(fn)

    def entry(self, e: Any) -> None:
        """Keep ``e``'s per-parameter scalars (step counts...) and flags as they are now."""
        with self._lock:
            if id(e) not in self._entries:
                small = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                         for k, v in e.small.items()}
                self._entries[id(e)] = (e, small, e.initialized, e.grad_scale)

    def ram(self, t: torch.Tensor, rows: Any, old: torch.Tensor) -> None:
        """``t[rows]`` (``rows`` None: all of ``t``) held ``old`` (a copy) before the step."""
        self._add(lambda: _put(t, rows, old))

    def stored(self, store: Any, handle: Any, rows: Any, undo: tuple[Any, Any]) -> None:
        """Rows of ``handle`` were copied to the same rows of ``undo`` = (store, handle)."""
        self._add(lambda: store.write_rows(
            handle, rows, undo[0].read_rows(undo[1], rows).result()).result())

    def ram_from(self, t: Any, rows: Any, undo: tuple[Any, Any], urows: Any) -> None:
        """``t[rows]`` (``rows`` None: all of ``t``) held what rows ``urows`` of the undo
        tensor ``undo`` = (store, handle) now hold."""
        self._add(lambda: _put(t, rows, undo[0].read_rows(undo[1], urows).result()))

    def stored_copy(self, store: Any, handle: Any, rows: Any, old: torch.Tensor) -> None:
        """``handle``'s ``rows`` (None: all of it) held ``old`` (a host copy) before the step."""
        self._add(lambda: (store.write(handle, old) if rows is None
                           else store.write_rows(handle, rows, old)).result())

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the step ends well (e.g. make the spare state tensors current)."""
        with self._lock:
            self._commit.append(fn)

    def exchange(self, store: Any, handle: Any, spare: Any) -> None:
        """At `run_exchanges`, ``handle`` (not the optimizer's) takes ``spare``'s contents."""
        with self._lock:
            self._exchanges.append((store, handle, spare))

    def run_exchanges(self) -> None:
        """Exchange every pending spare into place, one `Store.exchange` per store, each
        recorded so that an undo exchanges it back."""
        with self._lock:
            todo, self._exchanges = self._exchanges, []
        by_store: dict[int, tuple[Any, list]] = {}
        for store, h, sp in todo:
            by_store.setdefault(id(store), (store, []))[1].append((h, sp))
        for store, pairs in by_store.values():
            store.exchange(pairs)
            self._add(functools.partial(store.exchange, pairs))

    def commit(self) -> None:
        """The step succeeded: run the commit actions, then `end`."""
        for fn in self._commit:
            fn()
        self.end()

    def after_undo(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the old values are back."""
        with self._lock:
            self._after.append(fn)

    @property
    def exchanging(self) -> bool:
        """Whether spares wait for `run_exchanges`."""
        return bool(self._exchanges)

    # ------------------------------------------------------------------ the end
    def undo(self) -> list[BaseException]:
        """Put the old values back, newest first; returns what failed (empty: all back)."""
        errors: list[BaseException] = []
        for fn in [*reversed(self._records), self._restore_entries, *self._after]:
            try:
                fn()
            except BaseException as ex:  # noqa: BLE001 - reported to the caller, all tried
                errors.append(ex)
        return errors

    def _restore_entries(self) -> None:
        for e, small, initialized, grad_scale in self._entries.values():
            e.small, e.initialized, e.grad_scale = small, initialized, grad_scale

    def end(self) -> None:
        """The step is over (committed or undone): drop what was kept, end reservations."""
        self._records, self._entries, self._after, self._commit = [], {}, [], []
        self._exchanges = []
        self.unprotected = 0
        stores, self.stores = self.stores, set()
        for s in stores:
            with contextlib.suppress(Exception):  # a closed store holds nothing
                s.release_writes()


def _put(t: torch.Tensor, rows: Any, old: torch.Tensor) -> None:
    if rows is None:
        t.copy_(old)
    elif isinstance(rows, slice):
        t[rows].copy_(old)
    else:
        t.index_copy_(0, rows, old)


def wait_all(futures: list[Future]) -> None:
    """Wait for every future, ignoring their errors (reported elsewhere)."""
    for f in futures:
        with contextlib.suppress(BaseException):  # cancelled: nothing more to wait for
            f.exception()


class DeferInterrupt:
    """Hold Ctrl-C back once `arm` ran (before, it raises at once: the step can still be
    undone); the caller raises it after. Only in the main thread under Python's default
    handler; elsewhere a no-op."""

    def __init__(self) -> None:
        self.armed = False
        self.pending = False
        self._old: Any = None  # the handler replaced (Python's default), while active

    def __enter__(self) -> DeferInterrupt:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        if not self.armed:
            raise KeyboardInterrupt
        self.pending = True

    def arm(self) -> None:
        self.armed = True

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
