"""Copies made only to be pickled, kept alive while a process is started with them."""

from __future__ import annotations

import multiprocessing.context

__all__ = ["keep_for_child"]


def keep_for_child(obj: object) -> None:
    """Keep ``obj`` (made for a pickle alone) alive as long as the process being started.

    NOTE: ``multiprocessing``'s spawn and forkserver start methods pickle the child's arguments
    with torch's reductions, which move each tensor's storage into shared memory and name it by
    a file descriptor that the child inherits when it is started, after pickling. A copy made
    for the pickle alone (a plain copy of an offloaded model, the values of a tensor on disk)
    would close those descriptors when freed at the end of pickling, before the child is
    started ("bad value(s) in fds_to_keep"). The shared memory is the child's copy too, so
    keeping it costs no more memory. Outside such a start, nothing is kept.
    """
    popen = multiprocessing.context.get_spawning_popen()
    if popen is not None:
        popen.__dict__.setdefault("_headroom_pickled", []).append(obj)
