"""Initializing a model built on ``meta`` into headroom's store, against building it on the CPU.

A model too large to build in memory is built on ``meta`` and offloaded; whatever no checkpoint
fills is initialized by the model's own initialization, module by module, when first needed
(here ``state_dict()``), with the values a CPU build gets. This script times that against plain
PyTorch building the same model on the CPU (``from_config`` under ``torch.device("cpu")``: the
same initialization on real tensors), each variant in a fresh process, alternating, and reports
medians, the per-round ratios' median and each process's peak RSS:

- ``plain``: ``AutoModelForCausalLM.from_config(cfg, dtype=bf16)`` on the CPU;
- ``headroom_host``: built on ``meta``, ``hr.offload(store="cpu")``, then ``state_dict()``;
- ``headroom_disk``: the same with a ``DiskStore`` (values written to disk as they are made).

The values are compared (a digest of the state dict): the two headroom variants must be equal.
They are not plain's: a Hugging Face model built on the CPU draws random numbers twice (each
layer's constructor, then ``_init_weights``), one built on ``meta`` once, so the same seed gives
other values from the same distributions (``values_equal_to_plain`` records it).

    .venv/bin/python benchmarks/meta_init.py                    # a Llama-3.2-1B shape, 4 layers
    .venv/bin/python benchmarks/meta_init.py --layers 2 --rounds 1   # quicker

Writes ``benchmarks/results/meta_init.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
VARIANTS = ("plain", "headroom_host", "headroom_disk")

CHILD = r"""
import hashlib, json, resource, sys, time, warnings
import torch, transformers
import headroom as hr
variant, layers, scratch = sys.argv[1], int(sys.argv[2]), sys.argv[3]
warnings.simplefilter("ignore")
cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               tie_word_embeddings=True, max_position_embeddings=8192)
torch.manual_seed(0)
t0 = time.perf_counter()
if variant == "plain":
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    built = time.perf_counter()
    sd = model.state_dict()
else:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    store = "cpu" if variant == "headroom_host" else hr.DiskStore(scratch)
    hr.offload(model, device="cpu", store=store)
    built = time.perf_counter()
    sd = model.state_dict()  # initializes what is pending, into the store
end = time.perf_counter()
h = hashlib.sha256()
for k in sorted(sd):
    h.update(k.encode())
    h.update(sd[k].detach().contiguous().view(torch.uint8).numpy().tobytes())
print(json.dumps({"total_s": end - t0, "build_s": built - t0, "init_s": end - built,
                  "params": sum(v.numel() for v in model.parameters()),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "digest": h.hexdigest()}))
"""


def run_child(variant: str, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        out = subprocess.run([sys.executable, "-c", CHILD, variant, str(layers),
                              str(Path(tmp) / "store")], capture_output=True, text=True,
                             env=env, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/meta_init.json"))
    args = ap.parse_args()
    runs = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            runs[v].append(run_child(v, args.layers))
            print(f"round {r} {v:14s} total {runs[v][-1]['total_s']:6.2f} s"
                  f" (init {runs[v][-1]['init_s']:.2f} s)"
                  f" peak RSS {runs[v][-1]['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)
    digests = {run["digest"] for v in VARIANTS[1:] for run in runs[v]}
    if len(digests) != 1:
        raise SystemExit("the variants' values differ: " + json.dumps(
            {v: [x["digest"][:12] for x in runs[v]] for v in VARIANTS}))
    res = {"command": "python benchmarks/meta_init.py" + (
               f" --layers {args.layers}" if args.layers != 4 else "")
           + (f" --rounds {args.rounds}" if args.rounds != 3 else ""),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "torch": __import__("torch").__version__},
           "layers": args.layers, "params": runs["plain"][0]["params"],
           "values_equal_host_disk": True,
           "values_equal_to_plain": digests == {r["digest"] for r in runs["plain"]},
           "variants": {}}
    for v in VARIANTS:
        res["variants"][v] = {
            "total_s_median": statistics.median(x["total_s"] for x in runs[v]),
            "init_s_median": statistics.median(x["init_s"] for x in runs[v]),
            "peak_rss_bytes_median": statistics.median(x["peak_rss_bytes"] for x in runs[v]),
            "runs": runs[v]}
        if v != "plain":
            res["variants"][v]["ratio_total_vs_plain_median"] = statistics.median(
                a["total_s"] / b["total_s"] for a, b in zip(runs[v], runs["plain"], strict=True))
    Path(args.out).write_text(json.dumps(res, indent=1))
    for v in VARIANTS:
        x = res["variants"][v]
        print(f"{v:14s} total {x['total_s_median']:.2f} s  peak RSS"
              f" {x['peak_rss_bytes_median'] / 2**30:.2f} GiB"
              + (f"  ratio {x['ratio_total_vs_plain_median']:.2f}x" if v != "plain" else ""))


if __name__ == "__main__":
    main()
