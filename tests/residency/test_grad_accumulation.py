"""``hr.offload(..., grad_accumulation="device")``: micro-batch gradients summed on the device,
handed to the store once. Bitwise the store's own accumulation, one gradient written per step
instead of one per backward, and every read of ``param.grad`` (or clearing) in between
behaves as in plain PyTorch. What survives an exception and a ``kill -9``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import headroom as hr
from headroom.residency import state_of
from tests.optim._models import assert_state_equal, loss_fn, make_model, train

SLICE = 1024


def _offloaded(tmp_path, tag, *, accumulation, store="disk", dtype=torch.float32):
    model = make_model().to(dtype)
    st = hr.DiskStore(tmp_path / f"params-{tag}") if store == "disk" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu with store=cpu: mechanics only
        hr.offload(model, device="cpu", store=st, grad_accumulation=accumulation)
    return model


def _plain_and_offloaded(tmp_path, tag="m"):
    """The model in plain PyTorch (fused AdamW) and offloaded to a DiskStore with its sums
    held on the device (HostOptimizer's AdamW, the same kernel)."""
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    model = _offloaded(tmp_path, tag, accumulation="device")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, slice_bytes=SLICE)
    return ref_model, ref, model, opt


def _values(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _grad_bytes(model):
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("final", [False, True])
def test_disk_bitwise_plain_with_one_gradient_write_per_step(tmp_path, final):
    steps, accum = 4, 3
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(ref_model, ref, range(steps), accum=accum, clip=None if final else 0.05)
    io = {}
    for mode in ("store", "device"):
        model = _offloaded(tmp_path, f"{mode}{final}", accumulation=mode)
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                               weight_decay=0.1, slice_bytes=SLICE, bucket_bytes=1024)
        st = state_of(model).store
        before = st.stats()
        train(model, opt, range(steps), accum=accum, clip=None if final else 0.05,
              final=final)
        after = st.stats()
        io[mode] = (after["bytes_read"] - before["bytes_read"],
                    after["bytes_written"] - before["bytes_written"])
        sd = model.state_dict()
        for name, p in ref_model.named_parameters():
            assert torch.equal(p, sd[name]), f"{mode}: parameter {name} differs"
        assert_state_equal(ref, opt)
        opt.close()
    # the store's accumulation writes every backward's gradient and reads back all but the
    # first; summed in memory, one write per step
    saved = steps * (accum - 1) * _grad_bytes(make_model())
    assert io["store"][1] - io["device"][1] == saved
    assert io["store"][0] - io["device"][0] == saved


def test_bf16_parameters_fp32_gradients_in_host_memory_bitwise_the_store_path(tmp_path):
    """bf16 parameters in host memory with HostOptimizer: fp32 gradients that param.grad
    reads through the store, summed on the device in fp32 like the store sums them."""
    got = {}
    for mode in ("store", "device"):
        model = _offloaded(tmp_path, mode, accumulation=mode, store="cpu",
                           dtype=torch.bfloat16)
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        norms = train(model, opt, range(3), accum=4, clip=0.05)
        if mode == "device":
            assert state_of(model)._held == {}  # all handed over by the step
        got[mode] = (_values(model), norms, opt.state_dict())
    (va, na, sa), (vb, nb, sb) = got["store"], got["device"]
    assert all(torch.equal(va[k], vb[k]) for k in va)
    assert all(torch.equal(a, b) for a, b in zip(na, nb, strict=True))
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_reads_and_clearing_between_backwards_are_plain_pytorch(tmp_path):
    ref = make_model()
    model = _offloaded(tmp_path, "m", accumulation="device")
    params = list(model.parameters())
    for m in (ref, model):
        loss_fn(m, 0).backward()
        loss_fn(m, 1).backward()
    # param.grad reads the sum so far: it is handed over first
    for r, p in zip(ref.parameters(), params, strict=True):
        assert torch.equal(p.grad.clone(), r.grad)
    for m in (ref, model):
        loss_fn(m, 2).backward()  # adds onto what was handed over
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    got = torch.nn.utils.clip_grad_norm_(params, 0.1)
    assert torch.equal(got, want)
    for r, p in zip(ref.parameters(), params, strict=True):
        assert torch.equal(p.grad.clone(), r.grad)
    # cleared while a sum is held: the sum is dropped, the next backward starts afresh
    for m in (ref, model):
        loss_fn(m, 3).backward()
        m.zero_grad()
        loss_fn(m, 4).backward()
    for r, p in zip(ref.parameters(), params, strict=True):
        assert torch.equal(p.grad.clone(), r.grad)
    # zero_grad(set_to_none=False) zeroes the stored sum, later backwards add to zeros
    for m in (ref, model):
        m.zero_grad(set_to_none=False)
        loss_fn(m, 5).backward()
        loss_fn(m, 6).backward()
    for r, p in zip(ref.parameters(), params, strict=True):
        assert torch.equal(p.grad.clone(), r.grad)


