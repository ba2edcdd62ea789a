"""hr.convert: same parameters, buffers, hooks and state_dict; idempotent; errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import headroom as hr
import headroom.nn as hnn
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
