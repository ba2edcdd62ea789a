"""Hugging Face models beyond the causal LMs, offloaded and trained with hr.HostOptimizer:
BERT (sequence classification: attention, the pooler, token types), ViT (patch embedding,
class token) and ResNet (convolutions, BatchNorm's running statistics). Dropout on, clipping,
``model.zero_grad()`` between steps: bitwise torch's fused AdamW on the model left alone, in
host memory and on a DiskStore."""

from __future__ import annotations

import warnings

import pytest
import torch

import headroom as hr

T = pytest.importorskip("transformers")


def _bert():
    return T.BertForSequenceClassification(T.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3))


def _vit():
    return T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3))


def _resnet():
    return T.ResNetForImageClassification(T.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))


MODELS = {"bert": _bert, "vit": _vit, "resnet": _resnet}


def _batch(name: str, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    labels = torch.randint(0, 3, (4,), generator=g)
    if name == "bert":
        return {"input_ids": torch.randint(0, 64, (4, 12), generator=g), "labels": labels}
    size = 16 if name == "vit" else 32
    return {"pixel_values": torch.randn(4, 3, size, size, generator=g), "labels": labels}


def _train(name: str, store, tmp_path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    if store is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device="cpu" with a host store saves nothing
            hr.offload(model, device="cpu",
                       store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "s"))
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    for i in range(3):
        torch.manual_seed(100 + i)  # the same dropout masks
        model(**_batch(name, i)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        model.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("name", list(MODELS))
def test_offloaded_training_is_bitwise_plain(name, store, tmp_path):
    want = _train(name, None, tmp_path / "ref")
    got = _train(name, store, tmp_path / "hr")
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    if name == "resnet":  # BatchNorm's running statistics moved, in both
        k = next(k for k in want if k.endswith("running_mean"))
        assert not torch.equal(want[k], torch.zeros_like(want[k]))
