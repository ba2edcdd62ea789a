"""Fine-tuning Llama-shaped models on one device: the largest size each tool fits, and how fast.

Tools (each skipped, with the reason recorded, where it does not import or cannot run here):

- ``plain``: PyTorch alone: fp32 parameters on the device, bf16 autocast, ``torch.optim.AdamW
  (fused=True)``.
- ``fsdp2``: ``fully_shard`` (world of one process) on every decoder layer and the root, with
  ``CPUOffloadPolicy`` (fp32 shards, gradients and AdamW on the host) and bf16 compute
  (``MixedPrecisionPolicy``).
- ``torchao``: ``torchao.optim.CPUOffloadOptimizer`` (AdamW on the host) over fp32 parameters on
  the device, bf16 autocast; ``offload_gradients=True`` when there is one micro-batch per step
  (torchao does not support it with gradient accumulation).
- ``deepspeed``: ZeRO-3 with parameters and optimizer state offloaded to the host (bf16,
  ``torch.optim.AdamW`` on the host, so no C++ op has to be built).
- ``headroom``: bf16 parameters in host memory (or on disk when host memory cannot hold the
  fp32 masters and AdamW state: ``--disk-dir``), ``hr.offload`` (prefetch 1; the micro-batches'
  fp32 gradients summed on the device, ``--grad-accumulation``), ``hr.HostOptimizer`` (fp32
  masters, AdamW, overlapped with the last backward), the model built on ``meta`` and
  initialized into the store.
- ``headroom_plan``: what ``hr.plan(model, ..., budget=<device memory>, disk=...,
  fp32_masters=True)`` chooses for a bf16 model, applied with ``plan.apply``.

Every model uses gradient checkpointing (non-reentrant) except ``headroom_plan``, which gets
what the plan chooses. A step is ``--accum`` micro-batches of ``--micro-batch`` x ``--seq``
random tokens (the same batches every step, so the loss falls) and one optimizer step.

For each size (Llama 3.2 1B and 3B, Llama 3.1 8B, Llama 2 13B, Code Llama 34B, Llama 3.1 70B
shapes; no weights needed) and tool, in its own process with its own time limit: whether one
step fits, the step time (median of the timed steps after one warm-up step), tokens/s, model
TFLOP/s (``6 * N * tokens + 12 * layers * hidden * seq * tokens``, N the parameters that take
part in matmuls: all but the input embedding, counted once when tied; recomputation not
counted) and that as a fraction of the device's measured bf16 matmul rate (8192^3 matmuls),
peak device memory (allocated and reserved), the process's peak RSS, bytes read from and
written to disk (``/proc/self/io``), and the GPU's busy fraction (union of kernel intervals
over the wall time of the last step, from ``torch.profiler``). Sizes go up until a tool fails;
a size whose parameters, gradients and AdamW state cannot fit the device, host memory or disk
(by the bytes per parameter each tool keeps where) is recorded as predicted not to fit without
running it (``--no-predict`` runs it anyway). With ``--bisect``, time left after the ladder
goes to a bisection over depth between a tool's largest fitting size and its first failure.

``--mode lora`` compares, for a frozen base whose decoder linears are quantized as ``--quant``
says (``bf16``: unquantized; ``int8``: torchao's int8 weight-only; ``nf4``: bitsandbytes'
Linear4bit) with PEFT LoRA (r=16, every linear layer) trained by AdamW on the device:

- ``lora_peft``: the base resident on the device (the reference);
- ``lora_headroom``: the base in host memory, streamed a block at a time by ``hr.offload``
  (quantized weights as they are packed), the adapters on the device;
- ``lora_accelerate``: accelerate's ``dispatch_model(infer_auto_device_map(max_memory=...))``.

The JSON's ``lora`` section has each run's step time and peak memory as ratios to the resident
run's, and ``exact``: whether headroom's losses and adapter gradients and values are bitwise the
resident run's. ``--device-memory-gib N`` gives every run N GiB of the GPU
(``torch.cuda.set_per_process_memory_fraction``, set before anything is allocated).

The whole run respects ``--budget-s``: what does not fit in the time left is skipped, and the
JSON (``--out``) is written after every run, marked partial until the end.

    python benchmarks/llm_finetune.py --budget-s 480                 # on a GPU
    python benchmarks/llm_finetune.py --tiny --out /tmp/llm.json     # CPU, a few MB, exactness
    python benchmarks/llm_finetune.py --mode lora --quant nf4 --sizes 8b --device-memory-gib 8
    python benchmarks/llm_finetune.py --tiny --mode lora --quant int8 --out /tmp/lora.json
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "llm_finetune_gpu.json"
TOOLS = ("plain", "fsdp2", "torchao", "deepspeed", "headroom", "headroom_plan")
# Also runnable by name (--tools): headroom with its gradients summed in host memory, the
# A/B of grad_accumulation="device" in one run.
EXTRA_TOOLS = ("headroom_store",)
# --mode lora: LoRA over a frozen (quantized) base; the resident one is the reference
LORA_TOOLS = ("lora_peft", "lora_headroom", "lora_accelerate")
GiB = 1 << 30

# Llama shapes: hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=False),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                  tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=False),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                tie_word_embeddings=False),
    "34b": dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                tie_word_embeddings=False),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                tie_word_embeddings=False),
}

# Bytes per parameter each tool keeps where, at least (fp32 masters and AdamW state): what the
# size prediction compares with the device's memory, free host memory and free disk.
#   plain: fp32 parameter, gradient and two moments on the device.
#   fsdp2 (CPUOffloadPolicy) and torchao: the same four on the host; torchao keeps the fp32
#     parameters on the device too (and their gradients, with accumulation).
#   headroom, host store: bf16 parameter + fp32 gradient in the store, fp32 master + two
#     moments beside HostOptimizer; with parameters on disk the store's 6 bytes go there.
NEED = {
    "plain": {"device": 16},
    "fsdp2": {"host": 16},
    "torchao": {"device": 4, "host": 16},
    "deepspeed": {"host": 14},
    "headroom:host": {"host": 18},
    "headroom:disk": {"host": 12, "disk": 6},
    "headroom:disk+state": {"disk": 18},
}


# ----------------------------------------------------------------------------- shapes and flops

def config_for(size: str) -> dict:
    """The shape of ``size``: a name of `SHAPES`, or ``NAME@dDEPTH`` (the same shape with DEPTH
    decoder layers; the bisection's probes)."""
    name, _, depth = size.partition("@d")
    if name not in SHAPES:
        raise SystemExit(f"unknown size {size!r}: choose from {', '.join(SHAPES)}")
    cfg = dict(SHAPES[name])
    if depth:
        cfg["num_hidden_layers"] = int(depth)
    return cfg


def param_counts(cfg: dict) -> tuple[int, int]:
    """(all parameters, parameters that take part in matmuls), analytically."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    emb = cfg["vocab_size"] * h
    total = emb + n * layer + h + (0 if cfg["tie_word_embeddings"] else emb)
    return total, total - emb + (emb if cfg["tie_word_embeddings"] else 0)


def model_flops(cfg: dict, tokens: int, seq: int, *, frozen: bool = False) -> float:
    """Model FLOPs of one training step (PaLM's count: 6 N per token for the matmuls, 12 L H T
    per token for attention scores and values; recomputation not counted). ``frozen``: a
    frozen base (LoRA) computes no weight gradients, 4 N per token (adapters not counted)."""
    _, n_mm = param_counts(cfg)
    attention = 12.0 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq * tokens
    return (4.0 if frozen else 6.0) * n_mm * tokens + attention


# ----------------------------------------------------------------------------- measurements

def _proc_io() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/io").read_text().splitlines():
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    return {"read_bytes": out.get("read_bytes", 0), "write_bytes": out.get("write_bytes", 0)}


def _peak_rss() -> int:
    """The process's peak resident set (VmHWM), bytes."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:  # psutil is a test extra; VmRSS says the same
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _host_available() -> int:
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _filesystem(path: Path) -> str:
    """The type of the file system ``path`` is on (``/proc/mounts``), or ``"unknown"``."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        real = str(Path(path).resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")
                                   ) and len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("torch", "transformers", "accelerate", "peft", "torchao", "deepspeed",
                 "psutil"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        import headroom

        out["headroom"] = headroom.__version__
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=10)
        if commit.returncode == 0:
            out["headroom"] += f" ({commit.stdout.strip()})"
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["headroom"] = f"not importable: {e}"
    return out


def measure_env(device: str) -> dict:
    """Device name, memory, measured matmul rate and host link bandwidth, host memory, disk."""
    import torch

    env: dict = {"device_type": device, "cpus": os.cpu_count(),
                 "host_total_gib": None, "host_available_gib": _host_available() / GiB,
                 "torch": torch.__version__, "cuda": torch.version.cuda}
    with contextlib.suppress(ImportError):
        import psutil

        env["host_total_gib"] = psutil.virtual_memory().total / GiB
    if device == "cuda":
        dev = torch.device("cuda")
        env["device_name"] = torch.cuda.get_device_name(dev)
        free, total = torch.cuda.mem_get_info(dev)
        env["device_total_gib"], env["device_free_gib"] = total / GiB, free / GiB
        n, dtype, reps = 8192, torch.bfloat16, 10
    else:
        env["device_name"] = "cpu"
        n, dtype, reps = 512, torch.float32, 5
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t)
    env["matmul_dtype"] = str(dtype).removeprefix("torch.")
    env["matmul_n"] = n
    env["matmul_tflops"] = 2 * n**3 / statistics.median(times) / 1e12
    if device == "cuda":
        nbytes = 1 << 30
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for key, (dst, src) in (("h2d_GBps", (devbuf, host)), ("d2h_GBps", (host, devbuf))):
            ts = []
            for _ in range(4):
                sync()
                t = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                sync()
                ts.append(time.perf_counter() - t)
            env[key] = nbytes / statistics.median(ts) / 1e9
        del host, devbuf
    return env


def gpu_busy(trace_path: Path, wall_s: float) -> dict:
    """Union of kernel (and of copy) intervals in a chrome trace, over ``wall_s``."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])

    def union(cats: tuple[str, ...]) -> tuple[float, float, int]:
        spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                       if e.get("ph") == "X" and e.get("cat") in cats)
        total = busy = 0.0
        end = -math.inf
        start = None
        for s, f in spans:
            total += f - s
            if s > end:
                if start is not None:
                    busy += end - start
                start, end = s, f
            else:
                end = max(end, f)
        if start is not None:
            busy += end - start
        return busy / 1e6, total / 1e6, len(spans)

    cats: dict[str, int] = {}
    for e in events:
        if e.get("ph") == "X":
            cats[str(e.get("cat"))] = cats.get(str(e.get("cat")), 0) + 1
    k_busy, k_sum, k_n = union(("kernel",))
    c_busy, _, c_n = union(("gpu_memcpy", "gpu_memset"))
    return {"gpu_busy_fraction": k_busy / wall_s, "kernel_time_sum_s": k_sum,
            "kernel_count": k_n, "copy_busy_fraction": c_busy / wall_s, "copy_count": c_n,
            "profiled_step_s": wall_s, "trace_event_categories": cats}


