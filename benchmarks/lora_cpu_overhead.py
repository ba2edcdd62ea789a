"""Step time of LoRA over an offloaded frozen base against the same PEFT model kept whole (CPU).

A tiny Llama (hidden 256, 4 layers, bf16 base) with PEFT LoRA (r=16 on every linear layer),
batch 2 x 128 tokens, one thread. One copy is plain PEFT; the other is `hr.offload(model,
device="cpu", store="cpu")` under the same LoRA; a third, a second plain copy, gives the ratio
two identical models show (the measurement's own floor). Steps of the three rotate in one
process, each timed in CPU time (`time.process_time`); the figure is the median of the
per-round ratios offloaded / plain, per run (target < 1.05). The trained adapters are checked
bitwise.

    .venv/bin/python benchmarks/lora_cpu_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import headroom as hr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=60, help="alternated step pairs per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/lora_cpu_overhead.json")
    args = ap.parse_args()
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        sys.exit(f"needs transformers and peft (pip install -e '.[test]'): {e}")
    torch.set_num_threads(1)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
    lora = dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"])

    def base() -> torch.nn.Module:
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        m.requires_grad_(False)
        return m

    plain = get_peft_model(base(), LoraConfig(**lora))
    twin = get_peft_model(base(), LoraConfig(**lora))
    off = base()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # store="cpu" on the CPU saves no memory: known
        hr.offload(off, device="cpu", store="cpu")
    off = get_peft_model(off, LoraConfig(**lora))
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    opts = {id(m): torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
            for m in (plain, off, twin)}

    def step(m: torch.nn.Module) -> float:
        t = time.process_time()
        m(input_ids=ids, labels=ids).loss.backward()
        opts[id(m)].step()
        opts[id(m)].zero_grad()
        return time.process_time() - t

    for m in (plain, off, twin):  # first steps: optimizer state made
        step(m)
        step(m)
    runs = []
    for r in range(args.runs):
        a, b, ratios, floor = [], [], [], []
        for i in range(args.pairs):
            models = [plain, off, twin]
            models = models[i % 3:] + models[:i % 3]  # each in every position in turn
            t = {id(m): step(m) for m in models}
            x, y, z = t[id(plain)], t[id(off)], t[id(twin)]
            a.append(x)
            b.append(y)
            ratios.append(y / x)
            floor.append(z / x)
        row = {"plain_ms": statistics.median(a) * 1e3, "offloaded_ms": statistics.median(b) * 1e3,
               "median_paired_ratio": statistics.median(ratios),
               "plain_twin_median_ratio": statistics.median(floor)}
        runs.append(row)
        print(f"run {r}: plain {row['plain_ms']:.1f} ms, offloaded {row['offloaded_ms']:.1f} ms,"
              f" median paired ratio {row['median_paired_ratio']:.3f} (two plain copies:"
              f" {row['plain_twin_median_ratio']:.3f})", flush=True)
    exact = all(torch.equal(p, q) for (n, p), (_, q) in zip(
        plain.named_parameters(), off.named_parameters(), strict=True) if p.requires_grad)
    print(f"adapters bitwise equal: {exact}")
    out = {"machine": {"cpus": torch.get_num_threads(), "torch": torch.__version__},
           "command": "python benchmarks/lora_cpu_overhead.py", "runs": runs,
           "median_of_runs": statistics.median(r["median_paired_ratio"] for r in runs),
           "plain_twin_median_of_runs": statistics.median(r["plain_twin_median_ratio"]
                                                          for r in runs),
           "adapters_bitwise_equal": exact}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
