"""Shared helpers for the host optimizer and checkpoint tests: a small model, data, loops."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Net(nn.Module):
    """Embedding, 4 blocks, head: parameters of several shapes, including 1-D and 2-D."""

    def __init__(self, d: int = 16, vocab: int = 37, out: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.head = nn.Linear(d, out)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def batch(i: int, vocab: int = 37, out: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, vocab, (6, 7), generator=g), torch.randn(6, 7, out, generator=g)


def loss_fn(model: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return ((model(x) - y) ** 2).mean()


def train(model, opt, steps: range, *, accum: int = 1, clip: float | None = None,
          sched=None, final: bool = False) -> list[torch.Tensor]:
    """Plain training loop; clips with the optimizer's method when it has one; ``final``
    declares each step's last backward final (`HostOptimizer.final_backward`)."""
    norms = []
    for s in steps:
        for m in range(accum):
            last = final and m == accum - 1
            with opt.final_backward() if last else contextlib.nullcontext():
                loss_fn(model, s * accum + m).backward()
        if clip is not None:
            if hasattr(opt, "clip_grad_norm_"):
                norms.append(opt.clip_grad_norm_(clip))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return norms


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa.detach().cpu(), pb.detach().cpu()), f"parameter {na} differs"


def assert_state_equal(ref: torch.optim.Optimizer, opt: torch.optim.Optimizer) -> None:
    sa, sb = ref.state_dict(), opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys(), i
        for k, v in sa["state"][i].items():
            w = sb["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w.reshape(v.shape)), f"state {i}/{k} differs"
            else:
                assert v == w, f"state {i}/{k}: {v} != {w}"
    # NOTE: which kernel runs (fused/foreach) is a choice, not a hyperparameter.
    impl = ("fused", "foreach")
    for ga, gb in zip(sa["param_groups"], sb["param_groups"], strict=True):
        assert {k: v for k, v in ga.items() if k not in impl} == \
            {k: v for k, v in gb.items() if k not in impl}
