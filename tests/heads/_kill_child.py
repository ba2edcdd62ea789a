"""A process for `test_classifier_multilabel`'s kill -9 test: multi-label training on disk.

Run as ``python _kill_child.py FOLDER``: one full step of a disk-backed multi-label head with
`HostOptimizer` (prints ``stepped 1``), then the second step's backward SIGKILLs the process
between two gradient-slice writes, as a crash or an OOM kill would.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

import headroom as hr
from headroom.store import DiskStore

C, D, B, SLICE = 1000, 16, 24, 128


def open_head(folder: Path) -> tuple[hr.HugeClassifier, hr.HostOptimizer, DiskStore]:
    """The head (key ``ml``, its values kept when the store already holds them) and its SGD."""
    store = DiskStore(folder / "w")
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=store, key="ml",
                             slice_size=SLICE)
    opt = hr.HostOptimizer(head.parameters(), torch.optim.SGD, lr=0.5, momentum=0.0)
    return head, opt, store


def batch(step: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Step ``step``'s features and CSR targets (0 to 6 positives per row), reproducibly."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(B, D, generator=gen)
    counts = torch.randint(0, 7, (B,), generator=gen)
    indices = torch.cat([torch.randperm(C, generator=gen)[: int(k)] for k in counts])
    return x, (torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]), indices)


def train_step(head: hr.HugeClassifier, opt: hr.HostOptimizer, step: int) -> None:
    x, targets = batch(step)
    head(x, targets, loss="bce", pos_weight=2.0).backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    head, opt, store = open_head(Path(sys.argv[1]))
    train_step(head, opt, 1)
    store.flush()
    print("stepped 1", flush=True)
    x, targets = batch(2)
    loss = head(x, targets, loss="bce", pos_weight=2.0)
    real, issued = store.write_rows, []

    def write_then_die(*args, **kwargs):
        if len(issued) == 2:  # a weight and a bias gradient slice were written: die mid-pass
            for fut in issued:
                fut.result()  # landed for sure, so the store has changed since its flush
            os.kill(os.getpid(), signal.SIGKILL)
        issued.append(real(*args, **kwargs))
        return issued[-1]

    store.write_rows = write_then_die
    loss.backward()
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
