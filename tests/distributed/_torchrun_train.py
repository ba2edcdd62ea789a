"""A training script as ``torchrun`` runs it on each node: FSDP2 + hr.offload + HostOptimizer
and, in the same job, FSDP2 + AdamW alone; each rank writes its results to ``<dir>/rank<R>.pt``.

Usage: torchrun --nnodes=N --nproc-per-node=G --node-rank=R --rdzv-endpoint=HOST:PORT
       tests/distributed/_torchrun_train.py DIR   (tests/distributed/test_fsdp.py runs it)
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import headroom as hr
from tests.distributed._fsdp_workers import _local, _pair, batch


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # env:// from torchrun
    rank = dist.get_rank()
    model, ref = _pair()
    hr.offload(model, device="cpu", store="cpu")
    okw = dict(lr=1e-2, weight_decay=0.1)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, **okw)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **okw)
    losses: dict[str, list[torch.Tensor]] = {"got": [], "ref": []}
    for step in range(3):
        for tag, m, o in (("got", model, opt), ("ref", ref, ref_opt)):
            x, y = batch(rank, step)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
            o.zero_grad()
            losses[tag].append(loss.detach())
    env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")}
    torch.save({"got": _local(model), "ref": _local(ref), "env": env,
                "loss": torch.stack(losses["got"]), "loss_ref": torch.stack(losses["ref"])},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
