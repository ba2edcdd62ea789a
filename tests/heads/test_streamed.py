"""Host-resident class weights streamed through the transfer layer's RowStreamer.

On the CPU, the streamer's accelerator path (side-stream bookkeeping, pinned staging ring, events,
background gradient landing) is driven with a stand-in device module; results must be bitwise
those of the unstreamed path (streaming only copies rows). On an accelerator (gpu-marked tests)
the real streams are compared with the copy-on-use path, bitwise too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headroom as hr
from headroom.heads import _slices
from headroom.transfer import binding
from tests.conftest import DEVICES
from tests.transfer.test_row_streamer import streamer_on_cpu

pytestmark = pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")


@pytest.fixture
def streamed(monkeypatch):
    """Make host rows stream on the CPU; yields the list of streamers made (with traces)."""
    made = []

    def factory(src_device, device, *, prefetch):
        s, mod = streamer_on_cpu(prefetch)
        made.append((s, mod))
        return s

    monkeypatch.setattr(_slices, "host_streamer", factory)
    return made


def _lce(x, w, y, b, **kw):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    loss = hr.linear_cross_entropy(x, w, y, b, **kw)
    g = torch.randn_like(loss) if loss.dim() else torch.tensor(0.7)
    loss.backward(g.to(loss.dtype))
    return [loss.detach(), x.grad, w.grad] + ([] if b is None else [b.grad])


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_ce_streamed_path_is_bitwise_the_plain_one(streamed, monkeypatch, prefetch, dtype,
                                                          reduction):
    torch.manual_seed(0)
    x, w, b = torch.randn(12, 16), torch.randn(777, 16), torch.randn(777)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    y = torch.randint(0, 777, (12,))
    y[3] = -100
    kw = dict(slice_size=100, label_smoothing=0.1, reduction=reduction, prefetch=prefetch)
    torch.manual_seed(1)
    got = _lce(x, w, y, b, **kw)
    assert len(streamed) == 3  # forward source, backward source and gradient sink
    trace = streamed[1][1].trace
    assert sum(e[0] == "h2d" for e in trace) == 2 * 8  # weight and bias, 8 slices
    assert sum(e[0] == "land" for e in streamed[2][1].trace) == 2 * 8
    monkeypatch.setattr(_slices, "host_streamer", lambda *a, **k: None)
    torch.manual_seed(1)
    ref = _lce(x, w, y, b, **kw)
    for a, r in zip(got, ref, strict=True):
        assert a.dtype == r.dtype and torch.equal(a, r)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_classifier_host_store_streamed_is_bitwise_the_plain_one(streamed, monkeypatch, prefetch):
    def run():
        torch.manual_seed(0)
        head = hr.HugeClassifier(500, 8, bias=True, device="cpu", slice_size=64,
                                 prefetch=prefetch)
        x = torch.randn(10, 8, requires_grad=True)
        y = torch.randint(0, 500, (10,))
        out = []
        for _ in range(2):  # the second backward accumulates in the store (push accumulate)
            loss = head(x, y, label_smoothing=0.05)
            loss.backward()
            out.append(loss.detach())
        out += [x.grad, head.weight.grad.clone(), head.bias.grad.clone()]
        out += list(head.topk(x.detach(), 4))
        head.zero_grad(set_to_none=True)
        head(x, y, reduction="sum").backward()  # overwrite again after zero_grad
        out.append(head.weight.grad.clone())
        assert binding(head.weight).has_grad
        return out

    got = run()
    assert streamed and all(s.accelerated for s, _ in streamed)
    pushes = [e for _, m in streamed for e in m.trace if e[0] == "push"]
    assert pushes and any(e[0] == "h2d" for _, m in streamed for e in m.trace)
    monkeypatch.setattr(_slices, "host_streamer", lambda *a, **k: None)
    ref = run()
    for a, r in zip(got, ref, strict=True):
        assert torch.equal(a, r)


def _ll(x, w, targets, b, **kw):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    loss = hr.linear_loss(x, w, targets, bias=b, **kw)
    g = torch.randn_like(loss) if loss.dim() else torch.tensor(0.7)
    loss.backward(g.to(loss.dtype))
    return [loss.detach(), x.grad, w.grad] + ([] if b is None else [b.grad])


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("loss", ["bce", "softmax"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_loss_streamed_path_is_bitwise_the_plain_one(streamed, monkeypatch, prefetch,
                                                            loss, reduction):
    from tests.heads.test_linear_loss import random_targets

    torch.manual_seed(0)
    x, w, b = torch.randn(12, 16), torch.randn(777, 16), torch.randn(777)
    targets = random_targets(12, 777, values=True)
    kw = dict(slice_size=100, loss=loss, reduction=reduction, prefetch=prefetch)
    torch.manual_seed(1)
    got = _ll(x, w, targets, b, **kw)
    one_pass = loss == "bce" and reduction == "mean"
    # one pass: a source and a sink in forward; otherwise a source in each pass and a sink
    assert len(streamed) == (2 if one_pass else 3)
    lands = sum(e[0] == "land" for _, m in streamed for e in m.trace)
    assert lands == 2 * 8  # the weight's and the bias's gradient slices, once each
    monkeypatch.setattr(_slices, "host_streamer", lambda *a, **k: None)
    torch.manual_seed(1)
    ref = _ll(x, w, targets, b, **kw)
    for a, r in zip(got, ref, strict=True):
        assert a.dtype == r.dtype and torch.equal(a, r)


def test_classifier_multilabel_host_store_streamed_is_bitwise_the_plain_one(streamed,
                                                                           monkeypatch):
    from tests.heads.test_linear_loss import random_targets

    def run():
        torch.manual_seed(0)
        head = hr.HugeClassifier(500, 8, bias=True, device="cpu", slice_size=64)
        x = torch.randn(10, 8, requires_grad=True)
        targets = random_targets(10, 500)
        out = []
        for loss in ("bce", "softmax"):  # the second backward accumulates
            value = head(x, targets, loss=loss)
            value.backward()
            out.append(value.detach())
        return out + [x.grad, head.weight.grad.clone(), head.bias.grad.clone()]

    got = run()
    assert streamed and all(s.accelerated for s, _ in streamed)
    monkeypatch.setattr(_slices, "host_streamer", lambda *a, **k: None)
    for a, r in zip(got, run(), strict=True):
        assert torch.equal(a, r)


def test_prefetch_option_is_checked():
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        hr.linear_cross_entropy(torch.randn(2, 3), torch.randn(5, 3), torch.zeros(2).long(),
                                prefetch=-1)
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        hr.HugeClassifier(5, 3, device="cpu", prefetch=1.5)


def test_sampled_negatives_follow_the_generator():
    def sampled(seed):
        head = hr.HugeClassifier(1000, 4, device="cpu", sample_rate=0.05,
                                 generator=torch.Generator().manual_seed(seed))
        y = torch.tensor([3, 7, 7, 500])
        classes = []
        for _ in range(2):
            head(torch.randn(4, 4), y)
            classes.append(head.last_sampled_classes.clone())
        return classes

    a = sampled(1)
    torch.manual_seed(123)  # the global generator does not matter
    b = sampled(1)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0], a[1])  # the generator advances between steps
    assert not torch.equal(a[0], sampled(2)[0])
    assert all(len(c) == 50 and {3, 7, 500} <= set(c.tolist()) for c in a)
    head = hr.HugeClassifier(1000, 4, device="cpu", sample_rate=0.05,
                             generator=torch.Generator().manual_seed(1))
    x, y = torch.randn(4, 4), torch.tensor([3, 7, 7, 500])
    state = torch.get_rng_state()
    head(x, y)
    assert torch.equal(torch.get_rng_state(), state)  # the global random state is untouched
    with pytest.raises(ValueError, match="CPU torch.Generator"):
        hr.HugeClassifier(10, 4, device="cpu", sample_rate=0.5, generator=torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# accelerator: the real streams against the copy-on-use path (bitwise) and the dense reference


@pytest.mark.gpu
@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_accelerator_streamed_host_weight_is_exact(monkeypatch, pin, prefetch):
    dev = DEVICES[-1]
    x = torch.randn(64, 32, device=dev)
    w, b = torch.randn(5000, 32), torch.randn(5000)
    if pin:
        w, b = w.pin_memory(), b.pin_memory()
    y = torch.randint(0, 5000, (64,), device=dev)
    kw = dict(slice_size=700, label_smoothing=0.1, prefetch=prefetch)
    got = _lce(x, w, y, b, **kw)
    assert got[2].device.type == "cpu" and got[3].device.type == "cpu"
    monkeypatch.setattr(_slices, "host_streamer", lambda *a, **k: None)
    ref = _lce(x, w, y, b, **kw)
    for a, r in zip(got, ref, strict=True):
        assert torch.equal(a.cpu(), r.cpu())
    xd = x.detach().clone().requires_grad_()
    wd, bd = w.to(dev).requires_grad_(), b.to(dev).requires_grad_()
    dense = F.cross_entropy(xd @ wd.T + bd, y, label_smoothing=0.1)
    dense.backward(torch.tensor(0.7, device=dev))
    torch.testing.assert_close(got[0], dense.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], wd.grad.cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_accelerator_classifier_host_store_streamed_is_exact(monkeypatch, prefetch):
    dev = DEVICES[-1]

    def run():
        torch.manual_seed(0)
        head = hr.HugeClassifier(3000, 16, bias=True, device=dev, slice_size=512,
                                 prefetch=prefetch)
        x = torch.randn(32, 16, device=dev, requires_grad=True)
        y = torch.randint(0, 3000, (32,), device=dev)
        out = []
        for _ in range(2):
            loss = head(x, y)
            loss.backward()
            out.append(loss.detach().cpu())
        out += [x.grad.cpu(), head.weight.grad.clone(), head.bias.grad.clone()]
        out += [t.cpu() for t in head.topk(x.detach(), 5)]
        return out

    got = run()
    monkeypatch.setattr(_slices, "host_streamer", lambda *a, **k: None)
    ref = run()
    for a, r in zip(got, ref, strict=True):
        assert torch.equal(a, r)


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["bce", "squared_hinge", "softmax"])
def test_accelerator_linear_loss_host_weight_is_exact(monkeypatch, loss):
    from tests.heads.test_linear_loss import dense_loss, dense_target, random_targets

    dev = DEVICES[-1]
    x = torch.randn(64, 32, device=dev)
    w, b = torch.randn(5000, 32).pin_memory(), torch.randn(5000).pin_memory()
    targets = random_targets(64, 5000, device=dev)
    kw = dict(slice_size=700, loss=loss)
    got = _ll(x, w, targets, b, **kw)
    assert got[2].device.type == "cpu" and got[3].device.type == "cpu"
    monkeypatch.setattr(_slices, "host_streamer", lambda *a, **k: None)
    ref = _ll(x, w, targets, b, **kw)
    for a, r in zip(got, ref, strict=True):
        assert torch.equal(a.cpu(), r.cpu())
    xd = x.detach().clone().requires_grad_()
    wd, bd = w.to(dev).requires_grad_(), b.to(dev).requires_grad_()
    t = dense_target(targets, 64, 5000, torch.float32).to(dev)
    dense = dense_loss(xd @ wd.T + bd, t, loss)
    dense.backward(torch.tensor(0.7, device=dev))
    torch.testing.assert_close(got[0], dense.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], wd.grad.cpu(), rtol=1e-5, atol=1e-6)
