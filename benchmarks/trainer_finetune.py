"""transformers.Trainer fine-tuning on the CPU: plain against hr.offload(DiskStore) +
hr.HostOptimizer, peak RSS and step time measured in one run.

A GPT-2-like model built from a config (``--layers`` x ``--width``, 16384-token vocabulary,
fp32; every variant starts from one checkpoint), trained by ``transformers.Trainer`` (default
``max_grad_norm=1.0`` clipping, logging every step) for ``--steps`` steps of ``--batch``
sequences of ``--seq`` tokens (default one of 128), with Trainer's activation checkpointing
under ``--gradient-checkpointing`` (every variant alike). Variants, each in a fresh child process,
alternating run by run:

- ``plain``: ``from_pretrained`` (in memory), ``torch.optim.AdamW(fused=True)``;
- ``disk``: built on ``meta``, ``hr.offload(model, device="cpu", store=hr.DiskStore(...))``,
  ``hr.load_weights`` from the same checkpoint, ``hr.HostOptimizer(AdamW)`` with its state in
  host memory;
- ``disk_state_disk``: the same with ``state_store=hr.DiskStore(...)`` (optimizer state on
  disk too);
- ``lora_plain``: ``from_pretrained``, ``peft.get_peft_model`` (LoRA r=8 on ``c_attn`` and
  ``c_fc``; adapters drawn again by PEFT's ``reset_lora_parameters`` under a fixed seed),
  ``torch.optim.AdamW(fused=True)`` over the adapters;
- ``lora_disk``: built on ``meta`` and wrapped by ``peft.get_peft_model``, ``hr.offload`` to a
  DiskStore, ``hr.load_weights`` of the base checkpoint (the frozen base rests on disk, never
  whole in memory), ``hr.init_adapters`` under the same seed (the same initial adapters),
  ``hr.HostOptimizer`` over the adapters.

Each child reports ``fixed`` (its RSS after importing torch, transformers, headroom and
GPT-2's module, before the model exists), ``peak_rss`` (the kernel's VmHWM over the whole
process: model construction and training), ``peak_rss_train`` (VmHWM reset just before
``trainer.train()``: training only), the median step time (steps after the first, which
allocates the optimizer state, timed by a ``TrainerCallback``), its CPU time (every thread of
the process: on a busy machine a steadier measure of the work than the wall time), the same
split into forward + backward + clipping, optimizer step and the rest, and the bytes the
DiskStores read and wrote per step. Medians over ``--repeats`` runs; the ratios are medians
of the per-repeat ratios against ``plain`` (``lora_disk`` against ``lora_plain``). The goal,
reported for each full fine-tune variant as met or not: peak RSS <= 0.6x ``plain`` at <= 1.3x
its step time. ``--batch`` and ``--seq`` set the tokens per step (default one 128-token
sequence): the store traffic per step is fixed by the model, the compute grows with the
tokens, so the time ratio falls as a step holds more tokens. The load average at the start
and end is recorded; above half the CPU count at the start the step times are flagged as
unreliable. ``--profile`` adds each child's top functions
(cProfile, by own time).

    .venv/bin/python benchmarks/trainer_finetune.py              # ~5 min on 2 idle cores
    .venv/bin/python benchmarks/trainer_finetune.py --quick      # 1 repeat, 2 layers, 3 steps
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
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "trainer_finetune.json"
VARIANTS = ("plain", "disk", "disk_state_disk", "lora_plain", "lora_disk")
BASE = {"disk": "plain", "disk_state_disk": "plain", "lora_disk": "lora_plain"}
RSS_GOAL, TIME_GOAL = 0.6, 1.3  # full fine-tune against plain: peak RSS and step time

CHILD = r"""
import json, os, statistics, sys, time, warnings
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
batch, seq, ckpt_act = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1"
profile = len(sys.argv) > 8 and sys.argv[8] == "profile"
cfg = transformers.GPT2Config.from_pretrained(ckpt)
if variant.startswith("lora"):
    import peft
    lora = peft.LoraConfig(r=8, target_modules=["c_attn", "c_fc"], task_type="CAUSAL_LM")
    if variant == "lora_disk":
        # never whole in memory: built on meta and wrapped, the frozen base streamed from the
        # checkpoint to disk, new adapters drawn by PEFT's initializer
        with torch.device("meta"):
            model = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), lora)
        params_store = hr.DiskStore(root + "/params")
        hr.offload(model, device="cpu", store=params_store)
        hr.load_weights(model, ckpt)
        torch.manual_seed(0)
        hr.init_adapters(model)
    else:  # the same initial adapters: PEFT's initializer under the same seed
        model = peft.get_peft_model(transformers.GPT2LMHeadModel.from_pretrained(ckpt), lora)
        torch.manual_seed(0)
        for m in model.modules():
            if isinstance(m, peft.tuners.lora.LoraLayer):
                m.reset_lora_parameters("default", True)
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
    params_store = hr.DiskStore(root + "/params")
    hr.offload(model, device="cpu", store=params_store)
    hr.load_weights(model, ckpt)
    if variant == "disk_state_disk":
        state_store = hr.DiskStore(root + "/state")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4,
                           state_store=state_store if variant == "disk_state_disk" else "cpu")
