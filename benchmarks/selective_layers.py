"""Bytes kept for backward and time, plain PyTorch vs memsave_torch vs ``hr.convert``.

Five models built from ``torch.nn`` (a VGG-like CNN with six convolutions, a ResNet-18-like
network, a MobileNetV2-like network with depthwise convolutions and ReLU6, a UNet and a
DenseNet-like network, from ``tests/nn/_zoo.py``), four cases of what trains:

- ``all``: every parameter (ordinary training);
- ``input``: only the input (adversarial examples, feature visualization);
- ``norm``: only the BatchNorm affine parameters (norm tuning);
- ``surgical``: one convolution in the middle of the network.

Memory is measured two ways after a warm-up step, as bytes of storages created during the forward
that are still alive when it returns ("kept", the number that matters and the only fair one:
memsave_torch keeps some tensors as plain attributes of the autograd context, invisible to
saved-tensor hooks), and as bytes passed to ``torch.autograd.graph.saved_tensors_hooks``
("saved"), deduplicated by storage. Parameters and buffers are never counted. "Kept" is taken
from a forward without saved-tensor hooks (converted layers take their fast path, as in
training), "saved" from a second one under hooks (their autograd.Function path).

Time is forward+backward, medians of interleaved repeats (a random order per repeat), as a
ratio to plain PyTorch, in process CPU time (robust when other jobs share the machine; the
headline; also as the median of per-repeat ratios, "paired", in which load that drifts over the
run mostly cancels) and in wall time, with the median number of minor page faults per step (heap
regrowth after glibc returned freed memory to the OS costs process CPU time too, and differs
between runs). A second copy of the plain model is timed the same way ("torch_copy"): its ratio
to plain, 1.000x on a quiet machine, is the run's own noise floor.

Each model runs in a fresh process of its own (``--in-process``: all in this one, one after the
other), as a user trains one model per process: the state that earlier models leave in the
allocator and the caches otherwise moves later models' ratios by a few per cent (DenseNet-like
``input``, the same code: 1.055x paired as the 18th of 20 cases in one process, 1.028x alone).

Run (memsave_torch is optional; give the folder that contains the ``memsave_torch`` package):

    MEMSAVE_TORCH_PATH=/path/to/memsave_checkout .venv/bin/python benchmarks/selective_layers.py

Writes ``benchmarks/results/selective_layers.json``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import headroom as hr

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' models and measurements
from tests.nn._measure import CreatedStorages  # noqa: E402
from tests.nn._zoo import (  # noqa: E402
    UNet,
    densenet_like,
    mobilenet_v2_like,
    resnet_like,
    set_case,
    vgg_like,
)

MiB = 1 << 20
CASES = ("all", "input", "norm", "surgical")  # "none" keeps nothing either way


# --------------------------------------------------------------------------------- measuring
def measure_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(kept, saved) bytes, as described in the module docstring, from two forwards."""
    # "kept" is measured without saved-tensor hooks, so converted layers take the path a
    # plain training step takes (PyTorch's own nodes under headroom's hooks); under hooks of
    # the caller's ("saved") they take their autograd.Function path instead. Both keep the same.
    resident = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    gc.collect()
    mode = CreatedStorages()
    with mode:
        out = model(x)
    loss = out.float().sum()
    skip = resident | {out.untyped_storage()._cdata, loss.untyped_storage()._cdata}
    del out
    gc.collect()
    kept = mode.live_bytes(skip)
    if loss.requires_grad:
        loss.backward()
    model.zero_grad(set_to_none=True)
    saved = _saved(model, x)
    model.zero_grad(set_to_none=True)
    return kept, saved


def fwd_bwd(model: nn.Module, x: torch.Tensor) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, minor page faults) of one forward+backward."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = time.process_time(), time.perf_counter()
    out = model(x)
    out.float().sum().backward()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    model.zero_grad(set_to_none=True)
    return wall, cpu, faults


def load_memsave():
    path = os.environ.get("MEMSAVE_TORCH_PATH")
    if path:
        sys.path.insert(0, path)
    try:
        from memsave_torch.nn import convert_to_memory_saving
    except ImportError as exc:
        print(f"memsave_torch not importable ({exc}); set MEMSAVE_TORCH_PATH to compare")
        return None
    # memsave_torch's MemSaveDropout passes the bound method ``self.train`` where a bool is
    # expected and raises in training mode, so its dropout replacement is left off.
    return lambda model: convert_to_memory_saving(model, dropout=False)


