"""hr.convert: same parameters, buffers, hooks and state_dict; idempotent; errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import headroom as hr
import headroom.nn as hnn
from tests.nn._measure import forward_bytes
from tests.nn._models import resnet_like, vgg_like


def test_convert_shares_parameters_and_buffers_and_keeps_original():
    model = vgg_like()
    classes = [type(m) for m in model.modules()]
    conv = hr.convert(model)
    assert conv is not model
    assert [type(m) for m in model.modules()] == classes  # original untouched
    assert list(conv.state_dict()) == list(model.state_dict())
    for a, b in zip(model.parameters(), conv.parameters(), strict=True):
        assert a is b
    for a, b in zip(model.buffers(), conv.buffers(), strict=True):
        assert a is b
    assert isinstance(conv[0], nn.Conv2d) and type(conv[0]) is hnn.Conv2d
    assert type(conv[2]) is hnn.ReLU and type(conv[6]) is hnn.MaxPool2d
    assert type(conv[-2]) is hnn.Dropout and type(conv[-1]) is hnn.Linear


def test_convert_inplace_and_twice_is_noop():
    model = resnet_like()
    params = list(model.parameters())
    out = hr.convert(model, inplace=True)
    assert out is model
    assert type(model[4].conv1) is hnn.Conv2d and type(model[4].relu) is hnn.ReLU
    classes = [type(m) for m in model.modules()]
    assert hr.convert(model) is model
    assert hr.convert(model, inplace=True) is model
    assert [type(m) for m in model.modules()] == classes
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))


def test_hooks_are_kept_and_copies_are_independent():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    calls = []
    model[0].register_forward_hook(lambda m, i, o: calls.append("fwd"))
    model[1].register_forward_pre_hook(lambda m, i: calls.append("pre"))
    conv = hr.convert(model)
    conv(torch.randn(1, 3, 5, 5))
    assert calls == ["fwd", "pre"]
    conv[0].register_forward_hook(lambda m, i, o: calls.append("new"))
    calls.clear()
    model(torch.randn(1, 3, 5, 5))
    assert calls == ["fwd", "pre"]


def test_shared_module_stays_shared_and_subclasses_keep_their_class():
    class MyConv(nn.Conv2d):
        pass

    shared = nn.ReLU()
    model = nn.Sequential(nn.Conv2d(3, 3, 1), shared, MyConv(3, 3, 1), shared)
    conv = hr.convert(model)
    assert conv[1] is conv[3] and type(conv[1]) is hnn.ReLU
    assert isinstance(conv[2], MyConv) and isinstance(conv[2], hnn.Conv2d)
    assert type(conv[2]).__name__ == "MyConv" and type(model[2]) is MyConv


def test_single_layer_and_bad_input():
    layer = nn.BatchNorm2d(3)
    out = hr.convert(layer)
    assert type(out) is hnn.BatchNorm2d and out.weight is layer.weight
    with pytest.raises(TypeError, match="torch.nn.Module"):
        hr.convert(lambda x: x)


def test_state_dict_round_trip_between_plain_and_converted():
    model = vgg_like()
    conv = hr.convert(model)
    fresh = vgg_like()
    fresh.load_state_dict(conv.state_dict())
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_public_names():
    assert hr.convert is hnn.convert
    assert "convert" in hnn.__all__ and "Conv2d" in hnn.__all__
    for name in hnn.__all__:
        assert hasattr(hnn, name)


def test_converted_model_pickles_and_deep_copies_after_a_step():
    import copy
    import io

    model = hr.convert(resnet_like())
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    clone = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16)
    model.eval(), loaded.eval(), clone.eval()
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x)) and torch.equal(model(x), clone(x))
    assert type(loaded[4].relu) is hnn.ReLU


class _SameConv(nn.Conv2d):
    """timm's Conv2dSame pattern: its own forward pads "same" and calls F.conv2d itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.kernel_size[0] - 1
        x = nn.functional.pad(x, [pad // 2, pad - pad // 2] * 2)
        return nn.functional.conv2d(x, self.weight, self.bias, self.stride, 0)


class _ChannelsFirstNorm(nn.LayerNorm):
    """transformers' ConvNextLayerNorm pattern: permutes, then calls nn.LayerNorm's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _subclass_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        _SameConv(8, 8, 4),
        _ChannelsFirstNorm(8),
        nn.LazyConv2d(4, 1),
    )


def test_subclasses_keep_their_forward_and_lazy_modules_are_reported(capsys):
    """A subclass with its own forward is converted with that forward kept (bitwise equal),
    one calling up into torch.nn reaches the headroom twin, an uninitialized lazy module is
    left alone and named; verbose=True prints what was done and why."""
    model = _subclass_model()
    ours = hr.convert(model, verbose=True)
    printed = capsys.readouterr().out
    assert isinstance(ours[2], _SameConv) and isinstance(ours[2], hnn.Conv2d)
    assert isinstance(ours[3], _ChannelsFirstNorm) and isinstance(ours[3], hnn.LayerNorm)
    assert type(ours[4]) is nn.LazyConv2d
    assert "_SameConv: subclass of torch.nn.Conv2d: its own methods kept" in printed
    assert "_ChannelsFirstNorm: subclass of torch.nn.LayerNorm" in printed
    assert "4  LazyConv2d: an uninitialized lazy module" in printed
    assert "run one forward, then convert" in printed
    report = hnn.convert_report(ours)
    assert [r[0] for r in report.converted] == ["0", "1", "2", "3"]
    assert [r[0] for r in report.left_alone] == ["4"]
    x = torch.randn(2, 3, 8, 8)
    model(x)  # initializes the lazy convolution: it becomes an nn.Conv2d
    assert type(model[4]) is nn.Conv2d and type(hnn.convert_report(model).left_alone) is tuple
    ours = hr.convert(model)
    assert type(ours[4]) is hnn.Conv2d and not hnn.convert_report(ours).left_alone
    # bitwise equal, and the LayerNorm subclass reaches the twin: with only its bias
    # training and no input gradient, it keeps no input
    for m in (model, ours):
        m.requires_grad_(False)
        m[3].bias.requires_grad_(True)
    got = []
    for m in (model, ours):
        nbytes, _, out = forward_bytes(lambda m=m: m(x.clone()))
        out.square().sum().backward()
        got.append((nbytes, out.detach(), m[3].bias.grad.clone()))
        m[3].bias.grad = None
    assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][2], got[1][2])
    assert got[1][0] < got[0][0] - 2 * 8 * 8 * 8 * 4 + 1  # its input (2x8x8x8 floats) not kept


def test_converted_subclasses_pickle_and_deep_copy():
    import io

    model = _subclass_model()
    model(torch.randn(1, 3, 8, 8))
    ours = hr.convert(model)
    clone = copy.deepcopy(ours)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (clone, loaded):
        assert type(m[2]) is type(ours[2]) and type(m[3]) is type(ours[3])
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(clone(x), ours(x)) and torch.equal(loaded(x), ours(x))


def test_parametrized_layers_convert_and_unparametrize_to_the_twin():
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 0.5

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    parametrize.register_parametrization(model[2], "weight", Scale())
    ours = hr.convert(copy.deepcopy(model))
    assert isinstance(ours[2], hnn.Conv2d) and parametrize.is_parametrized(ours[2])
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    grads = [torch.autograd.grad(m(x).square().sum(), x)[0] for m in (model, ours)]
    assert torch.equal(grads[0], grads[1])
    parametrize.remove_parametrizations(ours[2], "weight")
    assert type(ours[2]) is hnn.Conv2d


def test_convert_after_offload_converts_the_guarded_classes():
    """hr.offload turns the root and its blocks into subclasses of their own classes (marked
    ``_headroom_base``); convert converts those too, keeps them guarded, and trains exactly."""
    import warnings

    torch.manual_seed(0)
    plain = vgg_like()
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu" with store="cpu" saves nothing
        hr.offload(model, device="cpu", store="cpu")
    guarded = {n for n, m in model.named_modules() if "_headroom_base" in type(m).__dict__}
    assert guarded - {""}, "offload guarded no block here: the test would check nothing"
    hr.convert(model, inplace=True)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear | nn.Conv2d | nn.ReLU):
            assert "headroom.nn" in hnn.convert_report(model).converted[0][2]
            assert any(c.__module__.startswith("headroom.nn") for c in type(m).__mro__), name
        if name in guarded:
            assert "_headroom_base" in type(m).__dict__, name  # still guarded
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model)]
    x = torch.randn(4, 3, 16, 16)
    for m, opt in zip((plain, model), opts, strict=True):
        for _ in range(2):
            torch.manual_seed(1)
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    hr.unoffload(model)
    for (n, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert type(model[15]) is hnn.Linear  # unguarded: the converted class remains
