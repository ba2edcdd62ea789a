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
