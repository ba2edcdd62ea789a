"""Parameter offload API: state dicts, unoffload, describe, modes, dtypes and clear errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from headroom.store import DiskStore, HostStore, StoreFullError
from headroom.transfer import StoreTensor, binding
from tests.conftest import DEVICES, accelerator_type
from tests.residency._models import (
    CNN,
    StoreStep,
    Transformer,
    cnn_batch,
    cnn_loss,
    lm_batch,
    lm_loss,
    values,
)


def _train_side_by_side(*pairs, steps: int = 3) -> torch.Tensor:
    """Train each (model, optimizer) pair on the same LM batches; returns the last batch."""
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        b = lm_batch(g)
        for m, o in pairs:
            torch.manual_seed(1)
            lm_loss(m, b).backward()
            o.step()
            o.zero_grad()
    return b


def _offload(model, store="cpu", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hr.offload(model, device="cpu", store=store, **kw)


@pytest.fixture(params=["cpu", "disk"])
def store(request, tmp_path):
    return "cpu" if request.param == "cpu" else DiskStore(tmp_path / "s", threads=2)


def test_state_dict_round_trip(store):
    ref = Transformer(tie=True)
    model = _offload(copy.deepcopy(ref), store)
    sd = model.state_dict()
    assert set(sd) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k  # real values, not placeholders
    other = Transformer(tie=True).state_dict()
    model.load_state_dict(other)
    ref.load_state_dict(other)
    for k, v in values(model).items():
        assert torch.equal(v, other[k]), k
    ref.eval()
    model.eval()
    x, _ = lm_batch(torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_unoffload_restores_plain_parameters(store):
    ref, model = Transformer(n=3), None
    model = _offload(copy.deepcopy(ref), store)
    opt = StoreStep(model.parameters(), lr=1e-2) if isinstance(store, DiskStore) else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    b = _train_side_by_side((ref, opt_ref), (model, opt))
    st = state_of(model).store
    torch.manual_seed(1)
    lm_loss(model, b).backward()  # a gradient comes back too
    torch.manual_seed(1)
    lm_loss(ref, b).backward()
    hr.unoffload(model)
    assert st.keys() == []
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert binding(p) is None and p.device.type == "cpu"
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad), n
    assert model.head.weight is not None and not hasattr(model, "_headroom_offload")
    torch.manual_seed(1)
    assert torch.equal(lm_loss(model, b), (torch.manual_seed(1), lm_loss(ref, b))[1])
    _offload(model)  # can be offloaded again


def test_describe_lists_blocks_and_outside():
    model = _offload(Transformer(n=3, tie=True))
    text = str(hr.describe(model))
    for name in ("layers.0", "layers.2", "found automatically", "emb.weight", "tied",
                 "(prefetch+1) x largest block"):
        assert name in text, name


def test_plan_of_a_meta_model_is_the_plan_offload_runs_with(tmp_path):
    """Plans are data: computed without a store or values (a model on meta), and what
    hr.offload applies; the budget is the bytes the plan's groups add up to."""
    from dataclasses import replace

    from headroom.residency import plan_offload

    torch.manual_seed(0)
    with torch.device("meta"):
        meta = Transformer(n=3, tie=True)
    plan = plan_offload(meta, device="cpu", prefetch=2)
    model = _offload(Transformer(n=3, tie=True), DiskStore(tmp_path / "s"), prefetch=2)
    applied = hr.describe(model)
    assert applied == replace(plan, store=applied.store)
    assert [b.name for b in plan.blocks] == ["layers.0", "layers.1", "layers.2"]
    assert "emb.weight" in [p.name for p in plan.outside.params]
    block = sum(p.numel() * 4 for p in model.layers[0].parameters())
    outside = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("lay"))
    assert plan.device_budget == 3 * block + outside


def test_train_eval_and_frozen_blocks(store):
    ref = Transformer(n=4)
    model = _offload(copy.deepcopy(ref), store)
    for m in (ref, model):
        for p in m.layers[0].parameters():
            p.requires_grad_(False)
    x, y = lm_batch(torch.Generator().manual_seed(0))
    for m in (ref, model):
        m.eval()
        torch.manual_seed(0)
    assert torch.equal(model(x), ref(x))
    for m in (ref, model):
        m.train()
        torch.manual_seed(0)
        lm_loss(m, (x, y)).backward()
    for n, p in model.named_parameters():
        r = ref.get_parameter(n)
        if r.grad is None:
            assert p.grad is None, n
        else:
            b = binding(p)
            assert torch.equal(b.store.read(b.grad_handle).result(), r.grad), n
    assert not any(b.resident for b in state_of(model).blocks)


