"""Advice at the end of reports: figures from dry runs, and reports that never fail for it."""

from __future__ import annotations

import io
import re

import pytest
import torch
from torch import nn

import headroom as hr
from headroom.memory import format_bytes


def blocks():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
                           for _ in range(4)])


X = torch.randn(512, 64)


def technique(lines: list[str], start: str) -> str:
    """The advice line of the technique whose label starts with ``start`` (lines are
    numbered by saving; those that save nothing are listed together)."""
    for ln in lines:
        text = re.sub(r"^\s*\d+\. ", "", ln)
        if text.startswith(start):
            return text
        if ln.strip().startswith("saves nothing here:") and start in ln:
            return ln.strip()
    raise AssertionError(f"no advice line for {start!r}: {lines}")


def test_estimate_advice_figures_are_dry_run_differences():
    model = blocks()
    est = hr.estimate(model, (X,), optimizer=None)
    names = [f"{i}" for i in range(4)]
    ckpt = hr.estimate(model, (X,), optimizer=None, checkpoint=names)
    assert ckpt.peak < est.peak
    text = est.report(file=open("/dev/null", "w"))  # noqa: SIM115
    assert "what would cut the peak most" in text
    line = technique(est.advice, "checkpointing the 4 blocks (0 to 3)")
    assert f"saves about {format_bytes(est.peak - ckpt.peak)}" in line
    assert "bitwise the same results" in line and "step time +" in line
    acts = est.peak_by_category["activations"]
    assert (f"the largest part of the peak is activations (saved for backward),"
            f" {format_bytes(acts)} of {format_bytes(est.peak)}") in text


def test_tracker_report_ends_with_advice_while_the_model_lives(capsys):
    model = blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        model(X).sum().backward()
        opt.step()
    text = mem.report()
    assert "what would cut the peak most" in text
    assert f"this run measured {format_bytes(mem.peak)}" in text
    assert "advice" not in mem.report(advice=False)
    del model, opt
    import gc

    gc.collect()
    with hr.track_memory() as mem2:
        m = blocks()
        m(X).sum().backward()
    del m
    gc.collect()
    assert "no longer alive" in mem2.report()


def test_a_failing_dry_run_gives_a_line_not_an_error():
    class ValueDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x[x > 0].reshape(-1, 4))

    model = ValueDependent()
    x = torch.ones(8, 4)
    with hr.track_memory(model=model) as mem:
        model(x).sum().backward()
    text = mem.report()
    assert "(no advice: a dry run of the step failed" in text


def test_advice_names_the_logits_when_they_dominate():
    class Head(nn.Module):  # a language model's shape: small body, wide output
        def __init__(self, classes):
            super().__init__()
            self.body = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, classes, bias=False)

        def forward(self, x):
            return self.lm_head(torch.tanh(self.body(x)))

    x = torch.randn(256, 32)
    models = [Head(8192), Head(16), blocks()]  # advice needs the models alive
    wide = hr.estimate(models[0], (x,), optimizer=None, loss_fn=lambda o: o.logsumexp(-1).sum())
    line = next(ln for ln in wide.advice if ln.strip().startswith("the logits of lm_head"))
    assert "256 x 8192" in line and format_bytes(256 * 8192 * 4) in line
    assert "hr.linear_cross_entropy(hidden, lm_head.weight, labels)" in line
    narrow = hr.estimate(models[1], (x,), optimizer=None, loss_fn=lambda o: o.sum())
    assert narrow.advice and not any("logits" in ln for ln in narrow.advice)
    other = hr.estimate(models[2], (X,), optimizer=None)
    assert other.advice and not any("logits" in ln for ln in other.advice)


