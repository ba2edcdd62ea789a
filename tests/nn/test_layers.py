"""Each headroom.nn layer against its torch.nn twin: bitwise equal results, fewer saved bytes."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.nn._util import assert_same, set_trainable, step, twin

# name -> (factory, input shape, modes where ours must save strictly less than PyTorch)
# modes: "all" (params + input), "input" (input only), "params" (params only), "bias"
# (bias only), "none"; each run in train and eval mode ("+eval" marks eval-only strictness,
# "@fn" strictness on the autograd.Function path only: on the fast path an activation called on
# its own keeps its input whole, since the caller passed it in and may keep it; in a model it
# keeps one bit, see test_models.py).
CONV = {"input", "bias"}
LAYERS = {
    "Conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=2), (2, 4, 9), CONV),
    "Conv1d-reflect": (
        lambda: nn.Conv1d(4, 6, 3, padding=2, padding_mode="reflect"),
        (2, 4, 9),
        CONV | {"all"},
    ),
    "Conv2d": (lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 9, 9), CONV),
    "Conv2d-options": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, dilation=2, groups=2, padding=2, bias=False),
        (2, 4, 11, 11),
        {"input"},
    ),
    "Conv2d-replicate": (
        lambda: nn.Conv2d(4, 6, 3, padding=(1, 2), padding_mode="replicate"),
        (2, 4, 9, 9),
        CONV | {"all"},
    ),
    "Conv2d-circular": (
        lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="circular"),
        (2, 4, 9, 9),
        CONV,
    ),
    "Conv2d-same-even": (lambda: nn.Conv2d(4, 6, 4, padding="same"), (2, 4, 9, 9), CONV),
    "Conv2d-same-unbatched": (lambda: nn.Conv2d(4, 6, 4, padding="same"), (4, 9, 9), CONV),
    "Conv2d-same-dilated": (
        lambda: nn.Conv2d(4, 6, 3, padding="same", dilation=2),
        (2, 4, 9, 9),
        CONV,
    ),
    "Conv2d-valid": (lambda: nn.Conv2d(4, 6, 3, padding="valid"), (2, 4, 9, 9), CONV),
    "Conv2d-unbatched": (lambda: nn.Conv2d(4, 6, 3), (4, 9, 9), CONV),
    "Conv3d": (lambda: nn.Conv3d(4, 6, 3, padding=1), (2, 4, 5, 5, 5), CONV),
    "ConvTranspose1d": (
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, output_padding=1),
        (2, 4, 9),
        CONV,
    ),
    "ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=2),
        (2, 4, 7, 7),
        CONV,
    ),
    "ConvTranspose2d-unbatched": (lambda: nn.ConvTranspose2d(4, 6, 3), (4, 5, 5), CONV),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(4, 6, 3, stride=2), (2, 4, 3, 3, 3), CONV),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(4), (3, 4, 5), {"bias", "input+eval"}),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(4), (3, 4, 5, 5), {"bias", "input+eval"}),
    "BatchNorm3d-cumulative": (
        lambda: nn.BatchNorm3d(4, momentum=None),
        (3, 4, 3, 3, 3),
        {"bias", "input+eval"},
    ),
    "BatchNorm2d-no-affine": (
        lambda: nn.BatchNorm2d(4, affine=False),
        (3, 4, 5, 5),
        {"input+eval"},
    ),
    "BatchNorm2d-no-running-stats": (
        lambda: nn.BatchNorm2d(4, track_running_stats=False),
        (3, 4, 5, 5),
        {"bias"},
    ),
    "LayerNorm": (lambda: nn.LayerNorm(16), (3, 5, 16), {"bias"}),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5, 5), {"bias"}),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.1), (2, 4, 9, 9), {"all@fn", "input@fn"}),
    "ReLU6": (lambda: nn.ReLU6(), (2, 4, 9, 9), {"all@fn", "input@fn"}),
    "Hardtanh": (lambda: nn.Hardtanh(-0.5, 0.5), (2, 4, 9, 9), {"all@fn", "input@fn"}),
    "Dropout": (lambda: nn.Dropout(0.3), (2, 4, 9, 9), {"all+train", "input+train"}),
    "Dropout-p0.9": (lambda: nn.Dropout(0.9), (2, 4, 9, 9), {"all+train", "input+train"}),
    "MaxPool1d": (lambda: nn.MaxPool1d(3, 2, 1), (2, 4, 9), {"all", "input"}),
    "MaxPool2d": (lambda: nn.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 4, 9, 9), {"all", "input"}),
    "MaxPool3d": (lambda: nn.MaxPool3d(2), (2, 4, 4, 4, 4), {"all", "input"}),
    "AdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d((3, None)), (2, 4, 9, 9), {"all", "input"}),
    "AdaptiveMaxPool2d-int": (lambda: nn.AdaptiveMaxPool2d(2), (2, 4, 9, 9), {"all", "input"}),
    "AdaptiveMaxPool1d": (lambda: nn.AdaptiveMaxPool1d(3), (2, 4, 9), {"all", "input"}),
    "AdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(2), (2, 4, 5, 5, 5), {"all", "input"}),
    "AdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(4), (2, 4, 9), {"all", "input"}),
    "AdaptiveAvgPool1d-1": (lambda: nn.AdaptiveAvgPool1d(1), (2, 4, 9), set()),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, 2, 1), (2, 4, 9), {"all", "input"}),
    "AvgPool2d": (
        lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False, divisor_override=2),
        (2, 4, 9, 9),
        {"all", "input"},
    ),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), (2, 4, 4, 4, 4), {"all", "input"}),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d(3), (2, 4, 9, 9), {"all", "input"}),
    "AdaptiveAvgPool2d-1": (lambda: nn.AdaptiveAvgPool2d(1), (2, 4, 9, 9), set()),
    "AdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d(2), (2, 4, 5, 5, 5), {"all", "input"}),
    "ReflectionPad2d": (lambda: nn.ReflectionPad2d(2), (2, 4, 9, 9), {"all", "input"}),
    "ReplicationPad3d": (lambda: nn.ReplicationPad3d(1), (2, 4, 4, 4, 4), {"all", "input"}),
    "Linear": (lambda: nn.Linear(9, 5), (2, 4, 9), set()),
    "ReLU-alone": (lambda: nn.ReLU(), (2, 4, 9, 9), set()),
}

MODES = ("all", "input", "params", "bias", "none")


def _strict(spec: set[str], mode: str, train: bool, hooks: bool) -> bool:
    suffix = "+train" if train else "+eval"
    return mode in spec or (mode + suffix) in spec or (hooks and f"{mode}@fn" in spec)


@pytest.mark.parametrize("hooks", [True, False], ids=["function-path", "fast-path"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_matches_torch_and_saves_less(name, hooks):
    factory, shape, strict = LAYERS[name]
    x = torch.randn(shape)
    for mode in MODES:
        for train in (True, False):
            torch.manual_seed(1)
            layer = factory().train(train)
            if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.track_running_stats:
                layer.running_mean.uniform_()
                layer.running_var.uniform_(0.5, 2)
                with torch.no_grad():
                    for p in layer.parameters():
                        p.uniform_()
            plain, ours = twin(layer)
            assert type(ours) is not type(plain) or name == "none"
            for m in (plain, ours):
                set_trainable(
                    m,
                    lambda n, _p, mode=mode: (
                        mode in ("all", "params") or (mode == "bias" and n == "bias")
                    ),
                )
            input_grad = mode in ("all", "input")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # padding="same" with even kernels
                a = step(plain, x, input_grad=input_grad, hooks=hooks)
                b = step(ours, x, input_grad=input_grad, hooks=hooks)
            assert_same(a, b)
            where = f"{name} mode={mode} train={train} hooks={hooks}: ours {b[4]} B, torch {a[4]} B"
            assert b[4] <= a[4], where
            if _strict(strict, mode, train, hooks):
                assert b[4] < a[4], where


@pytest.mark.parametrize("grad", ["sum", "permuted"])
def test_group_norm_bias_only_matches_for_non_contiguous_output_grads(grad):
    """Only the bias trains: the gradient of a ``.sum()`` loss (expanded) or a permuted one
    reaches the kernel in the input's layout, as through PyTorch's node."""
    plain, ours = twin(nn.GroupNorm(2, 4))
    for m in (plain, ours):
        m.weight.requires_grad_(False)
    x = torch.randn(3, 4, 5, 5)
    gy = torch.randn(5, 5, 3, 4).permute(2, 3, 0, 1)
    loss = (lambda y: y.sum()) if grad == "sum" else (lambda y: (y * gy).sum())
    (want,) = torch.autograd.grad(loss(plain(x)), plain.bias)
    (got,) = torch.autograd.grad(loss(ours(x)), ours.bias)
    assert torch.equal(got, want)


def test_conv_frozen_weight_saves_nothing_and_bias_only_saves_nothing():
    conv = nn.Conv2d(3, 5, 3)
    ours = twin(conv)[1]
    ours.weight.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    assert step(ours, x, input_grad=True)[4] == 0
    assert step(ours, x, input_grad=False)[4] == 0  # bias only
    ours.bias.requires_grad_(False)
    ours.weight.requires_grad_(True)
    # weight only: the input (2*3*8*8 fp32) and nothing else
    assert step(ours, x, input_grad=False)[4] == 2 * 3 * 8 * 8 * 4


def test_maxpool_keeps_indices_only():
    ours = twin(nn.MaxPool2d(2))[1]
    x = torch.randn(2, 3, 8, 8)
    assert step(ours, x, input_grad=True)[4] == 2 * 3 * 4 * 4 * 8  # int64 indices


def test_maxpool_return_indices_matches():
    plain, ours = twin(nn.MaxPool2d(2, return_indices=True))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    (o1, i1), (o2, i2) = plain(x), ours(x)
    assert torch.equal(o1, o2) and torch.equal(i1, i2)
    assert not i2.requires_grad


def test_leaky_relu_keeps_one_bit_per_element():
    ours = twin(nn.LeakyReLU(0.2))[1]
    x = torch.randn(3, 5, 7, 11)  # 1155 elements -> 145 bytes
    assert step(ours, x, input_grad=True)[4] == (x.numel() + 7) // 8


@pytest.mark.parametrize("cls", [nn.ReLU, nn.LeakyReLU, nn.ReLU6])
def test_inplace_activations_match(cls):
    plain, ours = twin(cls(inplace=True))
    conv = nn.Conv2d(3, 3, 1)
    x = torch.randn(2, 3, 5, 5)
    x[0, 0, 0, 0] = float("nan")
    outs = []
    for act in (plain, ours):
        conv.zero_grad()
        y = act(conv(x))
        (y * torch.arange(y.numel()).view_as(y)).nansum().backward()
        outs.append((y.detach(), conv.weight.grad.clone()))
    assert torch.equal(outs[0][0].nan_to_num(), outs[1][0].nan_to_num())
    assert torch.equal(outs[0][1].nan_to_num(), outs[1][1].nan_to_num())


def test_no_grad_mode_runs_torch_path():
    ours = twin(nn.Conv2d(3, 5, 3))[1]
    with torch.no_grad():
        y = ours(torch.randn(1, 3, 6, 6))
    assert y.grad_fn is None


def test_double_backward_raises():
    ours = twin(nn.Conv2d(3, 5, 3))[1]
    ours.weight.requires_grad_(False)
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    # On both paths the create_graph backward itself refuses: on the saved-tensor-hooks
    # path a kept shape has no values to differentiate; on the autograd.Function path (under
    # any hooks of the caller's) the Function's backward refuses.
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(ours(x).square().sum(), x, create_graph=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = ours(x)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_conv_transpose_output_size_argument():
    plain, ours = twin(nn.ConvTranspose2d(4, 3, 3, stride=2))
    for m in (plain, ours):
        m.weight.requires_grad_(False)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    outs = [m(x, output_size=[12, 12]) for m in (plain, ours)]
    assert outs[0].shape == outs[1].shape == (2, 3, 12, 12)
    grads = [torch.autograd.grad(o.sum(), x)[0] for o in outs]
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("act", [nn.ReLU, nn.LeakyReLU, nn.ReLU6])
def test_channels_last_block_matches(act):
    # Layouts must match too: a contiguous gradient would send batch norm's backward
    # down another reduction order than the channels-last one PyTorch produces.
    torch.manual_seed(0)
    block = nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), act(), nn.MaxPool2d(2)
    ).to(memory_format=torch.channels_last)
    block[0].requires_grad_(False)
    plain, ours = twin(block)
    x = torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)
    a, b = step(plain, x, input_grad=True), step(ours, x, input_grad=True)
    assert_same(a, b)
    assert b[4] < a[4]


@pytest.mark.parametrize("cls", [nn.Conv2d, nn.ConvTranspose2d])
def test_autocast_matches(cls):
    plain, ours = twin(cls(4, 4, 3))
    for m in (plain, ours):
        m.weight.requires_grad_(False)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    outs, grads = [], []
    for m in (plain, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        outs.append(y)
        grads.append(torch.autograd.grad(y.float().sum(), x)[0])
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


def test_kept_weight_modified_in_place_raises_like_torch():
    # On the fast path the weight is kept through headroom's saved-tensor hook, which
    # must keep PyTorch's version check: an in-place change before backward is an error.
    for m in twin(nn.Conv2d(3, 5, 3)):
        m.weight.requires_grad_(False)
        x = torch.randn(1, 3, 6, 6, requires_grad=True)
        y = m(x)
        with torch.no_grad():
            m.weight.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def _packed(out: torch.Tensor):
    """``out`` packed as the activations pack a mask: the bits, and a function unpacking them
    (into a reused buffer where grad mode is off, as inside a backward)."""
    from headroom.nn._activation import _pack_layout, _unpack_layout

    bits, memory_order, _ = _pack_layout(out)
    shape, stride, dtype = out.shape, out.stride(), out.dtype
    return bits, lambda: _unpack_layout(bits, shape, stride, memory_order, dtype,
                                        reuse=not torch.is_grad_enabled())


def test_relu_mask_buffer_is_reused_only_when_free():
    """The fast path unpacks a ReLU mask into a reused buffer, never one that is still held."""
    out = torch.relu(torch.randn(4, 64))
    _, unpack = _packed(out)
    with torch.no_grad():  # as inside ReluBackward0
        a = unpack()
        b = _packed((out == 0).float())[1]()  # `a` is still held: a fresh buffer
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, (out != 0).float()) and torch.equal(b, (out == 0).float())
    ptr = b.data_ptr()
    del a, b
    with torch.no_grad():
        c = unpack()  # nothing holds the buffer any more: reused
    assert c.data_ptr() == ptr and torch.equal(c, (out != 0).float())
    d = unpack()  # grad mode on (a double backward): always fresh
    assert d.data_ptr() != c.data_ptr() and torch.equal(d, c)


def _relu_node(y: torch.Tensor):
    todo = [y.grad_fn]
    while todo:
        node = todo.pop()
        if type(node).__name__ == "ReluBackward0":
            return node
        todo += [n for n, _ in node.next_functions if n is not None]
    raise AssertionError("no ReLU node in the graph")


def test_relu_double_backward_and_saved_result_match_torch():
    """The fast-path ReLU is PyTorch's own node: double backward and ``_saved_result`` work."""
    plain, ours = twin(nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)))
    x = torch.randn(3, 4, 6)
    grads, saved = [], []
    for m in (plain, ours):
        m[2].requires_grad_(False)  # the ReLU's consumer keeps nothing: a 1-bit mask
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        saved.append((_relu_node(y)._saved_result != 0).float())
        (g,) = torch.autograd.grad(y.square().sum(), xi, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), xi)
        grads.append((g.detach(), gg))
    assert torch.equal(saved[0], saved[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("hooks", [False, True])
def test_double_backward_through_a_function_layer_raises(hooks):
    """Second-order terms through a headroom autograd.Function must never go missing silently.

    # With ``once_differentiable`` this returned zeros: ``autograd.grad(..., inputs=x)``
    # reached ``x`` through the ReLU's saved output and never ran the pool's error node.
    """
    import contextlib

    plain, ours = twin(nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.MaxPool1d(2)))
    x = torch.randn(3, 4, 6)
    ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    for m in (plain, ours):
        xi = x.clone().requires_grad_(True)
        m(xi)  # warm-up, for the hooks case: the ReLU learns that the pool keeps no output
        with ctx if hooks else contextlib.nullcontext():
            y = m(xi)
        if m is plain:
            (g,) = torch.autograd.grad(y.square().sum(), xi, create_graph=True)
            assert torch.autograd.grad(g.square().sum(), xi)[0].abs().sum() > 0
        else:
            # The fast path's pool keeps a shape, which refuses in its unpack hook
            with pytest.raises(RuntimeError, match="differentiated twice|double backward"):
                torch.autograd.grad(y.square().sum(), xi, create_graph=True)


@pytest.mark.parametrize("fmt", ["channels_last", "channels_last_3d", "sliced"])
def test_relu_mask_of_other_layouts(fmt):
    if fmt == "channels_last":
        out = torch.relu(torch.randn(2, 5, 3, 7)).to(memory_format=torch.channels_last)
    elif fmt == "channels_last_3d":
        out = torch.relu(torch.randn(2, 3, 4, 3, 5)).to(memory_format=torch.channels_last_3d)
    else:
        out = torch.relu(torch.randn(6, 9))[:, 1:8]
    bits, unpack = _packed(out)
    assert bits.numel() == (out.numel() + 7) // 8
    with torch.no_grad():
        got = unpack()
    assert got.shape == out.shape and got.stride() == out.stride()
    assert torch.equal(got, (out != 0).float())


def test_relu_before_a_spectral_normed_conv():
    """A consumer whose weight is not in ``_parameters`` (spectral norm) still answers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.utils.spectral_norm(nn.Conv2d(4, 4, 3)))
    plain, ours = twin(model)
    x = torch.randn(2, 3, 8, 8)
    for m in (plain, ours):
        m[2].weight_orig.requires_grad_(False)
    assert_same(step(plain, x, input_grad=True), step(ours, x, input_grad=True))


def test_torch_compile_traces_pytorchs_own_forward(monkeypatch):
    """Under torch.compile the layers trace PyTorch's forward (what the compiled graph keeps is
    AOTAutograd's choice), and headroom's eager machinery (hooks, the ReLU registry, weak
    storage references) must not end up in the trace."""
    import sys

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding_mode="reflect", padding=1),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(8 * 7 * 7, 4),
    )
    model[0].requires_grad_(False)
    plain, ours = twin(model)
    x = torch.randn(2, 3, 16, 16)
    results = []
    for m in (plain, ours):
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        y = compiled(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, [p.grad for p in m.parameters() if p.requires_grad]))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2], strict=True))
    assert not unraisable, unraisable


@pytest.mark.parametrize("flush", [False, True])
def test_relu_mask_treats_subnormals_like_torch(flush):
    """The mask's compare sees subnormals as PyTorch's kernels do, with and without
    ``torch.set_flush_denormal`` (denormals-are-zero on this thread)."""
    if not torch.set_flush_denormal(flush):
        pytest.skip("this CPU cannot flush denormals")
    try:
        plain, ours = twin(nn.Sequential(nn.ReLU(), nn.MaxPool1d(1)))
        values = [1e-40, -1e-40, 0.0, 2.0, 1e-39, float("nan"), -0.0, 3e-42, 5.0]
        grads = []
        for m in (plain, ours):
            x = torch.tensor([[values * 3]], requires_grad=True)
            m(x)  # a first step (which the fast path does not need)
            y = m(x)
            y.backward(torch.ones_like(y))
            grads.append(x.grad)
        assert torch.equal(grads[0], grads[1])
    finally:
        torch.set_flush_denormal(False)


def test_torch_func_transforms_run_pytorchs_own_forward():
    """Inside torch.func.grad (functorch wrappers have no storage of their own) the layers run
    PyTorch's forward: same gradients as the unconverted model."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 2),
    )
    plain, ours = twin(model.eval())  # eval: train-mode batch norm mutates a captured buffer
    x = torch.randn(2, 3, 8, 8)
    xs = torch.randn(3, 1, 3, 8, 8)
    got = []
    for m in (plain, ours):
        params = {k: v.detach() for k, v in m.named_parameters()}
        buffers = {k: v.clone() for k, v in m.named_buffers()}
        loss = lambda p, m=m, buffers=buffers: functional_call(m, (p, buffers), (x,)).square().sum()
        got.append(grad(loss)(params))
        got.append({"vmap": vmap(lambda xi, m=m: m(xi))(xs)})
    for a, b in ((got[0], got[2]), (got[1], got[3])):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_jit_trace_and_fx_symbolic_trace():
    """torch.jit.trace records PyTorch's forward (the same ops every call); FX symbolic tracing
    into a headroom layer fails with a message naming the fix, and that fix works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    model[0].requires_grad_(False)
    plain, ours = twin(model)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    traced = torch.jit.trace(ours, x)
    assert torch.equal(traced(x), plain(x))
    with pytest.raises(RuntimeError, match="is_leaf_module"):
        torch.fx.symbolic_trace(ours)

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return type(m).__module__.startswith("headroom.nn") or super().is_leaf_module(m, name)

    graph = torch.fx.GraphModule(ours, Tracer().trace(ours))
    assert torch.equal(graph(x), plain(x))


@pytest.mark.parametrize("path", ["node", "function"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize(
    "act",
    [
        lambda: nn.ReLU(),
        lambda: nn.LeakyReLU(0.1),
        lambda: nn.LeakyReLU(0.2, inplace=True),
        lambda: nn.ReLU6(inplace=True),
        lambda: nn.Hardtanh(-0.5, 0.5),
        lambda: nn.Hardtanh(-3.0, -1.0, inplace=True),
    ],
    ids=["relu", "leaky", "leaky-inplace", "relu6-inplace", "hardtanh", "hardtanh-negative"],
)
def test_activation_masks_in_a_model(act, nan, dtype, path, monkeypatch):
    """Between a frozen convolution and a pool nothing else keeps what an activation's node
    saves: on the fast path it is packed to a 1-bit mask once the pool ran, and the unpacked
    stand-in (1/0, or the bound and a value inside for Hardtanh) gives PyTorch's gradient,
    channels-last included; so does the Function that large tensors (and in-place Hardtanh)
    take, whose backward reads the mask in one fused pass. A Hardtanh input with a NaN is kept
    whole: PyTorch's kernel treats a NaN differently in its vector and scalar loops."""
    from headroom.nn import _activation

    if path == "function":
        monkeypatch.setattr(_activation, "_FUSE_FROM", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), act(), nn.MaxPool2d(2)).to(dtype)
    model[0].requires_grad_(False)
    plain, ours = twin(model)
    x = torch.randn(2, 3, 9, 9, dtype=dtype) * 3
    if nan:
        x[0, 0, 4, 4] = float("nan")
    for fmt in (torch.contiguous_format, torch.channels_last):
        xf = x.contiguous(memory_format=fmt)
        a = step(plain, xf, input_grad=True, hooks=False)
        b = step(ours, xf, input_grad=True, hooks=False)
        for u, v in zip(a[:3], b[:3], strict=True):
            assert torch.equal(u.nan_to_num(), v.nan_to_num())
            assert torch.equal(u.isnan(), v.isnan())
        numel = 2 * 8 * 9 * 9
        keeps_whole = nan and isinstance(model[1], nn.Hardtanh)
        saved = numel * x.element_size() if keeps_whole else (numel + 7) // 8
        # the pool keeps int64 indices; the activation a 1-bit mask (or the tensor whole)
        assert b[4] == 2 * 8 * 4 * 4 * 8 + saved < a[4], (a[4], b[4])


