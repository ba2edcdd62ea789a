"""Thread pools that let go of their owner: jobs that drop their references before they
complete, and threads that end with the object owning them.

Two things keep an object alive past its last user's ``del``. A ``ThreadPoolExecutor``'s
worker holds a job's function and arguments (bound methods of the owner) until a moment
*after* the job's future completes, so a caller that waits for the future and then drops the
owner may leave the last reference on the worker thread, and its finalizer (a `DiskStore`'s
folder lock) runs some time later. And the pool's threads outlive an owner garbage-collected
without ``close()``: they exit only once the executor itself is collected, from their own loop.
`Pool` drops each job's references as the job starts; `owned_pool` ties a pool's threads to
its owner, whose finalizer tells the pool's threads to end (see `stop_pool`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Pool", "owned_pool", "stop_pool"]


class _Once:
    """A job that forgets its function and arguments as it starts (they are gone, with the
    frame that ran them, by the time the job's future completes)."""

    __slots__ = ("_job",)

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self._job: tuple | None = (fn, args, kwargs)

    def __call__(self) -> Any:
        fn, args, kwargs = self._job
        self._job = None
        return fn(*args, **kwargs)


class Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose jobs hold nothing once they have run (see the module
    docstring): waiting for a job's future, then dropping what the job used, frees it."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return super().submit(_Once(fn, args, kwargs))


def stop_pool(pool: ThreadPoolExecutor) -> None:
    """Tell ``pool``'s threads to end once they are idle, without waiting for them (they end
    within moments: an owner that is unreachable runs no job). Idempotent; safe from one of
    the pool's own threads (an owner's last reference dropped by a job on its own pool).

    NOTE: called by finalizers, which run wherever a garbage collection starts, perhaps in a
    thread holding a lock that a joining thread takes: a thread that starts runs a collection
    while it holds ``threading``'s lock of ending threads, and ``Thread.join`` takes that lock
    once the joined thread has ended, whatever its timeout; joining there hangs every thread
    start of the process for good. So nothing here waits; ``close()`` methods, called by the
    user, wait for their threads.
    """
    pool.shutdown(wait=False)


def owned_pool(owner: object, max_workers: int, prefix: str) -> Pool:
    """A `Pool` whose threads end when ``owner`` is garbage-collected (its owner may still
    shut it down earlier, with `stop_pool` or ``shutdown``)."""
    pool = Pool(max_workers, thread_name_prefix=prefix)
    weakref.finalize(owner, stop_pool, pool)
    return pool
