"""Writes into a HugeClassifier's store-resident weight land in the store, or are refused.

Each write a user or an initializer makes to ``head.weight`` / ``head.bias`` (in-place ops,
``.data``, ``nn.init.*``, ``vector_to_parameters``, ``module.apply``, ``load_state_dict``) is
applied to a plain module holding the same values; the store must then hold exactly the plain
module's values, and the head's next loss and gradients must be those of a head loaded with
them (`HugeClassifier.load_weight`). Host memory and a `DiskStore`, on a fresh head and after
a training step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import headroom as hr
from headroom.store import DiskStore

C, D, B = 40, 8, 12

pytestmark = pytest.mark.filterwarnings("ignore:HugeClassifier\\(device='cpu', store='cpu'\\)")


class _Plain(nn.Module):
    """The reference: a module with the head's parameter names, shapes and values."""

    def __init__(self, head: hr.HugeClassifier) -> None:
        super().__init__()
        self.weight = nn.Parameter(head.read_weight().clone())
        b = head.read_bias()
        self.bias = None if b is None else nn.Parameter(b.clone())


def _values(p: torch.Tensor, k: int) -> torch.Tensor:
    return (torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / k).to(p.dtype)


def _seeded(fn):
    def run(p, m):
        torch.manual_seed(5)
        fn(p)
    return run


def _init_all(m: nn.Module) -> None:
    torch.manual_seed(6)
    if isinstance(getattr(m, "weight", None), torch.Tensor):
        nn.init.normal_(m.weight, std=0.1)
    if isinstance(getattr(m, "bias", None), torch.Tensor):
        nn.init.uniform_(m.bias)


# name -> fn(param, module): the write, applied the same way to the head and to the reference
WRITES = {
    "copy_": lambda p, m: p.copy_(_values(p, 7)),
    "fill_": lambda p, m: p.fill_(0.25),
    "zero_": lambda p, m: p.zero_(),
    "mul_": lambda p, m: p.mul_(3.0),
    "add_": lambda p, m: p.add_(1.0),
    "clamp_": lambda p, m: p.clamp_(-0.05, 0.05),
    "view write": lambda p, m: p.view(-1)[::3].fill_(2.0),
    "data.copy_": lambda p, m: p.data.copy_(_values(p, 3)),
    "data.mul_": lambda p, m: p.data.mul_(0.5),
    "data =": lambda p, m: setattr(p, "data", _values(p, 5)),
    "init.normal_": _seeded(nn.init.normal_),
    "init.uniform_": _seeded(nn.init.uniform_),
    "init.zeros_": _seeded(nn.init.zeros_),
    "init.ones_": _seeded(nn.init.ones_),
    "init.xavier_uniform_": _seeded(nn.init.xavier_uniform_),
    "init.kaiming_uniform_": _seeded(nn.init.kaiming_uniform_),
    "init.orthogonal_": _seeded(nn.init.orthogonal_),
    "init.trunc_normal_": _seeded(nn.init.trunc_normal_),
    "vector_to_parameters": lambda p, m: torch.nn.utils.vector_to_parameters(
        torch.linspace(-1, 1, sum(q.numel() for q in m.parameters())), m.parameters()),
    "apply(init)": lambda p, m: m.apply(_init_all),
    "load_state_dict": lambda p, m: m.load_state_dict(
        {k: _values(v, 9) for k, v in m.state_dict().items()}),
}
# writes that also make sense on the 1-D bias
BIAS_WRITES = ["copy_", "fill_", "mul_", "data.copy_", "data =", "init.normal_", "init.zeros_"]


def _head(kind, tmp_path, *, bias):
    store = "cpu" if kind == "cpu" else DiskStore(tmp_path / "store")
    return hr.HugeClassifier(C, D, bias=bias, device="cpu", store=store, slice_size=16)


def _train_one_step(head):
    opt = hr.HostOptimizer(head.parameters(), torch.optim.AdamW, lr=0.1)
    head(torch.randn(B, D), torch.randint(0, C, (B,))).backward()
    opt.step()
    opt.zero_grad()


