"""HugeClassifier against a dense reference (F.cross_entropy on full logits).

Bitwise equality is impossible (the log-sum-exp is summed slice by slice), so values are compared
with `assert_close` at 1e-5 relative, as for `linear_cross_entropy`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import headroom as hr
from headroom.store import DiskStore
from headroom.transfer import StoreTensor, binding
from tests.conftest import accelerator_type

C, D, B = 1000, 16, 24

pytestmark = pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def _store(kind, tmp_path):
    return "cpu" if kind == "cpu" else DiskStore(tmp_path / "store")


def _grad(head, p):
    b = binding(p)
    return head.store.read(b.grad_handle).result()


def _dense(head):
    w = head.read_weight().clone().requires_grad_()
    b = head.read_bias()
    return w, (b.clone().requires_grad_() if b is not None else None)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward_exact(kind, bias, tmp_path):
    head = hr.HugeClassifier(C, D, bias=bias, device="cpu", store=_store(kind, tmp_path),
                             slice_size=300)
    w, b = _dense(head)
    x = torch.randn(B, D, requires_grad=True)
    y = torch.randint(0, C, (B,))
    y[5] = -100
    xr = x.detach().clone().requires_grad_()
    for _ in range(2):  # the second backward accumulates, as autograd does
        loss = head(x, y, label_smoothing=0.1)
        ref = F.cross_entropy(xr @ w.T + (b if b is not None else 0), y, label_smoothing=0.1)
        _close(loss, ref)
        loss.backward()
        ref.backward()
    _close(x.grad, xr.grad)
    _close(_grad(head, head.weight), w.grad)
    if bias:
        _close(_grad(head, head.bias), b.grad)
    assert binding(head.weight).has_grad and binding(head.weight).grad_rows is None
    # zero_grad(set_to_none=True) makes the next backward overwrite
    head.zero_grad(set_to_none=True)
    w.grad = None
    head(x, y, reduction="sum").backward()
    F.cross_entropy(xr @ w.T + (b if b is not None else 0), y, reduction="sum").backward()
    _close(_grad(head, head.weight), w.grad)


def test_host_store_param_is_the_store_tensor_and_trains_with_torch_optim():
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", slice_size=256)
    assert head.weight.data_ptr() == head.store.host_tensor(binding(head.weight).handle).data_ptr()
    ref = [torch.nn.Parameter(head.read_weight()), torch.nn.Parameter(head.read_bias())]
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2)
    for _ in range(4):
        x = torch.randn(B, D)
        y = torch.randint(0, C, (B,))
        head(x, y).backward()
        # gradients: close to the dense ones at the same point
        dense = torch.autograd.grad(F.cross_entropy(x @ ref[0].T + ref[1], y), ref)
        _close(head.weight.grad, dense[0])
        _close(head.bias.grad, dense[1])
        # the step: a plain torch optimizer on the store's tensors, bitwise like on copies
        ref[0].grad, ref[1].grad = head.weight.grad.clone(), head.bias.grad.clone()
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        assert torch.equal(head.read_weight(), ref[0].detach())
        assert torch.equal(head.read_bias(), ref[1].detach())


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_topk_exact(kind, tmp_path):
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=_store(kind, tmp_path),
                             slice_size=128)
    w, b = _dense(head)
    x = torch.randn(2, 7, D)
    for k in (1, 5, 200):  # 200 > slice size
        v, i = head.topk(x, k)
        rv, ri = torch.topk(x @ w.T + b, k)
        assert v.shape == (2, 7, k) and i.dtype == torch.int64
        assert torch.equal(i, ri)
        _close(v, rv)
    with pytest.raises(ValueError, match="k must be"):
        head.topk(x, C + 1)


def test_disk_store_round_trip(tmp_path):
    store = DiskStore(tmp_path / "s")
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=store, key="faces")
    # values live in files only: the parameters are tensors whose ops run on them
    assert isinstance(head.weight, StoreTensor) and isinstance(head.bias, StoreTensor)
    w = torch.randn(C, D)
    b = torch.randn(C)
    head.load_weight(w, b)
    store.close()
    again = hr.HugeClassifier(C, D, bias=True, device="cpu", store=DiskStore(tmp_path / "s"),
                              key="faces")
    assert torch.equal(again.read_weight(), w) and torch.equal(again.read_bias(), b)
    with pytest.raises(ValueError, match="already holds"):
        hr.HugeClassifier(C, D + 1, device="cpu", store=again.store, key="faces")


def test_sampled_mode_is_partial_fc_with_row_sparse_grads():
    head = hr.HugeClassifier(C, D, device="cpu", slice_size=64, sample_rate=0.1)
    w, _ = _dense(head)
    x = torch.randn(B, D, requires_grad=True)
    y = torch.randint(0, C, (B,))
    loss = head(x, y)
    rows = head.last_sampled_classes
    assert rows.numel() == 100 and bool(torch.isin(y, rows).all())
    assert torch.equal(rows, torch.sort(rows).values)
    # the approximation is exactly the softmax over the sampled classes
    local = torch.searchsorted(rows, y)
    xr = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(xr @ w[rows].T, local)
    _close(loss, ref)
    loss.backward()
    ref.backward()
    _close(x.grad, xr.grad)
    g = _grad(head, head.weight)
    assert torch.equal(binding(head.weight).grad_rows, rows)
    _close(g[rows], w.grad[rows])
    others = torch.ones(C, dtype=torch.bool)
    others[rows] = False
    assert not g[others].any()
    # a new overwrite clears the rows the previous sample wrote
    head.zero_grad(set_to_none=True)
    head(x.detach(), y).backward()
    g2 = _grad(head, head.weight)
    rows2 = head.last_sampled_classes
    stale = torch.ones(C, dtype=torch.bool)
    stale[rows2] = False
    assert not g2[stale].any()


def test_sampled_mode_trains_with_host_optimizer_on_disk(tmp_path):
    store = DiskStore(tmp_path / "w")
    head = hr.HugeClassifier(C, D, device="cpu", store=store, slice_size=128, sample_rate=0.2)
    opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=DiskStore(tmp_path / "st"), row_sparse=[head.weight])
    before = head.read_weight()
    x = torch.randn(B, D)
    y = torch.randint(0, C, (B,))
    head(x, y).backward()
    rows = head.last_sampled_classes
    opt.step()
    opt.zero_grad()
    after = head.read_weight()
    moved = (after != before).any(dim=1)
    assert bool(moved[rows].all())
    moved[rows] = False
    assert not moved.any()  # lazy Adam: rows without a gradient stay put


@pytest.mark.parametrize("labels", ["class_ids", "multilabel"])
def test_exact_training_with_host_optimizer_on_disk(labels, tmp_path):
    from tests.heads.test_linear_loss import dense_target, random_targets

    head = hr.HugeClassifier(C, D, device="cpu", store=DiskStore(tmp_path / "w"),
                             slice_size=200)
    ref = torch.nn.Parameter(head.read_weight())
    opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=DiskStore(tmp_path / "st"))
    opt_ref = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    pw = torch.rand(C) * 3
    for _ in range(3):
        x = torch.randn(B, D)
        if labels == "class_ids":
            y = torch.randint(0, C, (B,))
            head(x, y).backward()
            dense = F.cross_entropy(x @ ref.T, y)
        else:  # one-vs-all BCE with pos_weight, the positives as CSR
            targets = random_targets(B, C)
            head(x, targets, pos_weight=pw).backward()
            dense = F.binary_cross_entropy_with_logits(
                x @ ref.T, dense_target(targets, B, C, torch.float32), pos_weight=pw)
        grad = _grad(head, head.weight)
        (dense,) = torch.autograd.grad(dense, [ref])
        _close(grad, dense, atol=1e-6 if labels == "class_ids" else 1e-9)
        ref.grad = grad
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        # weights and Adam state rest on disk; the step is bitwise torch's AdamW
        assert torch.equal(head.read_weight(), ref.detach())


def test_bad_input():
    head = hr.HugeClassifier(C, D, device="cpu")
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"outside \[0, 1000\)"):
        head(x, torch.tensor([0, 1, 1000, 2]))
    with pytest.raises(TypeError, match="integer"):
        head(x, torch.zeros(4))
    with pytest.raises(ValueError, match="in_features=16"):
        head(torch.randn(4, D + 1), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels shape"):
        head(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="sample_rate"):
        hr.HugeClassifier(C, D, device="cpu", sample_rate=0.0)


def test_sizes_that_are_not_ints_are_named():
    with pytest.raises(TypeError, match="in_features must be an int, got '8'"):
        hr.HugeClassifier(10, "8", device="cpu")
    with pytest.raises(TypeError, match="num_classes must be an int"):
        hr.HugeClassifier(10.0, 8, device="cpu")


def test_cpu_store_on_cpu_warns():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        hr.HugeClassifier(10, 4, device="cpu")
    assert any("saves no memory" in str(r.message) for r in rec)


def test_empty_batch():
    head = hr.HugeClassifier(C, D, device="cpu")
    x = torch.randn(0, D, requires_grad=True)
    y = torch.empty(0, dtype=torch.long)
    assert head(x, y, reduction="none").shape == (0,)
    assert head(x, y, reduction="sum").item() == 0.0
    assert torch.isnan(head(x, y))


def test_checkpoint_round_trip_with_hr_save(tmp_path):
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=DiskStore(tmp_path / "a"))
    opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=DiskStore(tmp_path / "sa"))
    x, y = torch.randn(B, D), torch.randint(0, C, (B,))
    head(x, y).backward()
    opt.step()
    opt.zero_grad()
    hr.save(tmp_path / "ckpt.safetensors", head, opt)
    other = hr.HugeClassifier(C, D, bias=True, device="cpu", store=DiskStore(tmp_path / "b"))
    opt2 = hr.HostOptimizer(other.parameters(), torch.optim.AdamW, lr=1e-2,
                            state_store=DiskStore(tmp_path / "sb"))
    assert not torch.equal(other.read_weight(), head.read_weight())
    hr.load(tmp_path / "ckpt.safetensors", other, opt2)
    assert torch.equal(other.read_weight(), head.read_weight())
    assert torch.equal(other.read_bias(), head.read_bias())
    # one more identical step on both: same weights (state came back too)
    for h, o in ((head, opt), (other, opt2)):
        h(x, y).backward()
        o.step()
        o.zero_grad()
    assert torch.equal(other.read_weight(), head.read_weight())


def test_module_to_keeps_weight_in_its_store():
    head = hr.HugeClassifier(C, D, bias=True, device="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(D, D), head)
    ptr = head.weight.data_ptr()
    model.to(torch.float64)
    assert model[0].weight.dtype == torch.float64  # ordinary layers still convert
    assert head.weight.dtype == torch.float32 and head.weight.data_ptr() == ptr
    assert list(dict(head.named_parameters())) == ["weight", "bias"]
    assert binding(head.weight) is not None


@pytest.mark.gpu
def test_on_accelerator_with_host_store():
    from tests.conftest import DEVICES

    dev = DEVICES[-1]
    head = hr.HugeClassifier(C, D, bias=True, device=dev, slice_size=300)
    w, b = _dense(head)
    x = torch.randn(B, D, device=dev, requires_grad=True)
    y = torch.randint(0, C, (B,), device=dev)
    loss = head(x, y)
    xr = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(xr @ w.to(dev).T + b.to(dev), y)
    _close(loss, ref)
    loss.backward()
    ref.backward()
    _close(x.grad, xr.grad)
    (gw,) = torch.autograd.grad(F.cross_entropy(x.detach() @ w.T.to(dev) + b.to(dev), y), [w])
    _close(_grad(head, head.weight), gw)
    v, i = head.topk(x.detach(), 3)
    assert torch.equal(i, torch.topk(x.detach() @ w.to(dev).T + b.to(dev), 3).indices)


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_one_key_one_live_head_per_store(kind, tmp_path):
    from headroom.store import HostStore

    store = HostStore() if kind == "host" else DiskStore(tmp_path / "s")
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=store, key="faces")
    w = head.read_weight()
    with pytest.raises(RuntimeError, match=r"key='faces'.*in use by another live "
                                           r"HugeClassifier.*another key=.*del head"):
        hr.HugeClassifier(C, D, bias=True, device="cpu", store=store, key="faces")
    with pytest.raises(RuntimeError, match="key='faces'"):  # the weight alone clashes too
        hr.HugeClassifier(C, D, device="cpu", store=store, key="faces")
    other = hr.HugeClassifier(C, D, device="cpu", store=store, key="other")
    assert not torch.equal(other.read_weight(), w)
    # a notebook cell run again after the old head is gone (here only the cycle collector can
    # free it): the key is free, and the new head resumes the stored values
    cycle = [head]
    cycle.append(cycle)
    del head, cycle
    again = hr.HugeClassifier(C, D, bias=True, device="cpu", store=store, key="faces")
    assert torch.equal(again.read_weight(), w)


def test_failed_construction_frees_its_key_and_allocations(tmp_path):
    from headroom.store import StoreFullError

    store = DiskStore(tmp_path / "s", max_bytes=C * D * 4 + 100)  # the weight, not its grad
    with pytest.raises(StoreFullError) as info:
        hr.HugeClassifier(C, D, device="cpu", store=store, key="k")
    assert store.keys() == []  # the weight it allocated is freed again
    store.max_bytes = None
    # the error (and its traceback, which holds the half-built head) is still alive here
    head = hr.HugeClassifier(C, D, device="cpu", store=store, key="k")
    assert info.value is not None and head.read_weight().abs().sum() > 0  # initialized


@pytest.mark.filterwarnings("ignore:hr.offload found no repeated blocks")
def test_head_keys_and_offloaded_models_exclude_each_other(tmp_path):
    store = DiskStore(tmp_path / "s")
    head = hr.HugeClassifier(C, D, device="cpu", store=store, key="fc")
    model = torch.nn.Sequential()
    model.fc = torch.nn.Linear(D, C, bias=False)  # "fc.weight": the head's weight, same shape
    with pytest.raises(RuntimeError, match="another"):
        hr.offload(model, device="cpu", store=store)
    del head
    hr.offload(model, device="cpu", store=store)  # free now; takes over the stored values
    with pytest.raises(RuntimeError, match=r"key='fc'.*in use"):
        hr.HugeClassifier(C, D, device="cpu", store=store, key="fc")


@pytest.mark.skipif(accelerator_type() == "cuda", reason="cuda exists here")
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_missing_device_is_named_at_construction(kind, tmp_path):
    store = _store(kind, tmp_path)
    with pytest.raises(RuntimeError, match=r"'cuda' is not available on this machine.*"
                                           r"device='cpu'"):
        hr.HugeClassifier(C, D, device="cuda", store=store)
    if kind == "disk":
        assert store.keys() == []  # refused before anything was allocated


def test_device_is_kept_with_an_index(monkeypatch, tmp_path):
    acc = torch.accelerator  # pretend there is a cuda device 0 (nothing here touches it)
    monkeypatch.setattr(acc, "is_available", lambda: True)
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(acc, "current_device_index", lambda: 0)
    monkeypatch.setattr(acc, "device_count", lambda: 1)
    head = hr.HugeClassifier(C, D, device="cuda", store=DiskStore(tmp_path / "s"))
    # what tensors created with device="cuda" report, so features.device == head.device
    assert head.device == torch.device("cuda", 0)


@pytest.mark.parametrize("mode", ["host", "disk", "sampled"])
def test_double_backward_is_refused_with_the_fix(mode, tmp_path):
    store = DiskStore(tmp_path / "s") if mode == "disk" else "cpu"
    head = hr.HugeClassifier(C, D, device="cpu", store=store, slice_size=300,
                             sample_rate=0.5 if mode == "sampled" else 1.0)
    x = torch.randn(B, D, requires_grad=True)
    loss = head(x, torch.randint(0, C, (B,)))
    with pytest.raises(RuntimeError, match=r"does not support double backward.*"
                                           r"create_graph=True.*F\.cross_entropy"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.gpu
def test_accelerator_device_without_index():
    from tests.conftest import accelerator_type as acc

    head = hr.HugeClassifier(C, D, device=acc(), slice_size=300)
    x = torch.randn(B, D, device=acc())
    assert head.device.index is not None and x.device == head.device
    head(x, torch.randint(0, C, (B,), device=acc()))  # accepted: same device


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_ignored_rows_skip_the_products(kind, tmp_path):
    # a batch with its prompt masked (3 rows in 4 ignored, shifted): the loss, the gradients
    # and the predictions as the dense reference's, with a quarter of the matrix products
    # (counted by torch's FlopCounterMode, independently of headroom)
    from torch.utils.flop_counter import FlopCounterMode

    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=_store(kind, tmp_path),
                             slice_size=300)
    w, b = _dense(head)
    x = torch.randn(2, 48, D, requires_grad=True)
    y = torch.randint(0, C, (2, 48))
    y[:, :36] = -100
    xr = x.detach().clone().requires_grad_()

    def flops(labels):
        head.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as fc:
            out = head(x, labels, shift=True, return_accuracy=True, return_predictions=True)
            out.loss.backward()
        return fc.get_total_flops(), out

    n_masked, out = flops(y)
    logits = (xr[:, :-1] @ w.T + b).reshape(-1, C)
    ref = F.cross_entropy(logits, y[:, 1:].reshape(-1))
    ref.backward()
    _close(out.loss, ref)
    _close(x.grad, xr.grad)
    _close(_grad(head, head.weight), w.grad)
    _close(_grad(head, head.bias), b.grad)
    kept = y[:, 1:] != -100
    want = torch.where(kept, logits.argmax(1).view(2, 47), -1)
    assert torch.equal(out.predictions, want)  # (batch, seq - 1), -1 where ignored
    _close(out.accuracy.double(), (want == y[:, 1:])[kept].double().mean())
    n_all, _ = flops(torch.randint(0, C, (2, 48)))
    rows_masked, rows_all = int(kept.sum()), 2 * 47
    assert n_masked * rows_all == pytest.approx(n_all * rows_masked, rel=0.01)
