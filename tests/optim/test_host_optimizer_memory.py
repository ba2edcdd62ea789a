"""HostOptimizer memory, measured by hr.track_memory against analytic sizes.

On the CPU the "device" and the host are the same memory, so the CPU tests check where the
optimizer keeps what: exactly the analytic Adam state in host memory, none of it sharing storage
with the parameters, and with ``state_store=DiskStore`` at most a few slices of it in memory.
The accelerator test checks the device side: no optimizer state and only gradients in flight.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import headroom as hr
from tests.conftest import accelerator_type
from tests.optim._models import loss_fn, make_model


def _adam_state_bytes(model: nn.Module) -> int:
    # exp_avg + exp_avg_sq in fp32, and a 0-dim fp32 step counter per parameter
    return sum(2 * p.numel() * 4 + 4 for p in model.parameters())


@pytest.mark.parametrize("overlap", [False, True])
def test_host_state_is_exactly_the_analytic_adam_state(overlap):
    model = make_model(d=32)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, overlap=overlap)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        for s in range(3):
            loss_fn(model, s).backward()
            opt.step()
            opt.zero_grad()
    cpu = mem.stats("cpu")
    assert cpu.max_by_category["optimizer_state"] == _adam_state_bytes(model)
    assert cpu.max_by_category["parameters"] == sum(p.numel() * 4 for p in model.parameters())
    # no state tensor shares memory with a parameter (the masters are the parameters here)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for st in opt.state.values():
        for v in st.values():
            assert v.untyped_storage().data_ptr() not in param_storages


def test_disk_state_keeps_only_slices_in_memory(tmp_path):
    model = make_model(d=64)
    slice_bytes = 4096
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, overlap=False,
                           state_store=hr.DiskStore(tmp_path / "state"), slice_bytes=slice_bytes)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        for s in range(3):
            loss_fn(model, s).backward()
            opt.step()
            opt.zero_grad()
    full = _adam_state_bytes(model)
    seen = mem.stats("cpu").max_by_category["optimizer_state"]
    widest_row = max(p[0].numel() * 4 if p.dim() > 1 else 4 for p in model.parameters())
    # double-buffered slices (2) of each of the two moments (2), plus the step counters (kept,
    # and one copy in the step)
    bound = 2 * 2 * max(slice_bytes, widest_row) + 2 * 4 * len(list(model.parameters()))
    assert 0 < seen <= bound < full // 4
    # The step is all-or-nothing without a copy of the state or of the parameters in memory
    # (the old values it keeps go to the disk): besides the parameters and gradients, its
    # peak holds activations and the slices in flight, far less than one copy of either.
    stats = mem.stats("cpu")
    extra = stats.peak - stats.peak_by_category["parameters"] - stats.peak_by_category["gradients"]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert extra < params // 3 < full


class _NewBytes:
    """Peak bytes of CPU storages created while counting and alive at the same time, over
    every thread that counts (`counting`); storages that existed before are not counted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live = self.peak = 0
        self.keys: set[int] = set()

    def reset(self) -> None:
        with self.lock:
            self.peak = self.live

    def _freed(self, key: int, n: int) -> None:
        with self.lock:
            self.keys.discard(key)
            self.live -= n

    def counting(self) -> TorchDispatchMode:
        return _Count(self)


class _Count(TorchDispatchMode):
    def __init__(self, acc: _NewBytes) -> None:
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        acc = self.acc
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            key, n = st._cdata, st.nbytes()
            if key in inputs or not n:
                continue  # in place, or a view of an input
            with acc.lock:
                if key in acc.keys:
                    continue
                acc.keys.add(key)
                acc.live += n
                acc.peak = max(acc.peak, acc.live)
            weakref.finalize(st, acc._freed, key, n)
        return out


@pytest.mark.parametrize("final", [False, True])
def test_host_memory_step_of_offloaded_bf16_keeps_no_copies(final):
    """A bf16 model offloaded to host memory (fp32 masters and state in host memory, no disk)
    is stepped slice by slice. The step allocates at most one slice of temporaries (in fact
    only its step counters): it keeps no copy of the old masters, state or values (it kept
    one of every slice until the step ended, 14 bytes per parameter)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())])
    model = model.to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu: mechanics only
        hr.offload(model, device="cpu", store="cpu")
    slice_bytes = 4096
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                           slice_bytes=slice_bytes, bucket_bytes=slice_bytes, overlap=final)
    acc = _NewBytes()
    worker_step = opt._overlap._step_entries

    def counted(batch, **kw):  # the steps started during final_backward, on the worker
        with acc.counting():
            return worker_step(batch, **kw)

    opt._overlap._step_entries = counted
    x = torch.randn(8, 64).to(torch.bfloat16)
    worker_steps = []
    for s in range(3):
        if s == 1:
            acc.reset()  # the first step creates the state: counted from the second on
            base = acc.live
        for m in range(2):
            with opt.final_backward(final and m == 1):
                model(x).float().square().mean().backward()
        worker_steps.append(sum(e.launched for e in opt._order))
        with acc.counting():
            opt.step()
        opt.zero_grad()
    if final:
        assert all(worker_steps)  # parameters did step on the worker, during backward
    n = sum(p.numel() for p in model.parameters())
    copies = n * (4 + 4 + 4 + 2)  # master, two moments, the bf16 value
    assert acc.peak - base <= slice_bytes < copies // 50


def test_tracker_counts_what_the_overlap_worker_allocates():
    """Steps started during final_backward run on a worker thread; hr.track_memory counts the
    tensors they allocate (it missed them: its dispatch mode belonged to the thread that
    entered it). A worker step that holds 1 MiB of temporaries shows among them."""
    model = make_model(d=32)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, overlap=True,
                           bucket_bytes=1 << 30)  # one bucket: one step on the worker
    held, threads = [], []
    worker_step = opt._overlap._step_entries

    def step_holding_scratch(batch, **kw):
        threads.append(threading.current_thread())
        held.append(torch.ones(1 << 18))  # 1 MiB a step could allocate, alive to the end
        return worker_step(batch, **kw)

    opt._overlap._step_entries = step_holding_scratch
    loss_fn(model, 0).backward()
    opt.step()  # state made before tracking: the tracked steps allocate no more of it
    opt.zero_grad()
    other = {}
    for final in (False, True):
        with hr.track_memory(model=model, optimizer=opt) as mem:
            with opt.final_backward(final):
                loss_fn(model, 1).backward()
            opt.step()
            opt.zero_grad()
        other[final] = mem.stats("cpu").max_by_category["other"]
        assert len(held) == final
        held.clear()
    assert threads and all(t is not threading.main_thread() for t in threads)
    assert other[False] < (1 << 20) <= other[True]


@pytest.mark.gpu
def test_device_holds_no_optimizer_state_and_only_gradients_in_flight():
    dev = accelerator_type()
    width, n_blocks = 2048, 8
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(n_blocks)]).to(dev)
    block_bytes = (width * width + width) * 4
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                           bucket_bytes=block_bytes)
    x = torch.randn(64, width, device=dev)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    d = mem.stats(dev)
    assert d.max_by_category["optimizer_state"] == 0
    # a gradient leaves the device once copied to the host; copies are waited for (off the
    # backward thread) every bucket_bytes, so about one bucket is produced, one copied and one
    # waited for at any time: never all 8 blocks' gradients
    assert d.max_by_category["gradients"] <= 3 * block_bytes
    assert all(torch.equal(e.master, e.param.detach().cpu()) for e in opt._order)
