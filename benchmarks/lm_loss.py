"""A causal LM's training step with a 128k vocabulary: memory and time of its loss.

A Llama-like model (Llama 3.2 1B's widths and vocabulary, 128,256 tokens, tied embeddings;
``--layers`` decoder layers), one sequence of 2048 tokens, forward + backward of the training
loss. Methods, each in a fresh subprocess of its own (peak memory is per process):

* ``plain``: ``model(ids, labels=labels).loss`` as transformers computes it (the
  ``tokens x vocab`` logits, upcast, log-softmax and their gradients).
* ``cce``: the decoder's hidden states into cut-cross-entropy's ``linear_cross_entropy(...,
  shift=True)`` (what its model patch does): its ``torch_compile`` implementation on the CPU,
  its Triton kernels (``impl="cce"``) on CUDA, where ``cce-compile`` is the ``torch_compile``
  one. Warmed up once (compile time reported apart).
* ``headroom``: ``hr.patch_causal_lm(model)``, then ``model(ids, labels=labels).loss``.
* ``body``: the decoder alone (``(hidden * 0).sum()`` backward): what the step costs without a
  loss.

``--part loss`` measures the loss alone, the same three ways, on leaf tensors: the hidden
states (``1 x 2048 x 2048``) and the output layer's weight (``128256 x 2048``), both requiring
grad: ``plain-loss`` (``lm_head`` then transformers' ``ForCausalLMLoss``), ``cce-loss`` and
``headroom-loss`` (``hr.linear_cross_entropy(..., shift=True)``). Its peak above the resting
inputs is the loss's memory, of which the gradients it returns (of the weight: 1 GiB in fp32)
are the part no method can avoid; the rest is its workspace.

Memory: on the CPU the peak resident set of the step above the resident set before it, from
the kernel (``VmHWM`` reset through ``/proc/self/clear_refs`` before each step; glibc is told to
return freed blocks at once, ``MALLOC_MMAP_THRESHOLD_``, so that the resident set follows the live
memory); on CUDA ``torch.cuda.max_memory_allocated`` above the allocated bytes before the
step. Time: wall clock of the step, the processes' repeats interleaved round by round so that
load from other work falls on all alike; medians, and the processes' CPU time of the step
(``time.process_time``, all threads), which a loaded machine inflates less. Every method's
loss and gradient norms must match ``plain``'s before anything is reported.

Usage:
    .venv/bin/python benchmarks/lm_loss.py                     # CPU, fp32, 5 rounds
    .venv/bin/python benchmarks/lm_loss.py --part loss         # the loss alone
    .venv/bin/python benchmarks/lm_loss.py --part loss --profile   # and where its time goes
    python benchmarks/lm_loss.py --device cuda --repeats 10    # GPU, bf16 model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak(device: str) -> int:
    """Start a new peak; return the bytes in use now."""
    if device == "cpu":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return _status("VmRSS")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak(device: str) -> int:
    if device == "cpu":
        return _status("VmHWM")
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def build(args: argparse.Namespace):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=True,
        max_position_embeddings=max(4096, args.seq))
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(getattr(torch, args.dtype)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    labels = ids.clone()
    labels[:, : args.seq // 8] = -100  # a prompt that is not trained on
    return model, ids, labels


def loss_inputs(args: argparse.Namespace):
    """Leaf hidden states and output weight (what the loss sees), and the labels."""
    g = torch.Generator().manual_seed(1)
    dtype = getattr(torch, args.dtype)
    h = torch.randn(args.batch, args.seq, args.hidden, generator=g)
    w = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    labels = ids.clone()
    labels[:, : args.seq // 8] = -100
    return (h.to(args.device, dtype).requires_grad_(), w.to(args.device, dtype).requires_grad_(),
            labels.to(args.device))


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dev = args.device
    if args.method.endswith("-loss"):
        loss_worker(args)
        return
    model, ids, labels = build(args)
    head = model.get_output_embeddings()

    if args.method == "plain":
        def step():
            return model(ids, labels=labels).loss
    elif args.method == "headroom":
        sys.path.insert(0, str(ROOT / "src"))
        import headroom as hr

        hr.patch_causal_lm(model)

        def step():
            return model(ids, labels=labels).loss
    elif args.method in ("cce", "cce-compile"):
        from cut_cross_entropy import linear_cross_entropy as cce

        impl = "torch_compile" if (dev == "cpu" or args.method == "cce-compile") else "cce"

        def step():
            hidden = model.model(ids).last_hidden_state
            return cce(hidden, head.weight, labels, shift=True, impl=impl)
    elif args.method == "body":
        def step():
            return (model.model(ids).last_hidden_state * 0).float().sum()
    else:
        raise SystemExit(f"unknown method {args.method}")

    serve(args, step, lambda: model.zero_grad(set_to_none=True),
          lambda: {n: float(p.grad.float().norm()) for n, p in model.named_parameters()
                   if p.grad is not None and ("embed" in n or "layers.0.mlp.down" in n)})


def loss_worker(args: argparse.Namespace) -> None:
    h, w, labels = loss_inputs(args)
    if args.method == "plain-loss":
        from transformers.loss.loss_utils import ForCausalLMLoss

        def step():
            return ForCausalLMLoss(torch.nn.functional.linear(h, w), labels, args.vocab)
    elif args.method == "cce-loss":
        from cut_cross_entropy import linear_cross_entropy as cce

        impl = "torch_compile" if args.device == "cpu" else "cce"

        def step():
            return cce(h, w, labels, shift=True, impl=impl)
    elif args.method == "headroom-loss":
        sys.path.insert(0, str(ROOT / "src"))
        import headroom as hr

        def step():
            return hr.linear_cross_entropy(h, w, labels, shift=True)
    else:
        raise SystemExit(f"unknown method {args.method}")

    def zero():
        h.grad = w.grad = None

    serve(args, step, zero, lambda: {"hidden": float(h.grad.float().norm()),
                                     "weight": float(w.grad.float().norm())})


def serve(args, step, zero, norms) -> None:
    """Answer the driver's requests for repeats of ``step`` (forward and backward)."""
    dev = args.device

    def run():
        zero()
        before = _reset_peak(dev)
        t, c = time.perf_counter(), time.process_time()
        loss = step()
        loss.backward()
        if dev != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t, time.process_time() - c, _peak(dev) - before, loss

    warm_s = None
    if args.method.startswith("cce"):
        warm_s, _, _, _ = run()
    # NOTE: the driver asks for each repeat, so that it can interleave the methods round by
    # round: on a shared machine the load changes over minutes.
    print(json.dumps({"ready": True, "warmup_s": warm_s}), flush=True)
    times, cpus, peaks = [], [], []
    loss = None
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t, cpu, peak, loss = run()
        times.append(t)
        cpus.append(cpu)
        peaks.append(peak)
        print(json.dumps({"time_s": t, "cpu_s": cpu, "step_peak_bytes": peak}), flush=True)
    assert loss is not None
    grads = norms()
    prof = _profile(run) if args.profile else {}
    print(json.dumps({**prof,
        "method": args.method, "times_s": times, "median_s": statistics.median(times),
        "min_s": min(times), "cpu_s": cpus, "median_cpu_s": statistics.median(cpus),
        "step_peaks_bytes": peaks,
        "median_step_peak_bytes": statistics.median(peaks), "loss": float(loss),
        "grad_norms": grads, "warmup_s": warm_s,
    }), flush=True)


