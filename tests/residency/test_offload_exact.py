"""Offloaded training is bitwise equal to plain training (CPU, fp32)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr
from headroom.store import DiskStore
from tests.residency._models import (
    CNN,
    StoreStep,
    Transformer,
    cnn_batch,
    cnn_loss,
    lm_batch,
    lm_loss,
    values,
)

STEPS = 10


def train_both(make, batch, loss_fn, store, *, micro: int = 1, steps: int = STEPS,
               blocks=None, prefetch: int = 1):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cpu+cpu "saves nothing" warning
        hr.offload(model, device="cpu", store=store, prefetch=prefetch,
                   blocks=None if blocks is None else blocks(model))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    if isinstance(store, DiskStore):
        opt = StoreStep(model.parameters(), torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the user's optimizer, unchanged
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for _ in range(micro):
            b = batch(g)
            for m in (ref, model):
                torch.manual_seed(2)  # same dropout masks
                (loss_fn(m, b) / micro).backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    return ref, model


def assert_same(ref, model):
    got = values(model)
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.detach()), name
    for name, buf in ref.named_buffers():
        assert torch.equal(model.get_buffer(name), buf), name


def _store(kind, tmp_path):
    return "cpu" if kind == "cpu" else DiskStore(tmp_path / "store", threads=2)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_transformer_exact(kind, tmp_path):
    ref, model = train_both(Transformer, lm_batch, lm_loss, _store(kind, tmp_path))
    assert_same(ref, model)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_cnn_exact(kind, tmp_path):
    ref, model = train_both(CNN, cnn_batch, cnn_loss, _store(kind, tmp_path))
    assert_same(ref, model)  # BatchNorm running statistics too


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_grad_accumulation_exact(kind, tmp_path):
    ref, model = train_both(Transformer, lm_batch, lm_loss, _store(kind, tmp_path), micro=4,
                            steps=8)
    assert_same(ref, model)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("where", ["inside", "around"])
def test_checkpointing_exact(kind, where, tmp_path):
    def make():
        return Transformer(ckpt=where == "inside", ckpt_blocks=where == "around")

    ref, model = train_both(make, lm_batch, lm_loss, _store(kind, tmp_path), steps=8)
    assert_same(ref, model)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_tied_weights_exact(kind, tmp_path):
    ref, model = train_both(lambda: Transformer(tie=True), lm_batch, lm_loss,
                            _store(kind, tmp_path))
    assert_same(ref, model)
    assert model.head.weight is model.emb.weight  # still one parameter
    assert len(list(model.parameters())) == len(list(ref.parameters()))


def test_tied_across_blocks_is_fetched_once(tmp_path):
    def make():
        m = Transformer(n=4)
        for layer in m.layers[1:]:  # every block shares the first block's fc1
            layer.fc1 = m.layers[0].fc1
        return m

    ref, model = train_both(make, lm_batch, lm_loss, "cpu", steps=5)
    assert_same(ref, model)
    assert "layers.0.fc1.weight" in str(hr.describe(model)).split("outside blocks")[1]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_given_blocks_and_prefetch_exact(prefetch, tmp_path):
    ref, model = train_both(CNN, cnn_batch, cnn_loss, _store("disk", tmp_path), steps=5,
                            blocks=lambda m: [m.stem, *m.stages], prefetch=prefetch)
    assert_same(ref, model)
