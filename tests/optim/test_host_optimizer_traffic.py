"""What a HostOptimizer step moves through a DiskStore: each tensor read once and written once,
no undo copy of the offloaded parameters (their new values go to spares exchanged into place
when the step ends), and a failure or Ctrl-C at the exchange is undone or completes."""

from __future__ import annotations

import os
import signal
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import headroom as hr
from tests.optim.test_host_optimizer_atomic import (
    _build,
    _check_against_reference,
    _Inject,
    _iteration,
    _same,
    _stores,
    _values,
    loss_fn,
    make_model,
)


def _traffic(root: Path, *, disk_state: bool, dtype: torch.dtype, final: bool,
             atomic: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 16)).to(dtype)
    P = sum(p.numel() * 4 for p in model.parameters())  # fp32 bytes of the parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu: mechanics only
        pstore = hr.DiskStore(root / "p")
        hr.offload(model, device="cpu", store=pstore)
    state = hr.DiskStore(root / "s") if disk_state else "cpu"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, state_store=state,
                           slice_bytes=1024, bucket_bytes=4096, lr=1e-2, atomic=atomic)
    stores = [pstore] + ([state] if disk_state else [])
    got = []
    for i in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i)).to(dtype)
        if final:
            # Forward and backward read the parameters once each and backward writes the
            # fp32 gradients: counted apart.
            stats = [s.stats() for s in stores]
            with opt.final_backward():
                model(x).float().pow(2).mean().backward()
            grads = P
            reads = 2 * P * dtype.itemsize // 4
        else:
            model(x).float().pow(2).mean().backward()
            stats = [s.stats() for s in stores]
            grads = reads = 0
        opt.step()
        opt.zero_grad()
        now = [s.stats() for s in stores]
        r = sum(b["bytes_read"] - a["bytes_read"] for a, b in zip(stats, now, strict=True))
        w = sum(b["bytes_written"] - a["bytes_written"] for a, b in zip(stats, now, strict=True))
        got.append(((r - reads) / P, (w - grads) / P))
    opt.close()
    return got


# (state on disk, dtype): (reads, writes) per step in units of the parameters' fp32 bytes P.
# fp32 with state on disk: master, gradient, exp_avg, exp_avg_sq read once; master and state
# written once each (the master to its spare). State in host memory: the master read and
# written, the gradient read, the two state tensors kept for an undo on the parameters' disk
# (2P). bf16: the fp32 master rests with the state, the bf16 value (P/2) is written only.
WANT = {
    (True, torch.float32): (4.0, 3.0),
    (False, torch.float32): (2.0, 3.0),
    (True, torch.bfloat16): (4.0, 3.5),
    (False, torch.bfloat16): (1.0, 3.5),
}


# atomic=False: nothing kept for an undo. State in host memory: only the master (fp32, on
# the parameters' disk) or the bf16 value is written; state on disk: as above (spares).
WANT_NOT_ATOMIC = {
    (True, torch.float32): (4.0, 3.0),
    (False, torch.float32): (2.0, 1.0),
    (True, torch.bfloat16): (4.0, 3.5),
    (False, torch.bfloat16): (1.0, 0.5),
}


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize(("disk_state", "dtype"), list(WANT))
def test_each_step_reads_and_writes_each_tensor_once(tmp_path, disk_state, dtype, final,
                                                     atomic):
    got = _traffic(tmp_path, disk_state=disk_state, dtype=dtype, final=final, atomic=atomic)
    # From the second step on (the first creates the state: nothing to read, nothing kept)
    # and without an undo copy of the parameter: 1P (fp32) or 1.5P (bf16) less written
    # than an undo copy before each overwrite.
    want = (WANT if atomic else WANT_NOT_ATOMIC)[disk_state, dtype]
    assert got[1] == got[2] == pytest.approx(want, abs=1e-9), got