# matrix products as the CPU profiler names them
_PRODUCTS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def _profile(run) -> dict:
    """One more step under ``torch.profiler``: its wall time, and the self time of its matrix
    products (where the methods' FLOPs are) against everything else."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        t, _, _, _ = run()
    ev = p.key_averages()
    products = [e for e in ev if e.key in _PRODUCTS]
    return {"profiled_step_s": t,
            "profiled_products_s": sum(e.self_cpu_time_total for e in products) / 1e6,
            "profiled_products": sum(e.count for e in products),
            "profiled_other_s": sum(e.self_cpu_time_total for e in ev
                                    if e.key not in _PRODUCTS) / 1e6}


def check(results: dict, rel: float) -> None:
    ref = results.get("plain") or results.get("plain-loss")
    if not ref or "error" in ref:
        return
    for m, r in results.items():
        if r is ref or m == "body" or "error" in r:
            continue
        pairs = [("loss", r["loss"], ref["loss"])] + [
            (n, r["grad_norms"][n], ref["grad_norms"][n]) for n in ref["grad_norms"]]
        for what, a, b in pairs:
            d = abs(a - b) / max(abs(b), 1e-30)
            r.setdefault("relative_difference_to_plain", {})[what] = d
            if d > rel:
                raise SystemExit(f"{m}: {what} {a} differs from plain's {b} (relative {d:.1e})")
    print(f"losses and gradient norms match plain's (relative {rel:g})")


def _load() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: float32 on the CPU, "
                   "bfloat16 elsewhere)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--methods", default=None, help="comma list (default: all available)")
    p.add_argument("--part", choices=["model", "loss"], default="model",
                   help="the model's training step, or the loss alone on leaf tensors")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true",
                   help="after the repeats, one more step of each method under torch.profiler:"
                        " the self time of its matrix products and of the rest")
    p.add_argument("--method", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    if args.method:
        worker(args)
        return

    methods = ["plain", "cce", "headroom", "body"]
    if args.device != "cpu":
        methods.insert(2, "cce-compile")
    if args.part == "loss":
        methods = ["plain-loss", "cce-loss", "headroom-loss"]
    if args.methods:
        methods = args.methods.split(",")
    try:
        import cut_cross_entropy  # noqa: F401
    except ImportError:
        print("cut-cross-entropy is not installed: skipping it (pip install cut-cross-entropy)")
        methods = [m for m in methods if not m.startswith("cce")]

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    procs: dict[str, subprocess.Popen] = {}
    results: dict[str, dict] = {}
    loads = [_load()]
    for m in methods:
        cmd = [sys.executable, __file__, "--method", m] + [
            f"--{k}={v}" for k, v in vars(args).items()
            if k not in ("method", "methods", "out", "part", "profile") and v is not None] + (
            ["--profile"] if args.profile else [])
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env)
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            print(f"{m}: failed to start ({proc.returncode})")
            results[m] = {"method": m, "error": f"exit {proc.returncode}"}
            continue
        procs[m] = proc
        print(f"{m}: ready {line.strip()}", flush=True)
    for r in range(args.repeats):
        for m, proc in procs.items():
            proc.stdin.write("run\n")
            proc.stdin.flush()
            rep = json.loads(proc.stdout.readline())
            print(f"round {r}: {m:>12} {rep['time_s']:8.2f} s ({rep['cpu_s']:7.2f} s CPU)  "
                  f"step peak {rep['step_peak_bytes'] / 2**30:6.2f} GiB", flush=True)
        loads.append(_load())
    for m, proc in procs.items():
        out, _ = proc.communicate("stop\n")
        results[m] = json.loads(out.strip().splitlines()[-1])

    check(results, 1e-4 if args.dtype == "float32" else 2e-2)
    body = results.get("body", {}).get("median_step_peak_bytes")
    base_t = (results.get("plain") or results.get("plain-loss") or {}).get("median_s")
    cce_ref = results.get("cce") or results.get("cce-loss") or {}
    if args.part == "loss":
        # the gradients every method returns: of the weight and of the hidden states
        item = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
        outputs = (args.vocab + args.batch * args.seq) * args.hidden * item
        for r in results.values():
            if "error" not in r:
                r["loss_peak_bytes"] = r["median_step_peak_bytes"]
                r["workspace_bytes"] = r["median_step_peak_bytes"] - outputs
    print(f"\n{args.batch} x {args.seq} tokens, vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.layers} layer(s), {args.dtype}, device {args.device}, {args.threads} threads, "
          f"median of {args.repeats}; load averages {loads[0]} .. {loads[-1]}")
    print(f"{'method':>12} | {'median s':>8} | {'x plain':>7} | {'x cce':>6} | "
          f"{'step peak GiB':>13} | {'loss GiB':>8} | {'x cce':>6}")
    for m, r in results.items():
        if "error" in r:
            print(f"{m:>12} | failed")
            continue
        if body is not None and m != "body":
            r["above_body_bytes"] = r["median_step_peak_bytes"] - body
        if base_t:
            r["time_x_plain"] = r["median_s"] / base_t
        if "median_s" in cce_ref:
            r["time_x_cce"] = r["median_s"] / cce_ref["median_s"]
            r["cpu_time_x_cce"] = r["median_cpu_s"] / cce_ref["median_cpu_s"]
            # the same round, both under the same load: the ratio per round
            r["time_x_cce_per_round"] = [a / b for a, b in zip(r["times_s"], cce_ref["times_s"],
                                                                strict=True)]
            for key in ("loss_peak_bytes", "workspace_bytes", "above_body_bytes"):
                if key in r and key in cce_ref:
                    r[key.replace("_bytes", "_x_cce")] = r[key] / cce_ref[key]
        lp = r.get("loss_peak_bytes", r.get("above_body_bytes"))
        print(f"{m:>12} | {r['median_s']:8.2f} | {r.get('time_x_plain', float('nan')):7.2f} | "
              f"{r.get('time_x_cce', float('nan')):6.2f} | "
              f"{r['median_step_peak_bytes'] / 2**30:13.2f} | "
              f"{(lp / 2**30 if lp is not None else float('nan')):8.2f} | "
              f"{r.get('loss_peak_x_cce', r.get('above_body_x_cce', float('nan'))):6.2f}"
              + f" | CPU {r['median_cpu_s']:.2f} s"
              + (f" ({r['cpu_time_x_cce']:.2f} x cce)" if "cpu_time_x_cce" in r else "")
              + (f" | workspace {r['workspace_bytes'] / 2**30:5.2f} GiB, "
                 f"{r.get('workspace_x_cce', float('nan')):.2f} x cce"
                 if "workspace_bytes" in r else "")
              + (f" | profiled: products {r['profiled_products_s']:.2f} s"
                 f" ({r['profiled_products']}), the rest {r['profiled_other_s']:.2f} s"
                 if "profiled_products_s" in r else ""))
    out = Path(args.out) if args.out else RESULTS / (
        "lm_loss.json" if args.device == "cpu" else "lm_loss_gpu.json")
    # one file for both parts: each run replaces its own part
    record = json.loads(out.read_text()) if out.exists() else {}
    record.setdefault("benchmark", "lm_loss")
    record[args.part] = {
        "config": {k: v for k, v in vars(args).items() if k != "method"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "device_name": (torch.cuda.get_device_name() if args.device != "cpu"
                                    else platform.processor())},
        "load_averages": loads,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