def test_other_is_broken_down_into_what_it_holds():
    class Head(nn.Module):
        def __init__(self, classes):
            super().__init__()
            self.body = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, classes, bias=False)

        def forward(self, x):
            return self.lm_head(torch.tanh(self.body(x)))

    x = torch.randn(256, 32)
    model = Head(8192)  # alive while the advice runs
    wide = hr.estimate(model, (x,), optimizer=None,
                       loss_fn=lambda o: nn.functional.cross_entropy(o, torch.zeros(
                           256, dtype=torch.long, device=o.device)))
    assert max(wide.peak_by_category, key=wide.peak_by_category.get) == "other"
    line = next(ln for ln in wide.advice
                if ln.strip().startswith("the largest part of the peak is other tensors"))
    assert "the logits of lm_head and their gradient" in line

    class Squares(nn.Module):  # "other" without a wide head: temporaries
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return (self.lin(x) ** 2).exp().pow(3)

    small = Squares()
    est = hr.estimate(small, (torch.randn(4096, 64),), optimizer=None,
                      loss_fn=lambda o: (o * o).sum())
    assert max(est.peak_by_category, key=est.peak_by_category.get) == "other"
    line = next(ln for ln in est.advice
                if ln.strip().startswith("the largest part of the peak is other tensors"))
    assert "temporaries" in line and "logits" not in line


def test_advice_inside_activation_offload_says_it_is_on(tmp_path):
    model = blocks()
    x = torch.randn(2048, 64)  # 512 KiB per saved activation
    with hr.track_memory(model=model) as mem, hr.offload_activations(
            store=hr.DiskStore(tmp_path / "act"), min_bytes=1 << 16, prefetch=1 << 20):
        model(x).sum().backward()
    resting = mem.resting_max["disk"]["activations"]
    assert resting > 0
    text = mem.report()
    assert f"activation offload is on in this run ({format_bytes(resting)}" in text
    assert "activation offload (hr.offload_activations" not in text
    with hr.track_memory(model=model) as plain:
        model(x).sum().backward()
    assert "activation offload is on" not in plain.report()
    assert "activation offload (hr.offload_activations" in plain.report()


class _MLPBlock(nn.Module):
    def __init__(self, dim: int = 256, *, fp32_tail: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.fp32_tail = fp32_tail

    def forward(self, x):
        h = nn.functional.gelu(self.up(self.norm(x)))
        if self.fp32_tail:  # a region the model keeps in fp32, as rotary embeddings do
            with torch.autocast(x.device.type, enabled=False):
                return x + self.down(h.float())
        return x + self.down(h)


class _MLP(nn.Module):
    def __init__(self, *, fp32_tail: bool = False, classes: int = 1000) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MLPBlock(fp32_tail=fp32_tail) for _ in range(3))
        self.head = nn.Linear(256, classes)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _measured_peak(model, opt, batches, loss_of, *, autocast=None) -> int:
    """The tracker's peak of a steady-state step: one forward and backward per micro-batch
    (each batch's tensors made before it, as a loader makes them; ``loss / len``), then the
    optimizer's step."""

    def step(parts):
        k = len(parts)
        while parts:
            xb = parts.pop(0)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                enabled=autocast is not None):
                loss = loss_of(model(xb), xb)
            del xb
            if k > 1:
                loss = loss / k
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step([b.clone() for b in batches])  # optimizer state created
    parts = [b.clone() for b in batches]
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step(parts)
    return mem.peak


def _loss(out, _xb=None):
    labels = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
    return nn.functional.cross_entropy(out, labels)


@pytest.fixture(scope="module")
def mlp():
    """An MLP step whose activations and logits dominate (SGD), its estimate and advice."""
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(512, 256)
    step = {"optimizer": torch.optim.SGD, "optimizer_kwargs": {"lr": 0.1}, "loss_fn": _loss}
    est = hr.estimate(model, (x,), **step)
    return model, x, step, est, est.advice