def test_model_reads_the_old_parameters_until_the_step_ends(tmp_path):
    model, opt, _ = _build("offloaded-disk-state", tmp_path)
    _iteration(model, opt, 0, False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with opt.final_backward():
        loss_fn(model, 1).backward()
    opt._wait()  # every parameter stepped on the worker
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    opt.step()
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("config", ["offloaded-disk-state", "offloaded-host-state",
                                    "offloaded-disk-state-final"])
def test_a_failed_exchange_is_undone_and_the_retry_is_exact(tmp_path, config):
    model, opt, final = _build(config, tmp_path)
    _iteration(model, opt, 0, final)
    store = next(e.bound.store for e in opt._order)
    orig = store.exchange
    calls = []

    def failing(pairs):
        calls.append(len(pairs))
        if len(calls) == 1:
            raise OSError(5, "Input/output error (injected)")
        return orig(pairs)

    store.exchange = failing
    before = _values(model, opt)
    with pytest.raises(OSError, match="injected") as info:
        _iteration(model, opt, 1, final)
    assert "undone" in "".join(info.value.__notes__)
    assert not _same(before, _values(model, opt))
    assert calls == [7]  # every parameter in one exchange
    opt.zero_grad()
    _iteration(model, opt, 1, final)
    _iteration(model, opt, 2, final)
    _check_against_reference(model, opt, 3)


def test_ctrl_c_at_the_exchange_completes_the_step(tmp_path):
    model, opt, final = _build("offloaded-disk-state", tmp_path)
    _iteration(model, opt, 0, final)
    store = next(e.bound.store for e in opt._order)
    orig = store.exchange

    def interrupted(pairs):
        os.kill(os.getpid(), signal.SIGINT)  # arrives while the exchange runs
        return orig(pairs)

    store.exchange = interrupted
    loss_fn(model, 1).backward()
    with pytest.raises(KeyboardInterrupt) as info:
        opt.step()
    assert "the step completed" in "".join(info.value.__notes__)
    store.exchange = orig
    opt.zero_grad()
    _iteration(model, opt, 2, final)
    _check_against_reference(model, opt, 3)


def test_an_exchange_failing_in_the_second_store_exchanges_the_first_back(tmp_path):
    """Parameters offloaded to two DiskStores: the first store's exchange is put back."""
    model, opt, _ = _build("offloaded-disk-state", tmp_path)
    head = hr.DiskStore(Path(tempfile.mkdtemp(dir=tmp_path)) / "head")
    model2 = type(model)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model2, device="cpu", store=head)
    opt2 = hr.HostOptimizer([*model.parameters(), *model2.parameters()], torch.optim.AdamW,
                            state_store="cpu", slice_bytes=64, lr=1e-2)
    opt.close()

    def it(s):
        (loss_fn(model, s) + loss_fn(model2, s)).backward()
        opt2.step()
        opt2.zero_grad()

    it(0)
    stores = list({id(e.bound.store): e.bound.store for e in opt2._order}.values())
    assert len(stores) == 2
    orig = stores[1].exchange
    stores[1].exchange = lambda pairs: (_ for _ in ()).throw(OSError(5, "injected"))
    before = _values(model, opt2) | {f"2/{k}": v for k, v in _values(model2, opt2).items()}
    with pytest.raises(OSError, match="injected") as info:
        it(1)
    assert "undone" in "".join(info.value.__notes__)
    after = _values(model, opt2) | {f"2/{k}": v for k, v in _values(model2, opt2).items()}
    assert not _same(before, after)
    stores[1].exchange = orig
    opt2.step()  # the gradients were kept
    opt2.zero_grad()


def _bf16_build(root: Path, disk_state: bool, *, atomic: bool = True):
    model = make_model().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store=hr.DiskStore(root / "p"))
    state = hr.DiskStore(root / "s") if disk_state else "cpu"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, state_store=state,
                           slice_bytes=32, bucket_bytes=64, lr=1e-2, weight_decay=0.1,
                           atomic=atomic)
    return model, opt


def _bf16_iteration(model, opt, s: int) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model, s)
    loss.float().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("how", ["raise", "write", "sigint"])
