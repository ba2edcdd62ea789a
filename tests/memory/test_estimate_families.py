"""hr.estimate on real batches of transformers' common families, against hr.track_memory.

Each family's step as a user trains it: padded batches with their attention mask, labels
(``labels=input_ids`` where a causal LM trains on its inputs), token types, encoder-decoders
with labels. The estimate equals the measured peak of a steady-state AdamW step on the CPU to
the byte; and the dry run's values of integer inputs steer it as they steer the real step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import headroom as hr
from headroom.fit import estimate

transformers = pytest.importorskip("transformers")

B, L = 2, 12


def _measure(model, kwargs, loss_fn):
    """The measured peak of a steady-state step (state exists, gradients do not)."""
    opt = torch.optim.AdamW(model.parameters())

    def step():
        loss_fn(model(**kwargs)).backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    return mem


def _batch(vocab=100):
    torch.manual_seed(0)
    ids = torch.randint(3, vocab, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 8:] = 0  # the second sequence is padded
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def _family(name):
    """A tiny model of the family and one step's inputs, as a user passes them."""
    ids, mask, labels = _batch()
    T = transformers
    dec = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=100)
    if name == "llama (padded)":
        return (T.LlamaForCausalLM(T.LlamaConfig(**dec)),
                dict(input_ids=ids, attention_mask=mask, labels=labels))
    if name == "gpt2 (padded)":
        cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64,
                           bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(cfg), dict(input_ids=ids, attention_mask=mask, labels=labels)
    if name == "mistral (labels=input_ids)":
        return T.MistralForCausalLM(T.MistralConfig(**dec)), dict(input_ids=ids, labels=ids)
    if name == "qwen2 (labels=input_ids)":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**dec)), dict(input_ids=ids, labels=ids)
    if name == "bert (padded, token types)":
        cfg = T.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, vocab_size=100)
        types = torch.zeros_like(ids)
        types[:, 6:] = 1
        return T.BertForMaskedLM(cfg), dict(input_ids=ids, attention_mask=mask,
                                            token_type_ids=types, labels=labels)
    if name.startswith("t5"):
        # dropout off: the CPU's fused attention kernel is then in play (it refuses dropout)
        cfg = T.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4,
                         d_kv=8, vocab_size=100, decoder_start_token_id=0, pad_token_id=0,
                         dropout_rate=0.0)
        kw = dict(input_ids=ids, labels=labels[:, :8].contiguous())
        if name == "t5 (padded)":
            kw["attention_mask"] = mask
        return T.T5ForConditionalGeneration(cfg), kw
    if name == "bart (padded)":
        cfg = T.BartConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, encoder_attention_heads=4,
                           decoder_attention_heads=4, vocab_size=100, max_position_embeddings=64,
                           pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           decoder_start_token_id=2)
        return T.BartForConditionalGeneration(cfg), dict(
            input_ids=ids, attention_mask=mask, labels=labels[:, :8].contiguous())
    if name == "vit":
        cfg = T.ViTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                          num_attention_heads=4, image_size=32, patch_size=8, num_labels=10)
        return T.ViTForImageClassification(cfg), dict(pixel_values=torch.randn(B, 3, 32, 32),
                                                      labels=torch.tensor([1, 2]))
    if name == "whisper":
        cfg = T.WhisperConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64,
                              decoder_ffn_dim=64, encoder_attention_heads=4,
                              decoder_attention_heads=4, vocab_size=100, num_mel_bins=16,
                              max_source_positions=8, max_target_positions=32, pad_token_id=0,
                              decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)
        return T.WhisperForConditionalGeneration(cfg), dict(
            input_features=torch.randn(B, 16, 16), labels=labels[:, :8].contiguous())
    assert name == "clip (padded)"
    cfg = T.CLIPConfig(
        text_config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, vocab_size=100, max_position_embeddings=16),
        vision_config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, image_size=32, patch_size=8),
        projection_dim=16)
    return T.CLIPModel(cfg), dict(input_ids=ids, attention_mask=mask,
                                  pixel_values=torch.randn(B, 3, 32, 32), return_loss=True)


FAMILIES = [
    "llama (padded)", "gpt2 (padded)", "mistral (labels=input_ids)",
    "qwen2 (labels=input_ids)",  # decoder-only
    "bert (padded, token types)",  # encoder-only
    "t5", "t5 (padded)", "bart (padded)",  # encoder-decoder
    "vit", "whisper", "clip (padded)",  # vision, speech, multimodal
]


