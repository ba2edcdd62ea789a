"""Claim: hr.estimate's peak is within 5% of the peak hr.track_memory measures on CPU.

Side by side in one run, for each model: the peak of one steady-state AdamW training step
measured by hr.track_memory, the dry-run estimate by hr.estimate, and PyTorch's own MemTracker
run under FakeTensorMode on ``cpu`` (torch.distributed._tools.mem_tracker; its categories
differ, so only its total is compared); then the same for the step with each of headroom's
features: hr.convert, checkpointing, activation offload (as what-ifs of the plain model), and
models under hr.offload (host memory, DiskStore; prefetch 0/1/2) with hr.HostOptimizer (state
in host memory or on a DiskStore, overlap on or off), estimated from the offloaded model itself.
Peaks are deterministic but for gradients still being written to disk; times are medians of
``--rounds`` runs.

    python benchmarks/estimate_accuracy.py [--rounds 3] [--models mlp,transformer]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import headroom as hr

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' feature helpers
from tests.memory._models import measure as measure_features  # noqa: E402
from tests.memory._models import with_features  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "estimate_accuracy.json"


def mlp():
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(),
                          nn.Linear(2048, 10))
    return model, (torch.randn(256, 512),), lambda o: o.square().mean()


def cnn():
    chans = [3, 32, 64, 64, 128]
    layers: list[nn.Module] = []
    for a, b in zip(chans, chans[1:], strict=False):
        layers += [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 2 * 2, 10))
    y = torch.randint(0, 10, (32,))
    return model, (torch.randn(32, 3, 32, 32),), lambda o: F.cross_entropy(o, y)


def transformer():
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    return model, (torch.randn(16, 128, 256),), lambda o: o.square().mean()


def _hf(name):
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000,
                                      n_positions=256)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256,
                                       intermediate_size=688, num_attention_heads=8,
                                       num_key_value_heads=4, vocab_size=8000)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(num_hidden_layers=4, hidden_size=256,
                                      intermediate_size=1024, num_attention_heads=4,
                                      vocab_size=8000)
        model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(0, 8000, (8, 256))
    return model, (ids,), lambda o: o.logits.float().square().mean()


MODELS = {"mlp": mlp, "cnn_batchnorm": cnn, "transformer": transformer,
          "gpt2": partial(_hf, "gpt2"), "llama": partial(_hf, "llama"),
          "bert": partial(_hf, "bert")}


ACT = {"min_bytes": 1 << 16, "prefetch": 4 << 20}  # activation offload with refill-ahead
# (case, hr.offload's (store, prefetch) or None, hr.HostOptimizer's (state, overlap) or None)
FEATURES = [
    ("hr.offload(store='cpu', prefetch=1) + AdamW", ("cpu", 1), None),
    ("hr.offload(DiskStore, prefetch=0) + HostOptimizer(state 'cpu', overlap)",
     ("disk", 0), ("cpu", True)),
    ("hr.offload(DiskStore, prefetch=1) + HostOptimizer(state DiskStore)",
     ("disk", 1), ("disk", False)),
    ("hr.offload(DiskStore, prefetch=2) + HostOptimizer(state DiskStore, overlap)",
     ("disk", 2), ("disk", True)),
    ("HostOptimizer(state 'cpu')", None, ("cpu", False)),
    ("HostOptimizer(state DiskStore, overlap)", None, ("disk", True)),
]


def blocks_of(name, model):
    if name == "transformer":
        return [f"layers.{i}" for i in range(len(model.layers))]
    if name in ("gpt2",):
        return [f"transformer.h.{i}" for i in range(len(model.transformer.h))]
    if name == "llama":
        return [f"model.layers.{i}" for i in range(len(model.model.layers))]
    if name == "bert":
        return [f"bert.encoder.layer.{i}" for i in range(len(model.bert.encoder.layer))]
    return []


def measure(model, args, loss_fn, *, wrap=None):
    opt = torch.optim.AdamW(model.parameters())

    def step():
        ctx = wrap() if wrap else _null()
        with ctx:
            loss_fn(model(*args)).backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    return mem.peak


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def memtracker_fake(make, loss_fn_of):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    try:
        with FakeTensorMode():
            torch.manual_seed(0)
            model, args, loss_fn = make()
            opt = torch.optim.AdamW(model.parameters())

            def step():
                loss_fn(model(*args)).backward()
                opt.step()
                opt.zero_grad()

            step()
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                step()
            return int(sum(v["Total"] for v in mt.get_tracker_snapshot("peak").values()))
    except Exception as e:  # its own limits, recorded as such
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def timed(fn, rounds):
    times, out = [], None
    for _ in range(rounds):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    args_ = parser.parse_args()
    names = args_.models.split(",")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rows = []
    tmp = tempfile.mkdtemp()
    for name in names:
        make = MODELS[name]
        torch.manual_seed(0)
        model, args, loss_fn = make()
        blocks = blocks_of(name, model)
        cases = [("plain", {}, None, None)]
        cases.append(("hr.convert", {"prepare": lambda m: hr.convert(m, inplace=True)},
                      lambda m: hr.convert(m), None))
        if blocks:
            def ckpt(m, blocks=blocks):
                for b in blocks:
                    mod = m.get_submodule(b)
                    mod.forward = partial(checkpoint, mod.forward, use_reentrant=False)
                return m
            cases.append(("checkpointing", {"checkpoint": blocks}, ckpt, None))
        cases.append(("hr.offload_activations", {"offload_activations": 1 << 16}, None,
                      lambda: hr.offload_activations(store=hr.DiskStore(tmp + "/a"),
                                                     min_bytes=1 << 16, prefetch=0)))
        cases.append(("hr.offload_activations(prefetch=4 MiB)", {"offload_activations": ACT},
                      None, lambda: hr.offload_activations(store=hr.DiskStore(tmp + "/a2"),
                                                           **ACT)))
        for case, options, transform, wrap in cases:
            torch.manual_seed(0)
            m, a, lf = make()
            est, t_est = timed(lambda m=m, a=a, lf=lf, options=options: hr.estimate(
                m, a, loss_fn=lf, optimizer=torch.optim.AdamW, **options), args_.rounds)
            if transform is not None:
                m = transform(m)
            meas, t_step = timed(lambda m=m, a=a, lf=lf, wrap=wrap: measure(m, a, lf, wrap=wrap),
                                 1)
            row = {"model": name, "case": case, "measured_peak": meas, "estimated_peak": est.peak,
                   "error": (est.peak - meas) / meas, "estimate_s": round(t_est, 3),
                   "measured_two_steps_s": round(t_step, 3)}
            if case == "plain":
                row["memtracker_fake_cpu_peak"] = memtracker_fake(make, None)
            rows.append(row)
            print(json.dumps(row))
        for case, offload, host in FEATURES:
            torch.manual_seed(0)
            m, a, lf = make()
            folder = Path(tempfile.mkdtemp(dir=tmp))
            opt = with_features(m, folder, offload=offload, host=host, slice_bytes=1 << 20)
            mem, t_step = timed(lambda m=m, a=a, opt=opt, lf=lf: measure_features(
                m, a, opt, loss=lf), 1)
            est, t_est = timed(lambda m=m, a=a, lf=lf, opt=opt: hr.estimate(
                m, a, loss_fn=lf, optimizer=opt), args_.rounds)
            row = {"model": name, "case": case, "measured_peak": mem.peak,
                   "estimated_peak": est.peak, "error": (est.peak - mem.peak) / mem.peak,
                   "estimate_s": round(t_est, 3), "measured_two_steps_s": round(t_step, 3)}
            rows.append(row)
            print(json.dumps(row))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "claim": "hr.estimate within 5% of hr.track_memory's measured peak on CPU",
        "command": f"python benchmarks/estimate_accuracy.py --rounds {args_.rounds}",
        "torch": torch.__version__, "machine": platform.machine(),
        "processor": platform.processor(), "rows": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows),
        "exact": sum(r["error"] == 0 for r in rows), "cases": len(rows),
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
