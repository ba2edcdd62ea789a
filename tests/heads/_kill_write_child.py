"""A process for `test_classifier_writes`'s kill -9 test: a write into a disk head's weight.

Run as ``python _kill_write_child.py FOLDER MODE``: a head on a `DiskStore` (key ``w``) is
flushed (prints ``flushed``), then ``head.weight.copy_(new_weight())`` is SIGKILLed: with MODE
``before``, as its write to the store is issued; with ``after``, once that write has completed
(not flushed).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

import headroom as hr
from headroom.store import DiskStore

C, D = 300, 16


def open_head(folder: Path) -> hr.HugeClassifier:
    """The head (its values kept when the store already holds them)."""
    return hr.HugeClassifier(C, D, device="cpu", store=DiskStore(folder), key="w")


def new_weight() -> torch.Tensor:
    return torch.randn(C, D, generator=torch.Generator().manual_seed(7))


def main() -> None:
    torch.manual_seed(0)
    head = open_head(Path(sys.argv[1]))
    store = head.store
    store.flush()
    print("flushed", flush=True)
    real = store.write

    def write_then_die(*args, **kwargs):
        if sys.argv[2] == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        real(*args, **kwargs).result()
        os.kill(os.getpid(), signal.SIGKILL)

    store.write = write_then_die
    with torch.no_grad():
        head.weight.copy_(new_weight())
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
