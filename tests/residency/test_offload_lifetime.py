"""Lifetimes of offloaded models: what hr.offload creates (the model's state, its store, the
store's threads and folder lock, page-locked memory, the optimizer's threads) goes when the user
drops the model and optimizer, with or without hr.unoffload; and an offloaded model handed to a
spawned process arrives there as the plain copy that copy.deepcopy gives."""

from __future__ import annotations

import gc
import multiprocessing
import os
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.memory._rss import current_rss
from headroom.residency import state_of
from headroom.store import DiskStore, HostStore, claimed_keys, pinned_bytes
from tests._threads import settled_thread_count
from tests.residency import _spawn_child

D = 128  # 4 layers of 128 x 128: 260 KiB of fp32 parameters per model


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(D, D) for _ in range(4)])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _offload(model: nn.Module, store) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # store="cpu" with device="cpu": a test of mechanics
        return hr.offload(model, device="cpu", store=store)


def _cycle(folder, store: str, optimizer: str, unoffload: bool,
           activations: str | None) -> list[weakref.ref]:
    """Offload a new model, train two steps, maybe unoffload; weak references to what was made
    (the caller drops everything else by returning)."""
    model = _model()
    st = {"cpu": lambda: "cpu", "pinned": lambda: HostStore(pin=True),
          "disk": lambda: DiskStore(folder / "params", threads=2)}[store]()
    _offload(model, st)
    made = state_of(model).store
    if optimizer == "host":
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, D)
    act = DiskStore(folder / "act", threads=1) if activations == "disk" else activations
    for _ in range(2):
        if activations is None:
            model(x).square().mean().backward()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with hr.offload_activations(store=act, min_bytes=0):
                    model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if unoffload:
        hr.unoffload(model)
    return [weakref.ref(model), weakref.ref(made), weakref.ref(opt)]


# store, optimizer, hr.unoffload first, activation offload
VARIANTS = [
    ("cpu", "torch", False, None),
    ("disk", "host", False, "disk"),
    ("cpu", "host", True, None),
    ("pinned", "host", False, None),
    ("cpu", "torch", True, "cpu"),
    ("disk", "host", True, None),
    ("cpu", "host", False, "cpu"),
    ("pinned", "torch", True, None),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_dropped_model_is_collected_with_its_store(tmp_path, variant):
    gc.collect()  # what earlier tests left goes now, not during the measurement
    threads, fds, pinned = settled_thread_count(), _open_fds(), pinned_bytes()
    refs = _cycle(tmp_path, *variant)
    gc.collect()
    assert [r() is None for r in refs] == [True] * 3  # model, store, optimizer
    assert settled_thread_count(threads) == threads  # the store's and the optimizer's threads
    assert _open_fds() == fds  # the folder's lock and journal
    assert pinned_bytes() == pinned
    if variant[0] == "disk":
        DiskStore(tmp_path / "params").close()  # the folder is free for a new store


@pytest.mark.slow  # about 10 s: a DiskStore's open and close sync its folder
def test_hundred_offload_train_del_cycles_hold_memory_threads_and_files_flat(tmp_path):
    """100 cycles in one process, each with a new model in the same DiskStore folder: RSS,
    open files, threads and page-locked bytes stay where the first cycles left them."""
    for variant in VARIANTS:  # warm-up: first-use allocations (libraries, caches, pools)
        _cycle(tmp_path, *variant)
    gc.collect()
    # Everything alive now lives on: the cycle collector needs to look at new objects only.
    gc.freeze()
    try:
        threads, fds, pinned = settled_thread_count(), _open_fds(), pinned_bytes()
        rss = current_rss()
        for i in range(100):
            refs = _cycle(tmp_path, *VARIANTS[i % len(VARIANTS)])
            gc.collect()
            alive = [r() is not None for r in refs]
            assert not any(alive), (i, VARIANTS[i % len(VARIANTS)], alive)
            assert (settled_thread_count(threads), _open_fds(), pinned_bytes()) == \
                (threads, fds, pinned), i
        grown = current_rss() - rss
    finally:
        gc.unfreeze()
    # Kept alive, each model (with its gradients and AdamW state) adds about 0.8 MiB.
    assert grown < 12 << 20, f"RSS grew {grown / 2**20:.1f} MiB over 100 cycles"


@pytest.mark.parametrize("store", ["none", "cpu", "disk"])
def test_optimizer_dropped_while_its_model_lives_is_collected(tmp_path, store):
    """A HostOptimizer made again for the same model (a learning-rate sweep) lets the dropped
    one go, with its threads; the model trains on with the new one."""
    model = _model()
    if store != "none":
        _offload(model, "cpu" if store == "cpu" else DiskStore(tmp_path / "s", threads=2))
    x = torch.randn(4, D)
    model(x).sum().backward()  # the store's own threads start
    model.zero_grad()
    gc.collect()
    threads = settled_thread_count()
    for _ in range(3):
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref = weakref.ref(opt)
        del opt
        gc.collect()
        assert ref() is None
        assert settled_thread_count(threads) == threads


def test_store_keys_of_a_dropped_model_are_free_for_the_next(tmp_path):
    """A store the user keeps: the keys of a model dropped without hr.unoffload are released
    when it is collected, and the next model offloaded there takes them over."""
    for st in (HostStore(), DiskStore(tmp_path / "s", threads=1)):
        for _ in range(3):
            torch.manual_seed(1)
            model = _offload(_model(), st)
            ref = _model()
            ref.load_state_dict(model.state_dict())
            assert claimed_keys(st)
            x = torch.randn(2, D)
            with torch.no_grad():
                assert torch.equal(model(x), ref(x))
            del model
            gc.collect()
            assert not claimed_keys(st)
        st.close()


def test_spawned_process_gets_a_plain_copy_of_an_offloaded_model(tmp_path):
    """An offloaded model (host memory or DiskStore) and the parameters of one on disk, as
    arguments of a spawned process: the child, without headroom, gets plain PyTorch objects
    with the same values."""
    torch.manual_seed(0)
    models = {"cpu": _model(), "disk": _model()}
    expected = {k: {n: v.clone() for n, v in m.state_dict().items()} for k, m in models.items()}
    _offload(models["cpu"], "cpu")
    _offload(models["disk"], DiskStore(tmp_path / "s", threads=1))
    params = list(models["disk"].parameters())
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_spawn_child.check, args=(models, params, expected, child))
    p.start()
    try:
        assert parent.poll(120), "the child did not answer"
        report = parent.recv()
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    assert report == ["cpu: equal=True plain=True", "disk: equal=True plain=True",
                      "params: ['Parameter'] equal=True", "headroom imported=False"]
    assert p.exitcode == 0
    x = torch.randn(2, D)
    for name, model in models.items():  # the parent's models are still offloaded, and run
        assert state_of(model) is not None
        ref = _model()
        ref.load_state_dict(expected[name])
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))



