"""hr.estimate(..., world_size=N): one rank's share of an FSDP2 step, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import headroom as hr
from headroom.optim import HostOptimizerOptions


class Net(nn.Module):
    """Blocks and a head; the head's 5 rows need padding for 2 ranks."""

    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(),
                                                  nn.Linear(2 * d, d)) for _ in range(n))
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = x + b(x)
        return self.head(x)


def _est(world, **kw):
    kw.setdefault("optimizer", torch.optim.AdamW)
    kw.setdefault("device", "cpu")
    return hr.estimate(Net(), (torch.randn(4, 64),), world_size=world, **kw)


def _padded_shards(model: nn.Module, world: int) -> int:
    """Bytes of rank 0's shards: dim 0 padded to a multiple of ``world``, split in ``world``."""
    return sum(math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) * p.element_size()
               for p in model.parameters())


def test_two_ranks_hold_half_the_sharded_state():
    one, two = _est(1), _est(2)
    full = sum(p.numel() * p.element_size() for p in Net().parameters())
    steps = 4 * len(list(Net().parameters()))  # AdamW's step counts, one scalar each
    for cat, per_param, extra in (("parameters", 1, 0), ("gradients", 1, 0),
                                  ("optimizer_state", 2, steps)):
        assert one.max_by_category[cat] == per_param * full + extra, cat
        # the head's bias (5 rows) and weight (5 x 64) are padded to 6 rows
        assert two.max_by_category[cat] == per_param * _padded_shards(Net(), 2) + extra, cat
    assert _padded_shards(Net(), 2) == (full + 65 * 4) // 2
    # what is sharded halves; what is not (activations, one unit gathered at a time) stays
    sharded = sum(one.max_by_category[c] for c in ("parameters", "gradients",
                                                   "optimizer_state"))
    assert one.peak - two.peak >= sharded // 2 - 3 * 65 * 4 - one.peak // 10
    assert two.max_by_category["activations"] == one.max_by_category["activations"]
    assert two.options["world_size"] == 2


def test_world_size_one_is_fsdp2_not_the_plain_step():
    # FSDP2 on one rank keeps the unit it computes with beside its (whole) shard
    plain = hr.estimate(Net(), (torch.randn(4, 64),), device="cpu",
                        optimizer=torch.optim.AdamW)
    one = _est(1)
    block = sum(p.numel() * 4 for p in Net().layers[0].parameters())
    assert one.peak >= plain.peak + block


def test_host_shards_leave_only_the_gathered_units_on_an_accelerator():
    dev = _est(2, device="cuda")
    host = _est(2, device="cuda", offload={"store": "cpu"},
                optimizer=HostOptimizerOptions(torch.optim.AdamW, {}, "cpu", False, 1 << 20,
                                               32 << 20))
    for cat in ("parameters", "gradients", "optimizer_state"):
        assert dev.max_by_category[cat] > 0
        assert host.max_by_category[cat] == 0, cat  # all on the host
    # the device keeps one unit unsharded (plus one prefetched, its buffers) at a time
    block = sum(p.numel() * 4 for p in Net().layers[0].parameters())
    assert host.peak < dev.peak - 2 * block
    assert host.transfers["link"] > 0


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        _est(bad)


def _mesh(*shape):
    from torch.distributed.device_mesh import DeviceMesh

    # a mesh description only (no process groups): what the estimate reads of it
    return DeviceMesh("cpu", torch.arange(math.prod(shape)).view(shape), _init_backend=False,
                      _rank=0)


def test_mesh_gives_the_world_size():
    assert _est(None, mesh=_mesh(2)).peak == _est(2).peak
    with pytest.raises(ValueError, match="world_size=3 but mesh has 2 ranks"):
        _est(3, mesh=_mesh(2))


