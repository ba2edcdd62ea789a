"""HostOptimizer on parameters offloaded by hr.offload (store-resident): bitwise and resumable."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import headroom as hr
from tests.optim._models import (
    assert_params_equal,
    assert_state_equal,
    loss_fn,
    make_model,
    train,
)

STEPS = 50
# NOTE: the embedding and the blocks' weights (2-2.4 KiB) take 2-3 slices each per step;
# smaller slices would only multiply the disk store's requests, each a hand-off to its threads.
SLICE = 1024


def _offloaded(store, tmp_path, seed=0, tag="m"):
    model = make_model(seed)
    st = hr.DiskStore(tmp_path / f"params-{tag}") if store == "disk" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu with store=cpu: mechanics only
        hr.offload(model, device="cpu", store=st)
    return model


def _plain_params_equal(ref, model):
    sd = model.state_dict()  # the offloaded model's real values, read from its store
    for name, p in ref.named_parameters():
        assert torch.equal(p, sd[name]), f"parameter {name} differs"


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("state", ["cpu", "disk"])
def test_offloaded_50_steps_bitwise(tmp_path, store, state):
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(ref_model, ref, range(STEPS), accum=2, clip=0.05)
    model = _offloaded(store, tmp_path)
    state_store = hr.DiskStore(tmp_path / "state") if state == "disk" else "cpu"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           state_store=state_store, slice_bytes=SLICE)
    assert all(e.kind == "bound" for e in opt._order)
    train(model, opt, range(STEPS), accum=2, clip=0.05)
    _plain_params_equal(ref_model, model)
    assert_state_equal(ref, opt)


def test_offloaded_disk_save_kill_load_resumes_bitwise(tmp_path):
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(ref_model, ref, range(STEPS), accum=2)
    model = _offloaded("disk", tmp_path, tag="a")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           state_store=hr.DiskStore(tmp_path / "state-a"), slice_bytes=SLICE)
    train(model, opt, range(STEPS // 2), accum=2)
    path = tmp_path / "ckpt.safetensors"
    hr.save(path, model, opt)
    opt.close()
    del model, opt
    gc.collect()
    model = _offloaded("disk", tmp_path, seed=7, tag="b")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           state_store=hr.DiskStore(tmp_path / "state-b"), slice_bytes=SLICE)
    hr.load(path, model, opt)
    early = _count_early(opt)
    train(model, opt, range(STEPS // 2, STEPS), accum=2, final=True)
    assert early[0] > 0, "the resumed run never overlapped a step with backward"
    _plain_params_equal(ref_model, model)
    assert_state_equal(ref, opt)
    # the file holds the real values, readable by a plain model
    plain = make_model(seed=3)
    hr.load(path, plain)
    fresh_ref = make_model()
    fresh_opt = torch.optim.AdamW(fresh_ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(fresh_ref, fresh_opt, range(STEPS // 2), accum=2)
    assert_params_equal(fresh_ref, plain)


def _count_early(opt) -> list[int]:
    """Count store-resident parameters that start their step during backward (overlap)."""
    early = [0]
    inner = opt._step_entries

    def spy(batch, **kw):
        if kw.get("early", False):
            early[0] += sum(1 for e in batch if e.kind == "bound")
        return inner(batch, **kw)

    opt._step_entries = spy
    return early


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_offloaded_overlap_steps_early_bitwise(tmp_path, store):
    steps, accum = 12, 4
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(ref_model, ref, range(steps), accum=accum)
    results = {}
    for overlap in (True, False):
        model = _offloaded(store, tmp_path, tag=f"o{overlap}")
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                               weight_decay=0.1, overlap=overlap, bucket_bytes=1024)
        early = _count_early(opt)
        train(model, opt, range(steps), accum=accum, final=True)
        _plain_params_equal(ref_model, model)
        assert_state_equal(ref, opt)
        results[overlap] = early[0]
        opt.close()
    n = len(list(ref_model.parameters()))
    # every step ran during its final backward, none on a partial accumulation
    assert results == {True: n * steps, False: 0}


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_offloaded_overlap_updates_before_step(tmp_path, store):
    model = _offloaded(store, tmp_path)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=1024)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn(model, 10).backward()
    assert not opt._overlap.busy, "a step started on a partial accumulation"
    with opt.final_backward():
        loss_fn(model, 11).backward()
    assert opt._overlap.busy, "no step was started during backward"
    opt._wait()
    after = model.state_dict()
    moved = [not torch.equal(before[k], after[k]) for k in before]
    if store == "cpu":
        assert all(moved), "offloaded parameters were not updated before step()"
    else:
        # On disk the new values wait in spares, exchanged into place when step() ends:
        # until then the model reads its parameters whole as before the step.
        assert not any(moved)
    runs = [0]
    orig = opt._slicer._run
    opt._slicer._run = lambda *a, **k: (runs.__setitem__(0, runs[0] + 1), orig(*a, **k))[1]
    opt.step()
    assert runs[0] == 0, "step() stepped what backward had stepped already"
    after = model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    opt.zero_grad()
    with opt.final_backward():
        loss_fn(model, 20).backward()
    with pytest.raises(RuntimeError, match="another gradient"):
        loss_fn(model, 21).backward()  # one backward pass after the one declared final
    opt.step()


def test_offloaded_overlap_defers_with_clipping(tmp_path):
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    na = train(ref_model, ref, range(8), accum=2, clip=0.05)
    model = _offloaded("disk", tmp_path)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, bucket_bytes=1024)
    early = _count_early(opt)
    nb = train(model, opt, range(8), accum=2, clip=0.05)
    assert all(torch.equal(x, y) for x, y in zip(na, nb, strict=True))
    # clipping needs every gradient first, so each step waits for step()
    assert early[0] == 0
    _plain_params_equal(ref_model, model)
    assert_state_equal(ref, opt)


def test_offloaded_overlap_waits_for_gradients_in_flight(tmp_path, monkeypatch):
    """On a DiskStore the last micro-batch's gradient is added to the stored one on the
    mover's own thread (read, add, write), still in flight when backward signals it; the early
    step must wait for it (sync_grad), or it would step on a partial accumulation."""
    import time

    from headroom.transfer import Mover

    slow = Mover._accumulate

    def slow_accumulate(self, gh, grad):
        time.sleep(0.02)
        slow(self, gh, grad)

    monkeypatch.setattr(Mover, "_accumulate", slow_accumulate)
    steps, accum = 5, 2
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(ref_model, ref, range(steps), accum=accum)
    model = _offloaded("disk", tmp_path)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           bucket_bytes=1 << 20)
    early = _count_early(opt)
    train(model, opt, range(steps), accum=accum, final=True)
    assert early[0] == len(opt._order) * steps
    _plain_params_equal(ref_model, model)
    assert_state_equal(ref, opt)
