"""hr.save / hr.load: safetensors + JSON, atomic, bitwise resume on CPU in fp32."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import headroom as hr
from headroom.offload import _checkpoint
from tests.offload._optim_util import (
    assert_params_equal,
    assert_state_equal,
    make_model,
    one_thread,  # noqa: F401 - fixture
    train,
)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 50


def _optimizer(kind, model, tmp_path, tag):
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), fused=True, **kw)
    if kind == "host":
        return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, slice_bytes=512,
                            state_store=hr.DiskStore(tmp_path / f"state-{tag}"), **kw)


def _sched(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


@pytest.mark.parametrize("kind", ["torch", "host", "disk"])
def test_save_kill_load_resumes_bitwise(tmp_path, kind):
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_sched = _sched(ref)
    train(ref_model, ref, range(STEPS), accum=2, clip=0.05, sched=ref_sched)

    model = make_model()
    opt = _optimizer(kind, model, tmp_path, "a")
    sched = _sched(opt)
    train(model, opt, range(STEPS // 2), accum=2, clip=0.05, sched=sched)
    path = tmp_path / "ckpt.safetensors"
    hr.save(path, model, opt, extra={"step": STEPS // 2, "sched": sched.state_dict()})
    # "kill": nothing of the first run survives but the file
    if hasattr(opt, "close"):
        opt.close()
    del model, opt, sched
    gc.collect()

    model = make_model(seed=123)  # different initial values, overwritten by load
    opt = _optimizer(kind, model, tmp_path, "b")
    sched = _sched(opt)
    extra = hr.load(path, model, opt)
    sched.load_state_dict(extra["sched"])
    assert extra["step"] == STEPS // 2
    train(model, opt, range(STEPS // 2, STEPS), accum=2, clip=0.05, sched=sched)
    assert_params_equal(ref_model, model)
    assert_state_equal(ref, opt)


def test_file_is_plain_safetensors_with_json(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    model = make_model()
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    path = tmp_path / "c.safetensors"
    hr.save(path, model, opt)
    tensors = load_file(path)  # a standard safetensors reader, no pickle anywhere
    assert torch.equal(tensors["model/head.weight"], model.head.weight)
    assert torch.equal(tensors["optimizer/0/exp_avg"], opt.state[model.emb.weight]["exp_avg"])
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["headroom"])
    assert meta["optimizer"]["inner_class"] == "AdamW"
    assert meta["optimizer"]["params"][0] == {"name": "emb.weight", "shape": [37, 16]}
    assert meta["optimizer"]["groups"][0]["hparams"]["lr"] == 1e-2


def test_save_is_atomic(tmp_path, monkeypatch):
    model = make_model()
    path = tmp_path / "c.safetensors"
    hr.save(path, model)
    old = path.read_bytes()
    saved = model.head.weight.detach().clone()
    with torch.no_grad():
        model.head.weight.add_(1.0)
    calls = {"n": 0}
    real = _checkpoint._write_bytes

    def failing(f, t):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(f, t)

    monkeypatch.setattr(_checkpoint, "_write_bytes", failing)
    with pytest.raises(OSError, match="No space"):
        hr.save(path, model)
    assert path.read_bytes() == old  # the previous checkpoint is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temp file left
    fresh = make_model()
    with torch.no_grad():
        fresh.head.weight.zero_()
    hr.load(path, fresh)
    assert torch.equal(fresh.head.weight, saved)


def test_bad_input(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = tmp_path / "c.safetensors"
    with pytest.raises(TypeError, match="no pickled objects"):
        hr.save(path, model, opt, extra={"obj": object()})
    assert not path.exists()
    hr.save(path, model, opt)
    with pytest.raises(ValueError, match="does not match the model"):
        hr.load(path, torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="shape mismatch"):
        hr.load(path, make_model(vocab=38))
    other = make_model()
    with pytest.raises(ValueError, match="SGD"):
        hr.load(path, other, torch.optim.SGD(other.parameters(), lr=0.1))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a headroom checkpoint"):
        hr.load(tmp_path / "plain.safetensors", model)