def test_bad_mesh_and_options():
    with pytest.raises(TypeError, match="mesh must be a torch.distributed"):
        hr.estimate(Net(), (torch.randn(4, 64),), device="cpu", mesh=(2,))
    with pytest.raises(ValueError, match="mesh has 2 dimensions"):
        _est(None, mesh=_mesh(2, 2))
    with pytest.raises(ValueError, match="store='cpu'"):
        _est(2, offload={"store": "disk"})
    with pytest.raises(ValueError, match="MixedPrecisionPolicy"):
        _est(2, offload={"store": "cpu", "compute_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="state_store='cpu'"):
        _est(2, optimizer=HostOptimizerOptions(torch.optim.AdamW, {}, "disk", False, 1 << 20,
                                               32 << 20))
    model = Net()
    with pytest.warns(UserWarning):
        hr.offload(model, device="cpu", store="cpu")
    with pytest.raises(ValueError, match="fully_shard cannot wrap a model under hr.offload"):
        hr.estimate(model, (torch.randn(4, 64),), world_size=2)


def test_plan_per_rank_offloads_the_shards_when_the_budget_needs_it():
    x = (torch.randn(4, 256),)
    host_opt = HostOptimizerOptions(torch.optim.AdamW, {}, "cpu", False, 1 << 20, 32 << 20)
    dev = hr.estimate(Net(256), x, device="cuda", world_size=2, optimizer=torch.optim.AdamW)
    host = hr.estimate(Net(256), x, device="cuda", world_size=2, optimizer=host_opt,
                       offload={"store": "cpu"})
    assert host.peak_reserved < dev.peak_reserved
    p = hr.plan(Net(256), x, budget=(dev.peak_reserved + host.peak_reserved) // 2,
                device="cuda", world_size=2)
    assert p.world_size == 2 and p.choice.params == p.choice.optimizer_state == "host"
    assert p.peak == host.peak_reserved  # the dry run of the chosen plan, the estimate's
    assert "each of 2 ranks" in str(p) and "each rank's shards in host memory" in str(p)
    assert "fully_shard(model, mesh=mesh)" in p.code()
    # no stores on disk for shards, and none on the device for the state of host shards
    assert all(c.params in ("device", "host") and c.params == c.optimizer_state
               for c, _, _ in p.candidates)
    with pytest.raises(RuntimeError, match="over 2 ranks .* not initialized"):
        p.apply(Net(256))
    with pytest.raises(ValueError, match="world_size must be"):
        hr.plan(Net(), x, budget="1GiB", device="cuda", world_size=0)


def test_an_estimate_inside_a_distributed_job_leaves_its_process_groups_as_they_are():
    # the dry run shards over a fake process group of its own: never the default group, and
    # gone after the estimate (so is the name FSDP2 looks the meta device's streams up by)
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from headroom.fit import _sharded

    outside = _est(2).peak
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        world = dist.group.WORLD
        assert _est(2).peak == outside  # rank 3 of 4 estimates rank 0 of 2 alike
        assert dist.group.WORLD is world and dist.get_rank() == 3
        assert dist.get_world_size() == 4
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized() and "meta" not in vars(torch)
    for i in range(next(_sharded._FAKE_GROUPS)):  # every fake group made so far
        with pytest.raises(RuntimeError, match="headroom_dry_run_"):
            _resolve_process_group(f"headroom_dry_run_{i}")


def test_a_torch_whose_fsdp2_cannot_run_on_meta_gets_a_clear_error(monkeypatch):
    # the dry run changes attributes of the objects fully_shard makes; a torch without one
    # is named, never estimated wrong, and the fake process group is unregistered
    from torch._C._distributed_c10d import _resolve_process_group
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from headroom.fit import _sharded

    monkeypatch.delattr(FSDPParamGroup, "_validate_no_meta_params")
    with pytest.raises(RuntimeError, match="FSDP2 .* cannot run in headroom's dry run"
                                           r" \(AttributeError.*_validate_no_meta_params"):
        _est(2)
    last = next(_sharded._FAKE_GROUPS) - 1
    with pytest.raises(RuntimeError, match=f"headroom_dry_run_{last}"):
        _resolve_process_group(f"headroom_dry_run_{last}")
