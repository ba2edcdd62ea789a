"""Tiny causal LMs of several families (random weights, no downloads), shared with benchmarks."""

from __future__ import annotations

import torch

VOCAB = 32000  # larger than a logits slice (8192 classes), so a slice is never the logits


def tiny_causal_lm(family: str, *, vocab: int = VOCAB, hidden: int = 32, layers: int = 1,
                   softcap: float | None = 0.5, dtype: torch.dtype = torch.float32):
    """A small ``transformers`` causal LM of ``family``; Gemma's soft cap is small so it bites."""
    import transformers as T

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    if family == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**common))
    elif family == "mistral":
        model = T.MistralForCausalLM(T.MistralConfig(**common))
    elif family == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(**common))
    elif family == "gemma2":
        model = T.Gemma2ForCausalLM(T.Gemma2Config(
            **common, head_dim=8, final_logit_softcapping=softcap))
    elif family == "gemma3":
        model = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            **common, head_dim=8, final_logit_softcapping=softcap))
    elif family == "gpt2":
        # no dropout: the patched and plain runs must see the same network
        model = T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    else:
        raise ValueError(f"unknown family {family!r}")
    return model.to(dtype)


FAMILIES = ["llama", "mistral", "qwen2", "gemma2", "gemma3", "gpt2"]