@pytest.mark.parametrize("disk_state", [True, False, "not-atomic"])
def test_bf16_parameters_on_disk_a_failure_at_every_slice_is_undone(tmp_path, disk_state, how):
    """The bf16 value goes to a spare exchanged in, the fp32 master (state on disk) to a spare
    swapped in: interrupted anywhere, both are as before, and the retry is exact. With state on
    disk that holds for atomic=False too: nothing in host memory to keep."""
    atomic = disk_state != "not-atomic"
    disk_state = bool(disk_state)
    model, opt = _bf16_build(tmp_path / "a", disk_state, atomic=atomic)
    ref, ref_opt = _bf16_build(tmp_path / "b", disk_state)
    inject = _Inject(how)
    inject.install(opt, _stores(model, opt))
    _bf16_iteration(model, opt, 0)
    _bf16_iteration(ref, ref_opt, 0)
    positions = inject.count
    assert positions >= 10
    for at in range(0, positions, 3):  # every third position: the test stays fast
        s = 1 + at
        before = _values(model, opt)
        inject.arm(at)
        with pytest.raises((RuntimeError, OSError, KeyboardInterrupt)) as info:
            _bf16_iteration(model, opt, s)
        assert "undone" in "".join(getattr(info.value, "__notes__", [])), at
        assert not _same(before, _values(model, opt)), at
        opt.zero_grad()
        _bf16_iteration(model, opt, s)
        _bf16_iteration(ref, ref_opt, s)
    assert not _same(_values(ref, ref_opt), _values(model, opt))


@pytest.mark.parametrize("how", ["raise", "write"])
def test_not_atomic_a_failure_part_way_is_a_mix_refused_until_a_checkpoint_loads(tmp_path, how):
    """atomic=False: the same values as the default when nothing fails; a failure inside the
    step says the state is mixed, step() refuses until a checkpoint is loaded, and training
    from that checkpoint is exact."""
    model, opt = _bf16_build(tmp_path / "a", False, atomic=False)
    ref, ref_opt = _bf16_build(tmp_path / "b", False)
    for s in range(2):
        _bf16_iteration(model, opt, s)
        _bf16_iteration(ref, ref_opt, s)
    assert not _same(_values(ref, ref_opt), _values(model, opt))  # (the differing keys)
    hr.save(tmp_path / "ckpt", model, opt)
    inject = _Inject(how)
    inject.install(opt, _stores(model, opt))
    inject.arm(3)
    with pytest.raises((RuntimeError, OSError)) as info:
        _bf16_iteration(model, opt, 2)
    assert "MIX" in "".join(info.value.__notes__)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="could not be undone.*Load the last checkpoint"):
        _bf16_iteration(model, opt, 2)
    opt.zero_grad()
    hr.load(tmp_path / "ckpt", model, opt)
    for s in (2, 3):
        _bf16_iteration(model, opt, s)
        _bf16_iteration(ref, ref_opt, s)
    assert not _same(_values(ref, ref_opt), _values(model, opt))  # (the differing keys)


def test_not_atomic_ctrl_c_waits_for_the_step(tmp_path):
    model, opt = _bf16_build(tmp_path / "a", False, atomic=False)
    ref, ref_opt = _bf16_build(tmp_path / "b", False)
    inject = _Inject("sigint")
    inject.install(opt, _stores(model, opt))
    _bf16_iteration(model, opt, 0)
    _bf16_iteration(ref, ref_opt, 0)
    inject.arm(2)
    with pytest.raises(KeyboardInterrupt):
        _bf16_iteration(model, opt, 1)  # raised once the step has completed
    opt.zero_grad()
    _bf16_iteration(ref, ref_opt, 1)
    assert not _same(_values(ref, ref_opt), _values(model, opt))  # (the differing keys)


