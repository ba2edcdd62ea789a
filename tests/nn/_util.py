"""Helpers for the headroom.nn tests: saved-bytes measurement and plain-vs-converted runs."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn

from tests.nn._measure import NumpyBuffers, forward_bytes


def saved_bytes(fn: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor] = ()):
    """Bytes autograd saves while ``fn`` runs, deduplicated by storage.

    Storages of ``exclude`` (parameters and buffers, resident anyway) are not counted.
    Returns ``(bytes, output)``; the saved tensors stay alive as long as ``output`` does.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def kept_bytes(fn: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor] = ()):
    """Bytes of storages created while ``fn`` runs that the graph still holds afterwards, NumPy
    buffers included (see :func:`tests.nn._measure.forward_bytes`).

    Unlike :func:`saved_bytes`, no saved-tensor hooks are installed, so converted layers take
    their fast path (PyTorch's own nodes under headroom's hooks). The output's storage and those
    of ``exclude`` are not counted. Returns ``(bytes, output)``.
    """
    kept, _, out = forward_bytes(fn, exclude, track_peak=False)
    return kept, out


def model_state(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def twin(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """A plain deep copy and a converted deep copy of ``model``, with identical values."""
    import headroom as hr

    plain = copy.deepcopy(model)
    ours = hr.convert(copy.deepcopy(model), inplace=True)
    return plain, ours


def set_trainable(model: nn.Module, which: Callable[[str, nn.Parameter], bool]) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(which(name, p))


def step(model: nn.Module, x: torch.Tensor, *, input_grad: bool, seed: int = 0, hooks: bool = True):
    """One forward+backward; returns (output, loss, input grad, param grads, bytes).

    ``hooks=True`` measures saved bytes with saved-tensor hooks (converted layers then take their
    autograd.Function path); ``hooks=False`` measures kept bytes without any (the fast path).
    """
    x = x.detach().clone().requires_grad_(input_grad)
    torch.manual_seed(seed)
    if hooks:
        nbytes, out = saved_bytes(lambda: model(x), model_state(model))
    else:
        # The input is cloned inside, so that a layer keeping its input counts it.
        nbytes, out = kept_bytes(lambda: model(x.clone()), model_state(model))
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    loss = (out.float() * weights).sum()
    grads = {}
    if loss.requires_grad:
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return out.detach(), loss.detach(), (x.grad if input_grad else None), grads, nbytes


def _assert_results_equal(out_a, gx_a, g_a, out_b, gx_b, g_b) -> None:
    """Outputs, input grads (or None) and parameter grads (by name), bitwise."""
    assert torch.equal(out_a, out_b)
    assert (gx_a is None) == (gx_b is None)
    if gx_a is not None:
        assert torch.equal(gx_a, gx_b)
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        assert torch.equal(g_a[k], g_b[k]), k


def assert_same(a, b) -> None:
    """Two :func:`step` results: output, loss, input grad and parameter grads, bitwise."""
    out_a, loss_a, gx_a, g_a, _ = a
    out_b, loss_b, gx_b, g_b, _ = b
    assert torch.equal(loss_a, loss_b)
    _assert_results_equal(out_a, gx_a, g_a, out_b, gx_b, g_b)


def allocated_bytes(fn: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of every CPU allocation made while ``fn`` runs that is still alive after it, the
    output's storage excepted: PyTorch's CPU allocator as its profiler reports it (tensors made
    outside the dispatcher too, such as a generator's ``get_state()``), plus NumPy buffers.
    Returns ``(bytes, output)``."""
    from torch.profiler import ProfilerActivity, profile

    # The profiler first: its first start loads much, which tracemalloc would trace.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with NumpyBuffers() as np_bufs:
            out = fn()
    events = prof.profiler.kineto_results.events()
    net = sum(e.nbytes() for e in events if e.name() == "[memory]")
    return net - out.untyped_storage().nbytes() + np_bufs.bytes, out


def first_steps(model: nn.Module, x: torch.Tensor, case: str, steps: int = 2):
    """``steps`` forward+backward steps of ``model`` (input grad in case ``input``), each
    ``(kept bytes, forward peak, output, input grad, parameter grads)``, bytes measured by
    :func:`tests.nn._measure.forward_bytes` (dispatch mode and NumPy buffers)."""
    results = []
    for seed in range(steps):
        xi = x.detach().clone().requires_grad_(case == "input")
        torch.manual_seed(seed)
        kept, peak, out = forward_bytes(lambda xi=xi: model(xi), model_state(model))
        grads = {}
        if out.requires_grad:
            weights = torch.linspace(-1, 1, out.numel()).view_as(out)
            (out * weights).sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((kept, peak, out.detach(), xi.grad, grads))
    return results


def assert_steps_equal(a, b) -> None:
    """Outputs, input grads and parameter grads of :func:`first_steps` results, bitwise."""
    for (_, _, out_a, gx_a, g_a), (_, _, out_b, gx_b, g_b) in zip(a, b, strict=True):
        _assert_results_equal(out_a, gx_a, g_a, out_b, gx_b, g_b)