# ----------------------------------------------------------------------------- the tools

class Skip(Exception):
    """The tool cannot run here (not installed, needs an accelerator); not a failure to fit."""


def _build(cfg_kw: dict, dtype, device, *, use_cache: bool = False):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(max_position_embeddings=8192, use_cache=use_cache, **cfg_kw)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _ckpt(model) -> None:
    """Non-reentrant checkpointing of every decoder layer (transformers' own switch, under its
    current name where it has one)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _autocast(spec: dict):
    import torch

    if spec["precision"] == "bf16":
        return torch.autocast(spec["device"], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _forward(model, batch, scale: float):
    ids, pos = batch
    return model(input_ids=ids, labels=ids, position_ids=pos).loss * scale


class _StepCalls:
    """Times each ``opt.step()`` call of a tool's step (what is left of the optimizer's work once
    the last backward has returned: for a host optimizer, the tail the GPU may idle through).
    On CUDA as the device's timeline sees it (events around the call, no synchronization, so
    the timed step is unchanged); on the CPU by the wall clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list = []

    def __call__(self, fn) -> None:
        import torch

        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            self.marks.append((a, b))
        else:
            t = time.perf_counter()
            fn()
            self.marks.append(time.perf_counter() - t)

    def seconds(self, which: list[int]) -> list[float]:
        """The calls numbered ``which`` (0: the first step's), in seconds (waits for the
        device)."""
        import torch

        marks = [self.marks[i] for i in which]
        if self.cuda and marks:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in marks]
        return marks


def setup_plain(spec: dict):
    import torch

    torch.manual_seed(spec["seed"])
    model = _build(spec["cfg"], torch.float32, spec["device"])
    _ckpt(model)
    model.train()
    fused = spec["device"] == "cuda"  # on CPU: PyTorch's default step, what the others match
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=fused or None)
    calls = _StepCalls(spec["device"] == "cuda")

    def step(batches):
        total = 0.0
        for b in batches:
            with _autocast(spec):
                loss = _forward(model, b, 1 / len(batches))
            loss.backward()
            total += loss.detach()
        calls(opt.step)
        opt.zero_grad()
        return float(total)

    step.calls = calls

    info = {"params": "fp32 on the device", "compute": spec["precision"] + " autocast",
            "optimizer": f"torch.optim.AdamW(fused={fused}) on the device",
            "checkpointing": "every layer", "fp32_masters": True}
    return model, step, info, lambda: {n: p.detach() for n, p in model.named_parameters()}, []


def setup_fsdp2(spec: dict):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dev = spec["device"]
    if dev == "cuda":
        torch.cuda.set_device(0)  # the one rank's device, known to NCCL from the start
    if not dist.is_initialized():  # a world of one process; nothing leaves this machine
        dist.init_process_group("nccl" if dev == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    mesh = init_device_mesh(dev, (1,))
    torch.manual_seed(spec["seed"])
    # NOTE: initialized where it computes (the host's init is slow for billions of values);
    # fully_shard then moves each shard to the host (CPUOffloadPolicy) and frees the original
    model = _build(spec["cfg"], torch.float32, dev)
    _ckpt(model)
    kw: dict = {"mesh": mesh}
    if spec["precision"] == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if dev == "cuda":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    model.train()
    fused = dev == "cuda"  # the fused CPU kernel for the host shards; cpu: PyTorch's default
    info = {"params": "fp32 shards " + ("on the host (CPUOffloadPolicy, pinned)" if dev == "cuda"
                                        else "in memory (no offload policy on cpu)"),
            "compute": spec["precision"] + (" (MixedPrecisionPolicy)"
                                            if spec["precision"] == "bf16" else ""),
            "optimizer": f"torch.optim.AdamW(fused={fused}) on the "
                         + ("host" if dev == "cuda" else "cpu"),
            "checkpointing": "every layer", "fp32_masters": True}

    def fallback(e: Exception) -> torch.optim.Optimizer:
        info["fallback"] = f"fused AdamW refused ({type(e).__name__}: {str(e)[:300]})"
        info["optimizer"] = "torch.optim.AdamW() on the host (default step)"
        return torch.optim.AdamW(model.parameters(), lr=spec["lr"])

    try:
        opts = [torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=fused or None)]
    except (RuntimeError, ValueError, NotImplementedError) as e:
        if not fused:
            raise
        opts = [fallback(e)]

    def step(batches):
        total = 0.0
        for b in batches:
            loss = _forward(model, b, 1 / len(batches))
            loss.backward()
            total += loss.detach()
        try:
            opts[0].step()
        except (RuntimeError, NotImplementedError) as e:
            if not fused or "fallback" in info:
                raise
            # NOTE: the fused kernel refused the host DTensor shards before changing anything
            # (its checks come first): PyTorch's default step instead, recorded as such
            opts[0] = fallback(e)
            opts[0].step()
        opts[0].zero_grad()
        return float(total)

    def values():
        return {n: p.full_tensor().detach() for n, p in model.named_parameters()}

    return model, step, info, values, []


