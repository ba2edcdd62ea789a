"""A DiskStore in forked children: a clear error at once instead of a hang, and a folder lock
that lives and dies with the process that opened the store (real processes, bounded in time)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import headroom
from headroom.store import DiskStore

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
FORK = multiprocessing.get_context("fork")


def _child_writes(store: DiskStore, conn) -> None:
    try:
        h = store.get("x")
        store.write(h, torch.full((4,), 2.0)).result()
        conn.send("returned")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(f"{type(e).__name__}: {e}")
    try:
        store.alloc("y", (2,), torch.float32)
    except RuntimeError as e:
        conn.send(f"alloc: {e}")
    store.close()  # nothing in a child: the parent's store stays open
    conn.send("closed")


def _hold(locks, held: threading.Event, go: threading.Event) -> None:
    for lock in locks:
        lock.acquire()
    held.set()
    go.wait(60)
    for lock in locks:
        lock.release()


def test_forked_child_using_an_inherited_store_raises_at_once(tmp_path):
    store = DiskStore(tmp_path / "s", threads=2)
    store.put("x", torch.ones(4))
    parent, child = FORK.Pipe()
    # Another thread holds the store's locks at the fork (as an I/O thread may): the child must
    # not wait for a thread it does not have.
    held, go = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=([store._lock, store._ledger.lock], held, go))
    holder.start()
    assert held.wait(30)
    p = FORK.Process(target=_child_writes, args=(store, child))
    try:
        p.start()
    finally:
        go.set()
        holder.join(30)
    try:
        assert parent.poll(30), "the child hung using the inherited store"
        got = parent.recv()
        assert parent.poll(30)
        got_alloc = parent.recv()
        assert parent.poll(30) and parent.recv() == "closed"
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()
    assert got.startswith("RuntimeError: DiskStore(") and f"opened in process {os.getpid()}" \
        in got and "a child forked from it" in got and "DataLoader worker" in got, got
    assert got_alloc.startswith("alloc: DiskStore(") and "forked" in got_alloc
    # The parent's store is untouched: its threads, journal and lock still work.
    store.write(store.get("x"), torch.full((4,), 3.0)).result()
    assert torch.equal(store.read(store.get("x")).result(), torch.full((4,), 3.0))
    with pytest.raises(RuntimeError, match="already open in this process"):
        DiskStore(tmp_path / "s")
    store.close()
    s = DiskStore(tmp_path / "s")
    assert torch.equal(s.read(s.get("x")).result(), torch.full((4,), 3.0)) and s.keys() == ["x"]
    s.close()


class _Rows(torch.utils.data.Dataset):
    def __init__(self, store: DiskStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.store.read(self.store.get("x")).result()


def test_dataloader_worker_reading_an_inherited_store_raises(tmp_path):
    store = DiskStore(tmp_path / "s")
    store.put("x", torch.ones(4))
    loader = torch.utils.data.DataLoader(_Rows(store), num_workers=1, timeout=30,
                                         multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match=r"a child forked from it.*DataLoader worker"):
        next(iter(loader))
    store.close()


_PARENT = """
import os, sys, time, torch
from headroom.store import DiskStore
s = DiskStore(sys.argv[1])
s.put("x", torch.ones(4))
s.flush()
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
time.sleep(120)
"""


def test_lock_dies_with_the_parent_while_a_forked_child_lives(tmp_path):
    folder = tmp_path / "s"
    src = str(Path(headroom.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _PARENT, str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    child = None
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read() if proc.poll() is not None else line
        child = int(line)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(child, 0)  # the child is alive and still has its copy of every descriptor
        deadline = time.monotonic() + 10
        while True:  # the kernel drops the dead parent's descriptors as it reaps it
            try:
                s = DiskStore(folder)
                break
            except RuntimeError as e:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the lock outlived its process: {e}") from None
                time.sleep(0.05)
        assert torch.equal(s.read(s.get("x")).result(), torch.ones(4))
        s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
