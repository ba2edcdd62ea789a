"""Memory of the sliced cross-entropy does not grow with the number of classes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import headroom as hr

B, D, SLICE = 32, 8, 8192
# one B x slice logits buffer, plus a few B- and B x D-sized tensors (lse, scales, grad of x)
BUDGET = B * SLICE * 4 + 64 * B * (D + 1) * 4


def _extra_peak(classes: int, *, bias: bool = False) -> int:
    x = torch.randn(B, D, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(classes, D))
    b = torch.nn.Parameter(torch.randn(classes)) if bias else None
    y = torch.randint(0, classes, (B,))
    with hr.track_memory() as mem:
        loss = hr.linear_cross_entropy(x, w, y, b, slice_size=SLICE, label_smoothing=0.1)
        loss.backward()
    # the weight and its gradient (and bias and its gradient) are the caller's; x too
    own = 2 * w.nbytes + 2 * x.nbytes + (2 * b.nbytes if b is not None else 0)
    assert mem.peak >= own
    return mem.peak - own


@pytest.mark.parametrize("classes", [65536, 262144, 1 << 20])
def test_peak_beyond_weight_within_batch_x_slice_budget(classes):
    extra = _extra_peak(classes)
    assert extra <= BUDGET
    # the check can fail: dense logits alone would be far over the budget
    assert B * classes * 4 > 4 * BUDGET


def test_peak_does_not_grow_with_classes():
    small, big = _extra_peak(65536, bias=True), _extra_peak(1 << 20, bias=True)
    # bias slices add a few kB; the class count (16x) adds nothing
    assert big <= small + 4 * SLICE * 4


def test_dense_reference_exceeds_budget():
    # the same tracker sees the dense computation's B x C logits (so it would catch ours)
    x = torch.randn(B, D, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(65536, D))
    y = torch.randint(0, 65536, (B,))
    with hr.track_memory() as mem:
        F.cross_entropy(x @ w.T, y).backward()
    assert mem.peak - 2 * w.nbytes - 2 * x.nbytes > BUDGET


def _classifier_peak(classes: int, tmp_path) -> int:
    from headroom.store import DiskStore

    head = hr.HugeClassifier(classes, D, bias=True, device="cpu",
                             store=DiskStore(tmp_path / str(classes)), slice_size=SLICE)
    x = torch.randn(B, D, requires_grad=True)
    y = torch.randint(0, classes, (B,))
    with hr.track_memory() as mem:
        head(x, y).backward()
        head(x, y, label_smoothing=0.1).backward()  # accumulating: read-modify-write slices
        head.topk(x.detach(), 5)
    return mem.peak - 2 * x.nbytes


def test_disk_classifier_peak_is_slices_only(tmp_path):
    # the weight rests on disk: nothing of size C is ever in memory, only B x slice logits
    # (forward's and topk's), and a few slice-sized host buffers (reads in flight, gradient
    # slices being written), whatever the class count
    budget = 2 * B * SLICE * 4 + 8 * SLICE * (D + 1) * 4 + 64 * B * (D + 1) * 4
    small = _classifier_peak(65536, tmp_path)
    big = _classifier_peak(1 << 20, tmp_path)
    assert small <= budget and big <= budget
    # equal but for a few nnz-sized scratch tensors (how many positives one slice holds)
    assert abs(big - small) <= 8 * B * 8
    assert 4 * budget < (1 << 20) * D * 4  # the weight alone would not fit the budget


# ---------------------------------------------------------------------------------------------
# multi-label losses (hr.linear_loss): two B x slice buffers, the gradients formed in forward


def _bce_fn(scores, targets, classes):
    return F.binary_cross_entropy_with_logits(scores, targets, reduction="sum")


def _multilabel_extra_peak(classes: int, loss) -> int:
    from tests.heads.test_linear_loss import random_targets

    x = torch.randn(B, D, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(classes, D))
    targets = random_targets(B, classes)
    with hr.track_memory() as mem:
        hr.linear_loss(x, w, targets, loss=loss, slice_size=SLICE).backward()
    own = 2 * w.nbytes + 2 * x.nbytes
    assert mem.peak >= own
    return mem.peak - own


# two B x slice buffers (logits, and the bulk loss's scratch or a loss function's targets) plus
# B-, D- and nnz-sized vectors (at most 8 positives per row)
ML_BUDGET = 2 * B * SLICE * 4 + 64 * B * (D + 1) * 4 + 64 * B * 8 * 8
# a loss function's autograd also holds its own B x slice intermediates and the gradient
FN_BUDGET = ML_BUDGET + 6 * B * SLICE * 4


@pytest.mark.parametrize("loss", ["bce", "squared_hinge", "softmax", "fn"])
def test_multilabel_peak_within_budget_and_flat_in_classes(loss):
    budget = FN_BUDGET if loss == "fn" else ML_BUDGET
    fn = _bce_fn if loss == "fn" else loss
    small, big = _multilabel_extra_peak(65536, fn), _multilabel_extra_peak(1 << 20, fn)
    assert small <= budget and big <= budget
    assert big <= small + 4 * SLICE * 4  # the class count (16x) adds nothing
    assert B * (1 << 20) * 4 > 4 * FN_BUDGET  # dense logits alone would be far over it


def test_dense_bce_reference_exceeds_budget():
    x = torch.randn(B, D, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(65536, D))
    target = torch.zeros(B, 65536)
    with hr.track_memory() as mem:
        F.binary_cross_entropy_with_logits(x @ w.T, target).backward()
    assert mem.peak - 2 * w.nbytes - 2 * x.nbytes - target.nbytes > FN_BUDGET


def _multilabel_classifier_peak(classes: int, tmp_path) -> int:
    from headroom.store import DiskStore
    from tests.heads.test_linear_loss import random_targets

    head = hr.HugeClassifier(classes, D, bias=True, device="cpu",
                             store=DiskStore(tmp_path / f"ml{classes}"), slice_size=SLICE)
    x = torch.randn(B, D, requires_grad=True)
    targets = random_targets(B, classes)
    with hr.track_memory() as mem:
        head(x, targets).backward()
        head(x, targets, loss="softmax").backward()  # accumulating: read-modify-write slices
    return mem.peak - 2 * x.nbytes


def test_disk_classifier_multilabel_peak_is_slices_only(tmp_path):
    budget = 2 * B * SLICE * 4 + 8 * SLICE * (D + 1) * 4 + 64 * B * (D + 1) * 4 + 64 * B * 64
    small = _multilabel_classifier_peak(65536, tmp_path)
    big = _multilabel_classifier_peak(1 << 20, tmp_path)
    assert small <= budget and big <= budget
    # equal but for a few nnz-sized scratch tensors (how many positives one slice holds)
    assert abs(big - small) <= 8 * B * 8
