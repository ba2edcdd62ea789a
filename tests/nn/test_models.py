"""Whole models: bitwise equal to torch.nn in every case, and fewer saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import headroom as hr
from tests.conftest import DEVICES
from tests.nn._models import CASES, resnet_like, trainable, vgg_like
from tests.nn._util import assert_same, step

MODELS = {"vgg": vgg_like, "resnet": resnet_like}


@pytest.mark.parametrize("kernels", ["c", "numpy"])
@pytest.mark.parametrize("hooks", [True, False], ids=["function-path", "fast-path"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("case", CASES)
def test_model_matches_torch_and_saves_less(name, case, hooks, kernels, monkeypatch):
    # hooks=True measures under saved-tensor hooks, so converted layers run their
    # autograd.Functions; hooks=False measures live storages instead, so they run PyTorch's own
    # nodes under headroom's hooks (the path a plain training step takes). Both must match,
    # with the C mask kernels and with the NumPy code that runs where they were not built.
    from headroom.nn import _bitmask

    if kernels == "c" and _bitmask._native is None:
        pytest.skip("the C kernels were not built here")
    if kernels == "numpy":
        monkeypatch.setattr(_bitmask, "_native", None)
    torch.manual_seed(0)
    plain = MODELS[name]()
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(4, 3, 16, 16)
    input_grad = case == "input"
    for m in (plain, ours):
        trainable(m, case)
    # Two steps: the first teaches converted ReLUs their consumers; both must match PyTorch.
    results = []
    for seed in (1, 2):
        a = step(plain, x, input_grad=input_grad, seed=seed, hooks=hooks)
        b = step(ours, x, input_grad=input_grad, seed=seed, hooks=hooks)
        assert_same(a, b)
        assert b[4] <= a[4], f"{name}/{case} step {seed}: ours {b[4]} B > torch {a[4]} B"
        results.append((a[4], b[4]))
    (plain_bytes, ours_bytes) = results[1]
    if case == "none":
        assert plain_bytes == ours_bytes == 0
    else:
        assert ours_bytes < plain_bytes
    if case in ("input", "norm"):
        # frozen convolutions drop their inputs: at least a third less than PyTorch
        assert ours_bytes < 0.67 * plain_bytes, (name, case, results)
        if name == "vgg":  # an nn.Sequential: ReLUs know their consumers from the first step
            assert results[0][1] == ours_bytes, results


def _relu_chain(train_convs: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    for p in model.parameters():
        p.requires_grad_(train_convs)
    return model


@pytest.mark.parametrize("hooks", [True, False], ids=["function-path", "fast-path"])
def test_relu_adds_nothing_when_consumer_keeps_its_output(hooks):
    plain = _relu_chain(True)
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(2, 3, 9, 9)
    x_bytes, out_bytes = x.numel() * 4, 2 * 8 * 9 * 9 * 4
    for _ in range(2):
        a = step(plain, x, input_grad=False, hooks=hooks)
        b = step(ours, x, input_grad=False, hooks=hooks)
        assert_same(a, b)
        assert a[4] == b[4] == x_bytes + out_bytes


@pytest.mark.parametrize("hooks", [True, False], ids=["function-path", "fast-path"])
def test_relu_keeps_one_bit_when_consumer_does_not_keep_its_output(hooks):
    plain = _relu_chain(False)
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(2, 3, 9, 9)
    numel = 2 * 8 * 9 * 9
    for _ in range(2):  # known from the nn.Sequential from the first step on
        a = step(plain, x, input_grad=True, hooks=hooks)
        b = step(ours, x, input_grad=True, hooks=hooks)
        assert_same(a, b)
        assert a[4] == x.numel() * 4 + numel * 4
        assert b[4] == (numel + 7) // 8  # 1 bit per element, nothing else


def test_fast_path_runs_pytorch_nodes_and_function_path_under_hooks():
    ours = hr.convert(_relu_chain(False))
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    y = ours[1](ours[0](x))
    assert type(y.grad_fn).__name__ == "ReluBackward0"
    assert type(ours[2](y).grad_fn).__name__ == "ConvolutionBackward0"
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = ours[1](ours[0](x))
        assert type(y.grad_fn).__name__ == "_MaskFunctionBackward"
        assert type(ours[2](y).grad_fn).__name__ == "_ConvFunctionBackward"


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(3, 8, 3, padding=1).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.relu(x))


def test_relu_in_custom_forward_keeps_a_mask_from_the_first_step():
    """Without hooks of the caller's the first step decides late and keeps the mask; under
    them (the autograd.Function path) a ReLU in a custom forward decides in forward and keeps
    its output, as PyTorch does, until it has seen its consumer."""
    torch.manual_seed(0)
    plain = _Custom()
    x = torch.randn(2, 3, 9, 9)
    mask = (x.numel() + 7) // 8
    first = step(hr.convert(copy.deepcopy(plain)), x, input_grad=True, hooks=False)
    assert first[4] == mask
    ours = hr.convert(copy.deepcopy(plain))
    first = step(ours, x, input_grad=True)
    assert first[4] == x.numel() * 4  # as PyTorch's ReLU: the output
    a, b = step(plain, x, input_grad=True), step(ours, x, input_grad=True)
    assert_same(a, b)
    assert a[4] == x.numel() * 4
    assert b[4] == mask


def test_requires_grad_changes_between_steps():
    plain = _relu_chain(True)
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(2, 3, 9, 9)
    numel = 2 * 8 * 9 * 9
    expected = {True: x.numel() * 4 + numel * 4, False: (numel + 7) // 8}
    for train in (True, False, True, False):
        for m in (plain, ours):
            for p in m.parameters():
                p.requires_grad_(train)
        step(ours, x, input_grad=not train)  # a step under the new flags
        a = step(plain, x, input_grad=not train)
        b = step(ours, x, input_grad=not train)
        assert_same(a, b)
        assert b[4] == expected[train]


def test_training_steps_give_bitwise_equal_parameters():
    torch.manual_seed(0)
    plain = vgg_like()
    ours = hr.convert(copy.deepcopy(plain))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, ours)]
    for i, case in enumerate(("all", "norm", "surgical", "all")):
        x = torch.randn(4, 3, 16, 16)
        y = torch.randint(0, 5, (4,))
        for model, opt in zip((plain, ours), opts, strict=True):
            trainable(model, case)
            torch.manual_seed(100 + i)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for (n, p), q in zip(plain.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["all", "input", "norm"])
def test_vgg_on_each_device(device, case):
    # On an accelerator, bitwise comparison needs deterministic kernels (cuDNN picks
    # algorithms per call otherwise); on CPU this repeats the main test on the device list.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.manual_seed(0)
        plain = vgg_like().to(device)
        ours = hr.convert(copy.deepcopy(plain))
        for m in (plain, ours):
            trainable(m, case)
        x = torch.randn(4, 3, 16, 16, device=device)
        for seed in (1, 2):
            a = step(plain, x, input_grad=case == "input", seed=seed)
            b = step(ours, x, input_grad=case == "input", seed=seed)
            assert_same(a, b)
            assert b[4] < a[4]
    finally:
        torch.use_deterministic_algorithms(False)


def test_full_backward_hooks_and_checkpoint_work_on_converted_layers():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    plain = vgg_like()
    ours = hr.convert(copy.deepcopy(plain))
    for m in (plain, ours):
        trainable(m, "norm")
    calls = []
    for m in (plain, ours):  # the second conv: frozen, its input needs a gradient
        m[3].register_full_backward_hook(lambda m, gi, go: calls.append((gi[0].shape, go[0])))
    x = torch.randn(4, 3, 16, 16)
    grads = []
    for m in (plain, ours):
        torch.manual_seed(3)
        out = checkpoint(m, x, use_reentrant=False)
        out.square().sum().backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
        m.zero_grad(set_to_none=True)
    assert len(calls) == 2 and calls[0][0] == calls[1][0] == torch.Size([4, 8, 16, 16])
    assert torch.equal(calls[0][1], calls[1][1])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


class _Logits(nn.Module):
    """A Hugging Face image classifier as a tensor -> tensor module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


@pytest.mark.parametrize("case", ["all", "input", "norm"])
def test_hugging_face_resnet_matches_torch_and_keeps_less(case):
    """A model defined elsewhere (transformers' ResNet, from a config): bitwise equal, and
    fewer kept bytes where something is frozen."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=5,
    )
    plain = _Logits(transformers.ResNetForImageClassification(cfg))
    ours = hr.convert(copy.deepcopy(plain))
    assert any(type(m).__module__.startswith("headroom.nn") for m in ours.modules())
    for m in (plain, ours):
        for name, p in m.named_parameters():
            p.requires_grad_(case == "all" or (case == "norm" and "normalization" in name))
    x = torch.randn(2, 3, 32, 32)
    for seed in (1, 2):  # the first step teaches converted ReLUs their consumers
        a = step(plain, x, input_grad=case == "input", seed=seed, hooks=False)
        b = step(ours, x, input_grad=case == "input", seed=seed, hooks=False)
        assert_same(a, b)
        assert b[4] <= a[4]
    if case != "all":
        assert b[4] < 0.75 * a[4], (b[4], a[4])
