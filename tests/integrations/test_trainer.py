"""transformers.Trainer with hr.offload + hr.HostOptimizer: bitwise the run without headroom.

Trainer clips with its default ``max_grad_norm=1.0`` through ``torch.nn.utils.clip_grad_norm_``
over ``model.parameters()`` and logs ``grad_norm.item()`` every step: the gradients of
parameters on disk, and the fp32 gradients of bf16 parameters, must read as tensors there.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

from tests.integrations._models import (
    LMData,
    assert_runs_equal,
    assert_same_state,
    count_holds,
    gpt2,
    offload,
    optimizer,
    state,
    train_logged,
)

pytest.importorskip("transformers")

# fp32 weights; fp32 weights under bf16 autocast; bf16 weights (the optimizer's fp32 masters)
MODES = {"fp32": (torch.float32, False), "bf16-autocast": (torch.float32, True),
         "bf16-weights": (torch.bfloat16, False)}


def _train(mode: str, store: str | None, headroom: bool, tmp_path):
    from transformers import Trainer, TrainingArguments

    dtype, bf16 = MODES[mode]
    model = offload(gpt2(dtype), store, tmp_path)
    opt = optimizer(model, headroom)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=bf16, seed=0,
        disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=LMData(), optimizers=(opt, None))
    return train_logged(trainer, model)


@pytest.mark.parametrize("mode", list(MODES))
def test_trainer_with_offload_and_host_optimizer_is_exact(mode, tmp_path):
    # The reference without headroom: torch's AdamW; for bf16 weights (no fp32 masters in
    # torch.optim) HostOptimizer alone, whose step and clipping equal a plain-torch fp32-master
    # loop (tests/optim/test_grads.py).
    assert_runs_equal(partial(_train, mode), mode == "bf16-weights", tmp_path)


@pytest.mark.parametrize("mode", ["fp32", "bf16-weights"])
def test_gradient_accumulation_summed_on_the_device_is_exact(mode, tmp_path, monkeypatch):
    """gradient_accumulation_steps=2 with hr.offload(grad_accumulation="device"): Trainer's
    clipping and logged norm read the sums through param.grad; the same logs and state."""
    from transformers import Trainer, TrainingArguments

    dtype = MODES[mode][0]

    def run(store, headroom, tmp):
        model = offload(gpt2(dtype), store, tmp, grad_accumulation="device")
        args = TrainingArguments(
            output_dir=str(tmp / "out"), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=LMData(),
                          optimizers=(optimizer(model, headroom), None))
        return train_logged(trainer, model)

    holds = count_holds(monkeypatch)
    assert_runs_equal(run, mode == "bf16-weights", tmp_path)
    assert holds[0] > 0


def test_bf16_on_disk_summed_on_the_device_without_undo_copies_is_exact(tmp_path, monkeypatch):
    """The placement llm_finetune uses for models whose masters and state fit in RAM but not
    their parameters too: bf16 weights on a DiskStore, sums on the device,
    HostOptimizer(atomic=False); Trainer with accumulation and clipping logs and ends the same
    as HostOptimizer alone."""
    from transformers import Trainer, TrainingArguments

    def run(store, headroom, tmp):
        model = offload(gpt2(torch.bfloat16), store, tmp, grad_accumulation="device")
        args = TrainingArguments(
            output_dir=str(tmp / "out"), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=LMData(),
                          optimizers=(optimizer(model, headroom, atomic=False), None))
        return train_logged(trainer, model)

    holds = count_holds(monkeypatch)
    assert_runs_equal(run, True, tmp_path)
    assert holds[0] > 0


def _resumed(store: str | None, headroom: bool, tmp_path):
    """Two steps, a checkpoint, then a new model and optimizer resumed to four steps."""
    from transformers import Trainer, TrainingArguments

    def train(steps: int, **kw):
        model = offload(gpt2(), store, tmp_path / f"store{steps}")
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
            seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=LMData(),
                          optimizers=(optimizer(model, headroom), None))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train(**kw)
        return model

    train(2)
    return state(train(4, resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2")))


def test_trainer_resume_from_checkpoint_on_disk_is_exact(tmp_path):
    """save_model's weights and the HostOptimizer state come back into a new DiskStore."""
    assert_same_state(_resumed(None, False, tmp_path / "ref"), _resumed("disk", True, tmp_path))


