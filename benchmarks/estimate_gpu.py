"""Claim: hr.estimate(device="cuda") predicts a real CUDA training step's peak, dropout included.

For each case, one run: a steady-state AdamW step (the second) of a Hugging Face model built from
its config, measured three ways — PyTorch's own `torch.cuda.max_memory_allocated` (independent of
headroom), `hr.track_memory`'s peak, and `hr.estimate`'s dry run for the same device — and the
ratios. GPT-2 small is run with its stock dropout (0.1 everywhere: attention dropout goes through
the fused attention kernels on CUDA) and with every dropout at 0.

    python benchmarks/estimate_gpu.py [--batch 8] [--seq 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

import headroom as hr

RESULTS = Path(__file__).parent / "results" / "estimate_gpu.json"


def gpt2(dropout: float):
    import transformers

    cfg = transformers.GPT2Config(attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
                                  attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4,
                                   vocab_size=32000, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


CASES = {"gpt2-small dropout 0.1": lambda: gpt2(0.1), "gpt2-small dropout 0": lambda: gpt2(0.0),
         "llama-150M": llama}


def loss_fn(out) -> torch.Tensor:
    return out.logits.float().square().mean()


def estimate(name: str, batch: int, seq: int):
    """The dry run's estimate of the case's step on "cuda" (needs no device), and its batch."""
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = CASES[name]()
    ids = torch.randint(0, meta_model.config.vocab_size, (batch, seq))
    est = hr.estimate(meta_model, (ids.to("meta"),), loss_fn=loss_fn,
                      optimizer=torch.optim.AdamW, device="cuda")
    return est, ids


def one(name: str, batch: int, seq: int) -> dict:
    est, ids = estimate(name, batch, seq)

    model = CASES[name]().cuda().train()
    opt = torch.optim.AdamW(model.parameters())
    ids = ids.cuda()

    def step():
        loss_fn(model(ids)).backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer state now exists: the next step is the steady state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    torch.cuda.synchronize()
    torch_peak = torch.cuda.max_memory_allocated()
    row = {
        "case": name, "batch": batch, "seq": seq,
        "torch_max_allocated": torch_peak,
        "tracker_peak": mem.peak,
        "estimate_peak": est.peak,
        "estimate_by_category": est.peak_by_category,
        "estimate_over_torch": est.peak / torch_peak,
        "tracker_over_torch": mem.peak / torch_peak,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--estimate-only", action="store_true",
                        help="only the dry runs (no device needed), to compare a new estimator"
                             " with the last measured run; writes --out (default"
                             " estimate_gpu_dryrun.json)")
    args = parser.parse_args()
    if args.estimate_only:
        if args.out == RESULTS:
            args.out = RESULTS.with_name("estimate_gpu_dryrun.json")
        measured = {r["case"]: r for r in json.loads(RESULTS.read_text())["rows"]} \
            if RESULTS.exists() else {}
        rows = []
        for name in CASES:
            est, _ = estimate(name, args.batch, args.seq)
            row = {"case": name, "estimate_peak": est.peak,
                   "estimate_by_category": est.peak_by_category}
            if name in measured:
                m = measured[name]
                row["measured_torch_max_allocated"] = m["torch_max_allocated"]
                row["measured_on"] = json.loads(RESULTS.read_text())["device"]
                row["estimate_over_measured"] = est.peak / m["torch_max_allocated"]
            rows.append(row)
            print(f"{name:24s} estimate {est.peak / 2**30:6.2f} GiB"
                  + (f"  over the last measured: {row['estimate_over_measured']:.3f}"
                     if "estimate_over_measured" in row else ""), flush=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
        return
    if not torch.cuda.is_available():
        raise SystemExit("estimate_gpu.py needs a CUDA device (or --estimate-only)")
    rows = []
    for name in CASES:
        row = one(name, args.batch, args.seq)
        torch.cuda.empty_cache()
        rows.append(row)
        gib = 2**30
        print(f"{name:24s} torch {row['torch_max_allocated'] / gib:6.2f} GiB  tracker"
              f" {row['tracker_peak'] / gib:6.2f}  estimate {row['estimate_peak'] / gib:6.2f}"
              f"  estimate/torch {row['estimate_over_torch']:.3f}", flush=True)
    import transformers

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
