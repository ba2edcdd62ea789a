"""The process's resident memory (RSS) over a tracked region, beside its tensors.

RSS decides whether the OOM killer comes on a CPU box. `RSSWatch` samples it on a background
thread and takes the exact peak from the kernel's high-water mark when the region raised it;
it never resets that mark, which the user's own tools may be reading.
"""

from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["RSSWatch", "current_rss", "peak_rss"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss() -> int | None:
    """This process's resident set size in bytes now (``None`` where it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def peak_rss() -> int | None:
    """The largest RSS this process has had so far, in bytes (``None`` if unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class RSSWatch:
    """RSS at the start and end of a region, its peak, and samples in between.

    Args:
        interval: seconds between samples.
        max_samples: past this many samples, every other one is dropped (keeping maxima).

    Attributes:
        start, end, peak: bytes (``None`` where RSS cannot be read).
        samples: ``(seconds since t0, bytes)``.
    """

    def __init__(self, *, interval: float = 0.005, max_samples: int = 20_000) -> None:
        self.interval = interval
        self.max_samples = max_samples
        self.start: int | None = None
        self.end: int | None = None
        self.peak: int | None = None
        self.samples: list[tuple[float, int]] = []
        self._t0 = 0.0
        self._hwm0: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, t0: float) -> None:
        """Start watching; sample times are measured from ``t0`` (a ``perf_counter`` value)."""
        self._t0 = t0
        self.start = current_rss()
        self._hwm0 = peak_rss()
        if self.start is None:
            return
        self.samples.append((time.perf_counter() - t0, self.start))
        self._thread = threading.Thread(target=self._run, name="hr-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = current_rss()
            if rss is None:
                return
            self.samples.append((time.perf_counter() - self._t0, rss))
            if len(self.samples) > self.max_samples:
                pairs = zip(self.samples[0::2], self.samples[1::2], strict=False)
                self.samples = [max(a, b, key=lambda s: s[1]) for a, b in pairs]

    def finish(self) -> None:
        """Stop watching and settle ``end`` and ``peak``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.end = current_rss()
        if self.end is not None:
            self.samples.append((time.perf_counter() - self._t0, self.end))
        hwm = peak_rss()
        # the high-water mark covers the process's life: the region's peak only if it raised it
        raised = hwm is not None and self._hwm0 is not None and hwm > self._hwm0
        self.peak = hwm if raised else max((r for _, r in self.samples), default=None)
