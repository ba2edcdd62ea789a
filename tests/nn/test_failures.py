"""What survives an exception (a Ctrl-C too) in the forward or backward of a converted model:
everything. The next steps train bitwise like PyTorch and keep as little as a fresh model.

headroom.nn keeps no per-step state that a failure could leave half-done: the holders of the
failed forward's activations die with its graph (the lists that track them hold weak
references), and Dropout's backward puts the random generator back in a ``finally``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import headroom as hr
from tests.nn._models import ZOO, trainable
from tests.nn._util import first_steps


class _Boom(Exception):
    pass


def _models():
    build, _ = ZOO["resnet_like"]
    torch.manual_seed(0)
    plain = nn.Sequential(build(), nn.ReLU(), nn.Dropout(0.5), nn.Linear(5, 5))
    return plain, hr.convert(copy.deepcopy(plain))


def _fail_forward(model: nn.Module, x: torch.Tensor, error: type[BaseException]) -> None:
    """A forward that raises in the middle (after the first block ran)."""

    def hook(module, args, output):
        raise error("injected")

    handle = model[0][4].register_forward_hook(hook)
    try:
        with pytest.raises(error):
            model(x.clone().requires_grad_(True))
    finally:
        handle.remove()


def _fail_backward(model: nn.Module, x: torch.Tensor, error: type[BaseException], where: str):
    """A backward that raises before (``where="before"``) or after the dropout's backward."""
    xi = x.clone().requires_grad_(True)
    h = model[1](model[0](xi))
    if where == "after":
        h.register_hook(lambda g: (_ for _ in ()).throw(error("injected")))
    out = model[3](model[2](h))
    if where == "before":
        out.register_hook(lambda g: (_ for _ in ()).throw(error("injected")))
    with pytest.raises(error):
        out.square().sum().backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("error", [_Boom, KeyboardInterrupt])
@pytest.mark.parametrize("when", ["forward", "backward-before", "backward-after"])
def test_training_after_a_failure_is_exact_and_keeps_as_little(error, when):
    plain, ours = _models()
    fresh = copy.deepcopy(ours)
    x = torch.randn(4, 3, 16, 16)
    for m in (plain, ours, fresh):
        trainable(m, "input")
    expected = first_steps(fresh, x, "input", steps=1)[0][0]
    for m in (plain, ours):
        torch.manual_seed(5)
        if when == "forward":
            _fail_forward(m, x, error)
        else:
            _fail_backward(m, x, error, when.split("-")[1])
    for m in (plain, ours):
        trainable(m, "all")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, ours)]
    for step in range(2):
        for m, opt in zip((plain, ours), opts, strict=True):
            torch.manual_seed(10 + step)
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for (n, a), b in zip(plain.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    for m in (plain, ours):
        trainable(m, "input")
    kept = first_steps(ours, x, "input", steps=1)[0][0]
    assert kept == expected  # nothing of the failed step stays pending or held


def test_random_stream_after_a_failed_backward_is_pytorchs():
    """A backward that fails after Dropout's replay leaves the generator where PyTorch's
    leaves it (the replay restores it in a finally)."""
    plain, ours = _models()
    x = torch.randn(4, 3, 16, 16)
    after = []
    for m in (plain, ours):
        torch.manual_seed(7)
        _fail_backward(m, x, _Boom, "after")
        after.append(torch.rand(5))
    assert torch.equal(after[0], after[1])
