"""Step time of torch.compile'd parameter offload against the torch.compile'd plain model.

One process, one model (pre-norm transformer blocks), four ways: compiled plain, compiled
offloaded with the parameters in host memory (``store="cpu"``) and on disk (`DiskStore`,
stepped by `HostOptimizer`), and the eager plain model for scale. Compilation happens in the
warm-up steps; then the variants' steps alternate, and the medians (and fastest steps) are
reported with the ratios to compiled plain. SGD everywhere, so the optimizers cost the same.

    .venv/bin/python benchmarks/compile_offload.py                    # CPU
    .venv/bin/python benchmarks/compile_offload.py --device cuda      # accelerator

JSON goes to benchmarks/results/compile_offload[_gpu].json unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import headroom as hr


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, n: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(n))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln(h))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3, help="steps per variant, compiling")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--disk", default=None, help="folder for the DiskStore (a temporary one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type != "cpu" and not torch.accelerator.is_available():
        sys.exit(f"--device {args.device}: no accelerator here")
    torch.manual_seed(0)
    base = LM(args.vocab, args.d, 8, args.layers)
    tmp = tempfile.TemporaryDirectory(dir=args.disk)

    def offloaded(store):
        m = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device=cpu, store=cpu: this measures mechanics
            hr.offload(m, device=dev, store=store)
        return m

    plain = copy.deepcopy(base).to(dev)
    eager = copy.deepcopy(base).to(dev)
    host = offloaded("cpu")
    disk = offloaded(hr.DiskStore(Path(tmp.name) / "params"))
    variants = {
        "compiled_plain": (torch.compile(plain), torch.optim.SGD(plain.parameters(), lr=1e-3)),
        "compiled_offload_host": (torch.compile(host),
                                  torch.optim.SGD(host.parameters(), lr=1e-3)),
        "compiled_offload_disk": (torch.compile(disk),
                                  hr.HostOptimizer(disk.parameters(), torch.optim.SGD, lr=1e-3)),
        "eager_plain": (eager, torch.optim.SGD(eager.parameters(), lr=1e-3)),
    }
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(dev)

    def sync():
        if dev.type != "cpu":
            torch.accelerator.synchronize()

    def step(name):
        run, opt = variants[name]
        sync()
        t = time.perf_counter()
        F.cross_entropy(run(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        sync()
        return time.perf_counter() - t

    compile_s = {}
    for name in variants:
        t = time.perf_counter()
        for _ in range(args.warmup):
            step(name)
        compile_s[name] = round(time.perf_counter() - t, 3)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(args.repeats):
        for name in variants:  # alternating: load on a shared machine hits every variant
            times[name].append(step(name))
    med = {n: statistics.median(v) for n, v in times.items()}
    best = {n: min(v) for n, v in times.items()}
    res = {
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg_1min_at_end": round(os.getloadavg()[0], 2),  # other processes' share
        "config": vars(args) | {"params": sum(p.numel() for p in base.parameters())},
        "warmup_s": compile_s,
        "median_step_s": {n: round(v, 5) for n, v in med.items()},
        "fastest_step_s": {n: round(v, 5) for n, v in best.items()},
        "ratio_to_compiled_plain_median": {n: round(v / med["compiled_plain"], 3)
                                           for n, v in med.items()},
        "ratio_to_compiled_plain_fastest": {n: round(v / best["compiled_plain"], 3)
                                            for n, v in best.items()},
    }
    print(json.dumps(res, indent=1))
    name = "compile_offload.json" if dev.type == "cpu" else "compile_offload_gpu.json"
    out = args.out or Path(__file__).parent / "results" / name
    Path(out).write_text(json.dumps(res, indent=1) + "\n")
    disk.zero_grad()
    variants.clear()
    hr.unoffload(disk)
    tmp.cleanup()


if __name__ == "__main__":
    main()