def setup_torchao(spec: dict):
    import torch

    if spec["device"] != "cuda":
        raise Skip("CPUOffloadOptimizer needs an accelerator (cuda or xpu)")
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as e:
        raise Skip(f"not installed ({e})") from e
    torch.manual_seed(spec["seed"])
    model = _build(spec["cfg"], torch.float32, "cuda")
    _ckpt(model)
    model.train()
    offload_grads = spec["accum"] == 1
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW,
                              offload_gradients=offload_grads, lr=spec["lr"], fused=True)

    calls = _StepCalls(True)

    def step(batches):
        total = 0.0
        for b in batches:
            with _autocast(spec):
                loss = _forward(model, b, 1 / len(batches))
            loss.backward()
            total += loss.detach()
        calls(opt.step)
        opt.zero_grad()
        return float(total)

    step.calls = calls
    info = {"params": "fp32 on the device", "compute": "bf16 autocast",
            "optimizer": "CPUOffloadOptimizer(AdamW(fused=True)) on the host,"
                         f" offload_gradients={offload_grads}",
            "checkpointing": "every layer", "fp32_masters": True}
    return model, step, info, lambda: {n: p.detach() for n, p in model.named_parameters()}, []


def setup_deepspeed(spec: dict):
    import torch

    cpu = spec["device"] == "cpu"
    if cpu:  # DeepSpeed's CPU accelerator (the structure check of --tiny, where it installs)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise Skip(f"not installed ({e})") from e
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if cpu:
        deepspeed.init_distributed(dist_backend="gloo")  # (its CPU default, oneCCL, may lack)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": spec["accum"],
        "bf16": {"enabled": spec["precision"] == "bf16"},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "zero_force_ds_cpu_optimizer": False,
        "wall_clock_breakdown": False,
    }
    # NOTE: zero.Init replaces torch.Tensor.__new__; dynamo, imported first inside it (by the
    # model's code), then rejects that signature for its polyfills: import it before
    import torch._dynamo.polyfills.loader  # noqa: F401

    torch.manual_seed(spec["seed"])
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = _build(spec["cfg"], torch.float32, "cpu")
    _ckpt(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)

    def step(batches):
        total = 0.0
        for b in batches:
            loss = _forward(engine, b, 1.0)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / len(batches)
        return float(total)

    info = {"params": "ZeRO-3, parameters and optimizer state offloaded to the host",
            "compute": spec["precision"], "optimizer": "torch.optim.AdamW on the host",
            "checkpointing": "every layer", "fp32_masters": True}
    return engine, step, info, None, []


def _initial_values(model, spec: dict, dtype) -> None:
    """Values for a model offloaded from ``meta``. For the exactness check, the ones plain
    PyTorch starts from (built on the CPU with the same seed, loaded with ``hr.load_weights``);
    otherwise the model's own initialization, into the store, here in the setup (reading the
    state dict initializes what is pending) rather than inside the first timed step."""
    import torch

    import headroom as hr

    if not spec["digest"]:
        model.state_dict()
        return
    torch.manual_seed(spec["seed"])
    init = Path(spec["scratch"]) / "init"
    _build(spec["cfg"], dtype, "cpu").save_pretrained(init)
    hr.load_weights(model, init)


def headroom_placement(spec: dict) -> str:
    """Where headroom keeps parameters and state: host memory if the fp32 masters and AdamW
    state fit it, else parameters on disk (state in host memory), else everything on disk."""
    if spec["device"] == "cpu":
        return "disk"  # on a CPU host memory is the device's: only a disk store saves memory
    n = spec["params"]
    host, disk = spec["host_available"] * 0.85, spec["disk_free"] * 0.9
    if NEED["headroom:host"]["host"] * n <= host:
        return "host"
    if NEED["headroom:disk"]["host"] * n <= host and NEED["headroom:disk"]["disk"] * n <= disk:
        return "disk"
    return "disk+state"


def setup_headroom(spec: dict):
    import torch

    import headroom as hr

    dev, where = spec["device"], headroom_placement(spec)
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    model = _build(spec["cfg"], dtype, "meta")  # never whole in memory: initialized in the store
    _ckpt(model)
    model.train()
    scratch = Path(spec["scratch"])
    store = "cpu" if where == "host" else hr.DiskStore(scratch / "params")
    acc = spec.get("grad_accumulation", "store")
    if acc == "device" and dev != "cpu" and spec["params"] * 4 > 0.4 * (
            torch.cuda.get_device_properties(dev).total_memory):
        acc = "store"  # the fp32 sums would take most of the device: the size is what counts
    hr.offload(model, device=dev, store=store, prefetch=1, grad_accumulation=acc)
    _initial_values(model, spec, dtype)
    state = hr.DiskStore(scratch / "state") if where == "disk+state" else "cpu"
    kw = {"fused": False} if dev == "cpu" else {}  # cpu: the step plain's default AdamW takes
    # Parameters on disk, masters and state in host memory: no undo copies of those on the
    # disk (12 bytes per parameter written per step fewer), as no other tool keeps any.
    atomic = where != "disk"
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=spec["lr"],
                           state_store=state, overlap=True, atomic=atomic, **kw)

    calls = _StepCalls(dev == "cuda")

    def step(batches):
        total = 0.0
        for j, b in enumerate(batches):
            with opt.final_backward(j == len(batches) - 1):
                loss = _forward(model, b, 1 / len(batches))
                loss.backward()
            total += loss.detach()
        calls(opt.step)
        opt.zero_grad()
        return float(total)

    step.calls = calls
    info = {"params": f"{str(dtype).removeprefix('torch.')} in "
                      + ("host memory (pinned)" if where == "host" else "a DiskStore")
                      + ", hr.offload(prefetch=1), built on meta",
            "compute": str(dtype).removeprefix("torch."),
            "optimizer": "hr.HostOptimizer(AdamW, overlap=True), fp32 masters and state in "
                         + ("a DiskStore" if where == "disk+state" else "host memory"),
            "checkpointing": "every layer", "fp32_masters": True, "placement": where,
            "grad_accumulation": acc, "atomic": atomic}
    stores = [x for x in (store, state) if not isinstance(x, str)]
    return model, step, info, lambda: dict(model.state_dict()), stores


def _plan_host_bytes(choice, n: int, dtype_bytes: int) -> int:
    """Host memory a plan's choice keeps at least (bytes), for a model of ``n`` parameters."""
    host = 0
    if choice.params == "host":
        host += n * dtype_bytes + n * 4  # parameters and their (fp32) gradients
    if choice.optimizer_state == "host":
        host += n * (12 if dtype_bytes < 4 else 8) + (n * 4 if choice.params == "device" else 0)
    return host