def test_host_optimizer_zero_grad_frees_what_is_held(tmp_path):
    model = _offloaded(tmp_path, "m", accumulation="device")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, slice_bytes=SLICE)
    loss_fn(model, 0).backward()
    state = state_of(model)
    assert len(state._held) == len(list(model.parameters()))
    opt.zero_grad()
    assert state._held == {}
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("who", ["module", "optimizer", "foreach"])
def test_zeroing_held_sums_reads_nothing_and_writes_zeros_once(tmp_path, who):
    """zero_grad(set_to_none=False) with sums held: they are dropped, not handed over to be
    overwritten; the store's gradients are written once, with zeros, and read not at all."""
    ref_model, ref, model, opt = _plain_and_offloaded(tmp_path, who)
    state = state_of(model)
    for m, o in ((ref_model, ref), (model, opt)):
        loss_fn(m, 0).backward()
        o.step()  # every stored gradient exists
        loss_fn(m, 1).backward()
        loss_fn(m, 2).backward()
        assert m is ref_model or len(state._held) == len(list(model.parameters()))
        before = state.store.stats()
        if who == "foreach":  # torch.optim's zero_grad(foreach=True): one _foreach_zero_
            grads = [p.grad for p in m.parameters()]
            torch._foreach_zero_(grads)
        else:
            (m if who == "module" else o).zero_grad(set_to_none=False)
        if m is model:
            after = state.store.stats()
            assert state._held == {}
            assert after["bytes_read"] == before["bytes_read"]
            assert after["bytes_written"] - before["bytes_written"] == _grad_bytes(model)
        loss_fn(m, 3).backward()  # onto the zeros
        o.step()
    sd = model.state_dict()
    for name, p in ref_model.named_parameters():
        assert torch.equal(p, sd[name]), f"parameter {name} differs"
        assert torch.equal(p.grad, dict(model.named_parameters())[name].grad.clone()), name


@pytest.mark.parametrize("how", ["error", "ctrl-c"])
def test_zeroing_cut_short_reads_as_cleared_and_training_goes_on_exactly(tmp_path, how):
    """A write of the zeros that fails (or a Ctrl-C there), with sums held: no mix of the
    stored gradient without the sum held back. The gradient reads as cleared (a read raises)
    and the next backward starts it afresh, as from the zeros: bitwise plain PyTorch."""
    from concurrent.futures import Future

    ref_model, ref, model, opt = _plain_and_offloaded(tmp_path, how)
    store = state_of(model).store
    head = model.head.weight
    for m, o in ((ref_model, ref), (model, opt)):
        loss_fn(m, 0).backward()
        o.step()
        loss_fn(m, 1).backward()
        loss_fn(m, 2).backward()  # held on the device
        if m is model:
            real, grad_key = store.write, head.grad._source.binding.grad_handle.key

            def failing(handle, value, _real=real, _key=grad_key):
                if handle.key != _key:
                    return _real(handle, value)
                if how == "ctrl-c":
                    raise KeyboardInterrupt
                fut = Future()
                fut.set_exception(OSError(5, "Input/output error (injected)"))
                return fut

            store.write = failing
            with pytest.raises((OSError, KeyboardInterrupt)):
                m.zero_grad(set_to_none=False)
            store.write = real
            with pytest.raises(RuntimeError, match="was cleared"):
                head.grad.clone()
            m.zero_grad(set_to_none=False)  # the others; this one is cleared already
        else:
            m.zero_grad(set_to_none=False)
        loss_fn(m, 3).backward()
        o.step()
    sd = model.state_dict()
    for name, p in ref_model.named_parameters():
        assert torch.equal(p, sd[name]), f"parameter {name} differs"
        assert torch.equal(p.grad, dict(model.named_parameters())[name].grad.clone()), name


def test_an_exception_in_backward_then_zero_grad_goes_on_exactly(tmp_path):
    """A backward that breaks off keeps what it summed (as torch keeps a partial gradient);
    zero_grad() clears it, and training goes on bitwise."""
    steps, accum = 3, 2
    ref_model, ref, model, opt = _plain_and_offloaded(tmp_path, "m")
    train(ref_model, ref, range(steps), accum=accum)
    loss_fn(model, 100).backward()  # a first micro-batch, held

    def boom(grad):
        raise RuntimeError("injected")

    # half-way through backward: the head's and the last blocks' gradients are summed
    def arm(module, args, output):
        output.register_hook(boom)

    h = model.blocks[1].register_forward_hook(arm)
    out = loss_fn(model, 101)
    h.remove()
    with pytest.raises(RuntimeError, match="injected"):
        out.backward()
    assert model.head.weight.grad is not None and model.emb.weight.grad is not None
    opt.zero_grad()
    train(model, opt, range(steps), accum=accum)
    sd = model.state_dict()
    for name, p in ref_model.named_parameters():
        assert torch.equal(p, sd[name]), f"parameter {name} differs"


