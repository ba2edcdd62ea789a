"""Children for the interrupted-save tests: a model, and a save interrupted at its n-th step.

Run in a forkserver process (torch imported once): `save_and_signal` saves a model over the
checkpoint in a folder and sends itself a real signal at the n-th rename or removal in that
folder, before or after it happens, so every boundary between two files of a save is tried.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch import nn

from headroom.checkpoint import save_weights  # imported once, in the forkserver

# Six 8x8 fp32 weights of 256 bytes: max_shard_size 256/512/768/4096 gives 6/3/2/1 files.
LAYERS = 6


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(LAYERS)])
    with torch.no_grad():
        for p in m.parameters():
            p.add_(seed)  # every value differs between seeds
    return m


def save_and_signal(folder: str, seed: int, shard: int, stop_at: int, sig: int) -> None:
    """Save model(seed) into folder; at the ``stop_at``-th boundary, send ``sig`` to itself.

    Boundaries: just before and just after each ``os.replace`` / ``os.unlink`` (the calls that
    change what a reader of the folder sees), counted from 1. ``stop_at=0``: no signal; the
    exit status is then the number of boundaries.
    """
    count = 0

    def boundary() -> None:
        nonlocal count
        count += 1
        if count == stop_at:
            os.kill(os.getpid(), sig)
            time.sleep(10)  # SIGTERM / SIGKILL end the process here; SIGINT raises in it

    def wrap(fn):
        def call(*args, **kw):
            boundary()
            out = fn(*args, **kw)
            boundary()
            return out
        return call

    os.replace, os.unlink = wrap(os.replace), wrap(os.unlink)
    # A killed process's writes reach the page cache, which survives it: what a kill leaves
    # does not depend on the syncs (a power loss would), and skipping them keeps this fast.
    os.fsync = lambda fd: None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    save_weights(model(seed), folder, max_shard_size=shard)
    os._exit(count if stop_at == 0 else 0)  # stop_at 0: report how many boundaries there are


def save_and_kill_at_seal(folder: str, seed: int) -> None:
    """Save model(seed) into folder, killed (SIGKILL) once the data is written, before the
    header is rewritten with its checksums."""
    from headroom.checkpoint import _file

    def kill(self) -> bytes:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)
        raise AssertionError("not killed")  # pragma: no cover

    _file.Seal.header = kill
    save_weights(model(seed), folder)