def test_compute_dtype_bf16_keeps_fp32_master_and_grads():
    ref = Transformer(n=3)
    model = _offload(copy.deepcopy(ref), compute_dtype=torch.bfloat16)
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    x, y = lm_batch(torch.Generator().manual_seed(0))
    for m in (model, ref16):
        torch.manual_seed(0)
        lm_loss(m, (x, y)).backward()
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
        # the device copy was bf16: gradients equal the bf16 model's, widened to fp32
        assert torch.equal(p.grad, ref16.get_parameter(n).grad.float()), n
        assert torch.equal(p, ref.get_parameter(n)), n  # master untouched, still fp32
    assert {s.dev.dtype for s in state_of(model).slots} == {torch.bfloat16}


def test_cpu_host_store_warns_that_it_saves_nothing():
    with pytest.warns(UserWarning, match="saves no memory"):
        hr.offload(CNN(), device="cpu", store="cpu")


def test_errors_are_clear_and_early(tmp_path):
    bad = "cuda:99" if accelerator_type() else "cuda"
    with pytest.raises(RuntimeError, match="not available"):
        hr.offload(CNN(), device=bad)
    model = _offload(CNN())
    with pytest.raises(RuntimeError, match="already offloaded.*unoffload"):
        _offload(model)
    with pytest.raises(RuntimeError, match="already offloaded"):
        _offload(nn.Sequential(model))
    with pytest.raises(StoreFullError, match="store full: budget 1000 bytes.*DiskStore"):
        _offload(CNN(), HostStore(max_bytes=1000))
    (tmp_path / "f").write_text("")
    with pytest.raises(PermissionError, match="not writable"):
        _offload(CNN(), DiskStore(tmp_path / "f" / "d"))
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point"):
        _offload(CNN(), compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="prefetch"):
        _offload(CNN(), prefetch=-1)
    m = CNN()
    with pytest.raises(ValueError, match="nested"):
        _offload(m, blocks=[m.stages, m.stages[0]])
    with pytest.raises(ValueError, match="not a submodule"):
        _offload(m, blocks=[nn.Linear(2, 2)])
    with pytest.raises(RuntimeError, match="not offloaded"):
        hr.describe(CNN())
    with pytest.raises(TypeError, match="torch.nn.Module, got NoneType"):
        hr.offload(None, device="cpu")


def test_torch_optim_on_disk_parameters_points_to_host_optimizer(tmp_path):
    model = _offload(CNN(), DiskStore(tmp_path / "s"))
    opt = torch.optim.AdamW(model.parameters())
    cnn_loss(model, cnn_batch(torch.Generator().manual_seed(0))).backward()
    with pytest.raises(RuntimeError, match="HostOptimizer"):
        opt.step()


def test_parameter_used_at_rest_is_reported():
    """A parameter object kept from before the forward and used after the backward: at rest
    the module holds the master, whose gradient would bypass the store."""
    model = _offload(Transformer(n=3))
    bias = model.layers[1].fc1.bias  # at rest: the master
    lm_loss(model, lm_batch(torch.Generator().manual_seed(0))).backward()
    with pytest.raises(RuntimeError, match=r"layers\.1\.fc1\.bias.*used while the model was"
                       r" at rest"):
        (lm_loss(model, lm_batch(torch.Generator().manual_seed(1))) + bias.sum()).backward()


def test_disk_parameters_placeholders_and_reopen(tmp_path):
    model = _offload(CNN(), DiskStore(tmp_path / "s"))
    # Masters are tensors whose values stay on disk: no bytes of their own in memory.
    assert all(isinstance(p, StoreTensor) for p in model.parameters())
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    st = state_of(model).store
    st.flush()
    with pytest.raises(RuntimeError, match="already open in this process"):
        DiskStore(tmp_path / "s")  # one live store per folder
    st.close()
    again = DiskStore(tmp_path / "s")
    assert sorted(again.keys()) == sorted(st.keys())
    again.close()


def test_meta_model_is_initialized_module_by_module(store, monkeypatch):
    def make():
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)], nn.BatchNorm1d(8))

    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = make()
    _offload(lazy, store)
    st = state_of(lazy).store
    writes = []
    real = type(st).write
    monkeypatch.setattr(type(st), "write", lambda self, h, v: (writes.append(h.key),
                                                              real(self, h, v))[1])
    sd = lazy.state_dict()
    # in host memory the initializer fills the store's own tensors: nothing is copied in
    assert len(writes) == (0 if store == "cpu" else 8)
    for k, v in eager.state_dict().items():
        assert torch.equal(sd[k], v), k
    x = torch.randn(4, 8)
    assert torch.equal(lazy(x), eager(x))