@pytest.mark.parametrize("name", FAMILIES)
def test_estimate_equals_the_measured_peak(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, kwargs = _family(name)
    loss_fn = lambda out: out.loss  # noqa: E731
    est = estimate(model, (), example_kwargs=kwargs, loss_fn=loss_fn,
                   optimizer=torch.optim.AdamW, device="cpu")
    mem = _measure(model, kwargs, loss_fn)
    assert est.peak == mem.peak, (est.peak, mem.peak, est.peak_by_category,
                                  mem.peak_by_category)
    assert est.peak_by_category == mem.peak_by_category


def test_advice_on_a_padded_batch():
    # the advice's own dry runs (and its search for the largest logits) read the mask too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, kwargs = _family("llama (padded)")
    est = estimate(model, (), example_kwargs=kwargs, optimizer=torch.optim.AdamW, device="cpu")
    advice = est.advice
    assert advice and not any("no advice" in line for line in advice), advice
    assert any("hr.convert" in line for line in advice), advice


def test_a_measured_report_advises_on_its_padded_batch(capsys):
    # the tracker keeps the step's inputs for the advice (ids and labels=ids, one tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, kwargs = _family("llama (padded)")
    opt = torch.optim.AdamW(model.parameters())
    with hr.track_memory(model=model, optimizer=opt) as mem:
        model(kwargs["input_ids"], attention_mask=kwargs["attention_mask"],
              labels=kwargs["labels"]).loss.backward()
        opt.step()
    text = mem.report()
    assert "what would cut the peak most" in text and "no advice" not in text, text


class _Branching(nn.Module):
    """Keeps a large extra activation when the batch is padded: its path depends on the
    values of its integer input, as transformers' masks do."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.lin = nn.Linear(64, 64)

    def forward(self, ids, mask):
        h = self.emb(ids)
        if not bool(mask.all()):  # padding: a detour that keeps more for backward
            keep = mask.to(h.dtype).unsqueeze(-1)
            h = torch.tanh(torch.exp(h)) * keep
        n = int(mask.sum().item())  # tokens kept: a Python number from the values
        return self.lin(h).sum() / n


@pytest.mark.parametrize("padded", [False, True])
def test_integer_inputs_steer_the_dry_run_as_the_real_step(padded):
    ids, mask, _ = _batch()
    if not padded:
        mask = torch.ones_like(mask)
    torch.manual_seed(0)
    model = _Branching()
    est = estimate(model, (ids, mask), loss_fn=lambda out: out, optimizer=torch.optim.AdamW,
                   device="cpu")
    opt = torch.optim.AdamW(model.parameters())

    def step():
        model(ids, mask).backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    assert est.peak == mem.peak, (est.peak, mem.peak)
    assert est.max_by_category == mem.max_by_category
    plain = estimate(model, (ids, torch.ones_like(mask)), loss_fn=lambda out: out,
                     optimizer=torch.optim.AdamW, device="cpu")
    acts = est.max_by_category["activations"], plain.max_by_category["activations"]
    assert (acts[0] > acts[1]) == padded, acts


class _Overwritten(nn.Module):
    """Writes values computed from its parameters into a tensor made from its integer input
    (whole, or through a view), then reads it: the dry run must not read stale values."""

    def __init__(self, through_view: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.through_view = through_view

    def forward(self, x, ids):
        picked = ids.clone()
        target = picked[0] if self.through_view else picked
        target.copy_(self.lin(x).argmax(-1)[: target.shape[-1]])
        if picked.sum().item() > 0:
            return self.lin(x).sum()
        return x.sum()


@pytest.mark.parametrize("through_view", [False, True])
def test_values_written_from_unknown_ones_are_not_kept(through_view):
    x = torch.randn(4, 4)
    ids = torch.zeros(1, 4, dtype=torch.long) if through_view else torch.zeros(4,
                                                                              dtype=torch.long)
    with pytest.raises(RuntimeError, match="needs tensor values"):
        estimate(_Overwritten(through_view), (x, ids), device="cpu")


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.emb(ids).flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("same", [True, False])
def test_an_input_given_twice_is_one_tensor(same):
    # labels=input_ids: one tensor in the step, so one stand-in in the dry run
    ids = torch.randint(0, 8, (64, 256))
    labels = ids if same else ids.clone()
    model = _Twice()
    est = estimate(model, (ids,), example_kwargs={"labels": labels}, device="cpu",
                   optimizer=torch.optim.SGD)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(ids, labels=labels).backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    assert est.peak == mem.peak, (est.peak, mem.peak)
