"""Code the spawned ranks run (importable by child processes), and the models both sides use."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import headroom as hr
from headroom.store import DiskStore

HEADS = 8
STEPS = 3


class Head(nn.Linear):
    """A head with a parameter its forward never uses (no rank ever has a gradient for it)."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__(d, c)
        self.spare = nn.Parameter(torch.zeros(2))


class MultiTask(nn.Module):
    """Shared parameters (the trunk) and one head per task."""

    def __init__(self, d: int = 8, heads: int = HEADS, spare: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        make = Head if spare else nn.Linear
        self.heads = nn.ModuleList(make(d, 3) for _ in range(heads))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def batch(rank: int, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def tasks(case: str, rank: int, step: int) -> int:
    if case == "same":
        return step % 2
    return (rank + 2 * step) % 5  # different tasks per rank; heads 5..7 are never used


def make_opt(params, host: bool, sgd: bool = False):
    if sgd:  # unlike Adam, sensitive to the gradient's scale (a sum instead of a mean shows)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    kw = dict(lr=1e-2, weight_decay=0.1)
    if host:
        return hr.HostOptimizer(params, torch.optim.AdamW, fused=False, **kw)
    return torch.optim.AdamW(params, **kw)


def multitask(rank: int, world: int, case: str, *, store: str = "cpu", host: bool = False,
              micro: int = 1, tmp: str = "", final: bool = False, spare: bool = False,
              announce: bool = False, sgd: bool = False, accumulation: str = "store",
              zero: str = "opt") -> dict:
    """Train the multi-task model with offloaded heads under hr.data_parallel; ``zero``:
    clear gradients with the optimizer's zero_grad() or the model's (as Trainer does)."""
    from headroom.residency._schedule import Offload

    held = [0]  # gradients summed where they were computed (grad_accumulation="device")
    real_hold = Offload._hold

    def hold(self, *a, **k):
        held[0] += 1
        return real_hold(self, *a, **k)

    Offload._hold = hold
    torch.manual_seed(0)
    model = MultiTask(spare=spare)
    st = "cpu" if store == "cpu" else DiskStore(os.path.join(tmp, f"rank{rank}"), threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model.heads, device="cpu", store=st, prefetch=0,
                   grad_accumulation=accumulation)
    dp = hr.data_parallel(model, timeout=20)
    assert set(dp.state_dict()) == {f"module.{k}" for k in model.state_dict()}
    opt = make_opt(model.parameters(), host, sgd)
    sent = []
    for step in range(STEPS):
        if announce:
            hr.prefetch(model.heads[tasks(case, rank, step + 1)])
        for m in range(micro):
            x, y = batch(rank, step, m)
            task = tasks(case, rank, step)
            last = m == micro - 1
            ctx = dp.no_sync() if not last else _null()
            with ctx:
                with opt.final_backward(final and last) if host else _null():
                    (F.cross_entropy(dp(x, task), y) / micro).backward()
        sent.append(dp.reducer.last_step_bytes)
        opt.step()
        (model if zero == "model" else opt).zero_grad()
        if spare:
            assert all(h.spare.grad is None for h in model.heads), "a gradient no rank made"
    out = {k: v.clone() for k, v in model.state_dict().items()}
    out["__sent__"] = torch.tensor(sent)
    out["__held__"] = torch.tensor(held[0])
    Offload._hold = real_hold
    return out


def transformer(rank: int, world: int, store: str = "cpu", tmp: str = "", micro: int = 1,
                accumulation: str = "store", fused: bool = False) -> dict:
    """A small transformer whose parameters all rest in a store, vs DDP on the plain model
    (``micro`` micro-batches per step, all but the last under ``no_sync``). ``fused``: its head
    weight is read inside the root's forward, not through the head's call (TRL's fused LM
    head), so the head's block is used outside its forward."""
    from headroom.residency._group import Residency
    from tests.residency._models import FusedHead, Transformer, lm_batch, lm_loss

    if fused:
        Transformer = FusedHead  # noqa: N806 - the model class of this run

    pushed = [0]  # gradients handed to the store by the last micro-batch's backward
    real_push = Residency.push_grad

    def push(self, *a, **k):
        pushed[0] += 1
        return real_push(self, *a, **k)

    Residency.push_grad = push
    torch.manual_seed(0)
    plain = Transformer(d=16, n=3)
    model = Transformer(d=16, n=3)
    model.load_state_dict(plain.state_dict())
    st = "cpu" if store == "cpu" else DiskStore(os.path.join(tmp, f"rank{rank}"), threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store=st, prefetch=1, grad_accumulation=accumulation)
    # small buckets: several all-reduces in one backward
    dp = hr.data_parallel(model, timeout=20, bucket_bytes=4096)
    ddp = torch.nn.parallel.DistributedDataParallel(plain)
    opt = make_opt(model.parameters(), store != "cpu")
    opt_ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1,
                                fused=False if store != "cpu" else None)
    last_pushed = []
    for step in range(STEPS):
        for m, o in ((dp, opt), (ddp, opt_ref)):
            for k in range(micro):
                b = lm_batch(torch.Generator().manual_seed(rank * 100 + step * 10 + k))
                torch.manual_seed(step)
                pushed[0] = 0
                with m.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    (lm_loss(m, b) / micro).backward()
            if m is dp:
                last_pushed.append(pushed[0])
            o.step()
            o.zero_grad()
    Residency.push_grad = real_push
    got = {k: v.clone() for k, v in model.state_dict().items()}
    return {"got": got, "ref": {k: v.clone() for k, v in plain.state_dict().items()},
            "pushed": last_pushed, "n_params": len(list(model.parameters()))}


def compiled_transformer(rank: int, world: int, store: str = "cpu", tmp: str = "") -> dict:
    """`transformer` under torch.compile: compiled data_parallel vs DDP of the plain model
    (aot_eager runs the kernels eager mode runs, so bitwise), batch size changing per step."""
    from tests.residency._models import Transformer, lm_batch, lm_loss

    torch._dynamo.reset()
    torch.manual_seed(0)
    plain = Transformer(d=16, n=3)
    model = Transformer(d=16, n=3)
    for m in (plain, model):
        for layer in m.layers:
            layer.drop.p = 0.0  # compiled dropout draws its own random numbers
    model.load_state_dict(plain.state_dict())
    st = "cpu" if store == "cpu" else DiskStore(os.path.join(tmp, f"rank{rank}"), threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store=st, prefetch=1)
    dp = torch.compile(hr.data_parallel(model, timeout=20), backend="aot_eager")
    ddp = torch.nn.parallel.DistributedDataParallel(plain)  # eager: compiling it costs seconds
    opt = make_opt(model.parameters(), store != "cpu")
    opt_ref = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1,
                                fused=False if store != "cpu" else None)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(rank * 100 + step)
        b = lm_batch(g, b=2 + step)
        for m, o in ((dp, opt), (ddp, opt_ref)):
            lm_loss(m, b).backward()
            o.step()
            o.zero_grad()
    from torch._dynamo.utils import counters

    got = {k: v.clone() for k, v in model.state_dict().items()}
    return {"got": got, "ref": {k: v.clone() for k, v in plain.state_dict().items()},
            "graphs": torch.tensor(counters["stats"]["unique_graphs"])}


