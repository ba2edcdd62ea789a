"""Code the spawned ranks of tests/distributed/test_fsdp_estimate.py run: a real FSDP2 step
under hr.track_memory against hr.estimate of one rank's step."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import headroom as hr
from tests.residency._models import Block

VOCAB = 37  # odd: the embedding's and the head's rows are padded to a multiple of the ranks
D = 24


class GPT(nn.Module):
    """A tiny GPT-2-like model whose parameters outweigh its activations."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(D) for _ in range(n))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.ln(h))


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))


def _loss(x: torch.Tensor):
    return lambda out: F.cross_entropy(out.float().flatten(0, 1), x.flatten())


def _cats(d: dict) -> dict:
    return {k: d[k] for k in ("parameters", "gradients", "optimizer_state")}


def step(rank: int, world: int, *, offloaded: bool = False, bf16: bool = False,
         nested: bool = False) -> dict:
    """One tracked steady-state step of FSDP2 (blocks and root fully_shard'ed, AdamW),
    with hr.offload(store="cpu") of the shards and HostOptimizer when ``offloaded``, and the
    estimates of it: of the model before fully_shard with world_size= (and with the mesh),
    and of the sharded model itself (the only one with ``bf16``: MixedPrecisionPolicy; with
    ``nested``: each block's fc1 a unit of its own inside the block's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT().eval()  # no dropout: the step is the same on every run
    x = _batch(rank)
    opt_kw = dict(lr=1e-3, weight_decay=0.1)
    mesh = init_device_mesh("cpu", (world,))
    if offloaded:
        from headroom.optim import HostOptimizerOptions

        what = HostOptimizerOptions(torch.optim.AdamW, dict(opt_kw, fused=False), "cpu", False,
                                    1 << 20, 32 << 20)
        what_if = hr.estimate(model, (x,), loss_fn=_loss(x), optimizer=what, device="cpu",
                              world_size=world, offload={"store": "cpu"})
    else:
        what_if = hr.estimate(model, (x,), loss_fn=_loss(x), optimizer=torch.optim.AdamW,
                              optimizer_kwargs=opt_kw, device="cpu", world_size=world)
    by_mesh = hr.estimate(model, (x,), loss_fn=_loss(x), optimizer=torch.optim.AdamW,
                          optimizer_kwargs=opt_kw, mesh=mesh,
                          offload={"store": "cpu"} if offloaded else None)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)} if bf16 else {}
    for block in model.layers:
        if nested:
            fully_shard(block.fc1, mesh=mesh, **kw)
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if offloaded:
        hr.offload(model, device="cpu", store="cpu")
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, fused=False, **opt_kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), **opt_kw)
    own = hr.estimate(model, (x,), loss_fn=_loss(x), optimizer=opt)

    def run() -> None:
        _loss(x)(model(x)).backward()
        opt.step()
        opt.zero_grad()

    run()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        run()
    local = sum(p.to_local().nbytes for p in model.parameters())
    # one unit's reduce-scatter input: fp32 gradients of a block, dim 0 padded
    block = max(sum(-(-p.shape[0] // world) * world * p[0].numel() * 4
                    for p in b.parameters()) for b in GPT().layers)
    return {"peak": mem.peak, "block": block, "what_if": what_if.peak, "by_mesh": by_mesh.peak,
            "own": own.peak, "max": _cats(mem.max_by_category),
            "est_max": _cats(what_if.max_by_category),
            "own_max": _cats(own.max_by_category), "local": local,
            "full": sum(p.numel() * p.element_size() for p in GPT().parameters())}


def refusals(rank: int, world: int) -> dict:
    """A world size that disagrees with the model's mesh; offload= of a sharded model."""
    from tests.distributed._fsdp_workers import _error

    warnings.simplefilter("ignore")
    x = _batch(rank)
    model = GPT()
    out = {}
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    out["world_disagrees"] = _error(lambda: hr.estimate(model, (x,), world_size=world + 1))
    out["offload_of_sharded"] = _error(lambda: hr.estimate(model, (x,),
                                                           offload={"store": "cpu"}))
    return out
