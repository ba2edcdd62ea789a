"""Small models and helpers shared by the parameter-offload tests (no tests here)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from headroom.transfer import binding

VOCAB = 50


class Block(nn.Module):
    """A pre-norm transformer layer (single-head attention + MLP)."""

    def __init__(self, d: int, ckpt: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)
        self.ckpt = ckpt

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        if self.ckpt:  # activation checkpointing inside the block
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class Transformer(nn.Module):
    def __init__(self, d: int = 16, n: int = 8, *, tie: bool = False, ckpt: bool = False,
                 ckpt_blocks: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, ckpt) for _ in range(n))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.ckpt_blocks = ckpt_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            # checkpointing around whole blocks, from the outside
            h = checkpoint(layer, h, use_reentrant=False) if self.ckpt_blocks else layer(h)
        return self.head(self.ln(h))


class FusedHead(Transformer):
    """The LM head applied by reading its weight inside the root's forward (TRL's fused LM head
    does this), plus a bias of a middle block read there too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        h = self.ln(h)
        return F.linear(h, self.head.weight) + self.layers[1].fc2.bias.sum()


class Stage(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class CNN(nn.Module):
    def __init__(self, c: int = 8, n: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.stages = nn.Sequential(*[Stage(c) for _ in range(n)])
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(F.relu(self.stem(x))).mean((2, 3)))


def lm_batch(g: torch.Generator, b: int = 4, t: int = 8):
    x = torch.randint(0, VOCAB, (b, t), generator=g)
    return x, torch.randint(0, VOCAB, (b, t), generator=g)


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def cnn_batch(g: torch.Generator, b: int = 4):
    return torch.randn(b, 3, 8, 8, generator=g), torch.randint(0, 10, (b,), generator=g)


def cnn_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


class StoreStep:
    """Test scaffold: a torch.optim optimizer over parameters whose values rest in a store.

    Each step reads master and gradient from the parameter's binding into proxy host
    parameters, runs the optimizer, and writes the master back — the same arithmetic as the
    optimizer on plain parameters, so results can be compared bitwise.
    """

    def __init__(self, params, cls=torch.optim.AdamW, **kw) -> None:
        self.params = list(params)
        self.proxies = [nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for p in self.params]
        self.opt = cls(self.proxies, **kw)

    def step(self) -> None:
        for p, q in zip(self.params, self.proxies, strict=True):
            b = binding(p)
            if p.grad is None:
                q.grad = None
                continue
            b.store.read(b.handle, out=q.data).result()
            q.grad = b.store.read(b.grad_handle).result()
        self.opt.step()
        for p, q in zip(self.params, self.proxies, strict=True):
            if q.grad is not None:
                binding(p).store.write(binding(p).handle, q.detach().clone()).result()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            binding(p).has_grad = False


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Real parameter values by name, wherever they rest (via the state dict)."""
    names = {n for n, _ in model.named_parameters()}
    return {k: v for k, v in model.state_dict().items() if k in names}
