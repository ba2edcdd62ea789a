"""``p`` and ``p.grad`` of offloaded parameters behave like tensors to torch's utilities.

With ``store="cpu"`` (fp32) they are host tensors; with a DiskStore they are StoreTensors whose
ops run on the values on disk. Either way clip_grad_norm_ (every foreach mode and norm type),
clip_grad_value_, get_total_norm/clip_grads_with_norm_, GradScaler.unscale_, p.grad.norm(),
isfinite, p.data, p.detach() and state_dict() give bitwise what plain PyTorch gives.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.store import DiskStore
from headroom.transfer import StoreTensor

STORES = ["cpu", "disk"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)],
                         nn.Linear(8, 2))


def _pair(store: str, tmp_path, x: torch.Tensor | None = None):
    """A plain model and an offloaded copy, both after one backward on the same batch."""
    ref, m = _model(), _model()
    st = DiskStore(tmp_path / "s") if store == "disk" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(m, device="cpu", store=st)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) if x is None else x
    for model in (ref, m):
        model(x).square().sum().backward()
    return list(ref.parameters()), list(m.parameters())


def _grads_equal(rs, ps) -> None:
    for r, p in zip(rs, ps, strict=True):
        assert torch.equal(p.grad.clone(), r.grad)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_grad_norm_is_bitwise_plain_torch(store, foreach, norm_type, tmp_path):
    rs, ps = _pair(store, tmp_path)
    want = torch.nn.utils.clip_grad_norm_(rs, 0.5, norm_type, foreach=foreach)
    got = torch.nn.utils.clip_grad_norm_(ps, 0.5, norm_type, foreach=foreach)
    assert type(got) is torch.Tensor and got.device.type == "cpu"  # never meta
    assert torch.equal(got, want) and float(want) > 0.5  # it clipped
    _grads_equal(rs, ps)


@pytest.mark.parametrize("store", STORES)
def test_total_norm_clip_value_and_reads_are_bitwise(store, tmp_path):
    rs, ps = _pair(store, tmp_path)
    n_ref = torch.nn.utils.get_total_norm([r.grad for r in rs])
    n = torch.nn.utils.get_total_norm([p.grad for p in ps])
    assert torch.equal(n, n_ref) and n.item() == n_ref.item()
    torch.nn.utils.clip_grads_with_norm_(rs, 0.3, n_ref)
    torch.nn.utils.clip_grads_with_norm_(ps, 0.3, n)
    _grads_equal(rs, ps)
    for foreach in (None, True, False):
        torch.nn.utils.clip_grad_value_(rs, 0.01, foreach=foreach)
        torch.nn.utils.clip_grad_value_(ps, 0.01, foreach=foreach)
        _grads_equal(rs, ps)
    for r, p in zip(rs, ps, strict=True):
        assert torch.equal(p.grad.norm(), r.grad.norm())
        assert bool(torch.isfinite(p.grad).all())
        assert torch.equal(p.data.clone(), r.data) and torch.equal(p.detach().clone(), r.detach())
        assert torch.equal(p.grad.view(-1), r.grad.view(-1))
        assert p.grad.device == p.device and p.grad.dtype == p.dtype


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("bad", [False, True])
def test_grad_scaler_unscale_and_inf_check(store, bad, tmp_path):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    if bad:
        x[0, 0] = float("inf")  # a non-finite gradient the scaler must find
    ref, m = _model(), _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(m, device="cpu", store=DiskStore(tmp_path / "s") if store == "disk" else "cpu")
    found = []
    for model in (ref, m):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        scaler.scale(model(x).square().sum()).backward()
        scaler.unscale_(opt)
        state = scaler._per_optimizer_states[id(opt)]
        found.append(sum(v.item() for v in state["found_inf_per_device"].values()))
    assert found[0] == found[1] == float(bad)
    for r, p in zip(ref.parameters(), m.parameters(), strict=True):
        # same bits, nan included
        assert torch.equal(p.grad.clone().view(torch.int32), r.grad.view(torch.int32))


def test_disk_master_and_grad_are_store_tensors_that_write_through(tmp_path):
    rs, ps = _pair("disk", tmp_path)
    p = ps[0]
    assert isinstance(p, StoreTensor) and isinstance(p.grad, StoreTensor)
    assert isinstance(p, nn.Parameter) and p.device.type == "cpu"
    p.grad.mul_(2.0)  # an in-place op lands in the store
    assert torch.equal(p.grad.clone(), rs[0].grad * 2.0)
    with torch.no_grad():
        p.data.copy_(torch.ones_like(rs[0]))
    assert torch.equal(p.clone(), torch.ones_like(rs[0]))
    v = p.grad.view(-1)  # a view of values on disk: writing into it writes the store
    assert isinstance(v, StoreTensor) and v.shape == (64,)
    v.mul_(2.0)
    p.grad[0].zero_()
    want = rs[0].grad * 4.0
    want[0] = 0
    assert torch.equal(p.grad.clone(), want)
    with pytest.raises(RuntimeError, match="replace the store's tensor"):
        p.grad.set_(torch.zeros(8, 8))


def test_rebinding_data_of_a_disk_master_writes_the_store(tmp_path):
    # p.data = x swaps a tensor's implementation below the dispatcher: it must not leave the
    # store with the old values while reads of p see ... the old values too (a silent no-op).
    rs, ps = _pair("disk", tmp_path)
    p = ps[1]
    p.data = torch.full_like(rs[1], 3.0)
    assert isinstance(p, StoreTensor)
    assert torch.equal(p.clone(), torch.full_like(rs[1], 3.0))
    model = p._source  # the value the next forward fetches comes from the store
    assert torch.equal(model.read()[0], torch.full_like(rs[1], 3.0))
    with pytest.raises(RuntimeError, match="shape is fixed by the store"):
        p.data = torch.zeros(3)


@pytest.mark.parametrize("store", STORES)
def test_state_dict_pickling_and_deepcopy_give_values(store, tmp_path):
    ref, m = _model(), _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(m, device="cpu", store=DiskStore(tmp_path / "s") if store == "disk" else "cpu")
    sd, want = m.state_dict(), ref.state_dict()
    assert sd.keys() == want.keys()
    for k, v in want.items():
        assert type(sd[k]) is torch.Tensor and torch.equal(sd[k], v), k
    buf = io.BytesIO()
    torch.save([p.detach() for p in m.parameters()], buf)
    buf.seek(0)
    for a, r in zip(torch.load(buf), ref.parameters(), strict=True):
        assert type(a) is torch.Tensor and torch.equal(a, r.detach())
    for p, r in zip(m.parameters(), ref.parameters(), strict=True):
        c = copy.deepcopy(p)
        assert type(c) is nn.Parameter and torch.equal(c.detach(), r.detach())


def test_grad_taken_before_zero_grad_refuses_to_read(tmp_path):
    _, ps = _pair("disk", tmp_path)
    opt = hr.HostOptimizer(ps, torch.optim.AdamW, lr=1e-2)
    g = ps[0].grad
    opt.zero_grad()
    assert ps[0].grad is None
    with pytest.raises(RuntimeError, match="was cleared"):
        g.norm()


def test_clipping_on_disk_reads_each_gradient_once_and_writes_none(tmp_path):
    """Clipping reads every gradient for the norm; the scaling is recorded, not written, and
    applied as each gradient is next read: the same bits as plain torch, one read and one write
    of every gradient fewer. flush() writes the scaled values out."""
    rs, ps = _pair("disk", tmp_path)
    store = ps[0].grad._source.binding.store
    writes, reads = [], []
    real_w, real_r = store.write, store.read
    store.write = lambda h, src: (writes.append(h.key), real_w(h, src))[1]
    store.read = lambda h, out=None: (reads.append(h.key), real_r(h, out))[1]
    try:
        n = torch.nn.utils.clip_grad_norm_(ps, 1e9)  # clamped to 1: nothing to scale
        assert writes == [] and float(n) < 1e9
        assert sorted(reads) == sorted(f"{k}.grad" for k in _keys(ps))
        reads.clear()
        torch.nn.utils.clip_grad_norm_(ps, 1e-3)  # clips: read once each, written never
        torch.nn.utils.clip_grad_value_(ps, 1e-5)  # a second in-place op, read and written
        assert sorted(reads) == sorted(2 * [f"{k}.grad" for k in _keys(ps)])
        assert len(writes) == len(ps)
    finally:
        del store.write, store.read
    for p in ps:  # scaled once more, deferred: read back in order
        p.grad.mul_(torch.tensor(0.5))
    torch.nn.utils.clip_grad_norm_(rs, 1e-3)
    torch.nn.utils.clip_grad_value_(rs, 1e-5)
    for r in rs:
        r.grad.mul_(torch.tensor(0.5))
    _grads_equal(rs, ps)
    h = ps[0].grad._source.binding.grad_handle
    store.flush()  # the file now holds the scaled gradient
    assert h.key not in store._scales
    assert torch.equal(store.read(h).result(), rs[0].grad)


def _keys(ps):
    return [p._source.handle.key for p in ps]


@pytest.mark.parametrize("where", ["clip", "step"])
@pytest.mark.parametrize("error", [OSError, KeyboardInterrupt])
def test_failure_while_clipping_on_disk_propagates_and_redoing_the_step_is_exact(error, where,
                                                                                  tmp_path):
    """An error (or Ctrl-C) reading a gradient for the norm, or reading a clipped gradient in
    the step (where its recorded scaling is applied), reaches the caller; parameters are
    untouched, and zero_grad + the same batch again give plain PyTorch's step."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    ref, m = _model(), _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(m, device="cpu", store=DiskStore(tmp_path / "s"))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = hr.HostOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2)
    before = [p.detach().clone() for p in m.parameters()]
    m(x).square().sum().backward()
    store = next(iter(m.parameters()))._source.store
    name = "read" if where == "clip" else "read_rows"
    real, calls = getattr(store, name), []

    def failing(h, *args, **kw):
        calls.append(h.key)
        if len(calls) == 3:
            raise error("injected")
        return real(h, *args, **kw)

    if where == "step":
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    setattr(store, name, failing)
    try:
        with pytest.raises(error, match="injected"):
            if where == "clip":
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
            else:
                opt.step()
    finally:
        delattr(store, name)
    assert all(torch.equal(p.detach().clone(), b) for p, b in zip(m.parameters(), before,
                                                                  strict=True))
    opt.zero_grad()
    for model, o in ((ref, ref_opt), (m, opt)):
        model(x).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        o.step()
        o.zero_grad()
    for r, p in zip(ref.parameters(), m.parameters(), strict=True):
        assert torch.equal(p.detach().clone(), r.detach())
