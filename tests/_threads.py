"""Threads that a finalizer told to end: they end within moments, not at once (a finalizer
never waits for threads; see `headroom.store._pools.stop_pool`)."""

from __future__ import annotations

import threading
import time


def settled_thread_count(expected: int | None = None, timeout: float = 10.0) -> int:
    """``threading.active_count()`` once it is ``expected`` (or, with ``None``, once it has
    not changed for 0.2 s: a baseline after earlier work's threads have ended), or after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = threading.active_count(), time.monotonic()
    while time.monotonic() < deadline:
        n = threading.active_count()
        if expected is not None and n == expected:
            return n
        if n != last:
            last, since = n, time.monotonic()
        elif expected is None and time.monotonic() - since >= 0.2:
            return n
        time.sleep(0.01)
    return threading.active_count()