def failing(rank: int, world: int, how: str) -> dict:
    """Rank 1 fails after a good step (stalls then raises, or is killed); rank 0 must fail
    clearly, within its timeout.

    The whole model is offloaded, so every collective is headroom's (DDP's own collectives fail
    with torch's errors, under the process group's timeout).
    """
    torch.manual_seed(0)
    model = MultiTask()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store="cpu", prefetch=0, blocks=list(model.heads))
    dp = hr.data_parallel(model, timeout=3)
    x, y = batch(rank, 0)
    F.cross_entropy(dp(x, rank), y).backward()  # one good step
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), 9)
        # Alive past rank 0's timeout without joining the next step's collectives, then
        # raising: rank 0 must give up on its own, not wait for this process to exit.
        time.sleep(5)
        raise ValueError("injected failure on rank 1")
    F.cross_entropy(dp(x, rank), y).backward()
    return {}


# ------------------------------------------------------------------ process plumbing
class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, jobs: list, out, path: list[str]) -> None:
    sys.path[:0] = [p for p in path if p not in sys.path]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    try:
        for i, (fn, kwargs) in enumerate(jobs):
            try:
                if ":" in fn:  # "module:function" of another worker module
                    mod, name = fn.split(":")
                    res = getattr(importlib.import_module(mod), name)(rank, world, **kwargs)
                else:
                    res = globals()[fn](rank, world, **kwargs)
                buf = io.BytesIO()
                torch.save(res, buf)  # bytes: the parent may read them after this rank exits
                out.put((i, rank, "ok", buf.getvalue()))
            except BaseException as e:  # reported to the test, which decides
                out.put((i, rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
                raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run(world: int, jobs: list[tuple[str, dict]], timeout: float = 120) -> dict:
    """Run ``jobs`` (function name, kwargs) in order on ``world`` spawned ranks.

    Returns ``{(job, rank): (status, result)}``; ranks that died leave their entries out.
    """
    # A fork server that has imported torch once: each set of ranks after the first starts in
    # a fraction of a second instead of importing torch again, nor torch._dynamo (which DDP's
    # constructor imports: seconds in every rank).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "tests.distributed._workers"])
    out = ctx.Queue()
    port = free_port()
    path = [os.path.abspath(p) for p in sys.path if p]
    procs = [ctx.Process(target=_entry, args=(r, world, port, jobs, out, path), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    import queue
    import time
    end = time.monotonic() + timeout
    try:
        while len(results) < world * len(jobs) and time.monotonic() < end:
            try:
                i, rank, status, res = out.get(timeout=1)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if status == "ok":
                res = torch.load(io.BytesIO(res), weights_only=True)
            results[(i, rank)] = (status, res)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return results


def run_named(world: int, named_jobs: dict[str, tuple[str, dict]],
              timeout: float = 240) -> dict[str, list]:
    """`run` for jobs named by their case: ``{name: [result of rank 0, rank 1, ...]}``; a rank
    that failed, died or timed out fails the calling test, naming the case and the rank."""
    names = list(named_jobs)
    res = run(world, [named_jobs[n] for n in names], timeout=timeout)
    out = {}
    for i, n in enumerate(names):
        out[n] = []
        for r in range(world):
            status, value = res.get((i, r), ("missing", "no result (rank died or timed out)"))
            assert status == "ok", f"{n} rank {r}: {value}"
            out[n].append(value)
    return out
