"""HostOptimizer: bitwise equality with torch.optim on CPU, overlap, accumulation, clipping."""

from __future__ import annotations

import copy
import gc
import threading
import time
import weakref

import pytest
import torch

import headroom as hr
from tests.optim._models import (
    assert_params_equal,
    assert_state_equal,
    batch,
    loss_fn,
    make_model,
    train,
)

STEPS = 50


def _pair(**kw):
    """Reference (torch.optim.AdamW, fused CPU kernel) and HostOptimizer on identical models."""
    a, b = make_model(), make_model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    opt = hr.HostOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **kw)
    return a, ref, b, opt


@pytest.mark.parametrize("overlap", [True, False])
def test_adamw_50_steps_bitwise(overlap):
    a, ref, b, opt = _pair(overlap=overlap)
    train(a, ref, range(STEPS))
    train(b, opt, range(STEPS), final=True)
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)
    assert isinstance(opt, torch.optim.Optimizer)


def test_default_single_tensor_path_matches_torch_default():
    # NOTE: fused and single-tensor AdamW differ in the last bit, so each is compared with its
    # own torch counterpart; fused=False selects torch's default CPU path.
    a, b = make_model(), make_model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt = hr.HostOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2, fused=False)
    train(a, ref, range(20))
    train(b, opt, range(20))
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)


def _count_early(opt) -> list[int]:
    """Count parameters whose step ran during backward (inside final_backward)."""
    early = [0]
    inner = opt._step_entries

    def spy(batch, **kw):
        if kw.get("early", False):
            early[0] += len(batch)
        return inner(batch, **kw)

    opt._step_entries = spy
    return early


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("schedule", [(2, 2, 3), (1, 1, 1, 2), (4, 4, 2, 4), (3, 1, 4, 1, 2)])
def test_any_micro_batch_schedule_is_bitwise(schedule, final):
    """Epochs whose last step has fewer (or more) micro-batches: only a backward declared
    final steps early, so every schedule gives the result of overlap=False, with the default
    overlap=True whether or not the loop declares its final backward passes."""
    a, ref, b, opt = _pair(overlap=True, bucket_bytes=1024)
    c = make_model()
    off = hr.HostOptimizer(c.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           overlap=False)
    early = _count_early(opt)
    for i, accum in enumerate(schedule):
        train(a, ref, range(i, i + 1), accum=accum)
        train(b, opt, range(i, i + 1), accum=accum, final=final)
        train(c, off, range(i, i + 1), accum=accum, final=final)
    assert_params_equal(a, b)
    assert_params_equal(c, b)
    assert_state_equal(ref, opt)
    n = len(list(b.parameters()))
    # with final_backward every step ran during its final backward; without, none early
    assert early[0] == (n * len(schedule) if final else 0)


def test_clipping_bitwise_and_refuses_final_backward():
    a, ref, b, opt = _pair(overlap=True)
    na = train(a, ref, range(STEPS), accum=2, clip=0.05)
    nb = train(b, opt, range(STEPS), accum=2, clip=0.05)
    assert all(torch.equal(x, y) for x, y in zip(na, nb, strict=True))
    assert any(float(n) > 0.05 for n in na)  # clipping really happened
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)
    before = [p.detach().clone() for p in b.parameters()]
    with pytest.raises(RuntimeError, match="clip_grad_norm_"), opt.final_backward():
        loss_fn(b, 0).backward()  # refused at the `with`, before any backward or step
    assert all(torch.equal(x, p) for x, p in zip(before, b.parameters(), strict=True))
    assert all(p.grad is None for p in b.parameters())


def test_final_backward_steps_during_backward():
    _, _, b, opt = _pair(overlap=True, bucket_bytes=1024)
    before = [p.detach().clone() for p in b.parameters()]
    with opt.final_backward():
        loss_fn(b, 1).backward()
    assert opt._overlap.busy, "no step was started during backward"
    opt._wait()
    moved = [not torch.equal(x, p) for x, p in zip(before, b.parameters(), strict=True)]
    assert all(moved), "parameters were not updated before step()"
    opt.step()
    opt.zero_grad()


def test_worker_thread_ends_with_an_optimizer_dropped_without_close():
    _, _, b, opt = _pair(overlap=True, bucket_bytes=1024)
    before = set(threading.enumerate())
    with opt.final_backward():
        loss_fn(b, 1).backward()
    mine = [t for t in threading.enumerate()
            if t not in before and t.name.startswith("hr-host-step")]
    assert mine, "no worker thread was started"
    opt.step()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    for t in mine:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in mine)


