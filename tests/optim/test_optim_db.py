"""Every optimizer of torch's own optimizer test database (``optim_db``), on its CPU inputs,
through `hr.HostOptimizer` with parameters in host memory and with parameters and state on disk.

Each case (an optimizer input, plain and with each implementation it supports: ``foreach``,
``fused``, ``differentiable``) runs 5 steps on a tiny model with plain torch and with
``HostOptimizer`` over the same model offloaded by ``hr.offload``. It must end bitwise equal,
or be refused: with torch's own error where torch refuses it too, else with headroom's reason
for that case (`_headroom_reason`). A refusal for any other reason fails.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import headroom as hr

STEPS = 5
ACCUM = 2  # backward passes per step of the models with sparse gradients (appended sums)
FUSED_DEFAULT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
NOT_ELEMENTWISE = (torch.optim.Muon, torch.optim.Adafactor)
INFOS = {info.optim_cls.__name__: info for info in optim_db}


def _cases(info) -> list[tuple[str, dict, str]]:
    """(description, kwargs, model kind) of each CPU case of ``info``."""
    kinds = (["sparse only"] if info.only_supports_sparse_grads else
             ["matrix"] if info.optim_cls is torch.optim.Muon else
             ["dense", "sparse"] if info.supports_sparse else ["dense"])
    out = []
    for inp in info.optim_inputs_func(device="cpu"):
        variants = [(inp.desc, inp.kwargs)]
        variants += [(f"{inp.desc} & {impl}", {**inp.kwargs, impl: True})
                     for impl in info.supported_impls]
        out += [(desc, kw, kind) for desc, kw in variants for kind in kinds]
    return out


class _Sparse(torch.nn.Module):
    """An embedding with sparse gradients (rows repeated within and across backward passes),
    and a dense layer after it unless ``sparse_only``."""

    def __init__(self, sparse_only: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 3, sparse=True)
        self.lin = None if sparse_only else torch.nn.Linear(3, 2)

    def forward(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        out = (e * w).pow(2).sum()
        return out if self.lin is None else out + self.lin(e).pow(2).sum()


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "matrix":  # Muon steps 2-D parameters only
        return torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(4, 2, bias=False))
    if kind.startswith("sparse"):
        return _Sparse(sparse_only=kind == "sparse only")
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _loss(model: torch.nn.Module, kind: str, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    if kind.startswith("sparse"):
        return model(torch.randint(0, 8, (6,), generator=g), torch.randn(6, 3, generator=g))
    return model(torch.randn(5, 3, generator=g)).pow(2).sum()


def _train(model, opt, kind: str, closure: bool) -> None:
    for step in range(STEPS):
        if closure:
            def run(step=step):
                opt.zero_grad()
                loss = _loss(model, kind, step, 0)
                loss.backward()
                return loss
            opt.step(run)
        else:
            for micro in range(ACCUM if kind.startswith("sparse") else 1):
                _loss(model, kind, step, micro).backward()
            opt.step()
        opt.zero_grad()


class _Split:
    """Torch's reference where HostOptimizer chose the fused kernel: fused for dense
    gradients, the class's default implementation for sparse ones (which fused refuses)."""

    def __init__(self, cls, model, kw):
        sparse = [model.emb.weight]
        dense = [] if model.lin is None else list(model.lin.parameters())
        self.opts = [cls(sparse, **copy.deepcopy(kw))]
        self.opts += [cls(dense, **copy.deepcopy({**kw, "fused": True}))] if dense else []

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


def _reference(cls, kw: dict, kind: str, closure: bool) -> torch.nn.Module | BaseException:
    model = _model(kind)
    try:
        if cls in FUSED_DEFAULT and "fused" not in kw and "foreach" not in kw:
            opt = (_Split(cls, model, kw) if kind.startswith("sparse")
                   else cls(model.parameters(), **copy.deepcopy({**kw, "fused": True})))
        else:
            opt = cls(model.parameters(), **copy.deepcopy(kw))
        _train(model, opt, kind, closure)
    except Exception as e:  # noqa: BLE001 - torch's own refusal, compared below
        return e
    return model


