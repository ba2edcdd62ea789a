"""One user at a time: an offloaded model's forward or backward, across threads.

A forward in one thread would release the device copies another thread computes with, so one
forward (a thread, reentrant) or one backward (a graph task) uses the model at a time; others
wait at the boundary of the whole call, giving plain PyTorch's result for that order. A
backward's use ends with its final callback or, if it breaks off, when autograd drops the graph
task holding that callback (a weak reference); the next user cleans up (`Offload.abort_backward`).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

__all__ = ["Use"]


class _EndBackward:
    """The final callback of one backward: runs ``fn``, then ends the backward's use."""

    __slots__ = ("use", "task", "fn", "__weakref__")

    def __init__(self, use: Use, task: int, fn: Callable[[], None]) -> None:
        self.use = use
        self.task = task
        self.fn = fn

    def __call__(self) -> None:
        try:
            self.fn()
        finally:
            self.use.exit_backward(self.task)


class Use:
    """Who runs an offloaded model now: nobody, a forward (a thread; short operations too) or
    a backward (a graph task). Waiters get it in the order they asked (none starves)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._owner: tuple | None = None  # ("f", thread ident) or ("b", graph task id)
        self._depth = 0  # nested uses of the owning thread (blocks within the root)
        self._queue: deque[object] = deque()  # tickets of the waiters, first come first
        self._watch: weakref.ref | None = None  # the running backward's final callback

    def _mine(self) -> bool:
        return self._owner == ("f", threading.get_ident())

    def _take(self, owner: tuple, give_up: Callable[[], bool] | None = None) -> bool:
        """Wait for a turn (holding ``_cond``) and own the model; ``False`` if ``give_up()``."""
        if self._owner is None and not self._queue:
            self._owner = owner
            return True
        ticket = object()
        self._queue.append(ticket)
        try:
            while self._owner is not None or self._queue[0] is not ticket:
                if give_up is not None and give_up():
                    return False
                self._cond.wait()
            self._owner = owner
            return True
        finally:
            self._queue.remove(ticket)
            self._cond.notify_all()  # the next waiter checks whether it is first now

    def _free(self) -> None:
        self._owner = None
        self._depth = 0
        self._watch = None
        self._cond.notify_all()

    # ---------------------------------------------------------------- forward
    def enter_forward(self) -> None:
        """Start (or nest) a forward in this thread, waiting for other users."""
        with self._cond:
            if not self._mine():
                self._take(("f", threading.get_ident()))
            self._depth += 1

    def try_enter(self) -> bool:
        """Take (or nest) a use in this thread if nobody else has one; never waits."""
        with self._cond:
            if not self._mine():
                if self._owner is not None or self._queue:
                    return False  # no ticket queued: waiters are not woken by a failed try
                self._owner = ("f", threading.get_ident())
            self._depth += 1
            return True

    def enter_short(self, *, wait_for_backward: bool) -> bool:
        """Take the model for a short operation (nested in this thread's forward), waiting for
        another thread's forward; for a backward only with ``wait_for_backward`` and outside
        it, else ``False``. Pair a ``True`` with `exit_forward`."""
        def give_up() -> bool:
            return self._owner is not None and self._owner[0] == "b" and (
                not wait_for_backward
                or self._owner[1] == torch._C._current_graph_task_id())

        with self._cond:
            if not self._mine() and not self._take(("f", threading.get_ident()), give_up):
                return False
            self._depth += 1
            return True

    def exit_forward(self, *, whole: bool = False) -> None:
        """End one nested use of this thread (``whole``: all of them, after a failure)."""
        with self._cond:
            if not self._mine():
                return
            self._depth = 0 if whole else self._depth - 1
            if self._depth <= 0:
                self._free()

    # ---------------------------------------------------------------- backward
    def enter_backward(self, task: int, end: Callable[[], None]) -> Callable[[], None]:
        """Start graph task ``task``'s backward, waiting for other users (inside this thread's
        forward: within its use); returns the final callback (``end``, then the use ends)."""
        with self._cond:
            cb = _EndBackward(self, task, end)
            if not self._mine():
                self._take(("b", task))
                # dropped with the graph task: a backward that breaks off ends its use then
                self._watch = weakref.ref(cb, lambda _, t=task: self.exit_backward(t))
            return cb

    def held_by(self, task: int) -> bool:
        """Whether graph task ``task``'s backward (or this thread's forward) uses the model."""
        return self._owner == ("b", task) or self._mine()

    def exit_backward(self, task: int) -> None:
        """End graph task ``task``'s use of the model (no-op if it holds none)."""
        with self._cond:
            if self._owner == ("b", task):
                self._free()
