"""Threads that a finalizer told to end: they end within moments, not at once (a finalizer
never waits for threads; see `headroom.transfer._pools.stop_pool`)."""

from __future__ import annotations

import threading
import time


def settled_thread_count(expected: int, timeout: float = 10.0) -> int:
    """``threading.active_count()`` once it is ``expected`` or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while threading.active_count() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()
