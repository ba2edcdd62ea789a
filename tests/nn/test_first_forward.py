"""From the very first forward, a converted model keeps no byte more than PyTorch, in any case
of any model here, and as little as it ever will; each defect of issue 12 has its own test.

Bytes are measured independently of headroom's hooks: storages created during the forward (a
dispatch mode) and NumPy buffers allocated during it (tracemalloc), still alive after it; the
peak is the most bytes of created storages alive at once during the forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import headroom as hr
from tests.nn._models import CASES, NORMS, ZOO, trainable
from tests.nn._util import allocated_bytes, assert_steps_equal, first_steps
from tests.nn._zoo import SqueezeExcite


def _pair(name: str) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    build, shape = ZOO[name]
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = build()
    ours = hr.convert(copy.deepcopy(plain))
    return plain, ours, torch.randn(shape)


FUSED = ["resnet_like", "mobilenet_v2_like", "unet", "densenet_like", "dcgan_discriminator"]


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize(
    ("name", "fused"), [(n, False) for n in ZOO] + [(n, True) for n in FUSED]
)
def test_first_forward_keeps_least_and_never_more_than_torch(name, fused, case, monkeypatch):
    """``fused``: every activation takes the autograd.Function that large tensors take (its
    fused backward, and from the second step on a mask packed ahead where the last step
    packed one)."""
    if fused:
        from headroom.nn import _activation

        monkeypatch.setattr(_activation, "_FUSE_FROM", 0, raising=False)  # (older code: none)
    plain, ours, x = _pair(name)
    if case == "norm" and not any(isinstance(m, NORMS) for m in plain.modules()):
        pytest.skip("no normalization layer")
    for m in (plain, ours):
        trainable(m, case)
    a, b = first_steps(plain, x, case), first_steps(ours, x, case)
    assert_steps_equal(a, b)
    where = f"{name}/{case}: torch {[s[:2] for s in a]}, headroom {[s[:2] for s in b]}"
    for (kept_a, peak_a, *_), (kept_b, peak_b, *_) in zip(a, b, strict=True):
        assert kept_b <= kept_a, where
        assert peak_b <= peak_a, where
    assert b[0][0] == b[1][0], where  # the first forward keeps what later ones keep


@pytest.mark.parametrize(
    ("name", "case", "fraction"),
    [
        ("resnet_like", "input", 0.6),
        ("unet", "input", 0.5),
        ("densenet_like", "norm", 0.55),
        ("hf_resnet", "input", 0.6),
    ],
)
def test_first_forward_of_custom_forwards_saves(name, case, fraction):
    """Models whose ReLUs sit in custom forwards (issue 12, item 1: the first forward used to
    keep what PyTorch keeps, ReLU outputs whole, until a ReLU had seen its consumers)."""
    plain, ours, x = _pair(name)
    for m in (plain, ours):
        trainable(m, case)
    a, b = first_steps(plain, x, case, steps=1), first_steps(ours, x, case, steps=1)
    assert_steps_equal(a, b)
    assert b[0][0] < fraction * a[0][0], (b[0][0], a[0][0])


def test_inplace_leaky_relu_before_trainable_conv_adds_nothing():
    """Issue 12, item 2a: PyTorch's leaky_relu_ saves its result, which the next trainable
    convolution saves anyway (one storage); a 1-bit mask on top was more than PyTorch."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
    )
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(2, 3, 16, 16)
    a, b = first_steps(plain, x, "all"), first_steps(ours, x, "all")
    assert_steps_equal(a, b)
    assert [s[0] for s in b] == [s[0] for s in a]


def test_relu_output_kept_by_an_unconverted_op_adds_nothing():
    """Issue 12, item 2b: a ReLU output that squeeze-excitation's product keeps whole anyway
    (``y * gate(fc(pool(y)))``): its mask was added on top, though the pool keeps nothing."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), SqueezeExcite(16))
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(2, 3, 16, 16)
    a, b = first_steps(plain, x, "all"), first_steps(ours, x, "all")
    assert_steps_equal(a, b)
    assert [s[0] for s in b] == [s[0] for s in a]


@pytest.mark.parametrize("shape", [(4, 256), (4, 64), (8, 4096)])
def test_dropout_keeps_no_more_than_torchs_mask(shape):
    """Issue 12, item 2c: each Dropout node kept the CPU generator's whole state (5056 bytes, a
    tensor made outside the dispatcher, so this counts every CPU allocation), more than
    PyTorch's own noise for small inputs (a classifier head on [4, 256])."""
    x = torch.randn(shape, requires_grad=True)
    got = {}
    for name, layer in (("torch", nn.Dropout(0.5)), ("headroom", hr.convert(nn.Dropout(0.5)))):
        torch.manual_seed(3)
        nbytes, out = allocated_bytes(lambda layer=layer: layer(x))
        (gx,) = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)).sum(), x)
        got[name] = (nbytes, out.detach(), gx)
    assert torch.equal(got["torch"][1], got["headroom"][1])
    assert torch.equal(got["torch"][2], got["headroom"][2])
    noise = x.numel() * 4
    assert got["torch"][0] == noise
    assert got["headroom"][0] == min(noise, 2504), got  # PyTorch's noise, or the position


def test_layers_called_without_their_converted_root():
    """Layers of a converted model called one by one from an outside loop (no root hook runs):
    holders settle when the loop drops its references, and keep as little."""
    plain, ours, x = _pair("resnet_like")
    for m in (plain, ours):
        trainable(m, "input")

    def by_layer(model):
        def run(xi):
            for layer in model:
                xi = layer(xi)
            return xi

        return run

    class Loop(nn.Module):  # an unconverted parent: hr.convert's root hooks are not on it
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, xi):
            return by_layer(self.model)(xi)

    a = first_steps(Loop(plain), x, "input")
    b = first_steps(Loop(ours), x, "input")
    c = first_steps(ours, x, "input")  # through the converted root
    assert_steps_equal(a, b)
    assert b[0][0] == b[1][0] == c[0][0] < a[0][0]


def test_a_mask_packed_ahead_adds_nothing_to_a_small_models_peak():
    """From the second forward a holder may pack its mask right after the op (where the last
    forward packed one), so that tensor and mask are alive together for a moment: only for
    tensors large enough to gain time from it. A dropout head on [4, 512] peaked 96 bytes above
    PyTorch's on its second forward when every mask was packed ahead."""
    from tests.nn._zoo import BUILDERS

    build, shape = BUILDERS["classifier_head"]
    torch.manual_seed(0)
    plain = build(2)
    ours = hr.convert(copy.deepcopy(plain))
    x = torch.randn(shape(2, 4))
    for case in ("all", "input"):
        for m in (plain, ours):
            trainable(m, case)
        a, b = first_steps(plain, x, case, steps=3), first_steps(ours, x, case, steps=3)
        assert_steps_equal(a, b)
        assert [s[1] for s in b] == [b[0][1]] * 3, case  # every forward peaks as the first
        assert all(pb <= pa for (_, pa, *_), (_, pb, *_) in zip(a, b, strict=True)), case