def test_a_plain_backward_never_steps_early():
    _, _, b, opt = _pair(overlap=True, bucket_bytes=1024)
    early = _count_early(opt)
    train(b, opt, range(3), accum=2)  # no final_backward
    assert early[0] == 0


def test_final_backward_misuse_is_an_error():
    _, _, b, opt = _pair(overlap=True)
    with opt.final_backward():
        loss_fn(b, 5).backward()
    with pytest.raises(RuntimeError, match="clip_grad_norm_"):
        opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    opt._overlap.clips = False  # pretend this optimizer never clipped, to check the other misuses
    with opt.final_backward():
        loss_fn(b, 6).backward()
    with pytest.raises(RuntimeError, match="another gradient"):
        loss_fn(b, 7).backward()
    with pytest.raises(RuntimeError, match="already used"), opt.final_backward():
        pass
    opt.step()
    with opt.final_backward():
        loss_fn(b, 8).backward()
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match="changed"):
        opt.step()


def test_failed_final_backward_says_what_stepped():
    _, _, b, opt = _pair(overlap=True, bucket_bytes=1024)
    fail = [True]

    def boom(grad):
        if fail[0]:
            raise RuntimeError("boom")
        return grad

    x, y = batch(3)
    h = b.emb(x)
    h.register_hook(boom)  # the last gradient of backward: every parameter's came before it
    out = h
    for blk in b.blocks:
        out = blk(out)
    loss = ((b.head(out) - y) ** 2).mean()
    with pytest.raises(RuntimeError, match="boom") as info, opt.final_backward():
        loss.backward()
    assert any("already taken this step" in n for n in getattr(info.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="restore the last checkpoint"):
        opt.zero_grad()
    opt.step()  # finishes the step; the optimizer is usable again
    opt.zero_grad()
    train(b, opt, range(1), final=True)


def test_overlap_hparam_change_detected_when_the_worker_starts_late():
    a, ref, b, opt = _pair(overlap=True)
    drain = opt._overlap._drain

    def late():
        time.sleep(0.2)  # the worker gets to the step only after lr was changed below
        drain()

    opt._overlap._drain = late
    loss_fn(a, 8).backward()
    with opt.final_backward():
        loss_fn(b, 8).backward()
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match="changed"):
        opt.step()
    # the early steps used the lr of their launch, as the error says
    ref.step()
    opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"]
    assert_params_equal(a, b)


def test_lr_scheduler_and_param_groups():
    a, b = make_model(), make_model()

    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if "norm" not in n]},
                {"params": [p for n, p in m.named_parameters() if "norm" in n], "lr": 3e-3,
                 "weight_decay": 0.0}]

    ref = torch.optim.AdamW(groups(a), lr=1e-2, fused=True)
    opt = hr.HostOptimizer(groups(b), torch.optim.AdamW, lr=1e-2)
    sa = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=[2e-2, 5e-3], total_steps=30)
    sb = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 5e-3], total_steps=30)
    train(a, ref, range(25), sched=sa)
    train(b, opt, range(25), sched=sb)
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)
    assert sb.get_last_lr() == sa.get_last_lr()


@pytest.mark.parametrize(
    "cls,kw",
    [
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
        (torch.optim.Adagrad, {"lr": 0.05}),
        (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
        (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}),
    ],
)
def test_other_optimizers_bitwise(cls, kw):
    a, b = make_model(), make_model()
    # HostOptimizer's default: torch's fused kernel for Adam, AdamW, Adagrad, else cls() itself
    fused = {"fused": True} if cls in (torch.optim.Adagrad, torch.optim.Adam) else {}
    ref = cls(a.parameters(), **kw, **fused)
    opt = hr.HostOptimizer(b.parameters(), cls, **kw)
    train(a, ref, range(10), accum=2)
    train(b, opt, range(10), accum=2)
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)


