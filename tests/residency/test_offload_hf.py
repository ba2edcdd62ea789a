"""Hugging Face models built from a config (no download) train offloaded, exactly."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr
from headroom.residency import state_of

transformers = pytest.importorskip("transformers")


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2)
    return transformers.GPT2LMHeadModel(cfg), "transformer.h"


def _llama():
    # a vocabulary big enough that the untied embedding and head get blocks of their own
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=4, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg), "model.layers"


def _expected_blocks(layers: str) -> list[str]:
    inner = [f"{layers}.{i}" for i in range(4)]
    return ["model.embed_tokens", *inner, "lm_head"] if layers == "model.layers" else inner


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "grad-ckpt"])
def test_hf_model_trains_offloaded_exactly(make, ckpt):
    torch.manual_seed(0)
    ref, layers = make()
    if ckpt:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store="cpu")
    names = [b.name for b in state_of(model).blocks]
    assert names == _expected_blocks(layers)  # found automatically
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=g)
        for m, o in zip((ref, model), opts, strict=True):
            torch.manual_seed(2)
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not any(b.resident for b in state_of(model).blocks)


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_model_trains_from_disk_with_host_optimizer(make, tmp_path):
    torch.manual_seed(0)
    ref, layers = make()
    model = copy.deepcopy(ref)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    assert [b.name for b in state_of(model).blocks] == _expected_blocks(layers)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, fused=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=g)
        for m, o in ((ref, opt_ref), (model, opt)):
            torch.manual_seed(2)
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_model_built_on_meta_moves_to_its_device_before_its_first_forward(store, tmp_path):
    """Trainer and Lightning call model.to(device) before any forward: buffers built on meta
    and not in the checkpoint (Llama's rotary inv_freq) stay pending, then fill as usual."""
    torch.manual_seed(0)
    ref, _ = _llama()
    ref.save_pretrained(tmp_path / "ck")
    with torch.device("meta"):
        model, _ = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu",
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w"))
    hr.load_weights(model, tmp_path / "ck")
    assert model.to("cpu") is model
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