# --------------------------------------------------------------------------------- layers
def _layer_specs() -> dict[str, tuple]:
    """Every converted layer kind, on an 8x32x32x32 (1 MiB fp32) input unless noted."""
    c = 32
    return {
        "Conv2d": (lambda: nn.Conv2d(c, c, 3, padding=1), (8, c, 32, 32)),
        "Conv2d reflect": (
            lambda: nn.Conv2d(c, c, 3, padding=1, padding_mode="reflect"),
            (8, c, 32, 32),
        ),
        "Conv1d": (lambda: nn.Conv1d(c, c, 3, padding=1), (8, c, 1024)),
        "Conv3d": (lambda: nn.Conv3d(c, c, 3, padding=1), (8, c, 8, 8, 16)),
        "ConvTranspose2d": (lambda: nn.ConvTranspose2d(c, c, 2, stride=2), (8, c, 32, 32)),
        "BatchNorm2d (train)": (lambda: nn.BatchNorm2d(c), (8, c, 32, 32)),
        "BatchNorm2d (eval)": (lambda: nn.BatchNorm2d(c).eval(), (8, c, 32, 32)),
        "LayerNorm": (lambda: nn.LayerNorm(256), (8, 128, 256)),
        "GroupNorm": (lambda: nn.GroupNorm(8, c), (8, c, 32, 32)),
        "ReLU -> frozen Conv2d": (
            lambda: nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 1)),
            (8, c, 32, 32),
        ),
        "ReLU -> trainable Conv2d": (
            lambda: nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 1)),
            (8, c, 32, 32),
        ),
        "LeakyReLU": (lambda: nn.LeakyReLU(0.1), (8, c, 32, 32)),
        "ReLU6": (lambda: nn.ReLU6(), (8, c, 32, 32)),
        "Hardtanh": (lambda: nn.Hardtanh(), (8, c, 32, 32)),
        "Dropout (train)": (lambda: nn.Dropout(0.5), (8, c, 32, 32)),
        "MaxPool2d": (lambda: nn.MaxPool2d(2), (8, c, 32, 32)),
        "MaxPool1d": (lambda: nn.MaxPool1d(2), (8, c, 1024)),
        "MaxPool3d": (lambda: nn.MaxPool3d(2), (8, c, 8, 8, 16)),
        "AdaptiveMaxPool2d": (lambda: nn.AdaptiveMaxPool2d(4), (8, c, 32, 32)),
        "AvgPool2d": (lambda: nn.AvgPool2d(2), (8, c, 32, 32)),
        "AdaptiveAvgPool2d(4)": (lambda: nn.AdaptiveAvgPool2d(4), (8, c, 32, 32)),
        "ReflectionPad2d": (lambda: nn.ReflectionPad2d(2), (8, c, 32, 32)),
        "ReplicationPad2d": (lambda: nn.ReplicationPad2d(2), (8, c, 32, 32)),
        "Linear": (lambda: nn.Linear(256, 256), (8, 128, 256)),
        # Measured, nothing to drop (hr.convert leaves them as they are):
        "GELU": (lambda: nn.GELU(), (8, 128, 256)),
        "SiLU": (lambda: nn.SiLU(), (8, 128, 256)),
        "Hardswish": (lambda: nn.Hardswish(), (8, 128, 256)),
        "Softmax": (lambda: nn.Softmax(-1), (8, 128, 256)),
        "Sigmoid": (lambda: nn.Sigmoid(), (8, 128, 256)),
        "Tanh": (lambda: nn.Tanh(), (8, 128, 256)),
        "Dropout2d (train)": (lambda: nn.Dropout2d(0.5), (8, c, 32, 32)),
        "AdaptiveAvgPool2d(1)": (lambda: nn.AdaptiveAvgPool2d(1), (8, c, 32, 32)),
        "Upsample (bilinear)": (
            lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
            (8, c, 32, 32),
        ),
        "PixelShuffle": (lambda: nn.PixelShuffle(2), (8, c, 32, 32)),
        "ZeroPad2d": (lambda: nn.ZeroPad2d(2), (8, c, 32, 32)),
        "MultiheadAttention": (lambda: _SelfAttention(256), (8, 128, 256)),
    }


class _SelfAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


