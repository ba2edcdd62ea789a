"""``headroom demo``: a small training run, tracked, with its memory report and plot."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class DemoNet(nn.Module):
    """A residual MLP classifier: enough structure for a readable per-module report."""

    def __init__(self, in_features: int = 64, dim: int = 256, depth: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _task(n: int, in_features: int, classes: int, generator: torch.Generator):
    """A learnable synthetic task: labels from a fixed random teacher network."""
    teacher = torch.randn(in_features, classes, generator=generator)
    x = torch.randn(n, in_features, generator=generator)
    return x, (x @ teacher).argmax(dim=1)


def run_demo(*, steps: int = 300, out: Path = Path("headroom_demo"), plot: bool = True) -> int:
    """Train :class:`DemoNet` for ``steps`` steps under the tracker; report, JSON and plot."""
    from tqdm.auto import tqdm

    import headroom as hr
    from headroom.memory import format_bytes

    if steps < 1:
        print("headroom demo: --steps must be at least 1", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x_all, y_all = _task(8192, 64, 10, g)
    model = DemoNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = 128

    def accuracy() -> float:
        with torch.no_grad():
            return (model(x_all[:2048]).argmax(1) == y_all[:2048]).float().mean().item()

    before = accuracy()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        bar = tqdm(range(steps), desc="headroom demo", unit="step", file=sys.stderr)
        for step in bar:
            idx = torch.randint(0, x_all.shape[0], (batch,), generator=g)
            loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}", peak=format_bytes(mem.peak))
        bar.close()
    after = accuracy()
    print(f"\ntrained {steps} steps: accuracy {before:.1%} -> {after:.1%}\n")
    mem.report()
    out = Path(out)
    mem.to_json(out.with_suffix(".json"))
    written = [out.with_suffix(".json")]
    if plot:
        mem.plot(out.with_suffix(".png"), title=f"headroom demo: {steps} steps of DemoNet (cpu)")
        written.append(out.with_suffix(".png"))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