def _headroom(cls, kw: dict, kind: str, placement: str, tmp) -> torch.nn.Module | BaseException:
    model = _model(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu" with store="cpu": mechanics only
        store = hr.DiskStore(tmp / "params") if placement == "disk" else "cpu"
        hr.offload(model, device="cpu", store=store)
    state = hr.DiskStore(tmp / "state") if placement == "disk" else "cpu"
    opt = None
    try:
        opt = hr.HostOptimizer(model.parameters(), cls, state_store=state, slice_bytes=48,
                               **copy.deepcopy(kw))
        _train(model, opt, kind, False)
    except Exception as e:  # noqa: BLE001 - a refusal, checked by the caller
        return e
    finally:
        if opt is not None:
            opt.close()
    return model


def _headroom_reason(cls, kw: dict, kind: str, placement: str, *, torch_steps: bool
                     ) -> str | None:
    """What headroom refuses where torch steps (or before torch's own refusal would show), in
    words its error contains."""
    if cls is torch.optim.LBFGS:
        return "LBFGS cannot run as a HostOptimizer"
    if kw.get("differentiable"):
        return "differentiable=True) records its step in autograd's graph"
    if placement == "disk" and cls in NOT_ELEMENTWISE:
        return "element-wise"
    if placement == "disk" and kind.startswith("sparse") and kw.get("momentum", 0) and \
            torch_steps:
        return "keeps state for a sparse gradient as sparse tensors (momentum_buffer)"
    return None


def _outcome(info, desc, kw, kind, placement, tmp) -> tuple[str, str | None]:
    """("exact" | "refused: torch" | "refused: headroom", a failure message or None)."""
    cls = info.optim_cls
    case = f"{cls.__name__} {desc!r} ({kind}, {placement})"

    def refused(why: str) -> tuple[str, str | None]:
        got = _headroom(cls, kw, kind, placement, tmp)
        ok = isinstance(got, Exception) and why in str(got)
        return "refused: headroom", None if ok else f"{case}: expected refusal {why!r}, got {got!r}"

    # refused when HostOptimizer is built, whatever torch does with it
    why = _headroom_reason(cls, kw, kind, placement, torch_steps=False)
    if why is not None:
        return refused(why)
    ref = _reference(cls, kw, kind, info.step_requires_closure)
    if isinstance(ref, Exception):
        first = str(ref).splitlines()[0]
        got = _headroom(cls, kw, kind, placement, tmp)
        ok = isinstance(got, Exception) and first in str(got)
        return "refused: torch", None if ok else f"{case}: torch refused ({first}), got {got!r}"
    why = _headroom_reason(cls, kw, kind, placement, torch_steps=True)
    if why is not None:
        return refused(why)
    got = _headroom(cls, kw, kind, placement, tmp)
    if isinstance(got, Exception):
        return "error", f"{case}: refused for no listed reason: {type(got).__name__}: {got}"
    values = got.state_dict()  # the offloaded model's values, read from its store
    bad = [n for n, p in ref.state_dict().items() if not torch.equal(p, values[n])]
    return "exact", None if not bad else f"{case}: {bad} differ from torch's"


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["host", "disk"])
@pytest.mark.parametrize("name", sorted(INFOS))
def test_optim_db_cpu_inputs(name, placement, tmp_path):
    info = INFOS[name]
    counts: dict[str, int] = {}
    failures = []
    for i, (desc, kw, kind) in enumerate(_cases(info)):
        outcome, failure = _outcome(info, desc, kw, kind, placement, tmp_path / str(i))
        counts[outcome] = counts.get(outcome, 0) + 1
        if failure is not None:
            failures.append(failure)
    assert not failures, "\n".join(failures)
    assert sum(counts.values()) > 0
