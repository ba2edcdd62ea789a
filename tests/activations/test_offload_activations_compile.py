"""hr.offload_activations under torch.compile: saved tensors of compiled graphs are offloaded,
the graphs are those of the plain compiled model, and gradients are bitwise eager's
(``aot_eager`` runs eager mode's kernels)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import headroom as hr
from headroom.activations import _offload
from tests.residency._models import Transformer

pytestmark = pytest.mark.filterwarnings(
    "ignore:hr.offload_activations with a host-memory store",
    "ignore:Using `torch.compile\\(module\\)` when there are global hooks")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model() -> Transformer:
    torch.manual_seed(0)
    m = Transformer(d=16, n=3)
    for layer in m.layers:
        layer.drop.p = 0.0  # compiled dropout draws other random numbers than eager
    return m


def _train(model, run, ctx):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for b in (2, 3, 4):  # a batch size that changes: dynamic shapes from the second step
        x = torch.randint(0, 50, (b, 6), generator=g)
        with ctx(model):  # a new context each step, as in a training loop
            loss = run(x).square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _graphs(backend="eager"):
    """Graphs dynamo makes, each then compiled by ``backend``."""
    graphs = []

    def record(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    return graphs, record


def _plain(model):
    return warnings.catch_warnings()


def _everything(model):
    return hr.offload_activations(store="cpu", min_bytes=0)


def _blocks(model):
    return hr.offload_activations(store="cpu", min_bytes=0, modules=list(model.layers))


@pytest.fixture
def packed(monkeypatch):
    """Whether each tensor autograd saved was offloaded (a ticket kept instead)."""
    out = []
    pack = _offload._Offloader.pack

    def spy(self, t):
        kept = pack(self, t)
        out.append(isinstance(kept, _offload._Ticket))
        return kept

    monkeypatch.setattr(_offload._Offloader, "pack", spy)
    return out


@pytest.mark.parametrize("ctx", [_everything, _blocks], ids=["all", "modules"])
def test_compiled_graphs_and_gradients_match_plain(packed, ctx):
    want = _train(m := _model(), m, ctx)  # eager, offloaded
    eager_packed = sum(packed)
    plain_graphs, backend = _graphs()
    _train(m := _model(), torch.compile(m, backend=backend), _plain)
    torch._dynamo.reset()
    graphs, backend = _graphs("aot_eager")
    model = _model()
    got = _train(model, torch.compile(model, backend=backend), ctx)
    # what the compiled graphs save (AOTAutograd saves it when they run) is offloaded
    assert sum(packed) - eager_packed > 0, "nothing saved by the compiled graphs was offloaded"
    if ctx is _everything:
        # the same graphs as the plain model (no recompile for a new context each step)
        assert len(graphs) == len(plain_graphs), [len(g.graph.nodes) for g in graphs]
    else:
        # the scoped modules' edges are graph breaks: a graph per block and around them
        assert len(graphs) <= 2 * (2 * len(model.layers) + 1), len(graphs)
    # aot_eager runs eager mode's kernels: bitwise
    for a, b in zip(got[0], want[0], strict=True):
        assert torch.equal(a, b)
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k