def _check_head_is(head, plain):
    assert torch.equal(head.read_weight(), plain.weight.detach())
    if plain.bias is not None:
        assert torch.equal(head.read_bias(), plain.bias.detach())
    x = torch.randn(B, D, requires_grad=True)
    y = torch.randint(0, C, (B,))
    # the same head code on the expected values, loaded through the API made for that
    ref = hr.HugeClassifier(C, D, bias=plain.bias is not None, device="cpu", slice_size=16)
    ref.load_weight(plain.weight.detach(), None if plain.bias is None else plain.bias.detach())
    xr = x.detach().clone().requires_grad_()
    loss, ref_loss = head(x, y), ref(xr, y)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(head.weight.grad, ref.weight.grad)
    # and plain PyTorch on dense logits, to rounding
    dense = F.linear(x.detach(), plain.weight.detach(),
                     None if plain.bias is None else plain.bias.detach())
    torch.testing.assert_close(loss, F.cross_entropy(dense, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", ["fresh", "trained"])
@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("write", list(WRITES))
def test_write_to_weight_lands_in_the_store(write, kind, stage, tmp_path):
    head = _head(kind, tmp_path, bias=True)
    if stage == "trained":
        _train_one_step(head)
    plain = _Plain(head)
    with torch.no_grad():
        WRITES[write](head.weight, head)
        WRITES[write](plain.weight, plain)
    _check_head_is(head, plain)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("write", BIAS_WRITES)
def test_write_to_bias_lands_in_the_store(write, kind, tmp_path):
    head = _head(kind, tmp_path, bias=True)
    plain = _Plain(head)
    with torch.no_grad():
        WRITES[write](head.bias, head)
        WRITES[write](plain.bias, plain)
    _check_head_is(head, plain)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_writes_the_store_cannot_take_are_refused(kind, tmp_path):
    head = _head(kind, tmp_path, bias=True)
    before = head.read_weight()
    with pytest.raises(RuntimeError, match="store"), torch.no_grad():
        head.weight.data = torch.zeros(C, D, dtype=torch.float64)  # the store keeps its dtype
    with pytest.raises(RuntimeError, match="store"), torch.no_grad():
        head.weight.data = torch.zeros(C + 1, D)
    with pytest.raises(RuntimeError, match="load_weight"):
        head.weight = nn.Parameter(torch.zeros(C, D))  # the loss would never read it
    with pytest.raises(RuntimeError, match="assign=True"):
        head.load_state_dict({"weight": torch.zeros(C, D), "bias": torch.zeros(C)}, assign=True)
    with pytest.raises(RuntimeError, match="store"):
        torch.nn.utils.vector_to_parameters(torch.zeros(C * D + C, dtype=torch.float64),
                                            head.parameters())
    assert torch.equal(head.read_weight(), before)
    assert isinstance(head.weight, nn.Parameter) and hr.transfer.binding(head.weight) is not None


def test_load_state_dict_round_trip_on_disk(tmp_path):
    """``state_dict()`` of a disk-backed head reads the stored values; loading one writes them."""
    head = _head("disk", tmp_path, bias=True)
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    assert torch.equal(sd["weight"], head.read_weight())
    other = hr.HugeClassifier(C, D, bias=True, device="cpu", store=DiskStore(tmp_path / "o"))
    other.load_state_dict(sd)
    assert torch.equal(other.read_weight(), head.read_weight())
    assert torch.equal(other.read_bias(), head.read_bias())


class _Injected(Exception):
    pass


@pytest.mark.parametrize("error", [_Injected, KeyboardInterrupt])
def test_a_failed_write_on_disk_leaves_the_old_values(error, tmp_path):
    """A write whose store write fails (an error, Ctrl-C) raises and changes nothing; the
    next write lands."""
    head = _head("disk", tmp_path, bias=False)
    before = head.read_weight()
    real = head.store.write

    def fail(*args, **kwargs):
        raise error("injected")

    head.store.write = fail
    with pytest.raises(error), torch.no_grad():
        head.weight.copy_(torch.zeros(C, D))
    head.store.write = real
    assert torch.equal(head.read_weight(), before)
    plain = _Plain(head)
    with torch.no_grad():
        head.weight.mul_(2.0)
        plain.weight.mul_(2.0)
    _check_head_is(head, plain)


@pytest.mark.parametrize("mode", ["before", "after"])
def test_kill_during_a_write_on_disk(mode, tmp_path, one_thread):
    """kill -9 as a write into a disk head's weight is issued leaves the old values; once it
    has completed (not flushed), the reopened head holds the written values."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.heads import _kill_write_child as child

    src = str(Path(hr.__file__).resolve().parents[1])
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(root)]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, child.__file__, str(tmp_path / "s"), mode],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["flushed"]
    torch.manual_seed(0)
    ref = child.open_head(tmp_path / "ref")  # the values the child's head was made with
    if mode == "before":  # nothing written since the flush: the store reopens clean
        head = child.open_head(tmp_path / "s")
    else:
        with pytest.warns(UserWarning, match="was not closed"):
            head = child.open_head(tmp_path / "s")
    want = ref.read_weight() if mode == "before" else child.new_weight()
    assert torch.equal(head.read_weight(), want)
