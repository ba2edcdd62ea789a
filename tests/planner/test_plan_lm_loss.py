"""hr.plan with a causal LM whose logits dominate the step: the LM-loss patch
(hr.patch_causal_lm) is one of the plan's techniques; and checkpointing, as a plan applies it,
of a model that keeps a key/value cache."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr
from headroom.fit import checkpoint_modules
from headroom.planner import PlanError, Speeds, plan

transformers = pytest.importorskip("transformers")

SPEEDS = Speeds(matmul=1e10, conv=1e10, memory=1e10, op=1e-5, disk_read=1e9, disk_write=5e8)
VOCAB = 32000


def llama(vocab=VOCAB):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(cfg)


torch.manual_seed(1)
IDS = torch.randint(0, VOCAB, (2, 64))
STEP = {"labels": IDS}  # a causal LM trained on its inputs: model(ids, labels=ids).loss


def train(model, opt, steps=3):
    """``steps`` steps; the second one measured (steady state)."""
    def step():
        model(IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    for _ in range(steps - 2):
        step()
    return mem


@pytest.fixture(scope="module")
def plain_peak():
    model = llama()
    return train(model, torch.optim.AdamW(model.parameters()), steps=2).peak


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)  # lm_head tied to the embedding


@pytest.mark.parametrize("make", [llama, gpt2])
def test_the_patch_dry_run_is_the_patched_step(make):
    from headroom.heads import patch_causal_lm_dry_run

    est = hr.estimate(make(), (IDS,), example_kwargs=STEP, optimizer=torch.optim.AdamW,
                      device="cpu", prepare=patch_causal_lm_dry_run)
    model = make()
    hr.patch_causal_lm(model)
    mem = train(model, torch.optim.AdamW(model.parameters()), steps=2)
    assert est.peak == mem.peak, (est.peak, mem.peak)
    assert est.peak_by_category == mem.peak_by_category


def test_the_plan_patches_the_lm_loss_when_only_it_fits(plain_peak):
    # The logits (2 x 64 x 32000 fp32) and their gradient are about half the peak: on the
    # CPU without a disk, neither checkpointing nor hr.convert comes near 70% of it.
    budget = int(0.7 * plain_peak)
    p = plan(llama(), (IDS,), example_kwargs=STEP, budget=budget, device="cpu",
             speeds=SPEEDS)
    assert p.choice.lm_loss, str(p)
    assert "hr.patch_causal_lm" in str(p) and "hr.patch_causal_lm(model)" in p.code()
    compile(p.code(), "<plan>", "exec")
    model, opt = p.apply(llama())
    assert model(IDS, labels=IDS).logits is None  # patched
    model.zero_grad()
    mem = train(model, opt)
    assert 0.95 * p.peak <= mem.peak <= p.peak <= budget, (mem.peak, p.peak, budget)
    # the same as patching by hand, bitwise (the patch is the model's loss to rounding only:
    # print(plan) says so)
    ref = llama()
    hr.patch_causal_lm(ref)
    train(ref, torch.optim.AdamW(ref.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(),
                                                 strict=True))
    assert "to rounding" in str(p)


def test_the_patch_combines_with_offload_to_disk(plain_peak, tmp_path):
    budget = int(0.3 * plain_peak)
    p = plan(llama(), (IDS,), example_kwargs=STEP, budget=budget, device="cpu",
             speeds=SPEEDS, disk=tmp_path)
    assert p.choice.lm_loss and p.choice.optimizer_state == "disk", str(p)
    model, opt = p.apply(llama())
    mem = train(model, opt)
    assert 0.95 * (p.peak - p.margin) <= mem.peak <= budget, (mem.peak, p.peak, budget)
    ref = llama()
    hr.patch_causal_lm(ref)
    train(ref, torch.optim.AdamW(ref.parameters()))
    if getattr(model, "_headroom_offload", None) is not None:
        model = hr.unoffload(model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(),
                                                 strict=True))


def test_plan_error_names_the_patch():
    with pytest.raises(PlanError, match=r"hr\.patch_causal_lm"):
        plan(llama(), (IDS,), example_kwargs=STEP, budget="1MiB", device="cpu", speeds=SPEEDS)


def test_lm_loss_option(plain_peak):
    budget = int(0.7 * plain_peak)
    with pytest.raises(PlanError, match="lm_loss=None allows hr.patch_causal_lm"):
        plan(llama(), (IDS,), example_kwargs=STEP, budget=budget, device="cpu", speeds=SPEEDS,
             lm_loss=False)  # without the patch nothing fits
    # by default only where nothing bitwise fits; asked for, wherever it applies
    p = plan(llama(), (IDS,), example_kwargs=STEP, budget=2 * plain_peak, device="cpu",
             speeds=SPEEDS)
    assert not p.choice.lm_loss and any(c.lm_loss for c, _, _ in p.candidates)
    p = plan(llama(), (IDS,), example_kwargs=STEP, budget=2 * plain_peak, device="cpu",
             speeds=SPEEDS, lm_loss=True)
    assert p.choice.lm_loss
    # a step that computes no loss inside the model: the patch does not apply
    with pytest.raises(ValueError, match="does not apply"):
        plan(llama(), (IDS,), loss_fn=lambda out: out.logits.sum(), budget=2 * plain_peak,
             device="cpu", speeds=SPEEDS, lm_loss=True)
    p = plan(llama(), (IDS,), loss_fn=lambda out: out.logits.sum(), budget=2 * plain_peak,
             device="cpu", speeds=SPEEDS)
    assert not p.choice.lm_loss and all(not c.lm_loss for c, _, _ in p.candidates)


def test_lm_loss_refused_for_a_patched_dry_run_that_raises_without_a_message():
    def loss_fn(out):
        if out.logits is None:  # patched: the loss_fn needs the logits it no longer gets
            raise RuntimeError()
        return out.loss

    ids = IDS[:, :8] % 256
    with pytest.raises(ValueError, match=r"its dry run fails \(RuntimeError: \)"):
        plan(llama(vocab=256), (ids,), example_kwargs={"labels": ids}, loss_fn=loss_fn,
             budget="1GiB", device="cpu", speeds=SPEEDS, lm_loss=True)


@pytest.mark.parametrize("masked", [False, True])
def test_checkpointed_blocks_keep_no_kv_cache_in_training(masked):
    # Llama keeps a key/value cache in training too (use_cache=True): checkpointed as a plan
    # applies it, each block's recomputation would append its keys again and attend over both
    # (silently other gradients without a mask; an error with one).
    model = llama(vocab=100)
    ref = copy.deepcopy(model)
    checkpoint_modules(model, ["model.layers.0", "model.layers.1"])
    ids = IDS[:, :12] % 100
    kw = {}
    if masked:
        mask = torch.ones_like(ids)
        mask[1, 8:] = 0
        kw["attention_mask"] = mask
    for m in (model, ref):
        m(ids, labels=ids, **kw).loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(),
                                                           ref.parameters(), strict=True))
