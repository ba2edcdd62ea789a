"""HostOptimizer.step() is all-or-nothing: a failure anywhere inside it leaves every parameter
and every state tensor old (or, past the point of no return, all new), and a retry is exact."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import warnings
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import headroom as hr
from headroom.store import StoreFullError

SLICE = 64  # bytes: the weights take 2-4 slices each
LR = dict(lr=1e-2, weight_decay=0.1)
CONFIGS = {
    # name: (parameters offloaded to a DiskStore, state store on disk, final_backward)
    "disk-state": (False, True, False),
    "offloaded-disk-state": (True, True, False),
    "offloaded-disk-state-final": (True, True, True),
    "offloaded-host-state": (True, False, False),
    "offloaded-host-state-final": (True, False, True),
}


class Small(torch.nn.Module):
    """Three weights of 2-4 slices, three biases and a 0-dim parameter (stepped on its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)])
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks[:-1]:
            x = torch.tanh(b(x))
        return self.blocks[-1](x) * self.scale


def loss_fn(model: torch.nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    return ((model(x) - y) ** 2).mean()


def make_model(d: int = 0) -> Small:
    return Small()


def _build(config: str, root: Path, tag: str = "m"):
    offloaded, disk_state, final = CONFIGS[config]
    model = make_model()
    if offloaded:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device=cpu: mechanics only
            hr.offload(model, device="cpu", store=hr.DiskStore(root / f"params-{tag}"))
    state = hr.DiskStore(root / f"state-{tag}") if disk_state else "cpu"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, state_store=state,
                           slice_bytes=SLICE, bucket_bytes=512, **LR)
    return model, opt, final


def _iteration(model, opt, s: int, final: bool) -> None:
    with opt.final_backward() if final else contextlib.nullcontext():
        loss_fn(model, s).backward()
    opt.step()
    opt.zero_grad()


