"""Tiny language models built from configs, data and helpers shared by the framework tests.

Nothing is downloaded: models come from configs, the tokenizer from a word-level vocabulary.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import headroom as hr

VOCAB = 64
SEQ = 12


def gpt2(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(cfg).to(dtype)


def llama(dtype: torch.dtype = torch.float32, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny Llama; ``vocab=32000`` gives a realistic vocabulary: its untied head and
    embedding then hold far more than a decoder layer, and hr.offload makes each a block."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=32, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2)
    return LlamaForCausalLM(cfg).to(dtype)


def token_ids(n: int = 16) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))


class LMData(torch.utils.data.Dataset):
    """Causal-LM examples as transformers.Trainer takes them."""

    def __init__(self, n: int = 16) -> None:
        self.ids = token_ids(n)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary (pad 0, eos 1, bos 2, unk 3)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1",
                                   bos_token="t2", unk_token="t3")


def offload(model: torch.nn.Module, store: str | None, tmp: Path, **kw) -> torch.nn.Module:
    """``hr.offload`` to host memory (``"cpu"``) or a DiskStore under ``tmp`` (``"disk"``)."""
    if store is None:
        return model
    st = hr.DiskStore(tmp / "store") if store == "disk" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu" with a host store saves nothing
        return hr.offload(model, device="cpu", store=st, **kw)


def optimizer(model: torch.nn.Module, headroom: bool, **kw) -> torch.optim.Optimizer:
    """AdamW: `hr.HostOptimizer` or torch's own (fused, as HostOptimizer runs it)."""
    kw = {"lr": 1e-3, **kw}
    if headroom:
        return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    return torch.optim.AdamW(model.parameters(), **{"fused": True, **kw})


def train_logged(trainer, model: torch.nn.Module):
    """``trainer.train()`` quietly; the (loss, grad_norm) logged at each step, and the state."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return logs, state(model)


def assert_runs_equal(train, headroom_ref: bool, tmp_path) -> None:
    """``train(store, headroom, tmp)`` without headroom, then offloaded to host memory and to a
    DiskStore with HostOptimizer: the same logs (three steps, clipped) and the same state."""
    ref_logs, ref_state = train(None, headroom_ref, tmp_path / "ref")
    assert len(ref_logs) == 3 and any(n > 1.0 for _, n in ref_logs)  # max_grad_norm=1.0 clips
    for store in ("cpu", "disk"):
        logs, st = train(store, True, tmp_path / store)
        assert logs == ref_logs, store
        assert_same_state(ref_state, st)


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def count_holds(monkeypatch) -> list[int]:
    """Count the gradients hr.offload(grad_accumulation="device") sums on the device (so that a
    test through a framework also shows the sums were formed, not only that training is
    exact)."""
    from headroom.residency._schedule import Offload

    n = [0]
    real = Offload._hold

    def hold(self, *a, **k):
        n[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(Offload, "_hold", hold)
    return n


def interrupt_lora_step(model: torch.nn.Module, where: str) -> None:
    """Ctrl-C (a KeyboardInterrupt) in the ``forward`` or ``backward`` of one LoRA adapter of
    a PEFT-wrapped Llama's second layer, mid-step; the step is left as the interrupt left it."""
    import pytest

    layer = model.base_model.model.model.layers[1].self_attn.q_proj.lora_B.default

    def interrupt(*args):
        raise KeyboardInterrupt

    h = (layer.register_forward_hook(interrupt) if where == "forward"
         else layer.register_full_backward_hook(interrupt))
    ids = torch.randint(0, 96, (2, 8))
    try:
        with pytest.raises(KeyboardInterrupt):
            model(input_ids=ids, labels=ids).loss.backward()
    finally:
        h.remove()
