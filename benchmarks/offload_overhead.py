"""Step time of parameter offload against plain PyTorch on the CPU (store="cpu").

With device="cpu" and store="cpu" offloading saves no memory; this measures the cost of its
mechanics — refilling each block's device copy before forward and again before backward,
moving gradients to the store, the hooks — against the same model trained plainly, for blocks
of 4, 16 and 64 MiB. Plain and offloaded steps alternate in one process; the ratio is
offloaded / plain (target <= 1.10), of medians and of the fastest steps. The accelerator
variant is `offload_overhead_gpu.py`.

    .venv/bin/python benchmarks/offload_overhead.py
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

import headroom as hr


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def width_for(block_mib: float) -> int:
    """Width whose block (two width x width fp32 linears) holds about ``block_mib`` MiB."""
    return int(math.sqrt(block_mib * 2**20 / 8))


def bench(block_mib: float, blocks: int, tokens: int, repeats: int) -> dict:
    torch.manual_seed(0)
    w = width_for(block_mib)
    plain = nn.Sequential(*[MLP(w) for _ in range(blocks)])
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "saves no memory": this is the overhead benchmark
        hr.offload(model, device="cpu", store="cpu", prefetch=1)
    x = torch.randn(tokens, w)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, model)}

    def step(m: nn.Module) -> float:
        t = time.perf_counter()
        m(x).square().mean().backward()
        opts[id(m)].step()
        opts[id(m)].zero_grad()
        return time.perf_counter() - t

    for m in (plain, model):  # warm-up: allocator, first-touch of optimizer state
        step(m)
    t_plain, t_off = [], []
    for _ in range(repeats):
        t_plain.append(step(plain))
        t_off.append(step(model))
    block_bytes = 2 * (w * w + w) * 4
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters(),
                                                 strict=True))
    return {
        "block_mib": block_bytes / 2**20,
        "width": w,
        "blocks": blocks,
        "tokens": tokens,
        "plain_step_s": statistics.median(t_plain),
        "offload_step_s": statistics.median(t_off),
        "ratio": statistics.median(t_off) / statistics.median(t_plain),
        # NOTE: the fastest step of each is the least disturbed by other processes
        "ratio_of_fastest": min(t_off) / min(t_plain),
        "plain_all_s": t_plain,
        "offload_all_s": t_off,
        "bitwise_equal_after": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="rows per batch")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: steadier timings on a shared machine)")
    ap.add_argument("--out", default="benchmarks/results/offload_overhead.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # (block MiB, number of blocks): fewer blocks for bigger ones keeps each run short
    configs = [(4, 8), (16, 4), (64, 2)]
    rows = [bench(mib, n, args.tokens, args.repeats) for mib, n in configs]
    print(f"{'block':>10} {'blocks':>6} {'plain s':>9} {'offload s':>10} {'ratio':>7}"
          f" {'fastest':>8}  exact")
    for r in rows:
        print(f"{r['block_mib']:>7.1f}MiB {r['blocks']:>6} {r['plain_step_s']:>9.3f}"
              f" {r['offload_step_s']:>10.3f} {r['ratio']:>7.3f} {r['ratio_of_fastest']:>8.3f}"
              f"  {r['bitwise_equal_after']}")
    out = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "torch_threads": torch.get_num_threads(),
        "target_ratio": 1.10,
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
