"""Values written into a parameter between steps are what HostOptimizer steps next.

A bf16 parameter stepped by `hr.HostOptimizer` has an fp32 master; the step writes the
parameter from it. A write into the parameter (``copy_``, ``nn.init.*``, ``p.data`` ops and
rebinding, ``load_state_dict``, ``vector_to_parameters``, ``hr.load_weights``) must become
the master's: the reference is a fresh HostOptimizer built on a plain bf16 model holding the
written values (its master is made from them). SGD without momentum has no state, so the two
must then train bitwise alike. Parameters in memory (HostOptimizer's own host master), offloaded
to host memory and to a `DiskStore` (state in memory and on disk), and a `HugeClassifier`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.store import DiskStore
from headroom.transfer import StoreTensor

D = 8
BF16 = torch.bfloat16


def _values(p: torch.Tensor, k: int) -> torch.Tensor:
    return (torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / k - 1).to(p.dtype)


def _seeded(fn):
    def run(m):
        torch.manual_seed(5)
        for p in m.parameters():
            fn(p)
    return run


def _each(fn):
    def run(m):
        for p in m.parameters():
            fn(p)
    return run


WRITES = {
    "copy_": _each(lambda p: p.copy_(_values(p, 7))),
    "mul_": _each(lambda p: p.mul_(3.0)),
    "data.mul_": _each(lambda p: p.data.mul_(0.5)),
    "data.copy_": _each(lambda p: p.data.copy_(_values(p, 3))),
    "data =": _each(lambda p: setattr(p, "data", _values(p, 5))),
    "init.normal_": _seeded(nn.init.normal_),
    "init.zeros_": _seeded(nn.init.zeros_),
    "vector_to_parameters": lambda m: torch.nn.utils.vector_to_parameters(
        torch.linspace(-1, 1, sum(p.numel() for p in m.parameters())).to(BF16), m.parameters()),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: _values(v, 9) for k, v in m.state_dict().items()}),
}


def _model() -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(D, D), nn.Linear(D, D)).to(BF16)


def _read(p: torch.Tensor) -> torch.Tensor:
    return p.stored().clone() if isinstance(p, StoreTensor) else p.detach().clone()


def _train(model, opt, steps, *, final=False):
    for i in range(steps):
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(i)).to(BF16)
        with opt.final_backward(final):  # steps start during backward
            model(x).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


SETUPS = ["in memory", "offload cpu", "offload disk", "offload disk, state on disk"]
# An in-place write through ``p.data`` of a plain parameter leaves no trace (its version
# counter does not move): HostOptimizer's own host master does not follow it (documented in
# docs/host_optimizer.md); offloaded masters' ``.data`` shares their version counter.
UNSEEN = {("in memory", "data.mul_"), ("in memory", "data.copy_")}


def _cases(writes):
    return [pytest.param(k, w) for k in SETUPS for w in writes if (k, w) not in UNSEEN]


def _setup(kind, tmp_path):
    model = _model()
    state_store = None
    if kind != "in memory":
        store = "cpu" if kind == "offload cpu" else DiskStore(tmp_path / "w")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # device="cpu": saves nothing, says so
            hr.offload(model, device="cpu", store=store, blocks=list(model))
        if kind.endswith("state on disk"):
            state_store = DiskStore(tmp_path / "state")
    kw = {} if state_store is None else {"state_store": state_store}
    return model, hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, **kw)


@pytest.mark.parametrize(("kind", "write"), _cases(WRITES))
def test_bf16_master_follows_a_write(kind, write, tmp_path):
    model, opt = _setup(kind, tmp_path)
    _train(model, opt, 2)  # masters hold more than the bf16 values now
    with torch.no_grad():
        WRITES[write](model)
    ref = _model()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters(), strict=True):
            r.copy_(_read(p))
    ref_opt = hr.HostOptimizer(ref.parameters(), torch.optim.SGD, lr=0.1)
    _train(model, opt, 2)
    _train(ref, ref_opt, 2)
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(_read(p), r.detach())


@pytest.mark.parametrize(("kind", "write"), _cases(["copy_", "data.mul_"]))
def test_write_before_a_final_backward(kind, write, tmp_path):
    """Steps started during backward (``final_backward``) start from the written values."""
    model, opt = _setup(kind, tmp_path)
    _train(model, opt, 2, final=True)
    with torch.no_grad():
        WRITES[write](model)
    ref = _model()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters(), strict=True):
            r.copy_(_read(p))
    ref_opt = hr.HostOptimizer(ref.parameters(), torch.optim.SGD, lr=0.1)
    _train(model, opt, 2, final=True)
    _train(ref, ref_opt, 2)
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(_read(p), r.detach())


@pytest.mark.parametrize("kind", ["offload disk", "offload disk, state on disk"])
def test_load_weights_after_training_is_stepped(kind, tmp_path):
    """hr.load_weights into a model HostOptimizer has stepped: the next step starts there."""
    from safetensors.torch import save_file

    model, opt = _setup(kind, tmp_path)
    _train(model, opt, 2)
    new = {k: _values(v, 11).contiguous() for k, v in _model().state_dict().items()}
    save_file(new, str(tmp_path / "w.safetensors"))
    hr.load_weights(model, tmp_path / "w.safetensors")
    ref = _model()
    ref.load_state_dict(new)
    ref_opt = hr.HostOptimizer(ref.parameters(), torch.optim.SGD, lr=0.1)
    _train(model, opt, 2)
    _train(ref, ref_opt, 2)
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(_read(p), r.detach())


@pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_bf16_huge_classifier_write_is_stepped(kind, tmp_path):
    C = 50

    def head_and_opt(store, values=None):
        head = hr.HugeClassifier(C, D, device="cpu", store=store, dtype=BF16, slice_size=16)
        if values is not None:
            head.load_weight(values)
        return head, hr.HostOptimizer(head.parameters(), torch.optim.SGD, lr=0.5)

    def train(head, opt, steps):
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            head(torch.randn(6, D, generator=g).to(BF16),
                 torch.randint(0, C, (6,), generator=g)).backward()
            opt.step()
            opt.zero_grad()

    head, opt = head_and_opt("cpu" if kind == "cpu" else DiskStore(tmp_path / "h"))
    train(head, opt, 2)
    with torch.no_grad():
        head.weight.mul_(0.5)
    ref, ref_opt = head_and_opt("cpu", head.read_weight())
    train(head, opt, 2)
    train(ref, ref_opt, 2)
    assert torch.equal(head.read_weight(), ref.read_weight())


@pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_bf16_row_sparse_master_of_rows_not_yet_stepped(kind, tmp_path):
    """Lazy Adam (row_sparse) on a bf16 head: rows stepped first at a later step start from
    their own values (their master was not made at the first step). With betas=(0, 0) Adam
    keeps no history, so lazy and dense steps are the same update."""
    C = 60

    def run(row_sparse):
        store = "cpu" if kind == "cpu" else DiskStore(tmp_path / f"h{row_sparse}")
        torch.manual_seed(0)
        head = hr.HugeClassifier(C, D, device="cpu", store=store, dtype=BF16, sample_rate=0.3,
                                 generator=torch.Generator().manual_seed(1))
        opt = hr.HostOptimizer(head.parameters(), torch.optim.Adam, lr=0.5, betas=(0.0, 0.0),
                               row_sparse=[head.weight] if row_sparse else ())
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            head(torch.randn(6, D, generator=g).to(BF16),
                 torch.randint(0, C, (6,), generator=g)).backward()
            opt.step()
            opt.zero_grad()
        return head.read_weight()

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [5, 3_000_001])  # one piece; several, with a short last one
def test_follow_is_exact(dtype, n):
    """`follow_` against torch's own rounding: unchanged where the value holds the master
    rounded (the fast check's bit arithmetic included: ties, signed zeros, subnormals,
    infinities, a NaN), the value's where it does not."""
    from headroom.optim._follow import follow_

    g = torch.Generator().manual_seed(0)
    m = torch.randn(n, generator=g) * 3
    m[::97] = -0.0
    m[1::89] = float("inf")
    m[2::83] = 1e-40
    m[3::79] = 3.4e38
    m[4::73] = 1.0 + 2.0 ** -8  # a tie of bf16's rounding
    m[n // 2] = float("nan")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    v = m.to(dtype)
    kept = m.clone()
    assert not follow_(kept, v)
    assert torch.equal(kept.view(torch.int32), m.view(torch.int32))
    w = v.clone()
    idx = torch.randint(0, n, (max(1, n // 100),), generator=g)
    w[idx] = torch.randn(idx.numel(), generator=g).to(dtype)
    got = m.clone()
    assert follow_(got, w)
    want = torch.where(v.view(bits) == w.view(bits), m, w.to(torch.float32))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize(("kind", "write"), _cases(["copy_", "data.copy_", "data ="]))
def test_write_between_backward_and_step(kind, write, tmp_path):
    """Written after backward, before step: the step starts from the written value (SGD:
    ``written - lr * grad``, rounded to bf16), as plain PyTorch's optimizers do."""
    model, opt = _setup(kind, tmp_path)
    _train(model, opt, 1)
    ref = _model()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters(), strict=True):
            r.copy_(_read(p))
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(9)).to(BF16)
    for m in (model, ref):
        m(x).float().pow(2).sum().backward()
    grads = [r.grad.float() for r in ref.parameters()]
    with torch.no_grad():
        WRITES[write](model)
        WRITES[write](ref)
    opt.step()
    for r, p, g in zip(ref.parameters(), model.parameters(), grads, strict=True):
        want = (r.detach().float() - 0.1 * g).to(BF16)
        assert torch.equal(_read(p), want)


@pytest.mark.gpu
@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_write_on_an_accelerator_is_stepped(dtype, final):
    """Parameters on an accelerator have host masters: a write into the device parameter
    (through it, or `.data = t`) is where the next step starts, with and without final_backward."""
    from tests.conftest import accelerator_type

    dev = accelerator_type()

    def build():
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(D, D), nn.Linear(D, D)).to(dev, dtype)

    def train(m, opt, steps):
        for i in range(steps):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(i)).to(dev, dtype)
            with opt.final_backward(final):
                m(x).float().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    model = build()
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    train(model, opt, 2)
    with torch.no_grad():
        model[0].weight.copy_(_values(model[0].weight, 7))
        model[1].weight.mul_(0.5)
    ref = build()
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters(), strict=True):
            r.copy_(p)
    ref_opt = hr.HostOptimizer(ref.parameters(), torch.optim.SGD, lr=0.1)
    train(model, opt, 2)
    train(ref, ref_opt, 2)
    for r, p in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.detach().cpu(), r.detach().cpu())
