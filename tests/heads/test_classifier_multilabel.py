"""HugeClassifier with multi-label targets: weights in a store, losses against dense references."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import headroom as hr
from headroom.store import DiskStore
from headroom.transfer import binding
from tests.heads.test_linear_loss import (
    assert_as_exact_as_torch,
    dense_loss,
    dense_target,
    random_targets,
)

C, D, B = 1000, 16, 24

pytestmark = pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")


def _store(kind, tmp_path, name="store"):
    return "cpu" if kind == "cpu" else DiskStore(tmp_path / name)


def _grad(head, p):
    return head.store.read(binding(p).grad_handle).result()


def _bce_fn(scores, targets, classes):
    return F.binary_cross_entropy_with_logits(scores, targets, reduction="sum")


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("loss", ["bce", "squared_hinge", "softmax", "fn"])
def test_forward_backward_exact(kind, loss, tmp_path):
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=_store(kind, tmp_path),
                             slice_size=300)
    w0, b0 = head.read_weight(), head.read_bias()
    x = torch.randn(B, D, requires_grad=True)
    targets = random_targets(B, C, values=loss != "softmax")
    ignore = torch.zeros(B, dtype=torch.bool)
    ignore[5] = True
    name = "bce" if loss == "fn" else loss
    kw = dict(loss=_bce_fn if loss == "fn" else loss, ignore_rows=ignore)
    kw["reduction"] = "sum" if loss == "fn" else "mean"
    for _ in range(2):  # the second backward accumulates in the store, as autograd does
        head(x, targets, **kw).backward()
    refs = {}
    for dt in (torch.float64, torch.float32):
        xs = [t.detach().to(dt).requires_grad_() for t in (x, w0, b0)]
        t = dense_target(targets, B, C, dt)
        for _ in range(2):
            dense_loss(xs[0] @ xs[1].T + xs[2], t, name, reduction=kw["reduction"],
                       keep=~ignore).backward()
        refs[dt] = [p.grad for p in xs]
    got = [x.grad, _grad(head, head.weight), _grad(head, head.bias)]
    for i, g in enumerate(got):
        assert_as_exact_as_torch(g, refs[torch.float32][i], refs[torch.float64][i], str(i))
    assert binding(head.weight).has_grad and binding(head.weight).grad_rows is None
    # zero_grad(set_to_none=True) makes the next backward overwrite
    head.zero_grad(set_to_none=True)
    x.grad = None
    head(x, targets, **kw).backward()
    assert_as_exact_as_torch(_grad(head, head.weight), refs[torch.float32][1] / 2,
                             refs[torch.float64][1] / 2, "overwritten")


@pytest.mark.parametrize("loss", ["bce", "squared_hinge", "fn"])
def test_sampled_mode_is_the_loss_over_the_sampled_classes(loss):
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", slice_size=64, sample_rate=0.1,
                             generator=torch.Generator().manual_seed(3))
    w, b = head.read_weight(), head.read_bias()
    x = torch.randn(B, D, requires_grad=True)
    targets = random_targets(B, C)
    seen = []

    def fn(scores, targets, classes):
        seen.append(classes)
        return _bce_fn(scores, targets, classes)

    out = head(x, targets, loss=fn if loss == "fn" else loss)
    rows = head.last_sampled_classes
    assert rows.numel() == 100 and bool(torch.isin(targets[1], rows).all())
    if loss == "fn":  # a user's loss sees the sampled classes' ids, not positions
        assert all(c.dtype == torch.int64 for c in seen)
        assert torch.equal(torch.cat(seen), rows)
    # exactly linear_loss over the sampled rows, the positives renumbered
    local = (targets[0], torch.searchsorted(rows, targets[1]))
    xr = x.detach().clone().requires_grad_()
    wr, br = w[rows].requires_grad_(), b[rows].requires_grad_()
    ref = hr.linear_loss(xr, wr, local, loss=fn if loss == "fn" else loss, bias=br,
                         slice_size=64)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)
    out.backward()
    ref.backward()
    torch.testing.assert_close(x.grad, xr.grad)
    g = _grad(head, head.weight)
    assert torch.equal(binding(head.weight).grad_rows, rows)
    torch.testing.assert_close(g[rows], wr.grad)
    torch.testing.assert_close(_grad(head, head.bias)[rows], br.grad)
    others = torch.ones(C, dtype=torch.bool)
    others[rows] = False
    assert not g[others].any()


def test_sampled_mode_trains_row_sparse_with_host_optimizer(tmp_path):
    head = hr.HugeClassifier(C, D, device="cpu", store=DiskStore(tmp_path / "w"),
                             slice_size=128, sample_rate=0.2)
    opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=DiskStore(tmp_path / "st"), row_sparse=[head.weight])
    before = head.read_weight()
    head(torch.randn(B, D), random_targets(B, C), loss="squared_hinge").backward()
    rows = head.last_sampled_classes
    opt.step()
    opt.zero_grad()
    moved = (head.read_weight() != before).any(dim=1)
    assert bool(moved[rows].all())
    moved[rows] = False
    assert not moved.any()  # lazy Adam: only the sampled rows are read, updated and written


def test_exact_squared_hinge_steps_only_rows_with_a_gradient(tmp_path):
    """Classes scored below -1 in every row get exactly zero gradient from the squared hinge;
    HostOptimizer(row_sparse=...) then reads, updates and writes only the other rows."""
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=DiskStore(tmp_path / "w"),
                             slice_size=128)
    w0 = torch.randn(C, D) * 0.05
    b0 = torch.full((C,), -3.0)
    b0[::7] = 0.0  # these classes score around 0: a gradient in every row
    head.load_weight(w0, b0)
    opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=DiskStore(tmp_path / "st"), row_sparse=[head.weight])
    x = torch.randn(B, D)
    targets = random_targets(B, C)
    head(x, targets, loss="squared_hinge").backward()
    g = _grad(head, head.weight)
    has = g.ne(0).any(1)
    assert 0 < int(has.sum()) < C // 2  # the exact gradient is row-sparse here
    ref = torch.nn.Parameter(w0.clone())
    t = dense_target(targets, B, C, torch.float32)
    dense_loss(x @ ref.T + b0, t, "squared_hinge", reduction="mean").backward()
    assert not ref.grad[~has].any()  # the zero rows are zero in the dense gradient too
    opt.step()
    opt.zero_grad()
    w = head.read_weight()
    assert torch.equal(w[~has], w0[~has])  # lazy Adam: rows without a gradient stay put
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, fused=True)
    ref.grad = g
    ref_opt.step()
    assert torch.equal(w[has], ref.detach()[has])  # a first step: what dense AdamW does there


def test_class_id_labels_and_multilabel_options_do_not_mix():
    head = hr.HugeClassifier(C, D, device="cpu")
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"tensor of class ids trains softmax.*\(offsets, "
                                         r"indices\)"):
        head(x, torch.zeros(4, dtype=torch.long), loss="bce")
    with pytest.raises(ValueError, match="ignore_index and label_smoothing apply to a tensor"):
        head(x, random_targets(4, C), label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"outside \[0, 1000\).*first: 1000 in row 0"):
        head(x, (torch.tensor([0, 1, 1, 1, 1]), torch.tensor([1000])))
    with pytest.raises(ValueError, match="in_features=16"):
        head(torch.randn(4, D + 1), random_targets(4, C))


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_double_backward_is_refused(mode, tmp_path):
    head = hr.HugeClassifier(C, D, device="cpu", store=_store(mode, tmp_path), slice_size=300)
    x = torch.randn(B, D, requires_grad=True)
    loss = head(x, random_targets(B, C))
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_topk_unchanged_by_multilabel_training(tmp_path):
    head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=DiskStore(tmp_path / "s"),
                             slice_size=128)
    head(torch.randn(B, D), random_targets(B, C)).backward()
    x = torch.randn(5, D)
    v, i = head.topk(x, 7)
    assert torch.equal(i, torch.topk(x @ head.read_weight().T + head.read_bias(), 7).indices)


# ---------------------------------------------------------------------------------------------
# what survives an exception (Ctrl-C included) mid-forward or mid-backward


class _Injected(Exception):
    pass


def _fail_read(monkeypatch, store, count, error):
    """Make the ``count``-th ``store.read_rows`` from now raise ``error``."""
    real, calls = store.read_rows, [0]

    def broken(*a, **k):
        calls[0] += 1
        if calls[0] == count:
            raise error("injected")
        return real(*a, **k)

    monkeypatch.setattr(store, "read_rows", broken)


@pytest.mark.parametrize("where", ["forward", "backward", "accumulating_backward", "disk_read"])
@pytest.mark.parametrize("error", [_Injected, KeyboardInterrupt])
def test_failure_then_zero_grad_keeps_training_exact(where, error, tmp_path, monkeypatch):
    torch.manual_seed(0)
    w0, b0 = torch.randn(C, D) * 0.3, torch.randn(C) * 0.1
    steps = [[(torch.randn(B, D), random_targets(B, C)) for _ in range(2)] for _ in range(3)]
    plan = {"fail": None, "calls": 0}

    def fn(scores, targets, classes):
        # forward calls it without grad, backward (recomputing the slice) with grad
        phase = "backward" if scores.requires_grad else "forward"
        if plan["fail"] == phase:
            plan["calls"] += 1
            if plan["calls"] == 2:  # the second of four slices
                plan["fail"] = None
                raise error("injected")
        return _bce_fn(scores, targets, classes)

    def run(fail: bool, tag: str):
        store = DiskStore(tmp_path / f"w{tag}")
        head = hr.HugeClassifier(C, D, bias=True, device="cpu", store=store, slice_size=256)
        head.load_weight(w0, b0)
        opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=1e-2,
                               state_store=DiskStore(tmp_path / f"s{tag}"))
        for i, micro in enumerate(steps):
            if fail and i == 1:
                plan["calls"] = 0
                if where == "accumulating_backward":
                    head(*micro[0], loss=fn, reduction="sum").backward()
                if where != "disk_read":
                    plan["fail"] = "forward" if where == "forward" else "backward"
                    with pytest.raises(error, match="injected"):
                        head(*micro[-1], loss=fn, reduction="sum").backward()
                    assert plan["fail"] is None  # it did fail where it was meant to
                else:
                    loss = head(*micro[-1], loss=fn, reduction="sum")
                    # backward's third slice read (a weight and a bias read per slice)
                    _fail_read(monkeypatch, store, 5, error)
                    with pytest.raises(error, match="injected"):
                        loss.backward()
                    monkeypatch.undo()
                # the documented recovery: clear the gradients of the step and redo it
                opt.zero_grad()
            for x, t in micro:
                head(x, t, loss=fn, reduction="sum").backward()
            opt.step()
            opt.zero_grad()
        return head.read_weight(), head.read_bias()

    for got, want in zip(run(True, "a"), run(False, "b"), strict=True):
        assert torch.equal(got, want)


def test_exception_in_forward_writes_nothing(tmp_path):
    head = hr.HugeClassifier(C, D, device="cpu", store=DiskStore(tmp_path / "s"),
                             slice_size=256)
    x, t = torch.randn(B, D), random_targets(B, C)
    head(x, t).backward()
    before = _grad(head, head.weight)

    def fn(scores, targets, classes):
        if classes.start == 512:
            raise _Injected("injected")
        return _bce_fn(scores, targets, classes)

    with pytest.raises(_Injected):
        head(x, t, loss=fn)
    assert torch.equal(_grad(head, head.weight), before)


def test_kill_mid_backward_on_disk_then_reopen_trains_exactly(tmp_path, one_thread):
    """kill -9 between two gradient writes of a disk head's backward: the reopened store holds
    the weight of the last finished step, and training from it is bitwise the uninterrupted run."""
    from tests.heads import _kill_child as child

    src = str(Path(hr.__file__).resolve().parents[1])
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(root)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, child.__file__, str(tmp_path / "killed")],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["stepped", "1"]

    ref, ref_opt, _ = child.open_head(tmp_path / "ref")
    child.train_step(ref, ref_opt, 1)
    with pytest.warns(UserWarning, match="was not closed"):  # and says to resume from hr.load
        head, opt, _ = child.open_head(tmp_path / "killed")  # keeps the stored values
    assert torch.equal(head.read_weight(), ref.read_weight())
    assert torch.equal(head.read_bias(), ref.read_bias())
    for step in (2, 3):  # the half-written gradient is overwritten, not added to
        child.train_step(ref, ref_opt, step)
        child.train_step(head, opt, step)
        assert torch.equal(head.read_weight(), ref.read_weight())
        assert torch.equal(head.read_bias(), ref.read_bias())
