"""Quantized tiny models for the tests of quantized parameters resting packed (no tests here).

Kinds: torchao's int8 weight-only (``Int8Tensor``), int4 weight-only in its CPU form
(``IntxUnpackedToInt8Tensor``, 4-bit values kept one per byte), float8 weight-only
(``Float8Tensor``); bitsandbytes' NF4 and FP4 (``Params4bit``, with and without double
quantization) and LLM.int8 (``Int8Params``). Each is skipped where its library does not run.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

AO = ["ao_int8", "ao_int4", "ao_fp8"]
BNB = ["bnb_nf4", "bnb_nf4_dq", "bnb_fp4_dq", "bnb_int8"]
KINDS = AO + BNB


def available(kind: str) -> bool:
    lib = "torchao" if kind.startswith("ao") else "bitsandbytes"
    return importlib.util.find_spec(lib) is not None


def kind_param(kinds: list[str] = KINDS) -> list:
    """``pytest.param`` of each kind, skipped where its library is not installed."""
    return [pytest.param(k, marks=pytest.mark.skipif(not available(k),
                                                     reason=f"{k}: library not installed"))
            for k in kinds]


def _quiet():
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")


def quantize_linears(root: nn.Module, kind: str, *, dtype: torch.dtype = torch.float32,
                     skip: tuple[str, ...] = ()) -> nn.Module:
    """Quantize every ``nn.Linear`` under ``root`` (except names in ``skip``) in place."""
    _quiet()
    if kind.startswith("ao"):
        from torchao.quantization import (
            Float8WeightOnlyConfig,
            Int8WeightOnlyConfig,
            IntxWeightOnlyConfig,
            quantize_,
        )
        from torchao.quantization.granularity import PerGroup

        cfg = {"ao_int8": lambda: Int8WeightOnlyConfig(),
               "ao_int4": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                       granularity=PerGroup(32)),
               "ao_fp8": lambda: Float8WeightOnlyConfig()}[kind]()

        def pick(m: nn.Module, fqn: str) -> bool:
            return isinstance(m, nn.Linear) and not any(fqn.endswith(s) for s in skip)

        quantize_(root, cfg, filter_fn=pick)
        return root
    import bitsandbytes as bnb

    for name, m in list(root.named_modules()):
        for cname, c in list(m.named_children()):
            full = f"{name}.{cname}" if name else cname
            if type(c) is not nn.Linear or any(full.endswith(s) for s in skip):
                continue
            if kind == "bnb_int8":
                q = bnb.nn.Linear8bitLt(c.in_features, c.out_features, bias=c.bias is not None,
                                        has_fp16_weights=False)
            else:
                q = bnb.nn.Linear4bit(c.in_features, c.out_features, bias=c.bias is not None,
                                      compute_dtype=dtype, quant_type=kind.split("_")[1],
                                      compress_statistics=kind.endswith("_dq"))
            q.load_state_dict(c.state_dict())
            q = q.to("cpu")  # bitsandbytes quantizes when the layer moves to a device
            if c.bias is not None:
                q.bias.requires_grad_(c.bias.requires_grad)
            setattr(m, cname, q)
    return root


class QBlock(nn.Module):
    """A pre-norm MLP block: a trainable LayerNorm, two quantized linears, a GELU."""

    def __init__(self, d: int, *, ckpt: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.ckpt = ckpt

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            from torch.utils.checkpoint import checkpoint

            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class QNet(nn.Module):
    """Blocks of `QBlock` between a trainable input projection and a trainable head."""

    def __init__(self, d: int = 64, n: int = 3, *, ckpt: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(QBlock(d, ckpt=ckpt) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def qnet(kind: str, *, d: int = 64, n: int = 3, ckpt: bool = False, seed: int = 0) -> QNet:
    """A `QNet` whose block linears are quantized (frozen), everything else trainable."""
    torch.manual_seed(seed)
    model = QNet(d, n, ckpt=ckpt)
    quantize_linears(model.layers, kind)
    for layer in model.layers:
        for lin in (layer.fc1, layer.fc2):
            lin.weight.requires_grad_(False)
            if lin.bias is not None:
                lin.bias.requires_grad_(False)
    return model


def quantized_bytes(p: torch.Tensor, owner: nn.Module | None = None) -> int:
    """Bytes of a quantized weight as its library keeps it, counted from its own attributes
    (not through headroom): torchao's inner tensors; bitsandbytes' packed codes, absmax and
    code books (nested ones too), or int8 rows and scales."""
    cls = type(p).__name__
    if cls == "Params4bit":
        qs = p.quant_state
        n = p.data.nbytes + qs.absmax.nbytes + qs.code.nbytes
        if qs.nested:
            n += qs.state2.absmax.nbytes + qs.state2.code.nbytes + torch.as_tensor(qs.offset).nbytes
        return n
    if cls == "Int8Params":
        scb = p.SCB if p.SCB is not None else owner.state.SCB
        return p.data.nbytes + scb.nbytes
    names, _ = p.__tensor_flatten__()
    return sum(getattr(p, n).nbytes for n in names)


def dequantized(p: torch.Tensor) -> torch.Tensor:
    """The weight's values in floating point (to compare quantized weights across copies)."""
    cls = type(p).__name__
    if cls == "Params4bit":
        import bitsandbytes.functional as BF

        return BF.dequantize_4bit(p.data, p.quant_state)
    if cls == "Int8Params":
        return p.data.float()
    return p.dequantize()