def _values(model, opt) -> dict[str, object]:
    """Every parameter (its real value, wherever it rests) and every state entry."""
    out: dict[str, object] = {f"p/{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"s/{i}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (a key in one only counts as differing)."""
    diff = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y.reshape(x.shape)):
                diff.append(k)
        elif x != y:
            diff.append(k)
    return diff


def _reference(steps: int):
    ref = make_model()
    opt = torch.optim.AdamW(ref.parameters(), fused=True, **LR)
    for s in range(steps):
        loss_fn(ref, s).backward()
        opt.step()
        opt.zero_grad()
    return ref, opt


def _check_against_reference(model, opt, steps: int) -> None:
    ref, ref_opt = _reference(steps)
    sd = model.state_dict()
    for n, p in ref.named_parameters():
        assert torch.equal(p, sd[n]), f"parameter {n} differs from plain AdamW"
    want, got = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    for i in want:
        for k, v in want[i].items():
            assert torch.equal(v, got[i][k].reshape(v.shape)), f"state {i}/{k} differs"


class _Inject:
    """Fails the ``at``-th call (counted from `arm`) of a slice update or a store write."""

    def __init__(self, how: str) -> None:
        self.how, self.at, self.count, self.fired = how, -1, 0, False

    def arm(self, at: int) -> None:
        self.at, self.count, self.fired = at, 0, False

    def hit(self) -> bool:
        n, self.count = self.count, self.count + 1
        if n == self.at and not self.fired:
            self.fired = True
            return True
        return False

    def install(self, opt, stores) -> None:
        if self.how == "write":
            for store in stores:
                orig = store.write_rows

                def write_rows(handle, rows, src, _orig=orig, _store=store):
                    if self.hit():
                        # the disk fails this write, as a DiskStore reports a full disk
                        fut: Future = Future()
                        fut.set_exception(_store._io_error(
                            OSError(28, "No space left on device (injected)"),
                            str(_store.path)))
                        return fut
                    return _orig(handle, rows, src)

                store.write_rows = write_rows
            return
        orig_run = opt._slicer._run

        def run(*args, **kw):
            if self.hit():
                if self.how == "sigint":  # a real Ctrl-C, from whichever thread steps
                    os.kill(os.getpid(), signal.SIGINT)
                else:
                    raise RuntimeError("injected failure inside a slice")
            return orig_run(*args, **kw)

        opt._slicer._run = run


def _stores(model, opt):
    out = [opt._state_store] if opt._state_store is not None else []
    out += list({id(e.bound.store): e.bound.store for e in opt._order if e.bound}.values())
    return out


@pytest.mark.parametrize(("config", "how"), [
    (c, h) for c in CONFIGS for h in ("raise", "write", "sigint")
    # A Ctrl-C sent from the worker (final_backward) lands wherever the main thread is,
    # mostly in backward; that is the offload layer's case, not the step's.
    if not (CONFIGS[c][2] and h == "sigint")])
def test_a_failure_at_every_slice_position_is_undone_and_the_retry_is_exact(
        tmp_path, config, how):
    model, opt, final = _build(config, tmp_path)
    inject = _Inject(how)
    inject.install(opt, _stores(model, opt))
    # Count the positions in one step (the first, which also creates the state).
    _iteration(model, opt, 0, final)
    positions = inject.count
    assert positions >= 10
    s = 1
    for at in range(positions):
        before = _values(model, opt)
        inject.arm(at)
        with pytest.raises((RuntimeError, OSError, KeyboardInterrupt)) as info:
            _iteration(model, opt, s, final)
            # a Ctrl-C from the worker may be handled only now, after step() returned
            for _ in range(100):
                pass
        assert inject.fired
        notes = "".join(getattr(info.value, "__notes__", []))
        assert "undone" in notes, (at, notes)
        if how == "write":
            assert isinstance(info.value, StoreFullError) and "DiskStore(" in str(info.value)
        diff = _same(before, _values(model, opt))
        assert not diff, f"position {at}: changed by a failed step: {diff[:5]}"
        opt.zero_grad()
        _iteration(model, opt, s, final)  # the retry, nothing injected
        s += 1
    _check_against_reference(model, opt, s)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_failure_in_the_first_step_undoes_the_new_state(tmp_path, config):
    model, opt, final = _build(config, tmp_path)
    inject = _Inject("raise")
    inject.install(opt, _stores(model, opt))
    before = _values(model, opt)
    inject.arm(7)
    with pytest.raises(RuntimeError, match="injected"):
        _iteration(model, opt, 0, final)
    assert not _same(before, _values(model, opt))
    assert opt.state_dict()["state"] == {}
    if not final:
        opt.step()  # the gradients were kept: step() again completes it
        opt.zero_grad()
    else:
        opt.zero_grad()
        _iteration(model, opt, 0, final)
    _iteration(model, opt, 1, final)
    _check_against_reference(model, opt, 2)


def test_a_failed_final_backward_undoes_the_steps_it_started(tmp_path):
    model, opt, _ = _build("offloaded-disk-state-final", tmp_path)
    opt._overlap.bucket_bytes = 64  # a bucket per parameter: most step before the failure
    _iteration(model, opt, 0, True)
    before = _values(model, opt)
    started = []
    orig = opt._step_entries

    def counting(batch, **kw):
        started.extend(batch)
        return orig(batch, **kw)

    opt._overlap._step_entries = counting
    g = torch.Generator().manual_seed(1001)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    x.requires_grad_(True)
    x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom")))  # last of all
    loss = ((model(x) - y) ** 2).mean()
    with pytest.raises(RuntimeError, match="boom") as info, opt.final_backward():
        loss.backward()
    opt._wait()
    assert started  # some parameters had started this step on the worker
    assert "their step was undone" in "".join(info.value.__notes__)
    assert not _same(before, _values(model, opt))
    opt.zero_grad()
    _iteration(model, opt, 1, True)
    _check_against_reference(model, opt, 2)


@pytest.mark.parametrize("final", [False, True])
def test_host_memory_step_completes_through_ctrl_c(final):
    """State in host memory is updated whole by PyTorch's kernel, last: a Ctrl-C there waits
    for the end of the step, then says that the step completed."""
    model = make_model()
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **LR)
    _iteration(model, opt, 0, final)
    inner = opt._inner.step

    def interrupted(*args, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        return inner(*args, **kw)

    opt._inner.step = interrupted
    if final:
        opt._overlap.enabled = False  # the step runs in step(), where the Ctrl-C lands
    with pytest.raises(KeyboardInterrupt) as info:
        _iteration(model, opt, 1, final)
    assert "the step completed" in "".join(info.value.__notes__)
    opt._inner.step = inner
    opt.zero_grad()
    _iteration(model, opt, 2, final)
    ref, ref_opt = _reference(3)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_worker_thread_that_cannot_start_leaves_the_step_to_step(tmp_path):
    model, opt, final = _build("offloaded-disk-state-final", tmp_path)

    def no_thread(fn):
        raise RuntimeError("can't start new thread")

    opt._overlap.submit = no_thread
    for s in range(3):
        _iteration(model, opt, s, final)
    _check_against_reference(model, opt, 3)


# ---------------------------------------------------------------------- a real full disk
@pytest.fixture
def small_disk(tmp_path):
    path = tmp_path / "disk"
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)],
                       capture_output=True, timeout=30, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); the full disk "
                    "is simulated by the injected ENOSPC writes of the test above")
    try:
        yield path
    finally:
        import gc

        gc.collect()
        subprocess.run(["umount", "-l", str(path)], timeout=30, check=False)


def _fill(path: Path) -> Path:
    filler = path / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return filler


def test_full_disk_fails_the_step_whole_and_cannot_interrupt_it(small_disk):
    model, opt, _ = _build("offloaded-disk-state", small_disk)
    # Full before the first step (its state and undo space are still to be allocated): it
    # fails before anything changed, naming the store; the gradients are kept.
    loss_fn(model, 0).backward()
    filler = _fill(small_disk)
    before = _values(model, opt)
    with pytest.raises(StoreFullError, match=r"DiskStore\(") as info:
        opt.step()
    assert "Nothing was updated" in str(info.value) or "undone" in "".join(info.value.__notes__)
    assert not _same(before, _values(model, opt))
    filler.unlink()
    opt.step()
    opt.zero_grad()
    # Full in the middle of a step (filled from inside a slice): the step's writes had their
    # space reserved when it began, so it completes.
    orig_run = opt._slicer._run
    calls = [0]

    def fill_midway(*args, **kw):
        calls[0] += 1
        if calls[0] == 6:
            _fill(small_disk)
        return orig_run(*args, **kw)

    opt._slicer._run = fill_midway
    _iteration(model, opt, 1, False)
    assert calls[0] > 6 and shutil.disk_usage(small_disk).free < 64 << 10
    opt._slicer._run = orig_run
    # Still full: the next step completes (its journal space is still reserved) or fails
    # whole; never in between.
    loss_fn(model, 2).backward()
    before = _values(model, opt)
    try:
        opt.step()
    except StoreFullError as ex:
        assert "undone" in "".join(ex.__notes__)
        assert not _same(before, _values(model, opt))
        (small_disk / "filler").unlink()
        opt.step()
    opt.zero_grad()
    with contextlib.suppress(FileNotFoundError):
        (small_disk / "filler").unlink()
    _iteration(model, opt, 3, False)
    _check_against_reference(model, opt, 4)


# ---------------------------------------------------------------------- kill -9
_CHILD = """
import os, signal, sys, warnings
import torch
import headroom as hr
from tests.optim.test_host_optimizer_atomic import loss_fn, make_model
root, kill_at, atomic = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "atomic"
# atomic: fp32, state on disk; not: bf16 with masters and state in host memory, no undo copies
model = make_model() if atomic else make_model().to(torch.bfloat16)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hr.offload(model, device="cpu", store=hr.DiskStore(root + "/params"))
opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, atomic=atomic,
                       state_store=hr.DiskStore(root + "/state") if atomic else "cpu",
                       slice_bytes=64)