def test_not_atomic_a_final_backward_failing_after_steps_began_lets_step_finish(tmp_path):
    """atomic=False, steps started inside final_backward: a backward failing after some took
    their step says so; step() finishes the others and puts every new bf16 value in place
    (the spares the early steps wrote included)."""
    model, opt = _bf16_build(tmp_path, False, atomic=False)
    _bf16_iteration(model, opt, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def boom(grad):
        raise RuntimeError("injected in backward")

    with pytest.raises(RuntimeError, match="injected in backward") as info:
        with opt.final_backward():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = model.blocks[0].register_forward_hook(
                    lambda m, a, out: out.register_hook(boom) and None)
                loss = loss_fn(model, 1)
                h.remove()
            loss.float().backward()
    assert "had already taken this step" in "".join(info.value.__notes__)
    opt.step()
    masters = opt.state_dict()["state"]
    params = list(model.parameters())
    changed = 0
    for i, p in enumerate(params):
        name = next(k for k, v in model.named_parameters() if v is p)
        if i in masters and "master" in masters[i]:
            assert torch.equal(model.state_dict()[name],
                               masters[i]["master"].to(torch.bfloat16).reshape(p.shape)), name
        changed += not torch.equal(model.state_dict()[name], before[name])
    assert 0 < changed < len(params)  # the layers backward reached, not the first one
    assert sum("master" in st for st in masters.values()) == len(params)
    opt.zero_grad()
    _bf16_iteration(model, opt, 2)


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_a_checkpoint_loaded_after_a_failed_final_backward_continues_exactly(tmp_path, store):
    """The recovery the note names: some parameters took the step inside a final_backward that
    failed; hr.load of the last checkpoint and zero_grad() go on bitwise like a run that never
    failed (the early steps' values are dropped, not exchanged in later). Host memory
    (unprotected early steps) and a DiskStore with atomic=False."""
    def build(tag):
        model = make_model().to(torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hr.offload(model, device="cpu",
                       store=hr.DiskStore(tmp_path / tag) if store == "disk" else "cpu")
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, slice_bytes=32,
                               bucket_bytes=64, lr=1e-2, weight_decay=0.1,
                               atomic=store == "cpu")
        return model, opt

    def iteration(model, opt, s, fail=False):
        with opt.final_backward(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.blocks[0].register_forward_hook(
                lambda m, a, out: out.register_hook(_boom) and None) if fail else None
            loss = loss_fn(model, s)
            if h is not None:
                h.remove()
            loss.float().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build("a")
    ref, ref_opt = build("b")
    iteration(model, opt, 0)
    iteration(ref, ref_opt, 0)
    hr.save(tmp_path / "ckpt", model, opt)
    with pytest.raises(RuntimeError, match="injected in backward") as info:
        iteration(model, opt, 1, fail=True)
    assert "hr.load, then zero_grad()" in "".join(info.value.__notes__)
    hr.load(tmp_path / "ckpt", model, opt)
    opt.zero_grad()
    for s in (1, 2):
        iteration(model, opt, s)
        iteration(ref, ref_opt, s)
    assert not _same(_values(ref, ref_opt), _values(model, opt))


def _boom(grad):
    raise RuntimeError("injected in backward")


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize(("disk_state", "dtype"), list(WANT))
def test_the_dry_run_moves_what_the_step_moves(tmp_path, disk_state, dtype, atomic):
    # hr.estimate's dry run (what hr.plan prices a step's disk time from) against the stores'
    # own counts of a steady-state iteration: forward and backward reading the parameters,
    # backward writing fp32 gradients (for a bf16 parameter too), the step's reads and writes
    # (spares, the exchange, undo copies of what rests in host memory)
    from headroom.optim import HostOptimizerOptions

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 16)).to(dtype)

    def loss(out):
        return out.float().pow(2).mean()

    x = torch.randn(4, 32).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu: mechanics only
        est = hr.estimate(make(), (x,), loss_fn=loss, device="cpu",
                          optimizer=HostOptimizerOptions(
                              torch.optim.AdamW, {"lr": 1e-2, "fused": False},
                              "disk" if disk_state else "cpu", False, 1024, 4096, atomic),
                          offload={"store": "disk", "prefetch": 1})
        model = make()
        pstore = hr.DiskStore(tmp_path / "p")
        hr.offload(model, device="cpu", store=pstore, prefetch=1)
    state = hr.DiskStore(tmp_path / "s") if disk_state else "cpu"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, state_store=state,
                           slice_bytes=1024, bucket_bytes=4096, lr=1e-2, fused=False,
                           atomic=atomic)
    stores = [pstore] + ([state] if disk_state else [])
    for _ in range(3):  # the first creates the state; the last is measured
        before = [s.stats() for s in stores]
        loss(model(x)).backward()
        opt.step()
        opt.zero_grad()
    after = [s.stats() for s in stores]
    moved = {k: sum(b[f"bytes_{n}"] - a[f"bytes_{n}"] for a, b in zip(before, after, strict=True))
             for k, n in (("disk_read", "read"), ("disk_write", "written"))}
    opt.close()
    assert {k: est.transfers[k] for k in moved} == moved
