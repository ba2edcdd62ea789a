"""Copies made only to be pickled, kept alive while a process is started with them."""

from __future__ import annotations

import multiprocessing.context

__all__ = ["keep_for_child"]


def keep_for_child(obj: object) -> None:
    """Keep ``obj`` (made for a pickle alone) alive as long as the process being started.

    NOTE: spawn and forkserver pickle the child's arguments with torch's reductions, which move
    each storage into shared memory named by a file descriptor the child inherits when started,
    after pickling. A copy made for the pickle alone would close those descriptors when freed
    ("bad value(s) in fds_to_keep"). The shared memory is the child's copy, so keeping it costs
    nothing more. Outside such a start, nothing is kept.
    """
    popen = multiprocessing.context.get_spawning_popen()
    if popen is not None:
        popen.__dict__.setdefault("_headroom_pickled", []).append(obj)