def setup_headroom_plan(spec: dict):
    import torch

    import headroom as hr
    from headroom.fit import Speeds

    dev = spec["device"]
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    meta = _build(spec["cfg"], dtype, "meta")
    meta.train()
    ids = torch.zeros(spec["micro_batch"], spec["seq"], dtype=torch.long)
    pos = torch.arange(spec["seq"]).expand(spec["micro_batch"], -1)
    # cpu: declared figures, so that the plan (and the tiny run) is the same on every machine
    speeds = Speeds(matmul=50e9, conv=50e9, memory=10e9, op=10e-6, disk_read=2e9,
                    disk_write=1e9) if dev == "cpu" else None
    env = spec.get("env") or {}
    if dev == "cuda" and env.get("matmul_tflops"):
        speeds = Speeds(matmul=env["matmul_tflops"] * 1e12 * 0.7, conv=env["matmul_tflops"] * 3e11,
                        memory=2.5e12, op=10e-6, disk_read=2e9, disk_write=1e9,
                        link=min(env["h2d_GBps"], env["d2h_GBps"]) * 1e9)
    example = {"input_ids": ids, "labels": ids, "position_ids": pos}
    t = time.perf_counter()
    budget = spec["plan_budget"]
    if budget is None:  # cpu: a fraction of the plain step's estimated peak
        est = hr.estimate(meta, (), example_kwargs=example, loss_fn=lambda o: o.loss,
                          optimizer=torch.optim.AdamW, device=dev)
        budget = int(est.peak * spec["plan_budget_fraction"])
    plan = hr.plan(meta, (), example_kwargs=example, loss_fn=lambda o: o.loss,
                   budget=budget, device=dev, optimizer=torch.optim.AdamW,
                   optimizer_kwargs={"lr": spec["lr"]},
                   disk=str(Path(spec["scratch"]) / "plan"), speeds=speeds,
                   fp32_masters=True)  # as every other tool trains: like for like
    plan_s = time.perf_counter() - t
    info = {"plan": str(plan), "plan_s": plan_s, "budget_bytes": budget,
            "choice": plan.choice.describe(), "estimated_peak_bytes": plan.peak,
            "estimated_step_s_per_micro_batch": plan.time_s,
            "checkpointing": f"{len(plan.choice.checkpoint)} layer(s), as planned",
            "compute": str(dtype).removeprefix("torch.")}
    spec["_info"] = info  # kept in the result if applying it fails
    need = _plan_host_bytes(plan.choice, spec["params"], 2 if dtype == torch.bfloat16 else 4)
    if dev != "cpu" and need > spec["host_available"] * 0.9:
        raise MemoryError(
            f"the plan needs at least {need / GiB:.1f} GiB of host memory, more than the"
            f" {spec['host_available'] / GiB:.1f} GiB available: not applied (hr.plan budgets"
            " the device only)")
    if plan.choice.params == "device":
        torch.manual_seed(spec["seed"])
        model = _build(spec["cfg"], dtype, dev)  # the plan keeps parameters where they compute
    else:
        model = meta
    model.train()
    model, opt = plan.apply(model)
    if plan.choice.params != "device":
        _initial_values(model, spec, dtype)
    info["optimizer"] = type(opt).__name__ + "(AdamW)"
    info["fp32_masters"] = dtype == torch.float32 or plan.fp32_masters

    def step(batches):
        total = 0.0
        for b in batches:
            loss = _forward(model, b, 1 / len(batches))
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return float(total)

    from headroom.residency import state_of
    from headroom.store import DiskStore

    stores = []
    with contextlib.suppress(Exception):  # not offloaded: no store of its own
        stores.append(state_of(model).store)
    stores.append(getattr(getattr(opt, "options", None), "state_store", None))
    stores = [x for x in stores if isinstance(x, DiskStore)]
    return model, step, info, lambda: dict(model.state_dict()), stores


# ----------------------------------------------------------------------------- LoRA (--mode lora)

