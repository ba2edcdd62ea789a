"""TRL's SFTTrainer (full fine-tune, and LoRA through ``peft_config``) with hr.offload +
hr.HostOptimizer: bitwise the run without headroom (its default clipping, logging every step)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from headroom.transfer import binding
from tests.integrations._models import (
    VOCAB,
    assert_runs_equal,
    assert_same_state,
    llama,
    offload,
    optimizer,
    token_ids,
    tokenizer,
    train_logged,
)

pytest.importorskip("trl")

BIG_VOCAB = 32000

# fp32 weights; fp32 weights under bf16 autocast; bf16 weights (the optimizer's fp32 masters)
MODES = {"fp32": (torch.float32, False), "bf16-autocast": (torch.float32, True),
         "bf16-weights": (torch.bfloat16, False)}


def _train(mode: str, store: str | None, headroom: bool, tmp_path, vocab: int = VOCAB):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    dtype, bf16 = MODES[mode]
    model = offload(llama(dtype, vocab), store, tmp_path)
    opt = optimizer(model, headroom)
    data = Dataset.from_dict({"input_ids": token_ids().tolist()})
    cfg = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                    logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=bf16,
                    seed=0, disable_tqdm=True, max_length=16)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=data, optimizers=(opt, None),
                         processing_class=tokenizer())
    return train_logged(trainer, model)


@pytest.mark.parametrize("mode", list(MODES))
def test_sft_trainer_full_fine_tune_with_offload_is_exact(mode, tmp_path):
    assert_runs_equal(partial(_train, mode), mode == "bf16-weights", tmp_path)


@pytest.mark.parametrize("mode", ["fp32", "bf16-weights"])
def test_sft_trainer_fused_lm_head_with_a_real_vocabulary(mode, tmp_path):
    """SFTTrainer's fused LM head (TRL's add_fused_lm_head) reads lm_head.weight inside the
    model's forward; with a 32k vocabulary the head is a block of its own, fetched on that
    read (before: "used outside the forward of their offloaded block" after the first step)."""
    import headroom as hr

    probe = offload(llama(vocab=BIG_VOCAB), "cpu", tmp_path / "probe")
    assert "lm_head" in {b.name for b in hr.describe(probe).blocks}
    assert_runs_equal(partial(_train, mode, vocab=BIG_VOCAB), mode == "bf16-weights", tmp_path)


def _train_dpo(store: str | None, headroom: bool, tmp_path):
    """DPOTrainer: the policy and the reference model each offloaded (on DiskStores of their
    own with ``store="disk"``), both with the fused LM head of a 32k vocabulary."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(4, VOCAB, (n,), generator=g))

    data = Dataset.from_dict({"prompt": [words(5) for _ in range(8)],
                              "chosen": [words(4) for _ in range(8)],
                              "rejected": [words(4) for _ in range(8)]})
    model = offload(llama(vocab=BIG_VOCAB), store, tmp_path / "policy")
    ref = offload(llama(vocab=BIG_VOCAB), store, tmp_path / "reference")
    opt = optimizer(model, headroom)
    cfg = DPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                    logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                    disable_tqdm=True, max_length=16, max_grad_norm=0.1)
    trainer = DPOTrainer(model=model, ref_model=ref, args=cfg, train_dataset=data,
                         optimizers=(opt, None), processing_class=tokenizer())
    return train_logged(trainer, model)


def test_dpo_trainer_policy_and_reference_offloaded(tmp_path):
    ref_logs, ref_state = _train_dpo(None, False, tmp_path / "ref")
    assert len(ref_logs) == 3 and all(n > 0.1 for _, n in ref_logs)  # max_grad_norm clips
    for store in ("cpu", "disk"):
        logs, st = _train_dpo(store, True, tmp_path / store)
        assert logs == ref_logs, store
        assert_same_state(ref_state, st)


def _train_lora(mode: str, store: str | None, headroom: bool, tmp_path):
    """SFTTrainer wraps the model in LoRA itself (``peft_config``), after ``hr.offload``: the
    optimizer is built by Trainer over the adapters, through ``optimizer_cls_and_kwargs``."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    import headroom as hr

    dtype, bf16 = MODES[mode]
    if store == "disk":  # the base never whole in memory: built on meta, loaded into the store
        llama(dtype).save_pretrained(tmp_path / "base")
        with torch.device("meta"):
            model = llama(dtype)
        model = offload(model, store, tmp_path)
        hr.load_weights(model, tmp_path / "base")
    else:
        model = offload(llama(dtype), store, tmp_path)
    opt = ((hr.HostOptimizer, {"lr": 1e-3}) if headroom
           else (torch.optim.AdamW, {"lr": 1e-3, "fused": True}))
    data = Dataset.from_dict({"input_ids": token_ids().tolist()})
    cfg = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                    logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=bf16,
                    seed=0, disable_tqdm=True, max_length=16)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(5)  # the adapters' initialization draws random numbers
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=data, peft_config=lora,
                         optimizer_cls_and_kwargs=opt, processing_class=tokenizer())
    if store is not None:  # the adapters TRL made stay on the device (hr.offload's default
        # adapters="device"), outside the store, trainable, in fp32
        lora = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
        assert lora and all(binding(p) is None and p.requires_grad for p in lora)
        assert {p.dtype for p in lora} == {torch.float32}
    return train_logged(trainer, trainer.model)


@pytest.mark.parametrize("mode", list(MODES))
def test_sft_trainer_peft_config_with_offload_is_exact(mode, tmp_path):
    pytest.importorskip("peft")
    ref_logs, ref_state = _train_lora(mode, None, False, tmp_path / "ref")
    for store in ("cpu", "disk"):
        logs, st = _train_lora(mode, store, True, tmp_path / store)
        assert logs == ref_logs, store
        assert_same_state(ref_state, st)
    # the adapters trained, the frozen base did not change
    base = llama(MODES[mode][0]).state_dict()
    lora = {k for k in ref_state if "lora_" in k}
    assert lora and {k.removeprefix("base_model.model.").replace(".base_layer", "")
                     for k in ref_state.keys() - lora} == base.keys()
    for k in ref_state.keys() - lora:
        assert torch.equal(ref_state[k], base[k.removeprefix("base_model.model.")
                                                .replace(".base_layer", "")]), k
