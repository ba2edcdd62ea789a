"""Data parallel with task heads: bytes all-reduced per step and step time, side by side.

A multi-task model (a shared trunk and 8 task heads), 2 ranks, each rank's batch from one task
(rank r, step s: task (r + s) mod 8, so the two ranks use different heads). Three setups train
the same model on the same batches in one run:

1. ``DistributedDataParallel(model, find_unused_parameters=True)``: every parameter's gradient
   is all-reduced every step (the heads nobody used as zeros).
2. ``DistributedDataParallel(model)`` with every head on the device and ``find_unused_parameters``
   off cannot run this schedule (unused heads fail the reducer); not measured.
3. ``hr.offload(model.heads, store="cpu", prefetch=0)`` + ``hr.data_parallel(model)``: the trunk
   through DDP, the heads' gradients through headroom's reducer, only those some rank used.

Bytes are the payload handed to all-reduce per step (DDP's buckets, counted by a comm hook that
then all-reduces as DDP's default does; headroom's buckets, bitmap and counts), on each rank;
with the ring all-reduce of 2 ranks each rank also sends about that many bytes. Step times are
medians over steps after warm-up, the median of several rounds; setups alternate within a round,
and the time ratio is also given as the median of per-round ratios.

    .venv/bin/python benchmarks/data_parallel.py            # CPU, gloo, 2 ranks (~2 min)
    .venv/bin/python benchmarks/data_parallel.py --quick    # a smoke test

With two or more GPUs it runs with NCCL, one GPU per rank (``--backend nccl``; that path has not
been run yet).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import headroom as hr

RESULTS = Path(__file__).parent / "results" / "data_parallel.json"


class MultiTask(nn.Module):
    def __init__(self, d: int, classes: int, heads: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.heads = nn.ModuleList(nn.Linear(d, classes) for _ in range(heads))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def _counting_hook(counter: list[int]):
    def hook(state, bucket):
        buf = bucket.buffer()
        counter[0] += buf.numel() * buf.element_size()
        buf.div_(dist.get_world_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook


def _setup(name: str, args, device: torch.device):
    torch.manual_seed(0)
    model = MultiTask(args.d, args.classes, args.heads).to(device)
    counter = [0]
    if name == "ddp_find_unused":
        wrapped = DDP(model, find_unused_parameters=True,
                      device_ids=[device.index] if device.type == "cuda" else None)
        wrapped.register_comm_hook(None, _counting_hook(counter))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device="cpu" with store="cpu"
            hr.offload(model.heads, device=device, store="cpu", prefetch=0)
        wrapped = hr.data_parallel(model, timeout=120,
                                   device_ids=[device.index] if device.type == "cuda" else None)
        wrapped.ddp.register_comm_hook(None, _counting_hook(counter))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, wrapped, opt, counter


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(args.threads)
    backend = args.backend
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    names = ["ddp_find_unused", "headroom"]
    setups = {n: _setup(n, args, device) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    sent: dict[str, list[int]] = {n: [] for n in names}
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(args.batch, args.d, generator=g) for _ in range(4)]
    ys = [torch.randint(0, args.classes, (args.batch,), generator=g) for _ in range(4)]
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for n in order:
            model, wrapped, opt, counter = setups[n]
            per = []
            for i in range(args.warmup + args.steps):
                task = (rank + i) % args.heads
                x, y = xs[i % 4].to(device), ys[i % 4].to(device)
                before = counter[0]
                own = wrapped.bytes_reduced if n == "headroom" else 0
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                F.cross_entropy(wrapped(x, task), y).backward()
                opt.step()
                opt.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if i >= args.warmup:
                    per.append(dt)
                    extra = (wrapped.bytes_reduced - own) if n == "headroom" else 0
                    sent[n].append(counter[0] - before + extra)
            times[n].append(statistics.median(per))
    # Replicas must agree (a check that both setups really trained in sync).
    equal = {}
    for n in names:
        model = setups[n][0]
        flat = torch.cat([v.float().flatten() for v in model.state_dict().values()]).to(device)
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        equal[n] = bool(torch.equal(ref, flat))
    queue.put((rank, {"times": times, "sent": sent, "replicas_equal": equal}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", default=None, help="gloo (default without GPUs) or nccl")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--classes", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.d, args.classes, args.steps, args.rounds = 64, 256, 3, 2
    if args.backend is None:
        args.backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    res = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    r0 = res[0]
    d, c, h = args.d, args.classes, args.heads
    head_bytes = (d * c + c) * 4
    trunk_bytes = 2 * (d * d + d) * 4
    out = {
        "benchmark": "data_parallel",
        "command": "benchmarks/data_parallel.py" + (" --quick" if args.quick else ""),
        "backend": args.backend,
        "world_size": world,
        "model": {"d": d, "classes": c, "heads": h, "head_bytes": head_bytes,
                  "trunk_bytes": trunk_bytes, "batch": args.batch},
        "steps_per_round": args.steps, "rounds": args.rounds, "threads_per_rank": args.threads,
        "platform": platform.platform(), "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "results": {},
    }
    for n in r0["times"]:
        sent = statistics.median(r0["sent"][n])
        out["results"][n] = {
            "bytes_all_reduced_per_step_median": sent,
            "head_bytes_fraction": (sent - trunk_bytes) / (h * head_bytes),
            "step_time_s_median": statistics.median(r0["times"][n]),
            "step_time_s_rounds": r0["times"][n],
            "replicas_equal": all(res[r]["replicas_equal"][n] for r in res),
        }
    base = out["results"]["ddp_find_unused"]
    hr_ = out["results"]["headroom"]
    out["bytes_ratio_headroom_vs_ddp"] = (hr_["bytes_all_reduced_per_step_median"]
                                          / base["bytes_all_reduced_per_step_median"])
    out["step_time_ratio_headroom_vs_ddp"] = (hr_["step_time_s_median"]
                                              / base["step_time_s_median"])
    # Per round the two setups run back to back, so a round's ratio is less exposed to the
    # load of a shared machine drifting than the ratio of the medians.
    rounds = [a / b for a, b in zip(hr_["step_time_s_rounds"], base["step_time_s_rounds"],
                                    strict=True)]
    out["step_time_ratio_per_round"] = rounds
    out["step_time_ratio_median_of_rounds"] = statistics.median(rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'setup':<18}{'MiB all-reduced/step':>22}{'head fraction':>15}{'step ms':>10}")
    for n, r in out["results"].items():
        print(f"{n:<18}{r['bytes_all_reduced_per_step_median'] / 2**20:>22.2f}"
              f"{r['head_bytes_fraction']:>15.3f}{r['step_time_s_median'] * 1e3:>10.1f}")
    print(f"bytes: headroom/DDP = {out['bytes_ratio_headroom_vs_ddp']:.3f};"
          f" step time: headroom/DDP = {out['step_time_ratio_headroom_vs_ddp']:.2f}"
          f" (median of per-round ratios {out['step_time_ratio_median_of_rounds']:.2f},"
          f" rounds {', '.join(f'{r:.2f}' for r in rounds)})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