class _TwoTasks(torch.nn.Module):
    """GPT-2's trunk and one LM head per task; a batch trains the head its first example names,
    so each step leaves the other head without a gradient."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        base = gpt2(dtype)
        self.trunk = base.transformer
        self.heads = torch.nn.ModuleList(
            torch.nn.Linear(32, base.config.vocab_size, bias=False, dtype=dtype)
            for _ in range(2))
        self.seen: list[int] = []  # the task of each step

    def forward(self, input_ids, labels, task):
        self.seen.append(int(task[0]))
        logits = self.heads[int(task[0])](self.trunk(input_ids).last_hidden_state).float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return {"loss": loss}


class _TaskData(LMData):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "task": torch.tensor(i % 2)}


@pytest.mark.parametrize("mode", ["fp32", "bf16-weights"])
def test_a_head_without_gradient_in_a_step_is_not_stepped(mode, tmp_path):
    """Trainer clears gradients with model.zero_grad() (param.grad = None): a head that gets
    no gradient in a step is skipped by the step, as torch's AdamW skips it, not stepped
    again with the gradient of the step before (which a store still held)."""
    from transformers import Trainer, TrainingArguments

    dtype = MODES[mode][0]

    seen = {}

    def run(store, headroom, tmp):
        model = offload(_TwoTasks(dtype), store, tmp)
        args = TrainingArguments(
            output_dir=str(tmp / "out"), max_steps=3, per_device_train_batch_size=4,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
            disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=_TaskData(),
                          optimizers=(optimizer(model, headroom), None))
        seen[store] = model.seen
        return train_logged(trainer, model)

    assert_runs_equal(run, mode == "bf16-weights", tmp_path)
    # the same tasks in every run, and a step whose head had a gradient the step before
    assert seen["cpu"] == seen["disk"] == seen[None]
    assert any(a != b for a, b in zip(seen[None], seen[None][1:], strict=False)), seen


@pytest.mark.slow
def test_trainer_torch_compile_matches_compiled_plain_to_rounding(tmp_path):
    """TrainingArguments(torch_compile=True): Trainer compiles the offloaded model (the blocks'
    forwards, inductor) and trains it with HostOptimizer from a DiskStore; logs and weights
    match the compiled plain run to rounding. Dropout is off: inductor draws per graph, so a
    model compiled whole and one compiled block by block draw different masks."""
    from transformers import Trainer, TrainingArguments

    def run(store, headroom, tmp):
        model = gpt2()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        model = offload(model, store, tmp)
        args = TrainingArguments(
            output_dir=str(tmp / "out"), max_steps=3, per_device_train_batch_size=4,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
            disable_tqdm=True, torch_compile=True)
        trainer = Trainer(model=model, args=args, train_dataset=LMData(),
                          optimizers=(optimizer(model, headroom), None))
        return train_logged(trainer, model)

    torch._dynamo.reset()
    ref_logs, ref_state = run(None, False, tmp_path / "ref")
    logs, st = run("disk", True, tmp_path / "disk")
    torch.testing.assert_close(torch.tensor(logs), torch.tensor(ref_logs), rtol=1e-5, atol=1e-6)
    for k, v in ref_state.items():
        torch.testing.assert_close(st[k], v, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("reentrant", [False, True])
def test_trainer_enabling_checkpointing_after_offload_is_exact(reentrant, tmp_path):
    """TrainingArguments(gradient_checkpointing=True): Trainer switches checkpointing on in the
    already offloaded model (each block recomputed in backward, its parameters fetched again);
    the same logs and state as the run without headroom."""
    from transformers import Trainer, TrainingArguments

    from tests.integrations._models import llama

    # transformers 5 renamed the switch (the old name still works, with a warning)
    name = ("activation_checkpointing" if "activation_checkpointing" in
            TrainingArguments.__dataclass_fields__ else "gradient_checkpointing")
    ckpt = {name: True, f"{name}_kwargs": {"use_reentrant": reentrant}}

    def run(store, headroom, tmp):
        model = offload(llama(), store, tmp)
        args = TrainingArguments(
            output_dir=str(tmp / "out"), max_steps=3, per_device_train_batch_size=4,
            logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
            disable_tqdm=True, **ckpt)
        trainer = Trainer(model=model, args=args, train_dataset=LMData(),
                          optimizers=(optimizer(model, headroom), None))
        return train_logged(trainer, model)

    assert_runs_equal(run, False, tmp_path)
