"""Parameter offload on an accelerator: step time vs plain and vs the transfer-bound limit.

Runs only when an accelerator is available (otherwise prints why and exits 0). For blocks of
4, 16 and 64 MiB it times forward+backward of the same model (a) resident on the device and
(b) offloaded with store="cpu" (pinned pool, side-stream copies, prefetch=1), and measures the
host<->device bandwidth with pinned buffers in the same run. Each offloaded step moves every
parameter host->device twice (forward and backward) and every gradient device->host once, so
the transfer-bound limit is max(H2D bytes / H2D bandwidth, D2H bytes / D2H bandwidth) (the two
directions overlap on a full-duplex link). The optimizer step is left out of both timings:
with offload it runs on the host (see docs/offload.md).

    .venv/bin/python benchmarks/offload_overhead_gpu.py
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

# NOTE: the same model as the CPU variant, so the two sets of numbers compare directly.
from offload_overhead import MLP, width_for  # sibling script: benchmarks/ is on sys.path

import headroom as hr


def _sync() -> None:
    torch.accelerator.synchronize()


def bandwidth(
    device: torch.device, nbytes: int = 512 << 20, repeats: int = 5
) -> tuple[float, float]:
    """Measured (H2D, D2H) bytes/s with page-locked host memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d, d2h = [], []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        _sync()
        h2d.append(nbytes / (time.perf_counter() - t))
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        _sync()
        d2h.append(nbytes / (time.perf_counter() - t))
    return statistics.median(h2d), statistics.median(d2h)


def check(plain: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """Before timing: the offloaded model's gradients are plain PyTorch's on the same device."""
    for m in (plain, model):
        m(x).square().mean().backward()
    _sync()
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad.to(p.device).float(), p.grad.float(), rtol=1e-5,
                                   atol=1e-6, msg=f"offloaded gradient of {name} differs")
    for m in (plain, model):
        for p in m.parameters():
            p.grad = None


def bench(device, block_mib, blocks, tokens, repeats, h2d_bps, d2h_bps) -> dict:
    torch.manual_seed(0)
    w = width_for(block_mib)
    base = nn.Sequential(*[MLP(w) for _ in range(blocks)])
    plain = copy.deepcopy(base).to(device)
    model = hr.offload(copy.deepcopy(base), device=device, store="cpu", prefetch=1)
    x = torch.randn(tokens, w, device=device)

    def step(m: nn.Module) -> float:
        _sync()
        t = time.perf_counter()
        m(x).square().mean().backward()
        _sync()
        dt = time.perf_counter() - t
        for p in m.parameters():
            p.grad = None
        return dt

    check(plain, model, x)
    for m in (plain, model):
        step(m)
    t_plain, t_off = [], []
    for _ in range(repeats):
        t_plain.append(step(plain))
        t_off.append(step(model))
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    limit = max(2 * param_bytes / h2d_bps, param_bytes / d2h_bps)
    off = statistics.median(t_off)
    return {
        "block_mib": 2 * (w * w + w) * 4 / 2**20,
        "blocks": blocks,
        "tokens": tokens,
        "plain_s": statistics.median(t_plain),
        "offload_s": off,
        "offload_over_plain": off / statistics.median(t_plain),
        "transfer_bound_s": limit,
        "offload_over_transfer_bound": off / limit,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/offload_overhead_gpu.json")
    args = ap.parse_args()
    if not torch.accelerator.is_available():
        print("no accelerator available: skipped (run this on a machine with a GPU)")
        return 0
    device = torch.accelerator.current_accelerator()
    h2d, d2h = bandwidth(device)
    rows = [bench(device, mib, n, args.tokens, args.repeats, h2d, d2h)
            for mib, n in [(4, 16), (16, 8), (64, 8)]]
    print(f"H2D {h2d / 1e9:.1f} GB/s, D2H {d2h / 1e9:.1f} GB/s (pinned)")
    print(f"{'block':>10} {'blocks':>6} {'plain s':>9} {'offload s':>10} {'xplain':>7}"
          f" {'bound s':>9} {'xbound':>7}")
    for r in rows:
        print(f"{r['block_mib']:>7.1f}MiB {r['blocks']:>6} {r['plain_s']:>9.4f}"
              f" {r['offload_s']:>10.4f} {r['offload_over_plain']:>7.2f}"
              f" {r['transfer_bound_s']:>9.4f} {r['offload_over_transfer_bound']:>7.2f}")
    out = {
        "command": ".venv/bin/python benchmarks/offload_overhead_gpu.py",
        "device": torch.accelerator.current_accelerator().type,
        "h2d_GBps": h2d / 1e9,
        "d2h_GBps": d2h / 1e9,
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