def _quantize_base(root, quant: str, dtype) -> str:
    """Quantize every linear layer under ``root`` in place as ``--quant`` says; returns how."""
    from torch import nn

    if quant == "bf16":
        return f"unquantized {str(dtype).removeprefix('torch.')}"
    if quant == "int8":
        try:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
        except ImportError as e:
            raise Skip(f"--quant int8 needs torchao: not installed ({e})") from e
        quantize_(root, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
        return "torchao Int8WeightOnlyConfig (int8 weights, a scale per row)"
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise Skip(f"--quant nf4 needs bitsandbytes: not installed ({e})") from e
    for m in list(root.modules()):
        for name, c in list(m.named_children()):
            if type(c) is not nn.Linear:
                continue
            q = bnb.nn.Linear4bit(c.in_features, c.out_features, bias=c.bias is not None,
                                  compute_dtype=dtype, quant_type="nf4")
            q.load_state_dict(c.state_dict())
            setattr(m, name, q.to("cpu"))  # bitsandbytes quantizes when the layer moves
    return "bitsandbytes Linear4bit NF4 (64-value blocks, fp32 absmax)"


def _lora_base(spec: dict):
    """The frozen base: built on the host with the run's seed, its decoder layers' linears
    quantized (``--quant``), checkpointed like every other model here."""
    import torch

    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    torch.manual_seed(spec["seed"])
    model = _build(spec["cfg"], dtype, "cpu")
    how = _quantize_base(model.model.layers, spec["quant"], dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    _ckpt(model)
    model.train()
    return model, how


def _lora_wrap(model, spec: dict):
    """PEFT LoRA (r=16) on every linear layer of the decoder, drawn from the same seed."""
    import peft
    import torch

    torch.manual_seed(spec["seed"] + 1)
    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


def _lora_train(model, spec: dict, info: dict):
    """AdamW over the adapters; the step as every tool's (micro-batches, then one step). With
    ``digest``, the adapters' gradients of each step are kept for the exactness check."""
    import torch

    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(adapters.values(), lr=spec["lr"])
    calls = _StepCalls(spec["device"] == "cuda")
    grads: dict = {}

    def step(batches):
        total = 0.0
        for b in batches:
            loss = _forward(model, b, 1 / len(batches))
            loss.backward()
            total += loss.detach()
        if spec["digest"]:
            grads.update({"grad:" + n: p.grad.detach().clone() for n, p in adapters.items()
                          if p.grad is not None})
        calls(opt.step)
        opt.zero_grad()
        return float(total)

    step.calls = calls
    info.update(adapters=sum(p.numel() for p in adapters.values()), lora="r=16, all linear",
                optimizer="torch.optim.AdamW over the adapters, on the device",
                checkpointing="every layer", fp32_masters=False)

    def values():
        return {**{n: p.detach() for n, p in adapters.items()}, **grads}

    return model, step, info, values, []


def _packed_bytes(model) -> int:
    """Bytes of the base's parameters as they rest (quantized ones packed)."""
    from headroom.residency import is_packed, packed_nbytes

    return sum((packed_nbytes(p) or 0) if is_packed(p) else p.numel() * p.element_size()
               for n, p in model.named_parameters() if not p.requires_grad)


def setup_lora_peft(spec: dict):
    """The quantized base resident on the device, PEFT's adapters beside it."""
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise Skip(f"peft not installed ({e})") from e
    model, how = _lora_base(spec)
    model = _lora_wrap(model.to(spec["device"]), spec)
    info = {"base": how + ", resident on the device", "base_bytes": _packed_bytes(model)}
    return _lora_train(model, spec, info)


def setup_lora_headroom(spec: dict):
    """The base in host memory, streamed a block at a time (``hr.offload``, packed as it is);
    the adapters on the device (its default)."""
    import warnings

    import headroom as hr

    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise Skip(f"peft not installed ({e})") from e
    model, how = _lora_base(spec)
    with warnings.catch_warnings():  # cpu: host memory is the device's (a check of mechanics)
        warnings.filterwarnings("ignore", message="hr.offload with device='cpu'")
        hr.offload(model, device=spec["device"], store="cpu", prefetch=1)
    model = _lora_wrap(model, spec)
    info = {"base": how + ", hr.offload(store='cpu', prefetch=1), adapters on the device",
            "base_bytes": _packed_bytes(model)}
    return _lora_train(model, spec, info)


def setup_lora_accelerate(spec: dict):
    """accelerate's big-model dispatch: ``infer_auto_device_map`` under ``max_memory`` (the
    device's share for weights) and ``dispatch_model``, which moves offloaded layers' weights to
    the device at each forward; PEFT's adapters over it."""
    import torch

    try:
        import peft  # noqa: F401
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError as e:
        raise Skip(f"accelerate or peft not installed ({e})") from e
    model, how = _lora_base(spec)
    dev = spec["device"]
    host = int(spec["host_available"] * 0.8) or (64 * GiB)
    if dev == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        cap = spec.get("device_memory_gib")
        weights = int(0.5 * (cap * GiB if cap else total))  # the rest: activations, adapters
        max_memory = {0: weights, "cpu": host}
    else:
        max_memory = {"cpu": host}
    device_map = infer_auto_device_map(model, max_memory=max_memory,
                                       no_split_module_classes=["LlamaDecoderLayer"])
    model = dispatch_model(model, device_map=device_map,
                           main_device=0 if dev == "cuda" else "cpu")
    model = _lora_wrap(model, spec)
    info = {"base": how + ", accelerate dispatch_model(infer_auto_device_map(max_memory=...))",
            "max_memory": {str(k): v for k, v in max_memory.items()},
            "placed": sorted({str(v) for v in device_map.values()}),
            "base_bytes": _packed_bytes(model)}
    return _lora_train(model, spec, info)


SETUP = {"plain": setup_plain, "fsdp2": setup_fsdp2, "torchao": setup_torchao,
         "deepspeed": setup_deepspeed, "headroom": setup_headroom,
         "headroom_store": lambda spec: setup_headroom({**spec, "grad_accumulation": "store"}),
         "headroom_plan": setup_headroom_plan, "lora_peft": setup_lora_peft,
         "lora_headroom": setup_lora_headroom, "lora_accelerate": setup_lora_accelerate}


# ----------------------------------------------------------------------------- one run (child)

def _digest(values: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(values):
        t = values[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_one(spec: dict) -> dict:
    """Set up ``spec['tool']`` for ``spec['size']``, run the steps, return the metrics. Writes
    what it has to ``spec['out']`` after each phase, so a run stopped by its time limit leaves
    them."""
    import torch

    dev = spec["device"]
    deadline = spec["deadline"]
    res: dict = {"tool": spec["tool"], "size": spec["size"], "status": "setup",
                 "params": spec["params"], "tokens_per_step": spec["tokens"]}
    out = Path(spec["out"])

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        tmp.replace(out)

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cuda = dev == "cuda"
    if cuda and spec.get("device_memory_gib"):  # before anything is allocated on the device
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["device_memory_gib"] * GiB
                                                       / total))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    io0 = _proc_io()
    t0 = time.perf_counter()
    setup_stacks = _trace_path(spec, "setup_stacks.txt")
    try:
        if setup_stacks is None:
            model, step, info, values, stores = SETUP[spec["tool"]](spec)
        else:  # where the setup's time goes (building, initializing, offloading), sampled
            with _StackSampler(0.01) as sampler:
                model, step, info, values, stores = SETUP[spec["tool"]](spec)
            setup_stacks.write_text(sampler.report())
    except Skip as e:
        res.update(status="skipped", reason=str(e))
        save()
        return res
    res["setup"] = info
    res["setup_s"] = time.perf_counter() - t0
    if cuda:  # the peaks reported are the steps' (warm-up included), not the setup's
        sync()
        res["device_peak_setup_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    res["status"] = "warm-up"
    save()
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(spec["accum"]):
        ids = torch.randint(0, spec["cfg"]["vocab_size"], (spec["micro_batch"], spec["seq"]),
                            generator=g)
        pos = torch.arange(spec["seq"]).expand(spec["micro_batch"], -1)
        batches.append((ids.to(dev), pos.to(dev)))

    def store_bytes() -> dict[str, int]:
        """Bytes headroom's disk stores read and wrote (logical: page-cache hits included)."""
        out = {"read_bytes": 0, "write_bytes": 0}
        for st in stores:
            x = st.stats()
            out["read_bytes"] += int(x.get("bytes_read", 0))
            out["write_bytes"] += int(x.get("bytes_written", 0))
        return out

    def timed() -> tuple[float, float]:
        sync()
        t = time.perf_counter()
        loss = step(batches)
        sync()
        return time.perf_counter() - t, loss

    dt, loss = timed()
    res.update(first_step_s=dt, losses=[loss], fits=True, status="timing")
    save()
    times, io_steps = [], []
    calls = getattr(step, "calls", None)
    timed_calls = []  # which optimizer calls belong to the timed steps
    profile = cuda and spec["profile"]
    for k in range(spec["steps"]):
        last = k == spec["steps"] - 1
        guess = max(dt, statistics.median(times) if times else dt)
        if time.time() + guess * (1.5 if last and profile else 1.2) > deadline:
            res["steps_cut"] = f"{spec['steps'] - k} timed step(s) left out: time limit"
            break
        io_a, st_a = _proc_io(), store_bytes()
        if last and profile:
            dt, loss = _profiled(timed, Path(spec["scratch"]) / "trace.json", res,
                                 keep=_trace_path(spec, "trace.json.gz"))
            res["profiled_step_timed"] = len(times) == 0
            if not times:
                times.append(dt)
                timed_calls.append(len(calls.marks) - 1 if calls is not None else None)
        else:
            dt, loss = timed()
            times.append(dt)
            timed_calls.append(len(calls.marks) - 1 if calls is not None else None)
        io_b, st_b = _proc_io(), store_bytes()
        io_steps.append({k: io_b[k] - io_a[k] for k in io_a}
                        | {"store_" + k: st_b[k] - st_a[k] for k in st_a})
        res["losses"].append(loss)
        res["step_times_s"] = times
    if not times:
        times = [res["first_step_s"]]
        res["step_time_from_warm_up"] = True
    step_s = statistics.median(times)
    if calls is not None and timed_calls:
        res["optimizer_step_call_s"] = statistics.median(calls.seconds(timed_calls))
    flops = model_flops(spec["cfg"], spec["tokens"], spec["seq"],
                        frozen=spec.get("mode") == "lora")
    res.update(
        status="ok",
        step_s=step_s,
        tokens_per_s=spec["tokens"] / step_s,
        model_tflops=flops / step_s / 1e12,
        rss_now_bytes=_rss(),
        rss_peak_bytes=_peak_rss(),
    )
    env = spec.get("env") or {}
    if env.get("matmul_tflops"):
        res["fraction_of_matmul_rate"] = res["model_tflops"] / env["matmul_tflops"]
    if io_steps:
        res["disk_read_bytes_per_step"] = statistics.median(s["read_bytes"] for s in io_steps)
        res["disk_write_bytes_per_step"] = statistics.median(s["write_bytes"] for s in io_steps)
        if stores:
            res["store_read_bytes_per_step"] = statistics.median(
                s["store_read_bytes"] for s in io_steps)
            res["store_write_bytes_per_step"] = statistics.median(
                s["store_write_bytes"] for s in io_steps)
    io1 = _proc_io()
    res["disk_read_bytes_total"] = io1["read_bytes"] - io0["read_bytes"]
    res["disk_write_bytes_total"] = io1["write_bytes"] - io0["write_bytes"]
    if cuda:
        res["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        res["device_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    if spec["digest"] and values is not None:
        res["digest"] = _digest(values())
    stacks = _trace_path(spec, "stacks.txt")
    if stacks is not None and time.time() + max(times) * 3 < deadline:
        # one more step (after the digest), untimed, with every Python thread's stack
        # sampled (autograd runs a CUDA backward, and its hooks, on a thread of its own):
        # where host time goes
        with _StackSampler() as sampler:
            step(batches)
        stacks.write_text(sampler.report())
        res["stack_samples_top"] = sampler.report(25)[-12000:]
    save()
    return res


class _StackSampler:
    """Samples every Python thread's stack every ``interval`` seconds from a thread of its own
    (a small py-spy): per thread, the share of samples in which each function was on the stack
    (inclusive) and on top of it (self)."""

    def __init__(self, interval: float = 0.002) -> None:
        import threading

        self.interval, self.n = interval, {}
        self.incl: dict = {}
        self.top: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                name = names.get(tid, f"thread-{tid}")
                seen, f, leaf = set(), frame, True
                while f is not None:
                    key = f"{f.f_code.co_filename.split('site-packages/')[-1]}:" \
                          f"{f.f_code.co_firstlineno}({f.f_code.co_name})"
                    if leaf:
                        self.top.setdefault(name, {}).setdefault(key, 0)
                        self.top[name][key] += 1
                        leaf = False
                    if key not in seen:
                        seen.add(key)
                        self.incl.setdefault(name, {}).setdefault(key, 0)
                        self.incl[name][key] += 1
                    f = f.f_back
                self.n[name] = self.n.get(name, 0) + 1

    def __enter__(self) -> _StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, rows: int = 60) -> str:
        out = []
        for name, n in sorted(self.n.items(), key=lambda kv: -kv[1]):
            out.append(f"== thread {name}: {n} samples every {self.interval * 1e3:.0f} ms")
            for title, d in (("self", self.top.get(name, {})), ("inclusive", self.incl[name])):
                out.append(f"  -- {title}")
                for key, c in sorted(d.items(), key=lambda kv: -kv[1])[:rows]:
                    out.append(f"  {c / n:6.1%} {key}")
        return "\n".join(out) + "\n"


def _trace_path(spec: dict, suffix: str) -> Path | None:
    """Where ``--trace-dir`` keeps this run's profile (None: not asked for)."""
    if not spec.get("trace_dir"):
        return None
    return Path(spec["trace_dir"]) / f"{spec['tool']}_{spec['size']}.{suffix}"


def _profiled(timed, trace: Path, res: dict, keep: Path | None = None) -> tuple[float, float]:
    """One timed step under ``torch.profiler`` (CUDA activity only; also the CPU's, every
    thread's operators, when ``keep`` names a gzipped copy of the trace to keep), its busy
    fractions into ``res``; a profiler that cannot start or export is recorded, and the step
    still counts."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if keep is not None else [])
    prof = profile(activities=acts)
    try:
        prof.__enter__()
    except Exception as e:  # noqa: BLE001 - e.g. CUPTI not permitted: time it unprofiled
        res["profile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        return timed()
    try:
        dt, loss = timed()
    except BaseException:
        with contextlib.suppress(Exception):
            prof.__exit__(None, None, None)
        raise
    try:
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(str(trace))
        res.update(gpu_busy(trace, dt))
        if keep is not None:
            with trace.open("rb") as f, gzip.open(keep, "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
            res["trace_file"] = str(keep)
    except Exception as e:  # noqa: BLE001 - the step is measured; only its profile is lost
        res["profile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    return dt, loss


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if not spec.get("in_process"):
        # NOTE: if host memory runs out, the kernel's OOM killer should take this run, not the
        # parent that records it (or anything else on the machine)
        with contextlib.suppress(OSError):
            Path("/proc/self/oom_score_adj").write_text("1000")
    if spec["tool"] == "env":
        env = measure_env(spec["device"])
        env["disk_free_gib"] = shutil.disk_usage(spec["scratch"]).free / GiB
        env["disk_dir"] = str(Path(spec["scratch"]).parent)
        env["disk_fs"] = _filesystem(Path(spec["scratch"]))
        Path(spec["out"]).write_text(json.dumps(env, indent=1))
        return 0
    try:
        run_one(spec)
    except BaseException as e:  # record every failure: an OOM is a result here
        if isinstance(e, KeyboardInterrupt) and spec.get("in_process"):
            raise
        out = Path(spec["out"])
        res = json.loads(out.read_text()) if out.exists() else {"tool": spec["tool"],
                                                                "size": spec["size"]}
        phase = res.get("status", "setup")
        if "_info" in spec and "setup" not in res:
            res["setup"] = spec["_info"]
        name = type(e).__name__
        oom = "OutOfMemory" in name or "out of memory" in str(e).lower() or \
            isinstance(e, MemoryError) or "StoreFull" in name
        res.update(status="oom" if oom else "error", fits=False if oom else res.get("fits"),
                   failed_in=phase, error=f"{name}: {str(e)[:1500]}",
                   traceback=traceback.format_exc()[-3000:])
        if oom:
            res["fits"] = False
        with contextlib.suppress(Exception):
            import torch

            if spec["device"] == "cuda":
                res["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
                res["device_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        res["rss_peak_bytes"] = _peak_rss()
        out.write_text(json.dumps(res, indent=1, default=str))
        return 1
    return 0


# ----------------------------------------------------------------------------- the parent

class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.time()
        self.deadline = self.start + args.budget_s
        self.scratch_root = (Path(args.disk_dir or tempfile.gettempdir())
                             / f"llm_finetune_{os.getpid()}")
        self.proc: subprocess.Popen | None = None
        self.scratch_root.mkdir(parents=True, exist_ok=True)
        self.doc: dict = {
            "benchmark": "llm_finetune",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "complete": False,
            "partial": "running",
            "budget_s": args.budget_s,
            "settings": {k: getattr(args, k) for k in (
                "device", "precision", "seq", "micro_batch", "accum", "steps", "lr", "sizes",
                "tools", "max_child_s", "predict", "bisect", "profile", "mode", "quant",
                "device_memory_gib")},
            "flops_formula": "6 * N * tokens + 12 * layers * hidden * seq * tokens per step (PaLM);"
                             " N = parameters in matmuls (all but the input embedding, tied"
                             " embeddings counted once); recomputation not counted",
            "versions": _versions(),
            "env": {},
            "models": {},
            "runs": [],
        }
        self.doc["settings"]["tokens_per_step"] = args.seq * args.micro_batch * args.accum
        self.failed: dict[str, str] = {}  # tool -> the size (and how) it stopped at
        self.unavailable: dict[str, str] = {}  # tool -> why it cannot run here at all

    # -- bookkeeping

    def left(self) -> float:
        return self.deadline - time.time()

    def write(self) -> None:
        self.doc["elapsed_s"] = time.time() - self.start
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        tmp.replace(out)

    def _child(self, spec: dict, limit: float) -> tuple[dict | None, str]:
        """Runs one child with a time limit; returns (its result file or None, how it ended)."""
        d = Path(tempfile.mkdtemp(prefix="run_", dir=self.scratch_root))
        spec = {**spec, "out": str(d / "result.json"), "scratch": str(d),
                "deadline": time.time() + limit - 5}
        (d / "spec.json").write_text(json.dumps(spec))
        if self.args.in_process:
            spec["in_process"] = True
            (d / "spec.json").write_text(json.dumps(spec))
            rc = child_main(str(d / "spec.json"))
            how = f"rc={rc}"
        else:
            log = open(d / "log.txt", "w")  # noqa: SIM115 - closed below
            # NOTE: a session of its own, so that a time limit ends the run with everything it
            # started (the parent's own group is left alone)
            proc = self.proc = subprocess.Popen(
                [sys.executable, __file__, "--child", str(d / "spec.json")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(limit, 1))
                how = f"rc={rc}" if rc >= 0 else f"killed by signal {-rc}"
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc, how = None, f"time limit ({limit:.0f} s)"
            finally:
                log.close()
                self.proc = None
            tail = (d / "log.txt").read_text(errors="replace")[-2000:]
            if rc != 0 or how.startswith("time"):
                spec["log_tail"] = tail
        res = None
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            res = json.loads(Path(spec["out"]).read_text())
        if res is not None and "log_tail" in spec and isinstance(res, dict):
            res["log_tail"] = spec["log_tail"]
        shutil.rmtree(d, ignore_errors=True)  # stores on disk go with it
        return res, how

    # -- phases

    def env(self) -> None:
        t = time.time()
        if self.args.device == "cpu":
            res = measure_env("cpu")
            res["disk_free_gib"] = shutil.disk_usage(self.scratch_root).free / GiB
            res["disk_dir"] = str(self.scratch_root)
            res["disk_fs"] = _filesystem(self.scratch_root)
        else:  # NOTE: in a process of its own: this one keeps no CUDA context the runs lack
            res, how = self._child({"tool": "env", "size": "", "device": self.args.device},
                                   min(120.0, max(self.left() - 5, 1)))
            res = res or {"error": f"environment child ended: {how}"}
        self.doc["env"] = res
        self.doc["env"]["measure_s"] = time.time() - t
        print(f"env: {json.dumps(self.doc['env'])}", flush=True)
        self.write()

    def predict(self, tool: str, n: int) -> str | None:
        """Why ``tool`` cannot fit ``n`` parameters here, by bytes per parameter; or None."""
        env = self.doc["env"]
        cap = {"device": env.get("device_total_gib", math.inf) * GiB,
               "host": env.get("host_available_gib", math.inf) * GiB * 0.92,
               "disk": env.get("disk_free_gib", math.inf) * GiB * 0.95}
        if self.args.device == "cpu":
            cap["device"] = cap["host"]  # the device's memory is the host's
        if env.get("disk_fs") in ("tmpfs", "ramfs"):
            cap["disk"] = 0.0  # files there are host memory: pass --disk-dir on a disk
        key = tool
        if tool in ("headroom", "headroom_store"):
            key = "headroom:" + headroom_placement(self._spec_basics(tool, n))
        elif tool == "headroom_plan":  # the placements the planner can choose from, at best
            key = ("headroom:" + headroom_placement(self._spec_basics(tool, n))
                   if self.args.device != "cpu" else None)
        need = NEED.get(key) if key else None
        if not need:
            return None
        for where, per in need.items():
            if per * n > cap[where]:
                return (f"needs at least {per * n / GiB:.1f} GiB of {where} memory ({per} bytes"
                        f" per parameter there, for what this tool keeps of the fp32 masters,"
                        f" gradients and AdamW state), {cap[where] / GiB:.1f} GiB available")
        return None

    def _spec_basics(self, tool: str, n: int) -> dict:
        env = self.doc["env"]
        return {"tool": tool, "device": self.args.device, "params": n,
                "host_available": env.get("host_available_gib", 0) * GiB,
                "disk_free": 0 if env.get("disk_fs") in ("tmpfs", "ramfs")
                else env.get("disk_free_gib", 0) * GiB}

    def run(self, tool: str, size: str) -> dict:
        a = self.args
        cfg = config_for(size)
        n, n_mm = param_counts(cfg)
        tokens = a.seq * a.micro_batch * a.accum
        self.doc["models"].setdefault(size, {
            "config": cfg, "params": n, "params_in_matmuls": n_mm,
            "model_flops_per_step": model_flops(cfg, tokens, a.seq)})
        row: dict = {"tool": tool, "size": size, "params": n}
        if tool in self.unavailable:
            row.update(status="skipped", reason=self.unavailable[tool])
        elif tool in self.failed:
            row.update(status="skipped", reason=f"stopped at a smaller size: {self.failed[tool]}")
        elif a.predict and (why := self.predict(tool, n)):
            row.update(status="predicted", fits=False, reason=f"predicted not to fit: {why}")
        elif self.left() < a.min_child_s:
            row.update(status="skipped", reason=f"time budget: {self.left():.0f} s left")
        else:
            limit = min(a.max_child_s, self.left() - 5)
            env = self.doc["env"]
            spec = {**self._spec_basics(tool, n), "size": size, "cfg": cfg,
                    "precision": a.precision, "seq": a.seq, "micro_batch": a.micro_batch,
                    "accum": a.accum, "tokens": tokens, "steps": a.steps, "lr": a.lr,
                    "grad_accumulation": a.grad_accumulation,
                    "seed": 0, "profile": a.profile, "digest": a.digest, "env": env,
                    "threads": a.threads, "trace_dir": a.trace_dir,
                    "plan_budget": int((a.device_memory_gib or env.get("device_total_gib", 0))
                                       * GiB * 0.95) if a.device == "cuda" else None,
                    "plan_budget_fraction": a.plan_budget_fraction, "mode": a.mode,
                    "quant": a.quant, "device_memory_gib": a.device_memory_gib}
            t = time.time()
            res, how = self._child(spec, limit)
            row.update(res or {})
            row["wall_s"] = time.time() - t
            row["ended"] = how
            if res is None:
                row.update(status="timeout" if how.startswith("time") else "error",
                           error=f"no result: the process ended ({how})")
            elif row.get("status") not in ("ok", "skipped", "oom", "error"):
                # stopped mid-way: by the time limit, or killed (the host's OOM killer)
                killed = "signal 9" in how
                row.update(status="oom" if killed else "timeout",
                           error=f"stopped in {row.get('status')}: {how}"
                                 + (" (likely the host's out-of-memory killer)" if killed else ""))
                if killed:
                    row["fits"] = False
        if row.get("status") == "skipped" and row.get("wall_s") is not None:
            self.unavailable[tool] = row["reason"]  # the tool itself said so: for every size
        if row.get("status") in ("oom", "predicted", "timeout") or (
                row.get("status") == "error" and not row.get("fits")):
            self.failed.setdefault(tool, f"{size} ({row['status']})")
        self.doc["runs"].append(row)
        self._summarize()
        self.write()
        print(_line(row), flush=True)
        return row

    def ladder(self) -> None:
        for size in self.args.sizes:
            for tool in self.args.tools:
                self.run(tool, size)

    def bisect(self) -> None:
        """Depth bisection, with the time left, between each tool's largest fitting size and
        the smallest one it did not fit (out of memory, or predicted so): the failing shape
        with fewer decoder layers."""
        for tool in self.args.tools:
            rows = [r for r in self.doc["runs"] if r["tool"] == tool]
            ok = [r for r in rows if r.get("status") == "ok"]
            bad = [r for r in rows if r.get("status") in ("oom", "predicted")]
            if not ok or not bad:
                continue
            fail = min(bad, key=lambda r: r["params"])["size"]
            if "@" in fail:
                continue
            shape = config_for(fail)
            n_fit = max(r["params"] for r in ok)
            lo = max([d for d in range(shape["num_hidden_layers"])
                      if param_counts({**shape, "num_hidden_layers": d})[0] <= n_fit], default=0)
            hi = shape["num_hidden_layers"]
            stopped = self.failed.pop(tool, None)
            while hi - lo > 1 and self.left() > self.args.min_child_s:
                mid = (lo + hi) // 2
                row = self.run(tool, f"{fail}@d{mid}")
                self.failed.pop(tool, None)  # each probe stands alone
                if row.get("status") == "ok":
                    lo = mid
                elif row.get("status") in ("oom", "predicted"):
                    hi = mid
                else:
                    break
            if stopped is not None:
                self.failed[tool] = stopped

    def _summarize(self) -> None:
        summary = {}
        for tool in self.args.tools:
            rows = [r for r in self.doc["runs"] if r["tool"] == tool]
            ok = [r for r in rows if r.get("status") == "ok"]
            largest = max(ok, key=lambda r: r["params"], default=None)
            failed = [r for r in rows if r.get("fits") is False]
            first_fail = min(failed, key=lambda r: r["params"], default=None)
            skipped = [r for r in rows if r.get("status") == "skipped"]
            summary[tool] = {
                "fp32_masters": largest and largest.get("setup", {}).get("fp32_masters"),
                "largest_fit": largest and largest["size"],
                "largest_fit_params": largest and largest["params"],
                "smallest_failure": first_fail and first_fail["size"],
                "note": skipped[0]["reason"] if skipped and not ok else None,
            }
        self.doc["summary"] = summary
        digests = {r["tool"]: r["digest"] for r in self.doc["runs"]
                   if r.get("digest") and r["size"] == self.args.sizes[0]}
        if "plain" in digests:
            self.doc["exact_vs_plain"] = {t: d == digests["plain"] for t, d in digests.items()
                                          if t != "plain"}
        if self.args.mode == "lora":
            self._summarize_lora(digests)

    def _summarize_lora(self, digests: dict) -> None:
        """Each LoRA run against the resident base's: step time, peak memory and base bytes as
        ratios, and whether its losses and adapter gradients and values are bitwise the
        resident's (``exact``: headroom's)."""
        rows = {r["tool"]: r for r in self.doc["runs"]
                if r["size"] == self.args.sizes[0] and r.get("status") == "ok"}
        ref = rows.get("lora_peft")
        ratios, exact = {}, {}
        for tool, r in rows.items():
            if ref is None or tool == "lora_peft":
                continue
            one = {"step_time": r["step_s"] / ref["step_s"],
                   "rss_peak": r["rss_peak_bytes"] / ref["rss_peak_bytes"]}
            if "device_peak_allocated_bytes" in r and ref.get("device_peak_allocated_bytes"):
                one["device_peak_allocated"] = (r["device_peak_allocated_bytes"]
                                                / ref["device_peak_allocated_bytes"])
            ratios[tool] = one
            exact[tool] = (r.get("losses") == ref.get("losses")
                           and digests.get(tool) is not None
                           and digests.get(tool) == digests.get("lora_peft"))
        self.doc["lora"] = {"quant": self.args.quant, "reference": "lora_peft",
                            "ratios_vs_resident": ratios, "exact_vs_resident": exact,
                            "peak_memory": {t: {k: r.get(k) for k in (
                                "device_peak_allocated_bytes", "device_peak_reserved_bytes",
                                "rss_peak_bytes")} for t, r in rows.items()},
                            "base_bytes": {t: r["setup"].get("base_bytes")
                                           for t, r in rows.items()}}
        self.doc["exact"] = exact.get("lora_headroom")

    def stop_child(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def finish(self, reason: str | None) -> None:
        self.stop_child()
        self.doc["complete"] = reason is None
        self.doc["partial"] = reason
        self._summarize()
        self.write()
        shutil.rmtree(self.scratch_root, ignore_errors=True)


def _line(r: dict) -> str:
    s = f"{r['tool']:14s} {r['size']:9s} {r.get('status', '?'):9s}"
    if r.get("status") == "ok":
        s += (f" step {r['step_s']:8.3f} s  {r['tokens_per_s']:9.0f} tok/s"
              f"  {r['model_tflops']:7.2f} TFLOP/s")
        if "fraction_of_matmul_rate" in r:
            s += f" ({r['fraction_of_matmul_rate']:.2f} of matmul)"
        if "device_peak_reserved_bytes" in r:
            s += f"  dev {r['device_peak_reserved_bytes'] / GiB:6.1f} GiB"
        s += f"  rss {r['rss_peak_bytes'] / GiB:6.1f} GiB"
        if "gpu_busy_fraction" in r:
            s += f"  busy {r['gpu_busy_fraction']:.2f}"
    else:
        s += " " + str(r.get("reason") or r.get("error") or "")[:200]
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU, a Llama of a few MB, fp32, 3 steps: structure and exactness")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--sizes", default=None, help=f"comma list of {', '.join(SHAPES)}"
                    " (default 1b,3b,8b,13b on a GPU)")
    ap.add_argument("--tools", default=None,
                    help=f"comma list (default: {','.join(TOOLS)}; --mode lora:"
                         f" {','.join(LORA_TOOLS)})")
    ap.add_argument("--mode", choices=("full", "lora"), default="full",
                    help="full: every parameter trains (the tools above); lora: PEFT LoRA (r=16,"
                         " all linear layers) over a frozen base, resident on the device"
                         " (lora_peft, the reference), streamed from host memory by headroom"
                         " (lora_headroom), or offloaded by accelerate (lora_accelerate)")
    ap.add_argument("--quant", choices=("bf16", "int8", "nf4"), default="bf16",
                    help="--mode lora: the base's decoder linears unquantized (in the run's"
                         " precision), torchao int8 weight-only, or bitsandbytes NF4")
    ap.add_argument("--device-memory-gib", type=float, default=None,
                    help="cuda: torch.cuda.set_per_process_memory_fraction to this many GiB"
                         " in each run, before anything is allocated (the budget of a smaller"
                         " GPU); cpu: recorded, no effect")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--accum", type=int, default=None, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--grad-accumulation", choices=("store", "device"), default="device",
                    help="headroom's hr.offload(grad_accumulation=): micro-batch gradients"
                         " summed on the device (default) or in the store")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="the whole run's wall time; the JSON is written before it ends")
    ap.add_argument("--max-child-s", type=float, default=180.0, help="time limit of one run")
    ap.add_argument("--min-child-s", type=float, default=25.0,
                    help="a run is not started with less time left than this")
    ap.add_argument("--no-predict", dest="predict", action="store_false")
    ap.add_argument("--bisect", action="store_true",
                    help="then bisect over depth with the time left")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--disk-dir", default=None, help="where disk stores go (default: the temp dir)")
    ap.add_argument("--plan-budget-fraction", type=float, default=0.5,
                    help="cpu only: hr.plan's budget as a fraction of the plain run's peak RSS")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads in each run (default: torch's; --tiny: 1, as"
                         " a tiny model on a busy machine is otherwise dominated by barriers)")
    ap.add_argument("--in-process", action="store_true",
                    help="run every tool in this process (no per-run isolation or time limit)")
    ap.add_argument("--trace-dir", default=None,
                    help="keep each run's profiled step as a gzipped chrome trace (CUDA and"
                         " every CPU thread's operators), and one more step's sampled Python"
                         " stacks, here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child)

    import torch

    if not args.tiny and args.device is None and not torch.cuda.is_available():
        # NOTE: billions of parameters on a CPU would take hours (`make bench` runs every script)
        print("no CUDA device here: running the --tiny check instead (--device cpu to insist)")
        args.tiny = True
    if args.tiny:
        args.device = args.device or "cpu"
        defaults = dict(sizes="tiny", precision="fp32", seq=32, micro_batch=2, accum=2, steps=3,
                        threads=1)
    else:
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        defaults = dict(sizes="1b,3b,8b,13b", precision="bf16", seq=2048, micro_batch=4,
                        accum=4, steps=2, threads=None)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.sizes = args.sizes.split(",")
    known = LORA_TOOLS if args.mode == "lora" else TOOLS + EXTRA_TOOLS
    args.tools = (args.tools or ",".join(LORA_TOOLS if args.mode == "lora" else TOOLS)
                  ).split(",")
    for t in args.tools:
        if t not in known:
            ap.error(f"unknown tool {t!r} for --mode {args.mode}: choose from {', '.join(known)}")
    for s in args.sizes:
        config_for(s)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available (use --device cpu or --tiny)")
    # LoRA: the adapters are small, their values and gradients are hashed on any device
    args.digest = args.mode == "lora" or (args.device == "cpu" and args.precision == "fp32")
    args.out = args.out or (RESULTS if args.device == "cuda" else
                            Path(tempfile.gettempdir()) / "llm_finetune_cpu.json")
    runner = Runner(args)

    def on_signal(signum, frame):
        runner.finish(f"stopped by signal {signum}")
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        runner.env()
        runner.ladder()
        if args.bisect:
            runner.bisect()
    except KeyboardInterrupt:
        runner.finish("interrupted")
        return 130
    except SystemExit:  # from on_signal, which has written the JSON
        raise
    except BaseException as e:
        runner.finish(f"the benchmark itself failed: {type(e).__name__}: {e}")
        raise
    left = [r for r in runner.doc["runs"] if r.get("status") in ("skipped", "timeout")
            and "time" in str(r.get("reason", r.get("error", "")))]
    runner.finish(f"{len(left)} run(s) left out for want of time or stopped at their time limit"
                  if left else None)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
