"""A process for `test_disk_safety` to kill: it fills a DiskStore and reports what completed.

Run as ``python _crash_child.py MODE FOLDER``; prints one line per completed operation and
flushes, so the parent knows what the store must hold when it sends SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from headroom.store import DiskStore
from headroom.store import _disk as disk_mod


def say(*parts) -> None:
    # One write(2) per line (a pipe takes up to 4 KiB atomically): print() may flush a
    # full buffer mid-line, and a kill then leaves the parent half a line ("done" alone).
    os.write(1, (" ".join(map(str, parts)) + "\n").encode())


def stream_ops(n_ops: int):
    """The deterministic sequence of writes of the "stream" mode: (key, rows or None, value)."""
    for i in range(n_ops):
        key = ("a", "b", "c")[i % 3]
        if i % 2:
            lo = (7 * i) % 40
            yield key, (lo, lo + 9), float(i)
        else:
            yield key, None, float(i)


SHAPES = {"a": (50, 64), "b": (50, 64), "c": (50, 64)}


def main() -> None:
    mode, folder = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    store = DiskStore(folder, threads=2)
    if mode == "allocs":
        store.put("w", torch.arange(12.0).reshape(3, 4))
        store.alloc("zeros", (5,), torch.float32)
        h = store.alloc("rows", (6, 2), torch.int64)
        store.write_rows(h, slice(2, 4), torch.tensor([[1, 2], [3, 4]])).result()
        say("ready")
    elif mode == "stream":
        handles = {k: store.alloc(k, s, torch.float32) for k, s in SHAPES.items()}
        say("allocated")
        for j, (key, rows, value) in enumerate(stream_ops(100000)):
            h = handles[key]
            if rows is None:
                store.write(h, torch.full(h.shape, value)).result()
            else:
                src = torch.full((rows[1] - rows[0], *h.shape[1:]), value)
                store.write_rows(h, slice(*rows), src).result()
            say("done", j)
    elif mode == "large":
        h = store.alloc("big", (32 << 20,), torch.float32)  # 128 MiB
        store.put("small", torch.ones(10))
        for i in range(1, 1000):
            src = torch.full(h.shape, float(i))
            t0 = time.perf_counter()
            say("start", i)
            store.write(h, src).result()
            say("done", i, f"{time.perf_counter() - t0:.4f}")
    elif mode == "tear":
        store.put("keep", torch.arange(10.0))
        h = store.put("torn", torch.zeros(1 << 20))
        real = disk_mod._pwrite_from

        def half_then_die(fd, buf, offset, written):
            real(fd, buf[:len(buf) // 2], offset, written)
            os.kill(os.getpid(), signal.SIGKILL)

        disk_mod._pwrite_from = half_then_die
        say("ready")
        store.write(h, torch.ones(1 << 20)).result()
    elif mode == "free":
        store.put("keep", torch.arange(10.0))
        h = store.put("gone", torch.ones(10))
        store.flush()

        def die(path, *a, **kw):  # killed between the journaled free and the unlink
            os.kill(os.getpid(), signal.SIGKILL)

        os.unlink = die
        say("freeing")
        store.free(h)
    elif mode == "train":
        import headroom as hr
        from tests.optim._models import loss_fn, make_model

        torch.set_num_threads(1)
        model = hr.offload(make_model(0), device="cpu", store=store)
        opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        for i in range(100000):
            loss_fn(model, i).backward()
            opt.step()
            opt.zero_grad()
            say("step", i + 1)
    time.sleep(600)


if __name__ == "__main__":
    main()
