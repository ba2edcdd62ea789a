"""Advice at the end of reports: figures from dry runs, and reports that never fail for it."""

from __future__ import annotations

import re

import torch
from torch import nn

import headroom as hr
from headroom.memory import format_bytes


def blocks():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
                           for _ in range(4)])


X = torch.randn(512, 64)


def test_estimate_advice_figures_are_dry_run_differences():
    model = blocks()
    est = hr.estimate(model, (X,), optimizer=None)
    names = [f"{i}" for i in range(4)]
    ckpt = hr.estimate(model, (X,), optimizer=None, checkpoint=names)
    assert ckpt.peak < est.peak
    text = est.report(file=open("/dev/null", "w"))  # noqa: SIM115
    assert "what would cut the peak most" in text
    line = next(ln for ln in est.advice if ln.strip().startswith("checkpointing the 4 blocks"))
    assert format_bytes(est.peak - ckpt.peak) in line
    assert re.search(r"activations are \d+% of the peak", text)


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
    line = next(ln for ln in wide.advice if ln.strip().startswith("other are"))
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
    line = next(ln for ln in est.advice if ln.strip().startswith("other are"))
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
    assert not any(ln.strip().startswith("activation offload (hr.offload_activations")
                   for ln in text.splitlines())
    with hr.track_memory(model=model) as plain:
        model(x).sum().backward()
    assert "activation offload is on" not in plain.report()
    assert "activation offload (hr.offload_activations" in plain.report()
