"""Which implementation HostOptimizer should default to: torch's fused CPU kernel, or the one
``torch.optim.X(params)`` picks by itself (on the CPU the single-tensor for-loop).

1. Bitwise: for each optimizer, which CPU implementations (for-loop, foreach, fused) give
   bitwise the same parameters after 5 steps (fp32, random tensors with odd sizes), and the
   largest difference between them.
2. A Llama-like model of 48.4M parameters (8 layers, hidden 512, vocabulary 32000, tied
   embeddings) on the CPU, fp32 parameters and bf16 parameters (fp32 masters):

   - the HostOptimizer step of each implementation (Adam, AdamW, SGD with momentum,
     Adagrad), each over its own copy of the model with the gradients of one backward,
     implementations interleaved in each round (the order rotating);
   - forward + backward of the same model at several tokens per step;
   - the extra cost of following torch's default as a fraction of the whole training step
     (forward + backward + the fused step), from the medians of this run;
   - the parameters after 5 training steps on the same batches: fused against for-loop
     (bitwise equal or not, largest difference).

The machine is shared: times are noisy; the fractions come from one run, and the load average
is recorded before and after.

    .venv/bin/python benchmarks/optimizer_impl.py            # ~15 min on 2 loaded cores
    .venv/bin/python benchmarks/optimizer_impl.py --quick    # small, for a smoke test
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

import headroom as hr

RESULTS = Path(__file__).parent / "results" / "optimizer_impl.json"

IMPLS = {"fused": {"fused": True}, "for-loop": {"foreach": False}, "foreach": {"foreach": True}}
CLASSES = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "Adam": (torch.optim.Adam, {"lr": 1e-3}),
    "SGD(momentum)": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
}
BITWISE_CASES = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "maximize": True}),
    (torch.optim.SGD, {"lr": 1e-2}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01,
                       "maximize": True}),
    (torch.optim.Adagrad, {"lr": 1e-2}),
    (torch.optim.Adagrad, {"lr": 1e-2, "weight_decay": 0.1, "lr_decay": 0.01}),
    (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9}),
    (torch.optim.Adamax, {"lr": 1e-2}),
    (torch.optim.NAdam, {"lr": 1e-2}),
    (torch.optim.RAdam, {"lr": 1e-2}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.ASGD, {"lr": 1e-2}),
    (torch.optim.Rprop, {"lr": 1e-2}),
]
FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _eq(pair: dict) -> str:
    return "bitwise" if pair["bitwise"] else f"{pair['max_abs_diff']:.1e}"


def bench_bitwise(steps: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 53), (1000,), (3,), (128, 64), (4099,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]

    def run(cls, kw, impl):
        ps = [t.clone().requires_grad_() for t in init]
        opt = cls(ps, **kw, **impl)
        for gs in grads:
            for p, gr in zip(ps, gs, strict=True):
                p.grad = gr.clone()
            opt.step()
        return [p.detach() for p in ps]

    out = []
    for cls, kw in BITWISE_CASES:
        impls = {k: v for k, v in IMPLS.items() if k != "fused" or cls in FUSED}
        res = {k: run(cls, kw, v) for k, v in impls.items()}
        pairs = {}
        for a, b in itertools.combinations(res, 2):
            pairs[f"{a} vs {b}"] = {
                "bitwise": all(torch.equal(x, y) for x, y in zip(res[a], res[b], strict=True)),
                "max_abs_diff": max((x - y).abs().max().item()
                                    for x, y in zip(res[a], res[b], strict=True))}
        out.append({"optimizer": cls.__name__, "kwargs": kw, "steps": steps, "pairs": pairs})
        print(f"  {cls.__name__:9s} {kw}: " + ", ".join(
            f"{k} {_eq(v)}" for k, v in pairs.items()))
    return out


def _model(dtype: torch.dtype, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1920,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                      tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def _ids(tokens: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (max(1, tokens // seq), min(seq, tokens)), generator=g)


def _fwd_bwd(model, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()


def bench_steps(base, repeats: int) -> dict:
    """Median HostOptimizer step time of each class and implementation (own model copies)."""
    ids = _ids(64, 64, 0)
    out = {}
    for name, (cls, kw) in CLASSES.items():
        models = {k: copy.deepcopy(base) for k in IMPLS}
        opts = {k: hr.HostOptimizer(models[k].parameters(), cls, overlap=False, **kw, **v)
                for k, v in IMPLS.items()}
        for k in IMPLS:
            _fwd_bwd(models[k], ids)
            opts[k].step()  # state allocated; the same gradients step again below
        times = {k: [] for k in IMPLS}
        names = list(IMPLS)
        for r in range(repeats):
            for k in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                opts[k].step()
                times[k].append(time.perf_counter() - t0)
        out[name] = {k: statistics.median(v) for k, v in times.items()}
        out[name]["ratio_for-loop_vs_fused"] = statistics.median(
            b / a for a, b in zip(times["fused"], times["for-loop"], strict=True))
        print(f"  {name:14s} " + "  ".join(f"{k} {v * 1e3:7.1f} ms" for k, v in out[name].items()
                                           if not k.startswith("ratio")))
        for o in opts.values():
            o.close()
        del models, opts
    return out


def bench_fwd_bwd(base, tokens: list[int], seq: int, repeats: int) -> dict:
    model = copy.deepcopy(base)
    for p in model.parameters():
        p.requires_grad_(True)
    batches = {t: _ids(t, seq, 1) for t in tokens}
    for t in tokens:
        _fwd_bwd(model, batches[t])
        model.zero_grad(set_to_none=True)
    times = {t: [] for t in tokens}
    for r in range(repeats):
        for t in tokens[r % len(tokens):] + tokens[: r % len(tokens)]:
            t0 = time.perf_counter()
            _fwd_bwd(model, batches[t])
            times[t].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    out = {str(t): statistics.median(v) for t, v in times.items()}
    print("  forward+backward: " + "  ".join(f"{t} tokens {v:.2f} s" for t, v in out.items()))
    return out


def bench_difference(base, steps: int, tokens: int, seq: int) -> dict:
    """Parameters after ``steps`` training steps on the same batches: fused vs for-loop."""
    out = {}
    for name, (cls, kw) in CLASSES.items():
        res = {}
        for k in ("fused", "for-loop"):
            model = copy.deepcopy(base)
            opt = hr.HostOptimizer(model.parameters(), cls, overlap=False, **kw, **IMPLS[k])
            for s in range(steps):
                _fwd_bwd(model, _ids(tokens, seq, 100 + s))
                opt.step()
                opt.zero_grad()
            opt.close()
            res[k] = [p.detach().float() for p in model.parameters()]
        diffs = [(a - b).abs().max().item() for a, b in zip(res["fused"], res["for-loop"],
                                                          strict=True)]
        out[name] = {"bitwise": all(torch.equal(a, b) for a, b in zip(
            res["fused"], res["for-loop"], strict=True)), "max_abs_diff": max(diffs)}
        print(f"  {name:14s} after {steps} steps: bitwise {out[name]['bitwise']}, "
              f"max |fused - for-loop| {out[name]['max_abs_diff']:.2e}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    q = args.quick
    layers, seq = (1, 64) if q else (8, 512)
    tokens = [64, 128] if q else [512, 2048]
    warnings.filterwarnings("ignore")
    res = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "platform": platform.platform()},
           "command": "python benchmarks/optimizer_impl.py" + (" --quick" if q else ""),
           "load_average_before": _load()}
    print("== which CPU implementations are bitwise equal (fp32, 5 steps)")
    res["bitwise"] = bench_bitwise()
    res["model"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).removeprefix("torch.")
        base = _model(dtype, layers)
        n = sum(p.numel() for p in base.parameters())
        print(f"== Llama-like, {n / 1e6:.1f}M parameters, {dn} (load {_load()})")
        r = res["model"][dn] = {"params": n, "layers": layers, "seq": seq}
        r["step_s"] = bench_steps(base, 3 if q else 9)
        r["fwd_bwd_s"] = bench_fwd_bwd(base, tokens, seq, 2 if q else 3)
        r["extra_cost_fraction"] = {
            name: {t: {impl: (st[impl] - st["fused"]) / (fb + st["fused"])
                       for impl in ("for-loop", "foreach")}
                   for t, fb in r["fwd_bwd_s"].items()}
            for name, st in r["step_s"].items()}
        for name, per in r["extra_cost_fraction"].items():
            print(f"  {name:14s} for-loop instead of fused: " + ", ".join(
                f"{v['for-loop'] * 100:+.1f}% of the step at {t} tokens" for t, v in per.items()))
        r["after_5_steps"] = bench_difference(base, 5, 64 if q else 256, seq)
        del base
    res["load_average_after"] = _load()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out} (load {res['load_average_after']})")


if __name__ == "__main__":
    main()
