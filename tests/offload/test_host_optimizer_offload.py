"""HostOptimizer on parameters offloaded by hr.offload (store-resident): bitwise and resumable."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import headroom as hr
from tests.offload._optim_util import (
    assert_params_equal,
    assert_state_equal,
    make_model,
    one_thread,  # noqa: F401 - fixture
    train,
)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 50


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
                           state_store=state_store, slice_bytes=512)
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
                           state_store=hr.DiskStore(tmp_path / "state-a"), slice_bytes=512)
    train(model, opt, range(STEPS // 2), accum=2)
    path = tmp_path / "ckpt.safetensors"
    hr.save(path, model, opt)
    opt.close()
    del model, opt
    gc.collect()
    model = _offloaded("disk", tmp_path, seed=7, tag="b")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           state_store=hr.DiskStore(tmp_path / "state-b"), slice_bytes=512)
    hr.load(path, model, opt)
    train(model, opt, range(STEPS // 2, STEPS), accum=2)
    _plain_params_equal(ref_model, model)
    assert_state_equal(ref, opt)
    # the file holds the real values, readable by a plain model
    plain = make_model(seed=3)
    hr.load(path, plain)
    fresh_ref = make_model()
    fresh_opt = torch.optim.AdamW(fresh_ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    train(fresh_ref, fresh_opt, range(STEPS // 2), accum=2)
    assert_params_equal(fresh_ref, plain)
