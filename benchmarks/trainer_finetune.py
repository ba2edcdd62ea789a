"""transformers.Trainer fine-tuning on the CPU: plain against hr.offload(DiskStore) +
hr.HostOptimizer, peak RSS and step time measured in one run.

A GPT-2-like model built from a config (``--layers`` x ``--width``, 16384-token vocabulary,
fp32; every variant starts from one checkpoint), trained by ``transformers.Trainer`` (default
``max_grad_norm=1.0`` clipping, logging every step) for ``--steps`` steps of one 128-token
sequence. Variants, each in a fresh child process, alternating run by run:

- ``plain``: ``from_pretrained`` (in memory), ``torch.optim.AdamW(fused=True)``;
- ``disk``: built on ``meta``, ``hr.offload(model, device="cpu", store=hr.DiskStore(...))``,
  ``hr.load_weights`` from the same checkpoint, ``hr.HostOptimizer(AdamW)`` with its state in
  host memory;
- ``disk_state_disk``: the same with ``state_store=hr.DiskStore(...)`` (optimizer state on
  disk too);
- ``lora_plain``: ``from_pretrained``, ``peft.get_peft_model`` (LoRA r=8 on ``c_attn`` and
  ``c_fc``), ``torch.optim.AdamW(fused=True)`` over the adapters;
- ``lora_disk``: the same wrapped model, then ``hr.offload`` to a DiskStore (the frozen base
  rests on disk), ``hr.HostOptimizer`` over the adapters.

Each child reports ``fixed`` (its RSS after importing torch, transformers, headroom and
GPT-2's module, before the model exists), ``peak_rss`` (the kernel's VmHWM over the whole
process: model construction and training), ``peak_rss_train`` (VmHWM reset just before
``trainer.train()``: training only; the LoRA variants load the whole model into memory before
offloading it) and the median step time (steps after the first, timed by a
``TrainerCallback``). The claim: ``disk`` peak RSS <= 0.6x ``plain`` at <= 1.3x its step time.
Medians over ``--repeats`` runs; the ratios are medians of the per-repeat ratios against
``plain`` (``lora_disk`` against ``lora_plain``).

    .venv/bin/python benchmarks/trainer_finetune.py              # ~5 min on 2 cores
    .venv/bin/python benchmarks/trainer_finetune.py --quick      # 1 repeat, 4 layers
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

RESULTS = Path(__file__).parent / "results" / "trainer_finetune.json"
VARIANTS = ("plain", "disk", "disk_state_disk", "lora_plain", "lora_disk")
BASE = {"disk": "plain", "disk_state_disk": "plain", "lora_disk": "lora_plain"}

CHILD = r"""
import json, statistics, sys, time, warnings
warnings.simplefilter("ignore")

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

import torch, transformers
from transformers.models.gpt2 import modeling_gpt2
import headroom as hr
torch.set_num_threads(2)
transformers.logging.set_verbosity_error()
fixed = rss("VmRSS")
variant, steps, root, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = transformers.GPT2Config.from_pretrained(ckpt)
if variant.startswith("lora"):
    import peft
    model = transformers.GPT2LMHeadModel.from_pretrained(ckpt)
    torch.manual_seed(0)  # the adapters' initialization
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["c_attn", "c_fc"],
                                                        task_type="CAUSAL_LM"))
    if variant == "lora_disk":  # wrapped, then offloaded: the frozen base rests on disk
        hr.offload(model, device="cpu", store=hr.DiskStore(root + "/params"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (hr.HostOptimizer(trainable, torch.optim.AdamW, lr=1e-4) if variant == "lora_disk"
           else torch.optim.AdamW(trainable, lr=1e-4, fused=True))
elif variant == "plain":
    model = transformers.GPT2LMHeadModel.from_pretrained(ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
else:
    # never whole in memory: built on meta, its weights streamed from the checkpoint to disk
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    hr.offload(model, device="cpu", store=hr.DiskStore(root + "/params"))
    hr.load_weights(model, ckpt)
    state = hr.DiskStore(root + "/state") if variant == "disk_state_disk" else "cpu"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, state_store=state)
n_params = sum(p.numel() for p in model.parameters())

class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, cfg.vocab_size, (steps, 128),
                                 generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

class Timer(transformers.TrainerCallback):
    def __init__(self):
        self.times = []
    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t0)

timer = Timer()
args = transformers.TrainingArguments(
    output_dir=root + "/out", max_steps=steps, per_device_train_batch_size=1, logging_steps=1,
    report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(),
                               optimizers=(opt, None), callbacks=[timer])
peak_all = rss("VmHWM")  # model construction
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: training only
before_train = rss("VmRSS")
trainer.train()
norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
print(json.dumps({"fixed": fixed, "peak_rss": max(peak_all, rss("VmHWM")),
                  "peak_rss_train": rss("VmHWM"), "before_train": before_train,
                  "n_params": n_params,
                  "step_s": statistics.median(timer.times[1:]), "step_times": timer.times,
                  "grad_norms": norms}))
"""


def _checkpoint(path: str, layers: int, width: int) -> None:
    """The model every variant fine-tunes, saved once (same weights everywhere)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                  vocab_size=16384, n_positions=256)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def _run(variant: str, steps: int, ckpt: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="hr-trainer-") as root:
        out = subprocess.run([sys.executable, "-c", CHILD, variant, str(steps), root, ckpt],
                             capture_output=True, text=True, timeout=3600, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.repeats = 4, 1
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    ckpt_dir = tempfile.TemporaryDirectory(prefix="hr-trainer-ckpt-")
    _checkpoint(ckpt_dir.name, args.layers, args.width)
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            res = _run(v, args.steps, ckpt_dir.name)
            runs[v].append(res)
            print(f"  run {r} {v:16s} fixed {res['fixed'] / 2**20:6.0f} MiB  peak RSS"
                  f" {res['peak_rss'] / 2**20:6.0f} MiB  step {res['step_s']:.2f} s", flush=True)
    keys = ("fixed", "peak_rss", "peak_rss_train", "before_train", "step_s")
    summary: dict = {v: {k: statistics.median(x[k] for x in rs) for k in keys}
                     for v, rs in runs.items()}
    summary["n_params"] = next(iter(runs.values()))[0]["n_params"]
    print(f"== medians ({summary['n_params'] / 1e6:.1f}M parameters)")
    for v, base in BASE.items():
        if v not in runs or base not in runs:
            continue
        pairs = list(zip(runs[v], runs[base], strict=True))
        summary[f"{v}_over_{base}"] = r = {
            "peak_rss": statistics.median(a["peak_rss"] / b["peak_rss"] for a, b in pairs),
            "peak_rss_above_fixed": statistics.median(
                (a["peak_rss"] - a["fixed"]) / (b["peak_rss"] - b["fixed"]) for a, b in pairs),
            "peak_rss_train": statistics.median(
                a["peak_rss_train"] / b["peak_rss_train"] for a, b in pairs),
            "step_s": statistics.median(a["step_s"] / b["step_s"] for a, b in pairs),
            # exactness while measuring: the clipped runs log the same gradient norms
            "grad_norms_equal": all(a["grad_norms"] == b["grad_norms"] for a, b in pairs),
        }
        print(f"  {v:16s} / {base}: peak RSS {r['peak_rss']:.2f}x (above fixed"
              f" {r['peak_rss_above_fixed']:.2f}x, training only {r['peak_rss_train']:.2f}x)"
              f"  step time {r['step_s']:.2f}x  grad norms equal {r['grad_norms_equal']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": 2, "load_avg_at_end": os.getloadavg()},
        "args": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": summary,
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