# Run in a fresh process: models that other tests of this process keep alive (module-scoped
# fixtures) rightly keep the hooks installed.
_HOOKS_CHILD = """
import gc, sys, warnings
import torch.nn as nn
from torch.nn.modules import module
from torch.optim import optimizer
import headroom as hr
from headroom.residency import state_of

def counts():
    return (len(module._global_module_registration_hooks),
            len(module._global_parameter_registration_hooks),
            len(optimizer._global_optimizer_pre_hooks),
            len(optimizer._global_optimizer_post_hooks))

def offload():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # store="cpu" with device="cpu": a test of mechanics
        return hr.offload(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device="cpu",
                          store="cpu")

unoffload = sys.argv[1] == "unoffload"
before = counts()
a, b = offload(), offload()
out = [before, counts()]
a[0].extra = nn.Linear(2, 2)  # adoption works through them
out.append(any(s.name == "0.extra.weight" for s in state_of(a).slots))
if unoffload:
    hr.unoffload(a)
del a
gc.collect()
out.append(counts())  # b still needs them
if unoffload:
    hr.unoffload(b)
del b
gc.collect()
out.append(counts())
c = offload()  # a new model installs them again
out.append(counts())
hr.unoffload(c)
out.append(counts())
print(out)
"""


@pytest.mark.parametrize("drop", ["collected", "unoffload"])
def test_process_wide_registration_hooks_live_only_while_a_model_is_offloaded(drop):
    # torch's registration and optimizer step hooks see every module and optimizer of the
    # process: installed with the first
    # offloaded model (one pair, shared), gone with the last one (dropped and collected, or
    # unoffloaded)
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _HOOKS_CHILD, drop], capture_output=True,
                         text=True, timeout=120, check=True)
    none, one = (0, 0, 0, 0), (1, 1, 1, 1)
    assert run.stdout.strip() == str([none, one, True, one, none, one, none]), run.stderr