def backward(s):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not atomic):
        loss = loss_fn(model, s)
    loss.float().backward()
backward(0); opt.step(); opt.zero_grad()
for name, p in model.state_dict().items():
    torch.save(p, f"{root}/old-{name}.pt")
run, calls = opt._slicer._run, [0]
def killing(*a, **k):
    calls[0] += 1
    if calls[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return run(*a, **k)
opt._slicer._run = killing
backward(1); opt.step()
"""


@pytest.mark.parametrize("atomic", ["atomic", "not-atomic"])
def test_kill_9_during_a_step_is_reported_when_the_store_is_reopened(tmp_path, atomic):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(hr.__file__).parents[1]), str(Path(__file__).parents[2])]))
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), "6", atomic], env=env,
                       capture_output=True, timeout=120, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    with pytest.warns(UserWarning, match="partly applied"):
        store = hr.DiskStore(tmp_path / "params")
    # No tensor is torn, and the spares (scratch) are gone. The parameters take their new
    # values only when the step ends (their spares exchanged into place in one journal
    # record): killed before, every parameter reopens as it was before the step.
    assert not [f for f in (tmp_path / "params").iterdir() if "scratch" in f.name]
    old = new = 0
    for key in list(store.keys()):
        if not (tmp_path / f"old-{key}.pt").exists():
            continue  # a gradient
        t = store.read(store.get(key)).result()
        want = torch.load(tmp_path / f"old-{key}.pt")
        if torch.equal(t, want):
            old += 1
        else:
            new += 1
    assert old == 7 and new == 0
    store.close()


# ---------------------------------------------------------------------- host memory only
def _host_bf16(final: bool = False):
    """Small in bf16 offloaded to host memory: fp32 masters and state in host memory, stepped
    slice by slice with no disk anywhere."""
    model = make_model().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu: mechanics only
        hr.offload(model, device="cpu", store="cpu")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, slice_bytes=SLICE,
                           bucket_bytes=64, overlap=final, **LR)
    return model, opt


def _bf16_iteration(model, opt, s: int, final: bool) -> None:
    g = torch.Generator().manual_seed(1000 + s)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    with opt.final_backward() if final else contextlib.nullcontext():
        ((model(x.bfloat16()).float() - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_host_memory_sliced_step_completes_through_ctrl_c_at_every_slice():
    """Without a disk, the sliced step keeps no old values: it runs last, like PyTorch's
    kernel on state in host memory, and a Ctrl-C at any slice waits for the end of the step,
    then says that it completed. The result is that of uninterrupted training."""
    model, opt = _host_bf16()
    twin, twin_opt = _host_bf16()
    inject = _Inject("sigint")
    inject.install(opt, [])
    _bf16_iteration(model, opt, 0, False)
    _bf16_iteration(twin, twin_opt, 0, False)
    positions = inject.count
    assert positions >= 10
    for at in range(positions):
        s = 1 + at
        inject.arm(at)
        with pytest.raises(KeyboardInterrupt) as info:
            _bf16_iteration(model, opt, s, False)
        assert inject.fired
        assert "the step completed" in "".join(info.value.__notes__), at
        opt.zero_grad()  # (step() raised after it ended: zero_grad() did not run)
        _bf16_iteration(twin, twin_opt, s, False)
        assert not _same(_values(twin, twin_opt), _values(model, opt)), at


def test_host_memory_failed_final_backward_keeps_the_steps_it_started():
    """Without a disk, steps started during final_backward keep no old values either: a
    backward failing after them leaves them stepped, says so, and step() finishes the others
    (the documented in-memory behaviour)."""
    model, opt = _host_bf16(final=True)
    twin, twin_opt = _host_bf16(final=True)
    _bf16_iteration(model, opt, 0, True)
    before = _values(model, opt)
    g = torch.Generator().manual_seed(1001)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    x = x.bfloat16().requires_grad_(True)
    x.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom")))  # last of all
    loss = ((model(x).float() - y) ** 2).mean()
    with pytest.raises(RuntimeError, match="boom") as info, opt.final_backward():
        loss.backward()
    opt._wait()
    assert "had already taken this step" in "".join(info.value.__notes__)
    assert _same(before, _values(model, opt))  # some parameters took the step
    with pytest.raises(RuntimeError, match="call step"):
        opt.zero_grad()
    opt.step()  # finishes the step for the others
    opt.zero_grad()
    _bf16_iteration(model, opt, 2, True)
    # The same as the same failed backward then step() with nothing stepped during it
    _bf16_iteration(twin, twin_opt, 0, True)
    with pytest.raises(RuntimeError, match="boom"):
        ((twin(x).float() - y) ** 2).mean().backward()
    twin_opt.step()
    twin_opt.zero_grad()
    _bf16_iteration(twin, twin_opt, 2, True)
    assert not _same(_values(twin, twin_opt), _values(model, opt))


@pytest.mark.parametrize("at", [0, 5, 11])
def test_host_memory_sliced_step_failing_part_way_says_so_and_a_checkpoint_restores_it(at):
    """Without a disk, an error at a slice (no copies kept) leaves the step part-way: the
    error says so and how to go on, step() refuses until a checkpoint is loaded, and training
    from that checkpoint is exactly uninterrupted training."""
    import copy

    model, opt = _host_bf16()
    twin, twin_opt = _host_bf16()
    inject = _Inject("raise")
    inject.install(opt, [])
    _bf16_iteration(model, opt, 0, False)
    _bf16_iteration(twin, twin_opt, 0, False)
    assert inject.count == 12
    saved = ({k: v.clone() for k, v in model.state_dict().items()},
             copy.deepcopy(opt.state_dict()))
    inject.arm(at)
    with pytest.raises(RuntimeError, match="injected") as info:
        _bf16_iteration(model, opt, 1, False)
    note = "".join(info.value.__notes__)
    assert "could not be undone" in note and "hr.load" in note, note
    # (at the first slice no parameter has taken the step yet: the note does not claim so)
    assert "7 parameter(s) with state in host memory, updated in place" in note, note
    with pytest.raises(RuntimeError, match="Load the last checkpoint"):
        opt.step()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    opt.zero_grad()
    for s in (1, 2):
        _bf16_iteration(model, opt, s, False)
        _bf16_iteration(twin, twin_opt, s, False)
    assert not _same(_values(twin, twin_opt), _values(model, opt))