n_params = sum(p.numel() for p in model.parameters())

class Data(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, cfg.vocab_size, (steps * batch, seq),
                                 generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}

def clocks():
    t = os.times()  # CPU seconds of every thread of the process (the store's I/O threads too)
    return time.perf_counter(), t.user + t.system

# Wall and CPU seconds of each step and of its phases: forward + backward + clipping (Trainer
# clips before on_pre_optimizer_step), the optimizer step, the rest (zero_grad).
class Timer(transformers.TrainerCallback):
    def __init__(self):
        self.times, self.cpu, self.phases, self.io = [], [], [], []
    def on_step_begin(self, args, state, control, **kw):
        self.t0 = clocks()
        self.io0 = io()
    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.t1 = clocks()
    def on_optimizer_step(self, args, state, control, **kw):
        self.t2 = clocks()
    def on_step_end(self, args, state, control, **kw):
        t3 = clocks()
        self.times.append(t3[0] - self.t0[0])
        self.cpu.append(t3[1] - self.t0[1])
        self.phases.append({k: [b[0] - a[0], b[1] - a[1]] for k, a, b in (
            ("fwd_bwd_clip", self.t0, self.t1), ("optimizer", self.t1, self.t2),
            ("rest", self.t2, t3))})
        self.io.append([b - a for a, b in zip(self.io0, io())])

STORES = [s for s in (globals().get("params_store"), globals().get("state_store"))
          if s is not None]

def io():  # bytes the DiskStores read and wrote so far
    return [sum(s.stats()["bytes_read"] for s in STORES),
            sum(s.stats()["bytes_written"] for s in STORES)]

timer = Timer()
args = transformers.TrainingArguments(
    output_dir=root + "/out", max_steps=steps, per_device_train_batch_size=batch,
    logging_steps=1, gradient_checkpointing=ckpt_act,
    report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(),
                               optimizers=(opt, None), callbacks=[timer])
peak_all = rss("VmHWM")  # model construction
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: training only
before_train = rss("VmRSS")
if profile:
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
trainer.train()
top = []
if profile:
    prof.disable()
    st = pstats.Stats(prof)
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in sorted(
            st.stats.items(), key=lambda kv: -kv[1][2])[:25]:
        where = file.split("site-packages/")[-1].split("/src/")[-1]
        top.append([f"{where}:{line}({fn})", ncalls, round(tottime, 3), round(cumtime, 3)])
norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
med = lambda xs: statistics.median(xs[1:])  # the first step allocates the optimizer state
print(json.dumps({"fixed": fixed, "peak_rss": max(peak_all, rss("VmHWM")),
                  "peak_rss_train": rss("VmHWM"), "before_train": before_train,
                  "n_params": n_params,
                  "step_s": med(timer.times), "step_times": timer.times,
                  "cpu_s": med(timer.cpu), "cpu_times": timer.cpu,
                  "phases_s": {k: [med([p[k][0] for p in timer.phases]),
                                   med([p[k][1] for p in timer.phases])]
                               for k in timer.phases[0]},
                  "io_bytes_per_step": [med([x[0] for x in timer.io]),
                                        med([x[1] for x in timer.io])],
                  "grad_norms": norms, "profile_top": top}))