def test_state_dict_round_trip_with_plain_torch():
    a, ref, b, opt = _pair()
    train(a, ref, range(5))
    train(b, opt, range(5))
    # a HostOptimizer loads a plain optimizer's state dict and vice versa
    c = make_model()
    c.load_state_dict(a.state_dict())
    opt2 = hr.HostOptimizer(c.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(a, ref, range(5, 10))
    train(c, opt2, range(5, 10))
    assert_params_equal(a, c)
    assert_state_equal(ref, opt2)
    d = make_model()
    d.load_state_dict(b.state_dict())
    ref2 = torch.optim.AdamW(d.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref2.load_state_dict(opt.state_dict())
    train(d, ref2, range(5, 10))
    assert_params_equal(a, d)


def test_state_dict_keyed_by_parameter_name_loads():
    """torch.distributed.checkpoint's set_state_dict hands load_state_dict a state dict keyed
    by parameter names (torch.optim zips them with the groups' order); so does HostOptimizer.
    A key the groups do not list is an error naming it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    a, ref, b, opt = _pair()
    train(a, ref, range(5))
    named = get_optimizer_state_dict(a, ref)
    assert "emb.weight" in named["state"]  # names, not indices
    c = make_model()
    c.load_state_dict(a.state_dict())
    opt2 = hr.HostOptimizer(c.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(copy.deepcopy(named))
    train(a, ref, range(5, 10))
    train(c, opt2, range(5, 10))
    assert_params_equal(a, c)
    assert_state_equal(ref, opt2)
    # Indices written as strings (a JSON round trip) load as well.
    sd = ref.state_dict()
    opt2.load_state_dict({"state": {str(k): v for k, v in sd["state"].items()},
                          "param_groups": sd["param_groups"]})
    assert_state_equal(ref, opt2)
    bad = copy.deepcopy(named)
    bad["state"]["no.such.weight"] = bad["state"].pop("emb.weight")
    bad["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match="state for 'no.such.weight', which its param_groups"):
        opt2.load_state_dict(bad)
    assert opt2.param_groups[0]["lr"] == 1e-2  # refused before anything changed
    assert_state_equal(ref, opt2)


def test_zero_grad_set_to_none_false_matches_torch():
    a, ref, b, opt = _pair()
    for s in range(6):
        loss_fn(a, s).backward()
        loss_fn(b, s).backward()
        ref.step()
        opt.step()
        ref.zero_grad(set_to_none=False)
        opt.zero_grad(set_to_none=False)
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)


def test_bf16_params_fp32_master_through_the_mover():
    """Parameters that are not fp32 get an fp32 host master; the update is the fp32 one."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(torch.bfloat16)
    master = [p.detach().float().clone() for p in lin.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, fused=True)
    opt = hr.HostOptimizer(lin.parameters(), torch.optim.AdamW, lr=1e-2)
    for s in range(5):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(s)).bfloat16()
        lin(x).float().square().sum().backward()
        grads = [opt.grad(p) for p in lin.parameters()]
        assert all(g.dtype == torch.float32 for g in grads)
        # moved to the host at once; param.grad reads that fp32 host gradient
        assert all(torch.equal(p.grad.clone(), g)
                   for p, g in zip(lin.parameters(), grads, strict=True))
        for m, g in zip(master, grads, strict=True):
            m.grad = g
        ref.step()
        opt.step()
        opt.zero_grad()
    for p, m in zip(lin.parameters(), master, strict=True):
        assert torch.equal(p, m.bfloat16())
    assert all(torch.equal(m, e.master) for m, e in zip(master, opt._order, strict=True))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_lands_gradient_copies_still_in_flight(set_to_none):
    """On an accelerator a gradient's copy to the host is only queued when backward hands it
    over; zero_grad must let it land first, or it lands afterwards, into the next sum.
    Emulated on the CPU with a mover that lands copies only when synchronized."""
    from headroom.transfer import Mover

    class Deferred(Mover):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.queued = []

        def push_grad(self, grad, b, *, accumulate):
            b.has_grad = True
            self.queued.append((grad.detach().clone(), b.grad_handle, accumulate))

        def synchronize(self):
            while self.queued:
                self._land(*self.queued.pop(0))

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(torch.bfloat16)
    fresh = copy.deepcopy(lin)
    opt = hr.HostOptimizer(lin.parameters(), torch.optim.AdamW, lr=1e-2)
    opt._mover = Deferred("cpu", opt._host)
    x1, x2 = (torch.randn(3, 8, generator=torch.Generator().manual_seed(s)).bfloat16()
              for s in (1, 2))
    lin(x1).float().square().sum().backward()  # a step that is skipped
    opt.zero_grad(set_to_none=set_to_none)
    lin(x2).float().square().sum().backward()
    fresh(x2).float().square().sum().backward()  # the second backward alone
    for p, q in zip(lin.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(opt.grad(p), q.grad.float())


# ---------------------------------------------------------------------- bad input
def test_mixed_devices_rejected():
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        hr.HostOptimizer([p, q], torch.optim.AdamW)


class _CudaOnly(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.device.type == "cpu":
                    raise RuntimeError("this kernel needs a CUDA tensor")


def test_optimizer_that_cannot_run_on_cpu_rejected():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="cannot step on CPU tensors"):
        hr.HostOptimizer([p], _CudaOnly)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        hr.HostOptimizer([p], object)
    with pytest.raises(ValueError, match="LBFGS"):
        hr.HostOptimizer([p], torch.optim.LBFGS)
    with pytest.raises(ValueError, match="row_sparse needs Adam"):
        hr.HostOptimizer([p], torch.optim.SGD, lr=0.1, row_sparse=[p])


def test_not_picklable_with_a_clear_message():
    import copy

    opt = hr.HostOptimizer([torch.nn.Parameter(torch.zeros(3))], torch.optim.AdamW)
    with pytest.raises(TypeError, match="headroom.save"):
        copy.deepcopy(opt)


# ---------------------------------------------------------------------- state on disk
@pytest.mark.parametrize("accum,clip", [(1, None), (2, 0.05)])
def test_disk_state_50_steps_bitwise(tmp_path, accum, clip):
    a, b = make_model(), make_model()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    # NOTE: tiny slices, so every 2-D parameter takes several slices per step.
    opt = hr.HostOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           state_store=hr.DiskStore(tmp_path / "state"), slice_bytes=256)
    train(a, ref, range(STEPS), accum=accum, clip=clip)
    train(b, opt, range(STEPS), accum=accum, clip=clip)
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)
    files = [f for f in (tmp_path / "state").glob("*.bin") if "headroom-scratch" not in f.name]
    # exp_avg and exp_avg_sq on disk, each with the spare the next step writes
    assert len(files) == 2 * 2 * len(list(b.parameters()))
    undo = [f for f in (tmp_path / "state").glob("*.bin") if "headroom-scratch" in f.name]
    assert len(undo) == len(list(b.parameters()))  # where a step keeps the old masters
    assert not any(isinstance(v, torch.Tensor) and v.numel() > 1
                   for st in opt.state.values() for v in st.values())  # none in memory


