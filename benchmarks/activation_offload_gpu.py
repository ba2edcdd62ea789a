"""Activation offload on an accelerator: peak device memory and tokens/s against plain PyTorch,
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` and torchtune's ``OffloadActivations``
(where torchtune imports).

Runs only when an accelerator is available (otherwise prints why and exits 0). The model is a
stack of pre-norm transformer blocks (SDPA attention, 4x MLP) in bf16, sized so that a block's
compute is long against the PCIe transfer of what it saves (``--d 2048 --seq 4096`` by default).
Each variant trains the same copy of the model for ``--steps`` steps (the first is reported
apart); variants run in turn, ``--repeats`` times in a rotated order, and the medians of the
per-repeat ratios to plain are reported. Peak device memory is
``torch.cuda.max_memory_allocated`` (the allocator's own count, not headroom's).

    .venv/bin/python benchmarks/activation_offload_gpu.py
    .venv/bin/python benchmarks/activation_offload_gpu.py --layers 8 --d 1024 --seq 2048 --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import headroom as hr

RESULTS = Path(__file__).parent / "results" / "activation_offload_gpu.json"


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _contexts() -> dict[str, contextlib.AbstractContextManager]:
    variants = {
        "plain": contextlib.nullcontext,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
        "headroom": lambda: hr.offload_activations(store="cpu"),
    }
    try:
        from torchtune.training import OffloadActivations
    except Exception as e:  # not installed, or not importable beside this torch
        print(f"torchtune's OffloadActivations left out: {type(e).__name__}: {e}")
    else:
        variants["torchtune"] = lambda: OffloadActivations(use_streams=True)
    return variants


def _run(model, x, ctx_factory, steps: int) -> dict:
    dev = x.device
    torch.accelerator.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with ctx_factory():
            loss = model(x).float().square().mean()
            loss.backward()
        torch.accelerator.synchronize()
        times.append(time.perf_counter() - t0)
        for p in model.parameters():
            p.grad = None
    peak = torch.cuda.max_memory_allocated(dev) - base
    step = statistics.median(times[1:] or times)
    return {"peak_above_model": peak, "step_s": step, "first_step_s": times[0],
            "tokens_per_s": x.shape[0] * x.shape[1] / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (run on a machine with one)")
        return
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.d, args.heads) for _ in range(args.layers)])
    model = model.to(dev, torch.bfloat16)
    x = torch.randn(args.batch, args.seq, args.d, device=dev, dtype=torch.bfloat16)
    variants = _contexts()
    names = list(variants)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for n in order:
            r = _run(model, x, variants[n], args.steps)
            runs[n].append(r)
            print(f"repeat {rep} {n:12s} peak {r['peak_above_model'] / 2**30:6.2f} GiB"
                  f"  step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9.0f} tok/s",
                  flush=True)
    summary = {}
    for n in names:
        summary[n] = {
            "peak_above_model": statistics.median(r["peak_above_model"] for r in runs[n]),
            "step_s": statistics.median(r["step_s"] for r in runs[n]),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[n]),
            "time_vs_plain": statistics.median(
                a["step_s"] / b["step_s"] for a, b in zip(runs[n], runs["plain"], strict=True)),
            "peak_vs_plain": statistics.median(
                a["peak_above_model"] / b["peak_above_model"]
                for a, b in zip(runs[n], runs["plain"], strict=True)),
        }
        s = summary[n]
        print(f"{n:12s} peak x{s['peak_vs_plain']:.2f}  time x{s['time_vs_plain']:.3f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "command": "benchmarks/activation_offload_gpu.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "python": platform.python_version(), "args": vars(args),
        "summary": summary, "runs": runs,
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
