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

Two families: everything saved offloaded (plain, ``save_on_cpu``, torchtune, headroom), and
every block checkpointed (``checkpoint``: non-reentrant ``torch.utils.checkpoint``;
``checkpoint+headroom``: the same inside ``hr.offload_activations``, so only the blocks' inputs
move), where the layer compute hides the transfer. Before timing, each variant's gradients
after one step are compared with plain PyTorch's (bitwise where the kernels are deterministic,
else within bf16 rounding; a mismatch stops the run). The transfer bound of the offloading
variants is the saved bytes (counted with a saved-tensor hook: storages of at least 1 MiB,
parameters left out) over the measured device-to-host plus host-to-device bandwidth.

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
from torch.utils.checkpoint import checkpoint

import headroom as hr

RESULTS = Path(__file__).parent / "results" / "activation_offload_gpu.json"  # or --out


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


class Stack(nn.Sequential):
    """The blocks in order; ``ckpt=True`` checkpoints each one (non-reentrant)."""

    ckpt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return x


def _contexts() -> dict[str, tuple[bool, contextlib.AbstractContextManager]]:
    """name -> (checkpoint every block, context factory)."""
    variants = {
        "plain": (False, contextlib.nullcontext),
        "save_on_cpu": (False, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)),
        "headroom": (False, lambda: hr.offload_activations(store="cpu")),
        "checkpoint": (True, contextlib.nullcontext),
        "checkpoint+headroom": (True, lambda: hr.offload_activations(store="cpu")),
    }
    try:
        from torchtune.training import OffloadActivations
    except Exception as e:  # not installed, or not importable beside this torch
        print(f"torchtune's OffloadActivations left out: {type(e).__name__}: {e}")
    else:
        variants["torchtune"] = (False, lambda: OffloadActivations(use_streams=True))
    return variants


def _step(model: Stack, x: torch.Tensor, ckpt: bool, ctx_factory) -> None:
    model.ckpt = ckpt
    with ctx_factory():
        loss = model(x).float().square().mean()
        loss.backward()


def _run(model: Stack, x, ckpt: bool, ctx_factory, steps: int) -> dict:
    dev = x.device
    torch.accelerator.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(model, x, ckpt, ctx_factory)
        torch.accelerator.synchronize()
        times.append(time.perf_counter() - t0)
        for p in model.parameters():
            p.grad = None
    peak = torch.cuda.max_memory_allocated(dev) - base
    step = statistics.median(times[1:] or times)
    return {"peak_above_model": peak, "step_s": step, "first_step_s": times[0],
            "tokens_per_s": x.shape[0] * x.shape[1] / step}


