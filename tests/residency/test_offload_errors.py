"""Mistakes with an offloaded model fail where they are made, with the cause and the fix."""

from __future__ import annotations

import copy
import socket
import sys
import warnings

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

import headroom as hr
from headroom.store import DiskStore


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])


def _offload(model, store="cpu"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hr.offload(model, device="cpu", store=store)


@pytest.fixture(params=["cpu", "disk"])
def store(request, tmp_path):
    return "cpu" if request.param == "cpu" else DiskStore(tmp_path / "s", threads=2)


def _train(model, opt, steps=3):
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _assert_same(ref, model):
    got = dict(model.state_dict())
    for name, p in ref.state_dict().items():
        assert torch.equal(got[name], p), name


def test_gradient_penalty_is_refused_and_training_goes_on(store):
    ref = _net()
    model = _offload(copy.deepcopy(ref), store)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True.*not supported"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)
    assert all(p.grad is None for p in model.parameters())  # nothing landed
    _train(model, opt)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))
    _assert_same(ref, model)


@pytest.mark.parametrize("call", [
    lambda m: m.half(), lambda m: m.double(), lambda m: m.bfloat16(),
    lambda m: m.to(torch.float16), lambda m: m.to("meta"), lambda m: m[1].half(),
])
def test_dtype_or_device_change_raises_at_the_call_and_changes_nothing(store, call):
    model = _offload(_net(), store)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    with pytest.raises(RuntimeError, match="hr.unoffload"):
        call(model)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model(torch.randn(2, 8)).sum().backward()  # still trains


def test_moves_that_change_nothing_work(store):
    ref = _net()
    model = _offload(copy.deepcopy(ref), store)
    assert model.to("cpu") is model
    model.float()
    model.to(torch.device("cpu"), torch.float32)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, opt)
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))
    _assert_same(ref, model)


def test_buffers_still_follow_to(store):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2)])
    _offload(model, store)
    model.to("cpu")
    assert model[0][1].running_mean.device.type == "cpu"


def test_conversion_of_an_unguarded_submodule_is_refused_or_reported(store):
    model = _offload(_net(), store)
    if isinstance(store, DiskStore):  # StoreTensor masters: refused at the call, unchanged
        with pytest.raises(RuntimeError, match=r"from torch\.float32 to torch\.float16"):
            model[1][0].half()
        model(torch.randn(2, 8))
    else:
        model[1][0].half()  # a layer inside a block: not intercepted at the call
        with pytest.raises(RuntimeError, match=r"'1\.0\.weight' was changed to torch\.float16"):
            model(torch.randn(2, 8))
    hr.unoffload(model)  # the stored values are intact
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_resize_token_embeddings_after_offload_is_refused_naming_the_fix(store):
    pytest.importorskip("transformers")
    from tests.integrations._models import llama, token_ids

    model = _offload(llama(), store)
    ids = token_ids(2)
    with torch.no_grad():
        before = model(ids).logits
    if isinstance(store, DiskStore):  # StoreTensor masters: refused at the rebinding
        with pytest.raises(RuntimeError, match="its shape is fixed by the store"):
            model.resize_token_embeddings(80)
    else:  # a host master's .data rebound: reported at the next use, naming the resize
        model.resize_token_embeddings(80)
        with pytest.raises(RuntimeError, match="was resized to .*Resize before hr.offload"):
            model(ids)
    hr.unoffload(model)  # the stored values are intact
    model.resize_token_embeddings(64)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


