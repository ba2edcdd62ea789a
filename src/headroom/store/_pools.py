"""Thread pools that let go of their owner: jobs that drop their references before they
complete, and threads that end with the object owning them.

A ``ThreadPoolExecutor``'s worker holds a job's function and arguments until *after* its future
completes, so the last reference to an owner may stay on a worker thread (and its finalizer,
a `DiskStore`'s folder lock, run late); and its threads outlive an owner collected without
``close()``. `Pool` drops each job's references as it starts; `owned_pool` ends a pool's
threads with its owner (see `stop_pool`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["Pool", "owned_pool", "stop_pool"]


class _Once:
    """A job that forgets its function and arguments as it starts."""

    __slots__ = ("_job",)

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self._job: tuple | None = (fn, args, kwargs)

    def __call__(self) -> Any:
        fn, args, kwargs = self._job
        self._job = None
        return fn(*args, **kwargs)


class Pool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` whose jobs hold nothing once they have run."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return super().submit(_Once(fn, args, kwargs))


def stop_pool(pool: ThreadPoolExecutor) -> None:
    """Tell ``pool``'s threads to end once idle, without waiting for them (idempotent)."""
    # NOTE: finalizers call this wherever a garbage collection starts, perhaps in a thread
    # starting up while it holds ``threading``'s lock of ending threads, which ``Thread.join``
    # takes: joining there would hang every thread start for good. ``close()`` waits instead.
    pool.shutdown(wait=False)


def owned_pool(owner: object, max_workers: int, prefix: str) -> Pool:
    """A `Pool` whose threads end when ``owner`` is garbage-collected (or shut down earlier)."""
    pool = Pool(max_workers, thread_name_prefix=prefix)
    weakref.finalize(owner, stop_pool, pool)
    return pool
