"""hr.linear_cross_entropy under torch.compile(fullgraph=True): one graph, eager's numbers."""

from __future__ import annotations

import pytest
import torch

import headroom as hr

C, D = 300, 16

CASES = {
    "one_pass": {},                                   # gradients formed in forward
    "slices": {"slice_size": 64},
    "none": {"reduction": "none", "label_smoothing": 0.1},
    "lm": {"shift": True, "softcap": 3.0, "z_loss": 1e-3, "return_lse": True,
           "return_accuracy": True, "return_predictions": True},
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, D, generator=g).requires_grad_()
    w = torch.randn(C, D, generator=g).requires_grad_()
    b = torch.randn(C, generator=g).requires_grad_()
    y = torch.randint(0, C, (2, 40), generator=g)
    y[0, :5] = -100
    return x, w, b, y


def _run(fn, kw):
    x, w, b, y = _inputs()
    out = fn(x, w, y, b, **kw)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    total = loss.sum() + (out.lse.sum() if kw.get("return_lse") else 0)
    grads = torch.autograd.grad(total, (x, w, b))
    extra = [] if isinstance(out, torch.Tensor) else [t for t in out[2:] if t is not None]
    return [loss, *extra, *grads]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_equals_eager(case, backend):
    kw = CASES[case]
    torch._dynamo.reset()
    compiled = torch.compile(hr.linear_cross_entropy, fullgraph=True, backend=backend)
    got, want = _run(compiled, kw), _run(hr.linear_cross_entropy, kw)
    for a, e in zip(got, want, strict=True):
        if backend == "aot_eager":
            assert torch.equal(a, e)
        else:
            torch.testing.assert_close(a, e)


def test_one_graph_and_label_check_inside():
    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(hr.linear_cross_entropy, fullgraph=True, backend=counts)
    x, w, b, y = _inputs()
    fn(x, w, y, b).backward()
    assert counts.frame_count == 1
    y[1, 3] = C  # out of range: the eager check runs inside the operator
    with pytest.raises(ValueError, match="outside \\[0, 300\\)"):
        fn(x, w, y, b)


ML_CASES = {
    "bce": {"loss": "bce", "pos_weight": 2.0},                      # gradients formed in forward
    "hinge_none": {"loss": "squared_hinge", "reduction": "none"},
    "softmax": {"loss": "softmax", "slice_size": 64},
    "ignored": {"loss": "bce", "ignore_rows": True},
}


def _ml_run(fn, kw):
    x, w, b, _ = _inputs()
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 4, (80,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    indices = torch.cat([torch.randperm(C, generator=g)[:int(k)] for k in counts])
    kw = dict(kw)
    if kw.pop("ignore_rows", False):
        kw["ignore_rows"] = torch.arange(80).reshape(2, 40) % 7 == 0
    out = fn(x, w, (offsets, indices), bias=b, **kw)
    return [out, *torch.autograd.grad(out.sum(), (x, w, b))]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(ML_CASES))
def test_linear_loss_fullgraph_equals_eager(case, backend):
    torch._dynamo.reset()
    compiled = torch.compile(hr.linear_loss, fullgraph=True, backend=backend)
    got, want = _ml_run(compiled, ML_CASES[case]), _ml_run(hr.linear_loss, ML_CASES[case])
    for a, e in zip(got, want, strict=True):
        if backend == "aot_eager":
            assert torch.equal(a, e)
        else:
            torch.testing.assert_close(a, e)


def test_linear_loss_function_or_list_targets_are_refused_under_compile():
    torch._dynamo.reset()
    x, w, _, _ = _inputs()
    rows = [torch.tensor([1, 2])] * 80
    with pytest.raises(Exception, match="CSR tuple of tensors"):
        torch.compile(hr.linear_loss, fullgraph=True, backend="eager")(x, w, rows)
    torch._dynamo.reset()
    offsets = torch.arange(81)
    with pytest.raises(Exception, match="loss function does not compile"):
        torch.compile(hr.linear_loss, fullgraph=True, backend="eager")(
            x, w, (offsets, offsets[:80] % C), loss=lambda s, t, c: s.sum())


def _transposed(t):
    """``t``'s values in a non-contiguous leaf (its last two dimensions' strides swapped)."""
    return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()