class _HalfInit(nn.Module):
    """Its reset_parameters() sets ``a`` only: ``b`` keeps no value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(4, 8))
        self.b = nn.Parameter(torch.empty(4, 8))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.a)

    def forward(self, x):
        return x @ self.a.T + x @ self.b.T


def test_meta_parameter_its_initializer_leaves_unset_is_refused(store, tmp_path):
    with torch.device("meta"):
        lazy = nn.Sequential(nn.Linear(8, 8), _HalfInit())
    _offload(lazy, store)
    with pytest.raises(RuntimeError, match=r"1\.b were created on the meta device and"
                                           " _HalfInit's initialization did not set them"):
        lazy(torch.randn(2, 8))
    assert not binding(lazy[1].b).has_value  # nothing made up, in the store's memory or not
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(8, 8), _HalfInit())
    nn.init.normal_(src[1].a)
    nn.init.normal_(src[1].b)
    from safetensors.torch import save_file

    save_file(src.state_dict(), tmp_path / "w.safetensors")
    hr.load_weights(lazy, tmp_path / "w.safetensors")
    x = torch.randn(2, 8)
    assert torch.equal(lazy(x), src(x))


class _Rebinds(nn.Linear):
    """Its initializer rebinds .data to a tensor made elsewhere, as some Hugging Face
    _init_weights do (an fp32 truncated normal, cast back)."""

    def reset_parameters(self) -> None:
        self.weight.data = nn.init.trunc_normal_(
            self.weight.data.to(torch.float64), std=0.02).to(self.weight.dtype)
        self.bias.data = torch.full_like(self.bias.data, 0.5)


def test_meta_initializer_that_rebinds_data_is_stored(store):
    torch.manual_seed(0)
    eager = nn.Sequential(_Rebinds(8, 8), nn.Linear(8, 2))
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = nn.Sequential(_Rebinds(8, 8), nn.Linear(8, 2))
    _offload(lazy, store)
    sd = lazy.state_dict()
    for k, v in eager.state_dict().items():
        assert torch.equal(sd[k], v), k
    x = torch.randn(3, 8)
    assert torch.equal(lazy(x), eager(x))


class _FailsOnce(nn.Linear):
    """Its initializer draws the weight, then fails (once): half of the module initialized."""

    failing: type[BaseException] | None = None

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if _FailsOnce.failing is not None:
            exc, _FailsOnce.failing = _FailsOnce.failing, None
            raise exc("initializer interrupted (injected)")


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_meta_initializer_interrupted_halfway_is_retried_exactly(store, exc):
    # In a host store the initializer writes the store's own memory: an exception or Ctrl-C
    # halfway leaves values there that count as none (has_value stays False); the next use
    # initializes again, with the values a CPU build draws.
    with torch.device("meta"):
        lazy = nn.Sequential(_FailsOnce(8, 8))
    _offload(lazy, store)
    _FailsOnce.failing = exc
    with pytest.raises(exc, match="injected"):
        lazy.state_dict()
    assert not binding(lazy[0].weight).has_value and not binding(lazy[0].bias).has_value
    torch.manual_seed(3)
    sd = lazy.state_dict()
    torch.manual_seed(3)
    eager = _FailsOnce(8, 8)
    for k, v in eager.state_dict().items():
        assert torch.equal(sd[f"0.{k}"], v), k
    x = torch.randn(2, 8)
    assert torch.equal(lazy(x), eager(x))


def test_unset_check_sees_a_nan_and_only_a_nan():
    from headroom.residency._meta import _still_unset

    t = torch.zeros(1000)
    assert not _still_unset(t)
    t[[3, 7]] = torch.tensor([float("inf"), float("-inf")])  # sums to NaN, holds none
    assert not _still_unset(t)
    t[500] = float("nan")
    assert _still_unset(t) and _still_unset(t.to(torch.bfloat16))
    assert not _still_unset(torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_gradients_equal_plain_on_each_device(device, prefetch):
    """Forward and backward on ``device`` with parameters resting on the host: on an
    accelerator this runs the pinned pool, side-stream copies, events and gradient copies back.
    Linear layers only, whose kernels are deterministic on accelerators too (attention and
    convolution backward kernels may not be), so the comparison stays bitwise."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(),
                                        nn.Linear(64, 16)) for _ in range(4)], nn.Linear(16, 3))
    model = copy.deepcopy(ref)
    ref.to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device=device, store="cpu", prefetch=prefetch)
    assert len(state_of(model).blocks) == 4
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second backward accumulates into the stored gradients
        x = torch.randn(8, 16, generator=g).to(device)
        for m in (ref, model):
            m(x).square().mean().backward()
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and p.grad.device.type == "cpu"
        assert torch.equal(p.grad, ref.get_parameter(n).grad.cpu()), n
    assert not any(b.resident for b in state_of(model).blocks)