"""


def _checkpoint(path: str, layers: int, width: int, seq: int) -> None:
    """The model every variant fine-tunes, saved once (same weights everywhere)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                  vocab_size=16384, n_positions=max(256, seq))
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def _run(variant: str, steps: int, ckpt: str, profile: bool, batch: int, seq: int,
         ckpt_act: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="hr-trainer-") as root:
        cmd = [sys.executable, "-c", CHILD, variant, str(steps), root, ckpt, str(batch), str(seq),
               str(int(ckpt_act))]
        out = subprocess.run(cmd + (["profile"] if profile else []), capture_output=True,
                             text=True, timeout=3600, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _verdict(r: dict, busy: bool) -> str:
    rss_ok, time_ok = r["peak_rss"] <= RSS_GOAL, r["step_s"] <= TIME_GOAL
    rss = f"RSS <= {RSS_GOAL}x: {'met' if rss_ok else 'NOT met'}"
    if busy:  # other work took the CPUs: the times do not say what the variant costs
        return (f"{rss}; step time <= {TIME_GOAL}x: not judged (machine busy; rerun on an idle"
                " one)")
    both = "MEETS BOTH GOALS" if rss_ok and time_ok else "does not meet both goals"
    return (f"{rss}; step time <= {TIME_GOAL}x: {'met' if time_ok else 'NOT met'} (CPU time"
            f" {r['cpu_s']:.2f}x); {both}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="TrainingArguments(gradient_checkpointing=True) in every variant")
    ap.add_argument("--quick", action="store_true", help="2 layers, 3 steps, 1 repeat")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each child's training (slower; top functions in the JSON)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.layers, args.steps, args.repeats = 2, 3, 1
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    ckpt_dir = tempfile.TemporaryDirectory(prefix="hr-trainer-ckpt-")
    _checkpoint(ckpt_dir.name, args.layers, args.width, args.seq)
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            res = _run(v, args.steps, ckpt_dir.name, args.profile, args.batch, args.seq,
                       args.gradient_checkpointing)
            runs[v].append(res)
            ph = "  ".join(f"{k} {w:.2f}" for k, (w, _) in res["phases_s"].items())
            print(f"  run {r} {v:16s} peak RSS {res['peak_rss'] / 2**20:6.0f} MiB  step"
                  f" {res['step_s']:.2f} s (cpu {res['cpu_s']:.2f} s; {ph})  store traffic"
                  f" {res['io_bytes_per_step'][0] / 2**20:.0f} MiB read,"
                  f" {res['io_bytes_per_step'][1] / 2**20:.0f} MiB written per step", flush=True)
    keys = ("fixed", "peak_rss", "peak_rss_train", "before_train", "step_s", "cpu_s")
    summary: dict = {v: {k: statistics.median(x[k] for x in rs) for k in keys}
                     for v, rs in runs.items()}
    for v, rs in runs.items():
        summary[v]["phases_s"] = {k: [statistics.median(x["phases_s"][k][j] for x in rs)
                                      for j in (0, 1)] for k in rs[0]["phases_s"]}
    summary["n_params"] = next(iter(runs.values()))[0]["n_params"]
    load_end = os.getloadavg()
    # other work before the runs (at the end the load average counts the runs' own threads)
    busy = load_start[0] > 0.5 * (os.cpu_count() or 1)
    print(f"== medians ({summary['n_params'] / 1e6:.1f}M parameters; load average"
          f" {load_start[0]:.1f} at start, {load_end[0]:.1f} at end on {os.cpu_count()} CPUs"
          f"{': busy, step times unreliable' if busy else ''})")
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
            "cpu_s": statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in pairs),
            # exactness while measuring: the clipped runs log the same gradient norms
            "grad_norms_equal": all(a["grad_norms"] == b["grad_norms"] for a, b in pairs),
        }
        print(f"  {v:16s} / {base}: peak RSS {r['peak_rss']:.2f}x (above fixed"
              f" {r['peak_rss_above_fixed']:.2f}x, training only {r['peak_rss_train']:.2f}x)"
              f"  step time {r['step_s']:.2f}x (CPU {r['cpu_s']:.2f}x)  grad norms equal"
              f" {r['grad_norms_equal']}")
        if base == "plain":
            r["goal"] = _verdict(r, busy)
            print(f"    goal: {r['goal']}")
    wall = time.perf_counter() - t_start
    print(f"  ({wall:.0f} s in all)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": 2, "load_avg_at_start": load_start,
                    "load_avg_at_end": load_end, "busy": busy, "wall_s": wall},
        "goal": {"peak_rss_over_plain": RSS_GOAL, "step_s_over_plain": TIME_GOAL},
        "args": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": summary,
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