def test_store_full_fails_the_step_whole(tmp_path):
    from headroom.store import StoreFullError

    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    # room for the state of about half the parameters
    store = hr.DiskStore(tmp_path / "state", max_bytes=n * 8 // 2)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, state_store=store)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, 0).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(StoreFullError, match="Nothing was updated"):
        opt.step()
    assert all(torch.equal(x, p) for x, p in zip(before, model.parameters(), strict=True))
    assert opt.state_dict()["state"] == {}
    assert store.used_bytes == 0
    # gradients are intact too: with a big enough store the same step gives the plain result
    opt2 = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                            state_store=hr.DiskStore(tmp_path / "big"))
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    for p, g in zip(ref_model.parameters(), grads, strict=True):
        p.grad = g
    ref.step()
    opt.close()
    opt2.step()
    assert_params_equal(ref_model, model)


def test_disk_state_needs_elementwise_optimizer(tmp_path):
    p = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="element-wise"):
        hr.HostOptimizer([p], torch.optim.Adafactor, state_store=hr.DiskStore(tmp_path))


# ---------------------------------------------------------------------- row-sparse (lazy Adam)
def test_row_sparse_equals_dense_when_every_row_has_a_gradient(tmp_path):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(40, 8))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2, fused=True)
    opt = hr.HostOptimizer([b], torch.optim.AdamW, lr=1e-2, row_sparse=[b], slice_bytes=64)
    for s in range(10):
        g = torch.randn(40, 8, generator=torch.Generator().manual_seed(s))
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert torch.equal(a, b)
    assert_state_equal(ref, opt)