def _grads(model: Stack, x: torch.Tensor, ckpt: bool, ctx_factory) -> list[torch.Tensor]:
    _step(model, x, ckpt, ctx_factory)
    out = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def check_gradients(model: Stack, x: torch.Tensor, variants: dict) -> dict:
    """Each variant's gradients after one step against plain PyTorch's; raises on a mismatch."""
    ref = _grads(model, x, False, contextlib.nullcontext)
    again = _grads(model, x, False, contextlib.nullcontext)
    deterministic = all(torch.equal(a, b) for a, b in zip(ref, again, strict=True))
    out = {}
    for name, (ckpt, factory) in variants.items():
        got = _grads(model, x, ckpt, factory)
        equal = all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
        err = max(((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                  for a, b in zip(got, ref, strict=True))
        out[name] = {"bitwise_equal": equal, "max_relative_error": err}
        print(f"gradients {name:20s} bitwise {equal!s:5}  max relative error {err:.2e}")
        if not equal and (deterministic or err > 1e-2):
            raise SystemExit(f"{name}: gradients differ from plain PyTorch's ({err:.2e})")
    out["plain_run_twice_bitwise_equal"] = deterministic
    return out


def saved_bytes(model: Stack, x: torch.Tensor, ckpt: bool, min_bytes: int = 1 << 20) -> int:
    """Bytes of distinct storages of at least ``min_bytes`` saved for backward, parameters
    left out: what an offloading variant moves each way."""
    seen: dict[int, int] = {}

    def pack(t):
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            st = t.untyped_storage()
            if st.nbytes() >= min_bytes:
                seen[st.data_ptr()] = st.nbytes()
        return t

    model.ckpt = ckpt
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().square().mean()
    del loss
    return sum(seen.values())


def bandwidth(dev: torch.device, nbytes: int = 512 << 20) -> tuple[float, float]:
    """Host-to-device and device-to-host bytes/s with page-locked memory (median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    rates = []
    for dst, src in ((devbuf, host), (host, devbuf)):
        ts = []
        for _ in range(5):
            torch.accelerator.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.accelerator.synchronize()
            ts.append(time.perf_counter() - t0)
        rates.append(nbytes / statistics.median(ts))
    return rates[0], rates[1]


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
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--variants", default=None,
                    help="comma list of variants to run (default: all; plain always runs)")
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic kernels (math attention, torch's deterministic mode):"
                         " gradients are then compared bitwise")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (run on a machine with one)")
        return
    if args.deterministic:
        import os

        from torch.nn.attention import SDPBackend, sdpa_kernel

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        with sdpa_kernel(SDPBackend.MATH):
            _main(args)
    else:
        _main(args)


def _main(args: argparse.Namespace) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = Stack(*[Block(args.d, args.heads) for _ in range(args.layers)])
    model = model.to(dev, torch.bfloat16)
    x = torch.randn(args.batch, args.seq, args.d, device=dev, dtype=torch.bfloat16)
    variants = _contexts()
    if args.variants:
        keep = {"plain", "checkpoint", *args.variants.split(",")}
        variants = {n: v for n, v in variants.items() if n in keep}
    names = list(variants)
    grads = check_gradients(model, x, variants)
    h2d, d2h = bandwidth(dev)
    moved = {"all": saved_bytes(model, x, False), "checkpoint": saved_bytes(model, x, True)}
    bound = {k: v / h2d + v / d2h for k, v in moved.items()}
    print(f"H2D {h2d / 1e9:.1f} GB/s, D2H {d2h / 1e9:.1f} GB/s; saved bytes moved each way:"
          f" {moved['all'] / 2**30:.2f} GiB (all), {moved['checkpoint'] / 2**30:.3f} GiB"
          f" (checkpointed): transfer bound {bound['all'] * 1e3:.1f} /"
          f" {bound['checkpoint'] * 1e3:.1f} ms")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for n in order:
            r = _run(model, x, *variants[n], args.steps)
            runs[n].append(r)
            print(f"repeat {rep} {n:20s} peak {r['peak_above_model'] / 2**30:6.2f} GiB"
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
            "time_vs_checkpoint": statistics.median(
                a["step_s"] / b["step_s"]
                for a, b in zip(runs[n], runs["checkpoint"], strict=True)),
            "peak_vs_plain": statistics.median(
                a["peak_above_model"] / b["peak_above_model"]
                for a, b in zip(runs[n], runs["plain"], strict=True)),
        }
        s = summary[n]
        ckpt = variants[n][0]
        if n not in ("plain", "checkpoint"):
            s["time_vs_transfer_bound"] = s["step_s"] / bound["checkpoint" if ckpt else "all"]
        extra = (f"  x{s['time_vs_checkpoint']:.3f} checkpoint" if ckpt else "") + (
            f"  x{s['time_vs_transfer_bound']:.2f} transfer bound"
            if "time_vs_transfer_bound" in s else "")
        print(f"{n:20s} peak x{s['peak_vs_plain']:.2f}  time x{s['time_vs_plain']:.3f} plain"
              + extra)
    args.out.parent.mkdir(exist_ok=True, parents=True)
    args.out.write_text(json.dumps({
        "command": "benchmarks/activation_offload_gpu.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()},
        "h2d_bytes_per_s": h2d, "d2h_bytes_per_s": d2h, "saved_bytes_moved": moved,
        "transfer_bound_s": bound, "gradients": grads, "summary": summary, "runs": runs,
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
