"""Lifetimes in the transfer layer: a store dropped without close() ends its threads and
unlocks its folder when collected, pool jobs let go of their owner before completing, pooled
page-locked memory goes back to the budget, gradient hooks do not keep their owner alive; and
stores refuse pickling and copying with the way that works."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from headroom.transfer import (
    DiskStore,
    HostStore,
    PinnedPool,
    owned_pool,
    pinned_bytes,
    weak_post_accumulate_grad_hook,
)
from headroom.transfer._pools import Pool
from tests._threads import settled_thread_count


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_disk_store_dropped_without_close_ends_threads_and_unlocks(tmp_path):
    gc.collect()  # what earlier tests left goes now, not during the measurement
    threads, fds = threading.active_count(), _open_fds()
    for i in range(8):  # the same folder, opened again each time
        st = DiskStore(tmp_path / "s", threads=3)
        if i == 0:
            h = st.alloc("x", (1000,), torch.float32)
        else:  # what the store dropped before it wrote is there
            h = st.get("x")
            assert torch.equal(st.read(h).result(), torch.full((1000,), float(i - 1)))
        st.write(h, torch.full((1000,), float(i))).result()
        ref = weakref.ref(st)
        del st, h
        gc.collect()
        assert ref() is None
        # its I/O threads have ended and its lock and journal are closed, now
        assert (settled_thread_count(threads), _open_fds()) == (threads, fds), i


class _Owner:
    pass


def test_pool_job_holds_nothing_once_its_future_completes():
    # Done callbacks run on the worker after the future completes, while a plain
    # ThreadPoolExecutor still holds the job's function and arguments.
    seen = []
    pool = Pool(1)
    try:
        owner = _Owner()
        ref = weakref.ref(owner)
        go = threading.Event()
        fut = pool.submit(lambda o: go.wait(30), owner)
        del owner
        fut.add_done_callback(lambda f: seen.append(ref() is None))
        go.set()  # the job ends after the callback is in place
        fut.result()
        pool.submit(int).result()  # the callback has run
    finally:
        pool.shutdown()
    assert seen == [True]


def test_owned_pool_threads_end_with_their_owner():
    gc.collect()
    threads = threading.active_count()
    owner = _Owner()
    pool = owned_pool(owner, 2, "t")
    assert pool.submit(lambda: 7).result() == 7
    assert threading.active_count() > threads
    del owner
    gc.collect()
    assert settled_thread_count(threads) == threads
    # The owner's last reference dropped by a job, on the pool's own thread: the pool is shut
    # down without that thread waiting for itself (an error, or a hang), and it then ends.
    owner = _Owner()
    pool = owned_pool(owner, 1, "t")
    box = [owner]
    del owner
    errors = []
    hook, sys.unraisablehook = sys.unraisablehook, errors.append  # a finalizer's errors
    try:
        pool.submit(box.clear).result()
        for t in [t for t in threading.enumerate() if t.name.startswith("t_")]:
            t.join(30)
    finally:
        sys.unraisablehook = hook
    assert pool._shutdown and not errors
    assert settled_thread_count(threads) == threads


def test_pinned_pool_dropped_without_clear_gives_back_its_budget():
    gc.collect()
    before = pinned_bytes()
    pool = PinnedPool(pin=True)
    a = pool.take(1 << 20)
    pool.give(a)
    pool.take(5000)  # one handed out, one cached
    assert pinned_bytes() > before
    del pool, a
    gc.collect()
    assert pinned_bytes() == before


def test_weak_grad_hook_fires_while_its_owner_lives_and_lets_it_go():
    class Owner:
        def __init__(self) -> None:
            self.p = torch.nn.Parameter(torch.ones(3))
            self.seen = []
            weak_post_accumulate_grad_hook(self.p, self.landed, "p")

        def landed(self, name: str, t: torch.Tensor) -> None:
            self.seen.append((name, t.grad.clone()))

    o = Owner()
    (o.p * 2).sum().backward()
    assert len(o.seen) == 1 and o.seen[0][0] == "p"
    assert torch.equal(o.seen[0][1], torch.full((3,), 2.0))
    ref = weakref.ref(o)
    del o
    gc.collect()
    assert ref() is None  # torch.Tensor.register_post_accumulate_grad_hook would keep it


@pytest.mark.parametrize("kind", ["host", "pinned", "disk"])
def test_stores_refuse_pickle_and_copy_naming_the_fix(tmp_path, kind):
    st = {"host": HostStore, "pinned": lambda: HostStore(pin=True),
          "disk": lambda: DiskStore(tmp_path / "s", threads=1)}[kind]()
    st.put("w", torch.ones(3))
    fix = "DiskStore(path)" if kind == "disk" else "Pass the model instead"
    for what in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match="cannot be pickled or copied") as e:
            what(st)
        assert fix in str(e.value)
    assert torch.equal(st.read(st.get("w")).result(), torch.ones(3))  # still usable
    st.close()


_COLLECTED_WHILE_A_THREAD_STARTS = """
import gc, sys, threading, torch
from headroom.transfer import DiskStore
st = DiskStore(sys.argv[1], threads=2)
st.write(st.alloc("x", (100,), torch.float32), torch.ones(100)).result()
cycle = [st]
cycle.append(cycle)  # collected only by a garbage collection, wherever it starts
del st, cycle
# A thread that starts holds threading's lock of ending threads while a collection may run
# (Thread._bootstrap_inner -> _maintain_shutdown_locks): the store's finalizer runs there.
with threading._shutdown_locks_lock:
    gc.collect()
t = threading.Thread(target=int)
t.start()
t.join()
print("done")
"""


@pytest.mark.skipif(not hasattr(threading, "_shutdown_locks_lock"),
                    reason="this Python's threading keeps no lock of ending threads")
def test_store_collected_while_a_thread_starts_does_not_hang_the_process(tmp_path):
    # Before: the finalizer joined the store's threads, and Thread.join takes that lock once
    # the joined thread ended: the process hung at its next thread start, for good.
    out = subprocess.run([sys.executable, "-c", _COLLECTED_WHILE_A_THREAD_STARTS,
                          str(tmp_path / "s")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-3000:]
