"""Lightning (configure_optimizers, gradient_clip_val, ModelCheckpoint + fit(ckpt_path=...))
with hr.offload + hr.HostOptimizer: bitwise the run without headroom."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from tests.integrations._models import (
    assert_same_state,
    count_holds,
    gpt2,
    offload,
    state,
    token_ids,
)

L = pytest.importorskip("lightning")

MODES = {"fp32": (torch.float32, "32-true"), "bf16-autocast": (torch.float32, "bf16-mixed"),
         "bf16-weights": (torch.bfloat16, "bf16-true")}
STEPS, SPLIT = 4, 2


class _LM(L.LightningModule):
    def __init__(self, dtype, store, headroom, tmp, impl, **offload_kw):
        super().__init__()
        self.lm = offload(gpt2(dtype), store, tmp, **offload_kw)
        self.headroom = headroom
        self.impl = impl
        self.norms: list[float] = []

    def training_step(self, x, i):
        return self.lm(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        # fused=False by default: Lightning refuses to clip for a fused torch optimizer under
        # bf16-mixed, so the run without headroom cannot use the kernel HostOptimizer picks.
        if self.headroom:
            import headroom as hr

            return hr.HostOptimizer(self.parameters(), torch.optim.AdamW, lr=1e-3, **self.impl)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, **self.impl)

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.nn.utils.get_total_norm(grads).item())


def _run(mode: str, store: str | None, headroom: bool, tmp_path, accum: int = 1,
         impl: dict | None = None, **offload_kw):
    """STEPS steps with gradient_clip_val=1.0 (of ``accum`` micro-batches each): SPLIT of
    them, a checkpoint, and the rest in a new Trainer and module resumed with
    fit(ckpt_path=...)."""
    dtype, precision = MODES[mode]
    kw = dict(accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
              enable_progress_bar=False, enable_model_summary=False, precision=precision,
              default_root_dir=str(tmp_path), accumulate_grad_batches=accum)

    def loader():
        return torch.utils.data.DataLoader(token_ids(2 * STEPS * accum), batch_size=2)

    ck = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"),
                                             every_n_train_steps=SPLIT, save_top_k=-1)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = {"fused": False} if impl is None else impl
        first = _LM(dtype, store, headroom, tmp_path / "a", impl, **offload_kw)
        L.Trainer(max_steps=SPLIT, callbacks=[ck], **kw).fit(first, loader())
        path = ck.best_model_path or ck.last_model_path
        assert path.endswith(f"step={SPLIT}.ckpt"), path
        second = _LM(dtype, store, headroom, tmp_path / "b", impl, **offload_kw)
        L.Trainer(max_steps=STEPS, enable_checkpointing=False, **kw).fit(
            second, loader(), ckpt_path=path)
    return first.norms + second.norms, state(second)


@pytest.mark.parametrize("mode", list(MODES))
def test_lightning_with_offload_and_host_optimizer_is_exact(mode, tmp_path):
    ref_norms, ref_state = _run(mode, None, mode == "bf16-weights", tmp_path / "ref")
    assert len(ref_norms) == STEPS and any(n > 1.0 for n in ref_norms)  # clipping acts
    for store in ("cpu", "disk"):
        norms, st = _run(mode, store, True, tmp_path / store)
        assert norms == ref_norms, store
        assert_same_state(ref_state, st)


def test_host_optimizers_default_clips_under_bf16_mixed_equal_to_rounding(tmp_path):
    """Lightning refuses to clip torch's fused AdamW under bf16-mixed; HostOptimizer's default
    (the same fused kernel, stepping on the host) clips, equal to the run without headroom
    (``AdamW(fused=False)``) to rounding; ``fused=False`` makes it bitwise (above)."""
    with pytest.raises(RuntimeError, match="fused"):
        _run("bf16-autocast", None, False, tmp_path / "fused", impl={"fused": True})
    ref_norms, ref_state = _run("bf16-autocast", None, False, tmp_path / "ref")
    norms, st = _run("bf16-autocast", "cpu", True, tmp_path / "cpu", impl={})
    torch.testing.assert_close(norms, ref_norms)
    assert st.keys() == ref_state.keys()
    for k, v in ref_state.items():
        torch.testing.assert_close(st[k], v, msg=k)


@pytest.mark.parametrize("mode", ["fp32", "bf16-weights"])
def test_accumulate_grad_batches_summed_on_the_device_is_exact(mode, tmp_path, monkeypatch):
    """accumulate_grad_batches=2 with hr.offload(grad_accumulation="device"): Lightning's
    clipping and the norms read in on_before_optimizer_step see the sums."""
    holds = count_holds(monkeypatch)
    ref_norms, ref_state = _run(mode, None, mode == "bf16-weights", tmp_path / "ref", accum=2)
    assert len(ref_norms) == STEPS
    for store in ("cpu", "disk"):
        norms, st = _run(mode, store, True, tmp_path / store, accum=2,
                         grad_accumulation="device")
        assert norms == ref_norms, store
        assert_same_state(ref_state, st)
    assert holds[0] > 0