LAYER_CASES = {
    # case -> (input requires grad, which parameters train)
    "all": (True, "all"),
    "input only": (True, "none"),
    "params only": (False, "all"),
    "bias only": (False, "bias"),
}


def _saved(model: nn.Module, x: torch.Tensor) -> int:
    resident = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in resident:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    if out.requires_grad:
        out.sum().backward()
    return sum(seen.values())


def layer_table() -> dict[str, dict[str, dict[str, int]]]:
    """Bytes saved by autograd per layer and case, torch vs headroom (after a warm-up step)."""
    table: dict[str, dict[str, dict[str, int]]] = {}
    for name, (build, shape) in _layer_specs().items():
        torch.manual_seed(0)
        plain = build()
        ours = hr.convert(copy.deepcopy(plain))
        row = {}
        for case, (input_grad, params) in LAYER_CASES.items():
            for model in (plain, ours):
                for pname, p in model.named_parameters():
                    want = params == "all" or (params == "bias" and pname.endswith("bias"))
                    p.requires_grad_(want and "frozen" not in name)
            x = torch.randn(shape).requires_grad_(input_grad)
            _saved(ours, x)  # warm-up: ReLUs learn their consumers
            row[case] = {"torch": _saved(plain, x), "headroom": _saved(ours, x)}
        table[name] = row
    return table


