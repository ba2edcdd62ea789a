"""One offloaded model used from two threads: a forward or backward waits for the other
thread's, so the results are plain PyTorch's under the same order, and nothing crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from headroom.store import DiskStore


def test_inference_while_training_is_plain_pytorch(tmp_path):
    """Run in a child process: before the use lock this crashed (SIGSEGV in resize_storage)
    or raised setStorage / meta-device errors in either thread."""
    from tests.residency import _threads_child as child

    src = str(Path(hr.__file__).resolve().parents[1])
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(root)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, child.__file__, str(tmp_path / "s"), "cpu", "disk"],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == ["ok (cpu)", "ok (disk)"]


def _model(store):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hr.offload(model, device="cpu", store=store)


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_a_forward_waits_for_another_threads_forward(store, tmp_path):
    model = _model("cpu" if store == "cpu" else DiskStore(tmp_path / "s"))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    inside, go_on = threading.Event(), threading.Event()

    def pause(module, args):
        inside.set()
        assert go_on.wait(30)

    h = model[2].register_forward_pre_hook(pause)
    first, first_out = _in_thread(lambda: model(x).detach())
    assert inside.wait(30)
    h.remove()
    second, second_out = _in_thread(lambda: model(x).detach())
    second.join(0.5)
    assert second.is_alive()  # waits for the first forward instead of releasing its blocks
    go_on.set()
    first.join(30)
    second.join(30)
    assert torch.equal(first_out[0], expected) and torch.equal(second_out[0], expected)


def test_a_backward_that_broke_off_lets_other_threads_in():
    """Its final callback never runs: the use ends when autograd drops the graph task."""
    model = _model("cpu")
    x = torch.randn(2, 8, requires_grad=True)
    out = model(x)
    x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        out.sum().backward()
    t, got = _in_thread(lambda: model(torch.randn(2, 8)).shape)
    t.join(30)
    assert not t.is_alive() and got == [(2, 8)]
    assert state_of(model).use._owner is None and not state_of(model)._bwd


def test_ctrl_c_while_waiting_for_a_turn_leaves_the_other_thread_alone():
    """SIGINT in the main thread while it waits for another thread's forward: it raises
    KeyboardInterrupt, takes no turn and undoes nothing of the other forward."""
    model = _model("cpu")
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    inside, go_on = threading.Event(), threading.Event()

    def pause(module, args):
        inside.set()
        assert go_on.wait(30)

    h = model[1].register_forward_pre_hook(pause)
    other, other_out = _in_thread(lambda: model(x).detach())
    assert inside.wait(30)
    h.remove()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            model(x)
    finally:
        timer.cancel()
        go_on.set()
    other.join(30)
    assert torch.equal(other_out[0], expected)
    use = state_of(model).use
    assert use._owner is None and not use._queue
    with torch.no_grad():
        assert torch.equal(model(x), expected)