@pytest.mark.parametrize("fn", ["linear_cross_entropy", "linear_loss"])
@pytest.mark.parametrize("case", ["one_pass", "slices"])
def test_non_contiguous_inputs_under_inductor(case, fn):
    # the real gradients are contiguous whatever the inputs' strides; a fake one that copied
    # x's strides failed inductor's stride assertion
    torch._dynamo.reset()
    x, w, b, y = _inputs()
    kw = {} if case == "one_pass" else {"slice_size": 64}
    if fn == "linear_loss":
        offsets = torch.arange(81)
        y = (offsets, offsets[:80] * 7 % C)
        kw["loss"] = "bce" if case == "one_pass" else "softmax"
    f = getattr(hr, fn)
    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    results = []
    for call in (compiled, f):
        xt, wt = _transposed(x), _transposed(w)
        assert not (xt.is_contiguous() or wt.is_contiguous())
        loss = call(xt, wt, y, bias=b, **kw)
        results.append([loss, *torch.autograd.grad(loss * 3, (xt, wt))])
    for a, e in zip(*results, strict=True):
        torch.testing.assert_close(a, e)


class _Head(torch.nn.Module):
    """A model's loss whose float options are attributes (symbolic under dynamic=True)."""

    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(w.detach()), torch.nn.Parameter(b.detach())
        self.softcap, self.z_loss, self.eps, self.pos_weight = 3.0, 1e-3, 0.1, 2.0

    def forward(self, h, y, offsets=None):
        if offsets is not None:
            return hr.linear_loss(h, self.w, (offsets, y), bias=self.b, loss="bce",
                                  pos_weight=self.pos_weight)
        return hr.linear_cross_entropy(h, self.w, y, self.b, shift=True, softcap=self.softcap,
                                       z_loss=self.z_loss, label_smoothing=self.eps)


@pytest.mark.parametrize("fn", ["linear_cross_entropy", "linear_loss"])
def test_float_options_under_dynamic_true(fn):
    # dynamic=True makes the float attributes symbolic: the option checks compare them (a
    # math.isfinite of one broke the graph, so fullgraph=True failed)
    torch._dynamo.reset()
    x, w, b, y = _inputs()
    head = _Head(w, b)
    compiled = torch.compile(head, fullgraph=True, dynamic=True, backend="aot_eager")
    for seq in (40, 33):
        h = x[:, :seq].detach()
        args = (h.reshape(-1, D), torch.arange(2 * seq) * 7 % C, torch.arange(2 * seq + 1)) \
            if fn == "linear_loss" else (h, y[:, :seq])
        got, want = compiled(*args), head(*args)
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got, head.w)[0],
                           torch.autograd.grad(want, head.w)[0])


_CACHED_RUN = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import headroom as hr
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 40, 16, generator=g).transpose(-1, -2).contiguous().transpose(-1, -2)
w = torch.randn(300, 16, generator=g)
y = torch.randint(0, 300, (2, 40), generator=g)
x.requires_grad_()
loss = torch.compile(hr.linear_cross_entropy, fullgraph=True, backend="inductor")(x, w, y)
loss.backward()
print("ran", hr.linear_cross_entropy(x.detach(), w, y).item() == loss.item())
"""


def test_inductor_disk_cache_from_another_version_is_not_reused(tmp_path):
    # inductor caches a compiled graph on disk under its operators' names, not their fake
    # kernels: an older headroom whose fake gradient copied x's strides left a graph that the
    # fixed code loaded and failed on (a stride assertion) until the operators were renamed per
    # source. Here the older code is this source with that fake kernel; both share one cache.
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import headroom
    src = Path(headroom.__file__).parent
    old = tmp_path / "old"
    shutil.copytree(src, old / "headroom", ignore=shutil.ignore_patterns("__pycache__"))
    compiled = old / "headroom" / "heads" / "_compiled.py"
    text = compiled.read_text()
    dense = "return torch.empty_like(t, memory_format=torch.contiguous_format)"
    assert dense in text
    compiled.write_text(text.replace(dense, "return torch.empty_like(t)"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
           "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0", "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    run = [sys.executable, "-c", _CACHED_RUN]
    first = subprocess.run([*run, str(old)], env=env, capture_output=True, text=True, timeout=300)
    assert "stride" in first.stderr  # the older code's own failure: its fake kernel is wrong
    assert any((tmp_path / "cache").rglob("*.py"))  # and it left a compiled graph on disk
    second = subprocess.run([*run, str(src.parent)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "ran True" in second.stdout