def test_autocast_advice_matches_a_measured_autocast_step(mlp):
    """The advice's autocast saving is a dry run under the CPU's autocast (bf16): the plain
    step's estimate less it is within 5% of the measured step under torch.autocast (here to
    the byte); fp16 and a region the model keeps in fp32 (autocast off inside it) too."""
    model, x, step, est, advice = mlp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    line = technique(advice, "mixed precision: autocast in bf16")
    amp = hr.estimate(model, (x,), **step, autocast=torch.bfloat16)
    saving = est.peak - amp.peak
    assert f"saves about {format_bytes(saving)}" in line
    assert "different numerics" in line and "torch.autocast('cpu'" in line
    assert _measured_peak(model, opt, [x], _loss) == est.peak
    measured = _measured_peak(model, opt, [x], _loss, autocast=torch.bfloat16)
    assert saving > 0.1 * est.peak  # a real saving: bf16 activations
    assert abs((est.peak - saving) - measured) <= 0.05 * measured, (measured, amp.peak)
    assert amp.peak == measured
    fp16 = hr.estimate(model, (x,), **step, autocast=torch.float16)
    assert fp16.peak == _measured_peak(model, opt, [x], _loss, autocast=torch.float16)
    torch.manual_seed(0)
    tail = _MLP(fp32_tail=True)
    opt = torch.optim.SGD(tail.parameters(), lr=0.1)
    amp = hr.estimate(tail, (x,), **step, autocast=torch.bfloat16)
    assert amp.peak == _measured_peak(tail, opt, [x], _loss, autocast=torch.bfloat16)
    assert amp.peak > est.peak - saving  # the fp32 region keeps more


def test_split_advice_matches_measured_accumulation(mlp):
    """Gradient accumulation over k micro-batches: the advice's saving is a dry run of k
    forwards and backwards of batch/k and one step; the estimate less it is within 5% of the
    measured accumulation step (here to the byte)."""
    model, x, step, est, advice = mlp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in (2, 4):
        line = technique(advice, f"gradient accumulation over {k} micro-batches")
        split = hr.estimate(model, (x,), **step, micro_batches=k)
        saving = est.peak - split.peak
        assert f"(batch 512 -> {512 // k})" in line
        assert "equal to rounding" in line and "step time" in line
        measured = _measured_peak(model, opt, list(x.tensor_split(k)), _loss)
        assert saving > 0.1 * est.peak
        assert abs((est.peak - saving) - measured) <= 0.05 * measured, (measured, split.peak)
        assert split.peak == measured


def test_accumulation_that_cuts_most_is_advised_first():
    """A batch whose activations dominate and come from many layers of small tensors (none
    reaches activation offload's 1 MiB, no blocks to checkpoint): accumulation is first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    x = torch.randn(1024, 128)
    est = hr.estimate(model, (x,), optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    ranked = [ln for ln in est.advice if re.match(r"\s*\d+\. ", ln)]
    assert ranked[0].strip().startswith("1. gradient accumulation over 4 micro-batches"), \
        est.advice
    assert ranked[1].strip().startswith("2. gradient accumulation over 2 micro-batches")


def test_a_smaller_optimizer_is_a_dry_run_of_it():
    """Adafactor instead of AdamW: the dry run steps torch.optim.Adafactor (its norms, read
    for the step size only, taken as 1 on meta); the saving equals the measured difference."""
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(64, 256)
    est = hr.estimate(model, (x,), optimizer=torch.optim.AdamW)
    line = technique(est.advice, "torch.optim.Adafactor instead of AdamW")
    measured = {}
    for cls in (torch.optim.AdamW, torch.optim.Adafactor):
        opt = cls(model.parameters())
        measured[cls] = _measured_peak(model, opt, [x], lambda o, xb: o.sum())
    saving = measured[torch.optim.AdamW] - measured[torch.optim.Adafactor]
    assert saving > 0
    assert f"saves about {format_bytes(saving)}" in line
    assert "different training" in line


def test_autocast_dry_run_follows_the_target_devices_autocast():
    """The casts are the target's autocast's: CUDA's runs layer_norm in fp32 (its input cast
    up, an fp32 copy saved), the CPU's in the input's dtype; so the same step keeps more
    activations on cuda. Bad what-ifs are clear errors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64))
    x = torch.randn(256, 64)
    acts = {dev: hr.estimate(model, (x,), device=dev, autocast=torch.bfloat16)
            .max_by_category["activations"] for dev in ("cpu", "cuda")}
    # the LayerNorm saves its input: bf16 on the CPU, cast to fp32 on CUDA (2 bytes more per
    # element); the next Linear saves its bf16 input on both
    assert acts["cuda"] - acts["cpu"] == 256 * 256 * 2
    with pytest.raises(ValueError, match="torch.bfloat16 or torch.float16"):
        hr.estimate(model, (x,), autocast=torch.float32)
    with pytest.raises(ValueError, match="micro_batches=512 splits"):
        hr.estimate(model, (x,), micro_batches=512)
    with pytest.raises(ValueError, match="an int >= 1"):
        hr.estimate(model, (x,), micro_batches=0)


