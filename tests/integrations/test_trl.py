"""TRL's SFTTrainer (full fine-tune) with hr.offload + hr.HostOptimizer: bitwise the run
without headroom (its default clipping, logging every step)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.integrations._models import (
    assert_runs_equal,
    llama,
    offload,
    optimizer,
    token_ids,
    tokenizer,
    train_logged,
)

pytest.importorskip("trl")

MODES = {"fp32": (torch.float32, False), "bf16-weights": (torch.bfloat16, False)}


def _train(mode: str, store: str | None, headroom: bool, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    dtype, bf16 = MODES[mode]
    model = offload(llama(dtype), store, tmp_path)
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