class _BigEnds(nn.Module):
    """Untied embedding and head larger than a layer, plus a second stack of layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(400, 16)
        self.encoder = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(),
                                                  nn.Linear(64, 16)) for _ in range(4))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 400)

    def forward(self, x):
        h = self.emb(x)
        for m in [*self.encoder, *self.layers]:
            h = h + m(h)
        return self.head(self.norm(h))


def test_large_outside_modules_get_blocks_of_their_own(tmp_path):
    ref = _BigEnds()
    model = _offload(copy.deepcopy(ref), DiskStore(tmp_path / "s"))
    st = state_of(model)
    names = [b.name for b in st.blocks]
    assert names == ["emb", *[f"encoder.{i}" for i in range(6)],
                     *[f"layers.{i}" for i in range(4)], "head"]
    assert [s.name for s in st.rest.slots] == ["norm.weight", "norm.bias"]  # small: resident
    x = torch.randint(0, 400, (2, 5))
    with hr.track_memory() as mem:
        model(x).square().mean().backward()
    ref(x).square().mean().backward()
    largest = max(b.nbytes for b in st.blocks)
    assert mem.max_by_category["parameters"] <= 2 * largest + st.rest.nbytes
    for n, p in model.named_parameters():
        b = binding(p)
        assert torch.equal(b.store.read(b.grad_handle).result(), ref.get_parameter(n).grad), n


def test_optimizer_created_before_offload_keeps_working():
    torch.manual_seed(0)
    ref = Transformer(n=3)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before offloading
    _offload(model)
    _train_side_by_side((ref, opt_ref), (model, opt))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_recovers_after_a_failed_backward():
    model = _offload(Transformer(n=3))
    b = lm_batch(torch.Generator().manual_seed(0))
    fail = [True]

    def boom(grad):
        if fail[0]:
            raise RuntimeError("boom")

    # raises inside backward after the later blocks were fetched (the final callback is lost)
    def arm(module, args, out):
        out.register_hook(boom)

    model.layers[0].register_forward_hook(arm)
    with pytest.raises(RuntimeError, match="boom"):
        lm_loss(model, b).backward()
    fail[0] = False
    model.zero_grad()
    lm_loss(model, b).backward()  # a clean step afterwards releases everything
    st = state_of(model)
    assert not any(bl.resident for bl in st.blocks) and not st.rest.resident
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_accelerator_code_path_on_cpu_is_exact(kind, tmp_path, monkeypatch):
    """The mover's accelerator path (staging buffers, side streams, events) driven by offload
    on the CPU under the stream model (tests/_streams.py), which checks every copy's ordering;
    exact gradients over two accumulations."""
    from tests._streams import stream_model

    with stream_model(monkeypatch):
        _accelerator_code_path(kind, tmp_path)


def _accelerator_code_path(kind, tmp_path):
    torch.manual_seed(0)
    ref = Transformer(n=4, ckpt=True)
    store = "cpu" if kind == "cpu" else DiskStore(tmp_path / "s")
    model = _offload(copy.deepcopy(ref), store)
    assert state_of(model).res.mover.accelerated
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        b = lm_batch(g)
        for m in (ref, model):
            torch.manual_seed(1)
            lm_loss(m, b).backward()
    for n, p in model.named_parameters():
        bd = binding(p)
        assert torch.equal(bd.store.read(bd.grad_handle).result(), ref.get_parameter(n).grad), n


def test_disk_store_reopened_by_a_later_run_resumes(tmp_path):
    torch.manual_seed(0)
    ref = Transformer(n=3)
    first = _offload(copy.deepcopy(ref), DiskStore(tmp_path / "w"))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = StoreStep(first.parameters(), lr=1e-2)
    b = lm_batch(torch.Generator().manual_seed(0))
    for m, o in ((ref, opt_ref), (first, opt)):
        torch.manual_seed(1)
        lm_loss(m, b).backward()
        o.step()
        o.zero_grad()
    state_of(first).store.close()
    # a later run: same architecture, created without values, same directory
    with torch.device("meta"):
        later = Transformer(n=3)
    store = DiskStore(tmp_path / "w")
    _offload(later, store)
    for k, v in values(later).items():
        assert torch.equal(v, ref.get_parameter(k)), k  # resumed, not re-initialized
    torch.manual_seed(1)
    lm_loss(later, b).backward()  # gradients reuse the stored gradient files
    with pytest.raises(RuntimeError, match="in use by another offloaded model"):
        _offload(Transformer(n=3), store)
    store.close()  # one live store per folder
    with pytest.raises(ValueError, match="already holds"):
        _offload(Transformer(n=3, d=8), DiskStore(tmp_path / "w"))


def test_failed_offload_leaves_the_model_as_it_was(tmp_path):
    ref = CNN()
    model = copy.deepcopy(ref)
    with pytest.raises(StoreFullError):
        _offload(model, HostStore(max_bytes=2000))  # fails part-way through the parameters
    assert not hasattr(model, "_headroom_offload")
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert binding(p) is None and torch.equal(p, q), n
    _offload(model)  # and it can be offloaded afterwards
    x, y = cnn_batch(torch.Generator().manual_seed(0))
    cnn_loss(model, (x, y)).backward()


def test_deepcopy_gives_a_plain_cpu_copy_sharing_nothing(store):
    """An EMA copy: copy.deepcopy is a plain model with the current values, on the CPU."""
    ref = Transformer(n=3, tie=True)
    model = _offload(copy.deepcopy(ref), store)
    opt = StoreStep(model.parameters(), lr=1e-2) if isinstance(store, DiskStore) else \
        torch.optim.AdamW(model.parameters(), lr=1e-2)
    b = _train_side_by_side((ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)), (model, opt))
    keys = sorted(state_of(model).store.keys())
    ema = copy.deepcopy(model)
    assert type(ema) is Transformer and type(ema.layers[0]) is type(ref.layers[0])
    assert not hasattr(ema, "_headroom_offload") and "_headroom_role" not in ema.__dict__
    assert all(binding(p) is None and p.device.type == "cpu" for p in ema.parameters())
    assert ema.head.weight is ema.emb.weight  # ties kept
    for k, v in ref.state_dict().items():
        assert torch.equal(ema.state_dict()[k], v), k
    assert sorted(state_of(model).store.keys()) == keys  # no store key taken
    for m in (ema, ref):
        m.eval()
    with torch.no_grad():
        assert torch.equal(ema(b[0]), ref(b[0]))
    # the two go on independently: an EMA update of the copy, a step of the model
    before = values(model)
    with torch.no_grad():
        for pe in ema.parameters():
            pe.mul_(0.5)
    assert all(torch.equal(v, before[k]) for k, v in values(model).items())
    ema_now = copy.deepcopy(ema.state_dict())
    _train_side_by_side((model, opt), steps=1)
    assert all(torch.equal(v, ema_now[k]) for k, v in ema.state_dict().items())
    block = copy.deepcopy(model.layers[1])  # one block alone
    assert type(block) is type(ref.layers[1]) and not block._forward_pre_hooks
    assert torch.equal(block.qkv.weight, values(model)["layers.1.qkv.weight"])


def test_pickling_saves_the_plain_copy_and_loads_without_headroom(store, tmp_path):
    """torch.save(model) of an offloaded model: what copy.deepcopy gives (the original classes,
    the current values), loadable where headroom is not installed; copy.copy stays shallow."""
    import subprocess
    import sys

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = _offload(copy.deepcopy(ref), store)
    with torch.no_grad():
        model[0].weight.mul_(2)  # a value only the store holds
        ref[0].weight.mul_(2)
    torch.save(model, tmp_path / "m.pt")
    assert type(model) is not nn.Sequential  # the offloaded model itself is unchanged
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert type(loaded) is nn.Sequential and type(loaded[0]) is nn.Linear
    assert all(binding(p) is None for p in loaded.parameters())
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    shallow = copy.copy(model)
    assert type(shallow) is type(model) and shallow is not model
    assert shallow[0] is model[0]
    code = ("import sys; sys.modules['headroom'] = None; import torch; "
            f"m = torch.load({str(tmp_path / 'm.pt')!r}, weights_only=False); "
            "print(type(m).__name__, float(m[0].weight.detach().sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["Sequential", repr(float(ref[0].weight.detach().sum()))]


def test_deepcopy_during_forward_is_refused():
    model = _offload(Transformer(n=2))
    model.layers[1].register_forward_pre_hook(lambda m, a: copy.deepcopy(model))
    with pytest.raises(RuntimeError, match="deepcopy.*between steps"):
        model(lm_batch(torch.Generator().manual_seed(0))[0])
    copy.deepcopy(model)  # after the failed forward it copies again