# --------------------------------------------------------------------------------- main
def _run_isolated(name: str) -> dict:
    """One model's rows, measured by this script in a fresh process (same options)."""
    keep, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a in ("--models", "--out"):
            skip = True
        elif not a.startswith(("--models=", "--out=")) and a != "--no-layers":
            keep.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model.json"
        cmd = [sys.executable, __file__, *keep, "--models", name, "--no-layers", "--in-process",
               "--out", str(out)]
        run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        sys.stdout.write("".join(line + "\n" for line in run.stdout.splitlines()
                                 if line.startswith(name)))
        if run.returncode:
            raise SystemExit(f"{name}: the child process failed (exit {run.returncode})")
        return json.loads(out.read_text())["models"][name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64, help="VGG-like input height and width")
    ap.add_argument("--resnet-size", type=int, default=128, help="ResNet-like input size")
    ap.add_argument("--mobilenet-size", type=int, default=96, help="MobileNetV2-like input size")
    ap.add_argument("--unet-size", type=int, default=64, help="UNet input size")
    ap.add_argument("--densenet-size", type=int, default=64, help="DenseNet-like input size")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per variant and case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="seeds the random order of the variants")
    ap.add_argument(
        "--models",
        default="vgg_like,resnet_like,mobilenet_v2_like,unet,densenet_like",
        help="comma-separated subset of the default",
    )
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer bytes table")
    ap.add_argument("--in-process", action="store_true",
                    help="run every model in this process instead of a fresh one each")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/selective_layers.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    memsave = load_memsave()
    rng = random.Random(args.seed)

    layers = {} if args.no_layers else layer_table()
    print("| layer | " + " | ".join(f"{c}: torch -> headroom KiB" for c in LAYER_CASES) + " |")
    print("|---|" + "---:|" * len(LAYER_CASES))
    for name, row in layers.items():
        cells = [
            f"{row[c]['torch'] / 1024:.1f} -> {row[c]['headroom'] / 1024:.1f}" for c in LAYER_CASES
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()

    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "batch": args.batch,
        "process_per_model": not args.in_process,
        "size": {
            "vgg_like": args.size,
            "resnet_like": args.resnet_size,
            "mobilenet_v2_like": args.mobilenet_size,
            "unet": args.unet_size,
            "densenet_like": args.densenet_size,
        },
        "memsave_torch": memsave is not None,
        "layers_saved_bytes": layers,
        "models": {},
    }
    builders = {
        "vgg_like": (lambda: vgg_like(size=args.size), args.size),
        "resnet_like": (resnet_like, args.resnet_size),
        "mobilenet_v2_like": (lambda: mobilenet_v2_like(16), args.mobilenet_size),
        "unet": (lambda: UNet(16, depth=3), args.unet_size),
        "densenet_like": (lambda: densenet_like(12, blocks=(4, 4, 4)), args.densenet_size),
    }
    wanted = args.models.split(",")
    unknown = set(wanted) - set(builders)
    if unknown:
        ap.error(f"unknown --models {sorted(unknown)}; choose from {sorted(builders)}")
    for name, (build, size) in builders.items():
        if name not in wanted:
            continue
        if not args.in_process:
            results["models"][name] = _run_isolated(name)
            continue
        torch.manual_seed(0)
        plain = build()
        # "torch_copy" is a second, identical plain model timed like the others: its
        # ratio to "torch" (1.000x if the machine were quiet) is this run's noise floor.
        # Every variant is a deep copy, made in the same way, so that none is favoured by
        # where its parameters happen to lie.
        variants = {
            "torch": copy.deepcopy(plain),
            "torch_copy": copy.deepcopy(plain),
            "headroom": hr.convert(copy.deepcopy(plain)),
        }
        if memsave is not None:
            variants["memsave"] = memsave(copy.deepcopy(plain))
        x0 = torch.randn(args.batch, 3, size, size)
        rows = {}
        for case in CASES:
            x = x0.clone().requires_grad_(case == "input")
            for model in variants.values():
                set_case(model, case)
                fwd_bwd(model, x)  # warm-up (and: converted ReLUs learn their consumers)
            row = {}
            for vname, model in variants.items():
                kept, saved = measure_bytes(model, x)
                row[vname] = {"kept_bytes": kept, "saved_bytes": saved}
            walls: dict[str, list[float]] = {v: [] for v in variants}
            cpus: dict[str, list[float]] = {v: [] for v in variants}
            faults: dict[str, list[int]] = {v: [] for v in variants}
            order = list(variants.items())
            for _ in range(args.repeats):
                # A fresh random order per repeat: no variant always runs first or after
                # the same one (what ran before changes the allocator's and caches' state).
                rng.shuffle(order)
                for vname, model in order:
                    wall, cpu, nfault = fwd_bwd(model, x)
                    walls[vname].append(wall)
                    cpus[vname].append(cpu)
                    faults[vname].append(nfault)
            for vname in variants:
                row[vname]["wall_s"] = statistics.median(walls[vname])
                row[vname]["cpu_s"] = statistics.median(cpus[vname])
                row[vname]["page_faults"] = statistics.median(faults[vname])
            for vname in variants:
                row[vname]["cpu_vs_torch"] = row[vname]["cpu_s"] / row["torch"]["cpu_s"]
                row[vname]["wall_vs_torch"] = row[vname]["wall_s"] / row["torch"]["wall_s"]
                # Also the median of per-repeat ratios: within one repeat the variants
                # run back to back, so load from other jobs on the machine, which drifts over
                # the run, mostly cancels in each ratio.
                row[vname]["cpu_vs_torch_paired"] = statistics.median(
                    c / t for c, t in zip(cpus[vname], cpus["torch"], strict=True)
                )
            rows[case] = row
            line = f"{name:12s} {case:9s}"
            for vname in variants:
                r = row[vname]
                line += (
                    f" | {vname} kept {r['kept_bytes'] / MiB:6.2f} MiB"
                    f" saved {r['saved_bytes'] / MiB:6.2f}"
                    f" cpu {r['cpu_s'] * 1e3:6.1f} ms ({r['cpu_vs_torch']:.3f}x,"
                    f" paired {r['cpu_vs_torch_paired']:.3f}x)"
                    f" wall ({r['wall_vs_torch']:.3f}x) faults {r['page_faults']:.0f}"
                )
            print(line, flush=True)
        results["models"][name] = rows

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")
    print(
        "\n| model | case | torch MiB | memsave MiB | headroom MiB "
        "| headroom CPU time vs torch | paired | memsave CPU time vs torch "
        "| headroom wall vs torch | torch copy vs torch (noise) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in results["models"].items():
        for case, row in rows.items():
            ms = row.get("memsave")
            ms_txt = f"{ms['kept_bytes'] / MiB:.1f}" if ms else "n/a"
            ms_time = f"{ms['cpu_vs_torch']:.3f}x" if ms else "n/a"
            print(
                f"| {name} | {case} | {row['torch']['kept_bytes'] / MiB:.1f} | {ms_txt} | "
                f"{row['headroom']['kept_bytes'] / MiB:.1f} | "
                f"{row['headroom']['cpu_vs_torch']:.3f}x | "
                f"{row['headroom']['cpu_vs_torch_paired']:.3f}x | {ms_time} | "
                f"{row['headroom']['wall_vs_torch']:.3f}x | "
                f"{row['torch_copy']['cpu_vs_torch']:.3f}x |"
            )


if __name__ == "__main__":
    main()
