"""Under headroom's own saved-tensor hooks (hr.track_memory, hr.offload_activations, composed by
headroom._saved_hooks) converted layers leave the fast path and stay bitwise PyTorch's."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import headroom as hr
from headroom.nn import _activation, _common, _conv
from tests.nn._models import ZOO, trainable


def _contexts(tmp_path):
    # a folder per store: the store of the previous call may not be collected (closed) yet
    n = iter(range(1 << 30))
    return {
        "track_memory": lambda: hr.track_memory(),
        "offload_activations": lambda: hr.offload_activations(
            hr.DiskStore(tmp_path / f"act{next(n)}"), min_bytes=0),
        "both": lambda: _nested(hr.track_memory(), hr.offload_activations(
            hr.DiskStore(tmp_path / f"both{next(n)}"), min_bytes=0)),
    }


@contextlib.contextmanager
def _nested(*ctxs):
    with contextlib.ExitStack() as stack:
        for c in ctxs:
            stack.enter_context(c)
        yield


@pytest.fixture
def fast_path_calls(monkeypatch):
    """How many times converted layers ran PyTorch's node with headroom's hooks on what it saves
    (the fast path): under hooks pushed around the op, or registered on a saved tensor."""
    calls = []
    run, save = _common.run_saving_less, _common.save_less

    def counting_run(*args):
        calls.append(args[1])
        return run(*args)

    def counting_save(saved, pack):
        calls.append(pack)
        return save(saved, pack)

    for mod in (_common, _conv, _activation):
        if hasattr(mod, "run_saving_less"):
            monkeypatch.setattr(mod, "run_saving_less", counting_run)
        if hasattr(mod, "save_less"):
            monkeypatch.setattr(mod, "save_less", counting_save)
    return calls


def _step(model, x, input_grad, seed, ctx=contextlib.nullcontext):
    """One forward+backward (no measurement): output, input grad, parameter grads."""
    x = x.detach().clone().requires_grad_(input_grad)
    torch.manual_seed(seed)
    with ctx():
        out = model(x)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [out.detach(), x.grad, *grads]


def _assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert (u is None) == (v is None)
        if u is not None:
            assert torch.equal(u, v)


# every model under the tracker; under activation offload (a DiskStore, every tensor) the
# models with each kind of activation the fast path handles differently: a plain ReLU chain,
# residual adds, ReLU6 and depthwise convolutions, squeeze-excitation, in-place LeakyReLU
_OFFLOADED = ["resnet_like", "mobilenet_v2_like", "mobilenet_v3_like", "dcgan_discriminator",
              "classifier_head"]
_PAIRS = ([(name, "track_memory") for name in ZOO]
          + [(name, ctx) for name in _OFFLOADED for ctx in ("offload_activations", "both")])


@pytest.mark.parametrize("case", ["all", "input"])
@pytest.mark.parametrize(("name", "context"), _PAIRS)
def test_headroom_hooks_leave_the_fast_path(name, context, case, tmp_path, fast_path_calls):
    build, shape = ZOO[name]
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = build()
    trainable(plain, case)
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(shape)
    ctx = _contexts(tmp_path)[context]
    grad_x = case == "input"
    # without hooks the converted model does take the fast path: the count below means something
    _assert_same(_step(plain, x, grad_x, 0), _step(ours, x, grad_x, 0))
    assert fast_path_calls, f"{name}/{case}: no layer took the fast path without hooks"
    fast_path_calls.clear()
    a = _step(plain, x, grad_x, 1, ctx)
    b = _step(ours, x, grad_x, 1, ctx)
    assert not fast_path_calls, f"{name}/{case}: fast path under {context}"
    _assert_same(a, b)
    # and the step after it, without hooks again
    _assert_same(_step(plain, x, grad_x, 2), _step(ours, x, grad_x, 2))