# ------------------------------------------------------------------ DistributedDataParallel
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TwoHeads(nn.Module):
    """A trunk and offloaded heads: DDP wraps the parent of the offloaded part."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(2))

    def forward(self, x, task: int = 0):
        return self.heads[task](self.trunk(x))


def _ddp_worker(rank: int, world: int, port: int, case: str, out) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        if case == "root":
            model = _offload(_net())
            try:
                DDP(model)
                out.put((rank, "no error"))
            except RuntimeError as e:
                out.put((rank, str(e)))
        elif case in ("ddp_first", "ddp_first_part", "hr_data_parallel_first", "fsdp1_first"):
            # The wrapper first (accelerate's prepare), then hr.offload: refused before
            # anything changes (before: DDP first trained silently wrong, replicas drifting).
            model = _TwoHeads()
            if case == "fsdp1_first":
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

                wrapped = FSDP(model, device_id=torch.device("cpu"))
            elif case == "hr_data_parallel_first":
                wrapped = hr.data_parallel(model)
            else:
                wrapped = DDP(model)
            target = wrapped if case != "ddp_first_part" else nn.Sequential(wrapped)
            try:
                _offload(target)
                out.put((rank, "no error"))
            except RuntimeError as e:
                out.put((rank, str(e)))
        elif case == "ddp_then_inner":  # DDP first, then hr.offload of the module inside it
            model = _TwoHeads()
            ddp = DDP(model)
            _offload(model)
            try:
                ddp(torch.randn(4, 8)).sum().backward()
                out.put((rank, "no error"))
            except RuntimeError as e:
                out.put((rank, str(e)))
        else:
            model = _TwoHeads()
            _offload(model.heads)
            ddp = DDP(model)
            try:
                ddp(torch.randn(4, 8)).sum().backward()
                out.put((rank, "no error"))
            except RuntimeError as e:
                out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["root", "parent", "ddp_first", "ddp_first_part",
                                  "hr_data_parallel_first", "fsdp1_first", "ddp_then_inner"])
def test_ddp_over_an_offloaded_model_is_refused(case):
    # A fork server that has imported torch and torch._dynamo (DDP's constructor imports it,
    # seconds each time) once, shared with tests/distributed: the ranks start without either.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, case, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert set(results) == {0, 1}
    for msg in results.values():
        if case in ("root", "parent", "ddp_then_inner"):
            assert "DistributedDataParallel cannot wrap a model offloaded" in msg, msg
            assert "hr.data_parallel(model)" in msg, msg  # the supported way
        elif case == "hr_data_parallel_first":
            assert "which hr.data_parallel already wraps: offload first" in msg, msg
        elif case == "fsdp1_first":
            assert "wrapped by FullyShardedDataParallel (FSDP1)" in msg, msg
            assert "fully_shard" in msg, msg
        else:
            where = "the model" if case == "ddp_first" else "its submodule '0'"
            assert f"hr.offload got {where}, wrapped by DistributedDataParallel" in msg, msg
            assert "model = hr.data_parallel(model)" in msg, msg
            assert "before accelerator.prepare" in msg, msg


def test_listing_and_forward_inspect_no_frames(monkeypatch):
    # DDP's forward and fully_shard are told apart without walking the stack: with FSDP2
    # imported and a process group up, a training loop's parameter listing, forward and
    # backward of an offloaded model inspect no frames
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_init  # noqa: F401

    model = _offload(_net())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        calls = []
        real = sys._getframe

        def counting(depth=0):
            calls.append(depth)
            return real(depth + 1)

        monkeypatch.setattr(sys, "_getframe", counting)
        names = [n for n, _ in model.named_parameters()]
        params = list(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        monkeypatch.undo()
        assert calls == []
        assert len(names) == len(params) == 6
    finally:
        dist.destroy_process_group()


def test_data_parallel_wrapper_then_offload_is_refused():
    """``torch.nn.DataParallel`` (single process; on the CPU it runs the module as is) around
    the model, or inside it: refused by hr.offload, nothing changed."""
    model = _net()
    for target in (nn.DataParallel(model), nn.Sequential(nn.DataParallel(model))):
        with pytest.raises(RuntimeError, match="wrapped by torch.nn.DataParallel"):
            hr.offload(target, device="cpu", store="cpu")
    assert not any(hasattr(m, "_headroom_offload") for m in model.modules())


@pytest.mark.parametrize("kind", ["torch", "host"])
def test_an_optimizer_built_before_offload_steps_exactly_or_is_refused(store, kind):
    # A torch.optim optimizer over parameters whose objects hr.offload keeps (host memory)
    # steps them exactly; one over parameters it replaced (a master on disk), or a
    # HostOptimizer (which planned its step for where they rested), is refused at step()
    # before anything changes. Both trained silently wrong before.
    def make_opt(m):
        if kind == "torch":
            return torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        return hr.HostOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)

    model, ref = _net(), _net()
    early = make_opt(model)
    _offload(model, store)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    if kind == "torch" and store == "cpu":
        _train(model, early)
        _train(ref, ref_opt)
        got, want = model.state_dict(), ref.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        return
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="(built before hr.offload|after this HostOptimizer"
                                           " was built).*Nothing was stepped"):
        _train(model, early, steps=1)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # the fix the message names: an optimizer built now trains exactly
    model.zero_grad(set_to_none=True)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)
    _train(model, opt)
    _train(ref, ref_opt)
    got, want = model.state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_optimizer_that_stepped_before_offload_is_refused_after_it_and_unoffload(tmp_path):
    # The step hooks remember per optimizer that it holds nothing offloaded (an unrelated
    # optimizer costs no walk over its parameters): that verdict must not survive hr.offload
    # of its parameters, nor the refusal of the parameters it replaced survive hr.unoffload.
    other = _offload(_net())  # the hooks are installed, verdicts are kept
    model = _net()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    _train(model, early, steps=1)  # an unrelated optimizer: verdict "nothing guarded"
    _offload(model, DiskStore(tmp_path / "s", threads=2))
    for offloaded in (True, False):  # while offloaded, then after hr.unoffload
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match="built before hr.offload.*Nothing was stepped"):
            _train(model, early, steps=1)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        if offloaded:
            model.zero_grad(set_to_none=True)
            hr.unoffload(model)
    del other


def test_a_host_optimizer_across_unoffload_is_refused_and_its_state_moves(store):
    # Kept across hr.unoffload it would step for where the parameters rested before; the fix
    # its message names (a new HostOptimizer, the state moved over) trains on exactly.
    model, ref = _net(), _net()
    _offload(model, store)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    _train(model, opt)
    _train(ref, ref_opt)
    model = hr.unoffload(model)
    with pytest.raises(RuntimeError, match="unoffloaded after this HostOptimizer was built.*"
                                           "load_state_dict"):
        _train(model, opt, steps=1)
    model.zero_grad(set_to_none=True)
    new = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)
    new.load_state_dict(opt.state_dict())
    _train(model, new)
    _train(ref, ref_opt)
    got, want = model.state_dict(), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