def test_row_sparse_touches_only_rows_with_gradients():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 8)
    opt = hr.HostOptimizer(emb.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                           row_sparse=[emb.weight])
    rows = torch.tensor([3, 7, 19])
    sub = torch.nn.Parameter(emb.weight.detach()[rows].clone())  # lazy Adam's definition
    ref = torch.optim.AdamW([sub], lr=1e-2, weight_decay=0.1, fused=True)
    before = emb.weight.detach().clone()
    for s in range(5):
        idx = rows[torch.randint(0, 3, (12,), generator=torch.Generator().manual_seed(s))]
        idx = torch.cat([idx, rows])  # every chosen row appears at least once
        emb(idx).square().sum().backward()
        sub.grad = emb.weight.grad[rows].clone()
        ref.step()
        opt.step()
        opt.zero_grad()
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(emb.weight.detach()[untouched], before[untouched])
    assert torch.equal(emb.weight.detach()[rows], sub.detach())
    st = opt.state_dict()["state"][0]
    assert torch.equal(st["exp_avg"][rows], ref.state[sub]["exp_avg"])
    assert not st["exp_avg"][untouched].any() and not st["exp_avg_sq"][untouched].any()


def test_float64_parameters_keep_float64_state(tmp_path):
    a = make_model().double()
    b = make_model().double()
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    opt = hr.HostOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=hr.DiskStore(tmp_path / "s"), slice_bytes=512)
    for s in range(5):
        for m, o in ((a, ref), (b, opt)):
            x, y = batch(s)
            ((m(x) - y.double()) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.float64


def test_row_sparse_store_resident_uses_grad_rows(tmp_path):
    """A store-resident weight (as the huge classifier keeps it) steps only binding.grad_rows."""
    from headroom.transfer import bind

    torch.manual_seed(0)
    weight = torch.randn(64, 8)
    store = hr.DiskStore(tmp_path / "w")
    p = torch.nn.Parameter(torch.empty(64, 8, device="meta"))
    b = bind(p, store.put("w", weight), grad_handle=store.alloc("w.grad", (64, 8), torch.float32))
    rows = torch.tensor([2, 5, 40, 41])
    sub = torch.nn.Parameter(weight[rows].clone())
    ref = torch.optim.AdamW([sub], lr=1e-2, fused=True)
    opt = hr.HostOptimizer([p], torch.optim.AdamW, lr=1e-2, row_sparse=[p], slice_bytes=64)
    for s in range(4):
        g = torch.zeros(64, 8)
        g[rows] = torch.randn(4, 8, generator=torch.Generator().manual_seed(s))
        store.write(b.grad_handle, g).result()
        b.has_grad, b.grad_rows = True, rows
        sub.grad = g[rows]
        ref.step()
        opt.step()
        opt.zero_grad()
        assert not b.has_grad and b.grad_rows is None  # consumed
    now = store.read(b.handle).result()
    assert torch.equal(now[rows], sub.detach())
    keep = torch.ones(64, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(now[keep], weight[keep])


def test_add_param_group_later_and_closure():
    a, b = make_model(), make_model()
    head_a, head_b = list(a.head.parameters()), list(b.head.parameters())
    rest_a = [p for n, p in a.named_parameters() if not n.startswith("head")]
    rest_b = [p for n, p in b.named_parameters() if not n.startswith("head")]
    ref = torch.optim.AdamW(rest_a, lr=1e-2, fused=True)
    opt = hr.HostOptimizer(rest_b, torch.optim.AdamW, lr=1e-2)
    train(a, ref, range(3))
    train(b, opt, range(3))
    ref.add_param_group({"params": head_a, "lr": 5e-3})
    opt.add_param_group({"params": head_b, "lr": 5e-3})
    for s in range(3, 8):
        ref.step(lambda s=s: loss_fn(a, s).backward())
        loss = opt.step(lambda s=s: loss_fn(b, s).backward() or loss_fn(b, s))
        assert loss is not None
        ref.zero_grad()
        opt.zero_grad()
    assert_params_equal(a, b)
    assert_state_equal(ref, opt)


def test_disk_state_dict_loads_into_plain_torch(tmp_path):
    a, b = make_model(), make_model()
    opt = hr.HostOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2,
                           state_store=hr.DiskStore(tmp_path / "s"))
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    train(a, ref, range(4))
    train(b, opt, range(4))
    c = make_model()
    c.load_state_dict(b.state_dict())
    plain = torch.optim.AdamW(c.parameters(), lr=1e-2, fused=True)
    plain.load_state_dict(opt.state_dict())
    train(a, ref, range(4, 8))
    train(c, plain, range(4, 8))
    assert_params_equal(a, c)
    loss_fn(b, 9).backward()
    assert torch.equal(opt.grad(b.head.weight), b.head.weight.grad)