@pytest.mark.parametrize("make", [lambda z: nn.LeakyReLU(z), lambda z: nn.Hardtanh(z, 1.0)],
                         ids=["LeakyReLU", "Hardtanh"])
def test_signed_zero_options_keep_their_sign(make):
    """``-0.0`` after ``0.0`` as a slope or bound, on a tensor big enough for the native path:
    the sign bits of the output are torch's (``-0.0 == 0.0`` as a cache key)."""
    x = torch.randn(1 << 18)
    x[::3] = 0.0
    x = -x.abs() if isinstance(make(0.0), nn.Hardtanh) else x
    for z in (0.0, -0.0):
        plain, ours = twin(make(z))
        out, want = ours(x.clone().requires_grad_()), plain(x.clone().requires_grad_())
        assert torch.equal(torch.signbit(out), torch.signbit(want)), z


@pytest.mark.parametrize("code", [
    "from headroom.nn import Hardtanh\nx = torch.randn(1 << 18)\n"
    "a = -x.abs().clone().requires_grad_()\nz = Hardtanh(0.0, 1.0)(a)\n",
    # torn down in another order: `sys` itself already gone when the callback runs
    "import headroom.nn as hn\nx = torch.randn(2, 5, 6, 7).transpose(1, 3).clone()"
    ".requires_grad_()\ny = hn.ReLU6(True)(x * 1.0)\n",
], ids=["hardtanh", "relu6_inplace_strided"])
def test_masks_kept_until_exit_leave_the_interpreter_quietly(code):
    """Activation outputs alive when the interpreter exits: their holders' release callbacks
    run while modules are torn down, and must not pack (which printed "Exception ignored")."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import torch\n" + code], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "Exception ignored" not in out.stderr, out.stderr