def test_block_names_read_as_what_they_are():
    from headroom.fit._advice import _names

    assert _names(["layers.0", "layers.1", "layers.2"]) == "layers.0 to layers.2"
    assert _names(["0", "3", "6", "9"]) == "0, 3, 6, 9"  # not "0 to 9": 1, 2, 4... are not
    assert _names([f"h.{i}" for i in range(0, 12, 2)]) == "h.0, h.2, h.4, h.6 and 2 more"


def test_a_split_the_loss_cannot_take_says_why():
    """A loss_fn closing over labels of the whole batch: the split's line says it was not
    estimated and why, the other techniques are still there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))
    est = hr.estimate(model, (x,), loss_fn=lambda o: nn.functional.cross_entropy(o, y))
    line = next(ln for ln in est.advice if "gradient accumulation over 2" in ln)
    assert "not estimated" in line and "labels it closes over" in line
    assert any(re.match(r"\s*\d+\. mixed precision", ln) for ln in est.advice), est.advice


def test_autocast_dry_run_casts_inside_python_functions():
    """nn.MultiheadAttention runs F.multi_head_attention_forward, a Python function: autocast
    casts the ops it calls (its projections, its attention), not its arguments as one op; the
    estimate equals the measured autocast step (cast as one op, it was 256 KiB above)."""
    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.att = nn.MultiheadAttention(128, 4, batch_first=True)
            self.norm = nn.LayerNorm(128)
            self.lin = nn.Linear(128, 128)

        def forward(self, x):
            h = self.norm(x)
            a, _ = self.att(h, h, h, need_weights=False)
            return self.lin(nn.functional.gelu(a + x)).softmax(-1)

    model = Attention()
    x = torch.randn(8, 64, 128)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(o, _xb=None):
        return o.float().pow(2).mean()

    est = hr.estimate(model, (x,), loss_fn=loss, optimizer=torch.optim.SGD,
                      optimizer_kwargs={"lr": 0.1}, autocast=torch.bfloat16)
    assert est.peak == _measured_peak(model, opt, [x], loss, autocast=torch.bfloat16)


def test_a_run_under_autocast_is_advised_under_it(mlp):
    """The measured forward ran inside torch.autocast: the advice's dry runs run in it (the
    step it estimates, the model's output summed, under autocast), and mixed precision is said
    to be on, not offered."""
    model, x, step, est, advice = mlp
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _measured_peak(model, opt, [x], _loss)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        del loss
    text = mem.report(file=io.StringIO())
    assert hr.estimate(model, (x,), **step, autocast=torch.bfloat16).peak == mem.peak
    sgd = {k: v for k, v in step.items() if k != "loss_fn"}  # the advice knows no loss_fn
    amp = hr.estimate(model, (x,), **sgd, autocast=torch.bfloat16)
    assert amp.peak != hr.estimate(model, (x,), **sgd).peak
    assert f"is estimated at {format_bytes(amp.peak)}; this run measured" in text
    assert "autocast in bf16 is on in this run" in text
    assert "mixed precision: autocast" not in text


def test_a_region_naming_the_target_device_is_the_dry_runs_autocast():
    """Model code that turns autocast off for "cuda" by name (not its input's device) keeps
    that part in fp32 in a dry run for cuda, as it does on the GPU."""

    class Tail(nn.Module):
        def __init__(self, device_type):
            super().__init__()
            self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
            self.device_type = device_type

        def forward(self, x):
            h = self.up(x)
            with torch.autocast(self.device_type or x.device.type, enabled=False):
                return self.down(h.float())

    x = torch.randn(256, 64)
    peaks = {}
    for name in ("cuda", None):
        torch.manual_seed(0)
        peaks[name] = hr.estimate(Tail(name), (x,), device="cuda", autocast=torch.bfloat16).peak
    torch.manual_seed(0)
    whole = hr.estimate(nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64)), (x,),
                        device="cuda", autocast=torch.bfloat16).peak
    assert peaks["cuda"] == peaks[None] != whole
