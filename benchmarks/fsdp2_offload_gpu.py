"""FSDP2 on a GPU: step time and peak device memory of FSDP2, FSDP2 + ``CPUOffloadPolicy`` and
FSDP2 + headroom (each rank's shards in a page-locked headroom store, or on a ``DiskStore``
under ``--disk``), on a Llama-style model built from a config (random weights).

One process per GPU, NCCL. World 1 is legal FSDP2 and enough to compare the setups:

    python3 benchmarks/fsdp2_offload_gpu.py                       # one GPU
    torchrun --nproc-per-node=8 benchmarks/fsdp2_offload_gpu.py   # a node

Each setup runs in its own process group of fresh processes (``--setup`` picks one; without it
the script runs itself once per setup). The results, with the device's name, go to
``benchmarks/results/fsdp2_offload_gpu.json`` (rank 0 writes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).parent / "results" / "fsdp2_offload_gpu.json"
SETUPS = ("fsdp2", "fsdp2_cpu_offload", "fsdp2_headroom", "fsdp2_headroom_disk")


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                      num_key_value_heads=max(1, args.hidden // 512), vocab_size=32000,
                      max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def one(args) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    import headroom as hr
    from headroom.residency._dtensor import sharded_state_of

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    model = _model(args)
    setup = args.setup
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)}
    if setup == "fsdp2_cpu_offload":
        kw["offload_policy"] = CPUOffloadPolicy()
    else:
        model.to(dev)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    okw = dict(lr=1e-5, weight_decay=0.1)
    if setup.startswith("fsdp2_headroom"):
        store = "cpu" if setup == "fsdp2_headroom" else hr.DiskStore(
            os.path.join(args.disk, f"rank{rank}"), overwrite=True)
        hr.offload(model, device=dev, store=store)
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **okw)
        stored = sharded_state_of(model).stored_bytes
    else:
        opt = torch.optim.AdamW(model.parameters(), **okw)
        stored = 0
    g = torch.Generator(device=dev).manual_seed(rank)
    times = []
    torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(args.steps):
        ids = torch.randint(0, 32000, (args.batch, args.seq), device=dev, generator=g)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return {
        "setup": setup, "world": world, "device": torch.cuda.get_device_name(dev),
        "step_s_median": statistics.median(times[2:] if len(times) > 3 else times),
        "step_s": times, "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
        "store_bytes_rank0": stored, "loss": float(loss),
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup", choices=SETUPS)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds one setup may take")
    ap.add_argument("--disk", default="/tmp/hr-fsdp2-disk",
                    help="folder of the disk setup's stores (one per rank)")
    args = ap.parse_args()
    if args.setup is None:  # one fresh run per setup (torchrun-launched runs pass --setup)
        rows = []
        doc = {"command": "python3 benchmarks/fsdp2_offload_gpu.py " + " ".join(sys.argv[1:]),
               "torch": torch.__version__, "config": vars(args), "runs": rows,
               "complete": False}
        for s in SETUPS:
            tmp = Path(args.out).with_suffix(f".{s}.part")
            cmd = [sys.executable, __file__, "--setup", s, "--out", str(tmp),
                   *[f"--{k}={v}" for k, v in vars(args).items()
                     if k not in ("setup", "out", "timeout")]]
            # a setup that fails or hangs is recorded with its error; the others still run
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                how = f"rc={p.returncode}"
                tail = (p.stdout + p.stderr)[-3000:]
            except subprocess.TimeoutExpired as e:
                how, tail = f"time limit ({args.timeout} s)", str(e.stderr or "")[-3000:]
            if tmp.exists():
                rows.append(json.loads(tmp.read_text()))
                tmp.unlink()
            else:
                rows.append({"setup": s, "error": how, "output_tail": tail})
                print(f"{s}: failed ({how})\n{tail}", file=sys.stderr)
            r = rows[-1]
            if "error" not in r:
                print(f"{r['setup']:<19} {r['device']}: step {r['step_s_median'] * 1e3:8.1f} ms,"
                      f" peak allocated {r['peak_allocated_bytes'] / 2**30:6.2f} GiB", flush=True)
            # written after each setup: a run stopped part way keeps what it measured
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        doc["complete"] = True
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        return
    if "RANK" not in os.environ:  # a single process: world 1
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT",
                                                                             "29511"))
    dist.init_process_group("nccl")
    try:
        res = one(args)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