def test_where_no_sum_can_be_held_it_says_so_once_and_stays_exact():
    # fp32 parameters in host memory with torch.optim: param.grad is the stored host tensor
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    model = _offloaded(None, "m", accumulation="device", store="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with pytest.warns(UserWarning, match="summed in host memory all the same") as rec:
        train(model, opt, range(2), accum=2)
    assert len([w for w in rec if "all the same" in str(w.message)]) == 1
    train(ref, ref_opt, range(2), accum=2)
    sd = model.state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(p, sd[name]), name


def test_a_bad_value_is_refused():
    with pytest.raises(ValueError, match="grad_accumulation must be 'store' or 'device'"):
        hr.offload(make_model(), device="cpu", store="cpu", grad_accumulation="host")


_CHILD = """
import os, signal, sys, warnings
import torch
import headroom as hr
from headroom.residency import state_of
from tests.optim._models import loss_fn, make_model
root = sys.argv[1]
model = make_model()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hr.offload(model, device="cpu", store=hr.DiskStore(root + "/params"),
               grad_accumulation="device")
opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, slice_bytes=64)
for mb in range(2):
    loss_fn(model, mb).backward()
opt.step(); opt.zero_grad()
for name, p in model.state_dict().items():
    torch.save(p, f"{root}/old-{name}.pt")
state = state_of(model)
hold, calls = state._hold, [0]
def killing(*a, **k):
    calls[0] += 1
    if calls[0] == 2 * len(state.slots) - 3:  # in the second backward, sums held
        os.kill(os.getpid(), signal.SIGKILL)
    return hold(*a, **k)
state._hold = killing
for mb in range(2, 4):
    loss_fn(model, mb).backward()
opt.step()
"""


def test_kill_9_while_sums_are_held_leaves_the_stored_parameters_whole(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(hr.__file__).parents[1]), str(Path(__file__).parents[2])]))
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env,
                       capture_output=True, timeout=120, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    # the sums died with the process; the parameters on disk are those of the last step
    with torch.device("meta"):
        model = make_model()
    with pytest.warns(UserWarning, match="was not closed"):
        hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "params"))
    sd = model.state_dict()
    assert sd.keys()
    for name, v in sd.items():
        assert torch.equal(v, torch.load(tmp_path / f"old-{name}.pt")), name


def test_unoffload_while_sums_are_held_keeps_them(tmp_path):
    ref = make_model()
    model = _offloaded(tmp_path, "m", accumulation="device")
    for m in (ref, model):
        loss_fn(m, 0).backward()
        loss_fn(m, 1).backward()
    assert state_of(model)._held
    hr.unoffload(model)
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, r.grad)


def test_a_failed_write_of_a_sum_is_a_clear_error_then_the_iteration_redone_is_exact(
        tmp_path):
    """The step hands the sums to the disk; one write fails. The step raises it (undone,
    saying what was lost), a second step() refuses to train on the stale gradient, and
    zero_grad() with the iteration run again trains on exactly."""
    from concurrent.futures import Future

    steps, accum = 3, 2
    ref_model, ref, model, opt = _plain_and_offloaded(tmp_path, "m")
    train(ref_model, ref, range(steps), accum=accum)
    before = _values(model)
    store = state_of(model).store
    real_write, failed = store.write, []

    def write(handle, value):
        if handle.key.endswith(".grad") and not failed:
            failed.append(handle.key)
            f = Future()
            f.set_exception(OSError(5, "injected I/O error"))
            return f
        return real_write(handle, value)

    store.write = write
    for mb in range(accum):
        loss_fn(model, 100 + mb).backward()
    with pytest.raises(OSError, match="injected") as e:
        opt.step()
    assert "zero_grad() and run the iteration again" in "\n".join(e.value.__notes__)
    assert failed and all(torch.equal(v, before[k]) for k, v in _values(model).items())
    with pytest.raises(RuntimeError, match=r"was lost.*zero_grad\(\) and run the iteration"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in _values(model).items())
    store.write = real_write
    opt.zero_grad()
    train(model, opt, range(steps), accum=accum)
    sd = model.state_dict()
    for name, p in ref_model.named_parameters():
        assert torch.equal(p, sd[name]), f"parameter {name} differs"
