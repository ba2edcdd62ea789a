"""torch.compile of an offloaded model: headroom's code stays outside the graphs, each block's
forward is one graph, and training is that of the plain model (bitwise with ``aot_eager``, whose
kernels are eager mode's; close with inductor)."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import headroom as hr
from tests.residency._models import Transformer

HR_SRC = os.path.dirname(hr.__file__)
BATCHES = (2, 3, 4)  # a batch size that changes: dynamo recompiles with dynamic shapes


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Recorder:
    """A backend that keeps every graph dynamo hands it, then runs ``backend`` on it."""

    def __init__(self, backend: str = "eager") -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = backend

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend(self.backend)(gm, example_inputs)


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")]


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(d=16, n=3)
    for layer in m.layers:
        layer.drop.p = 0.0  # compiled dropout draws other random numbers than eager
    return m


def _offloaded(model, store, tmp_path):
    st = hr.DiskStore(tmp_path / "params") if store == "disk" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device=cpu with store=cpu: mechanics only
        hr.offload(model, device="cpu", store=st)
    return model


def _opt(model, kind):
    if kind == "host":
        return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "host-sgd":
        return hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    # fused: the kernel HostOptimizer steps AdamW with, so both match one reference
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _train(model, step_fn, opt, batches=BATCHES):
    g = torch.Generator().manual_seed(1)
    losses = []
    for b in batches:
        x = torch.randint(0, 50, (b, 6), generator=g)
        loss = step_fn(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_no_headroom_in(graphs):
    for gm in graphs:
        for n in gm.graph.nodes:
            assert HR_SRC not in (n.meta.get("stack_trace") or ""), (
                f"headroom's code was traced into a graph:\n{n.meta['stack_trace']}")
            assert "resize_storage" not in str(n.target), n.format_node()


@pytest.mark.parametrize("store,opt", [("cpu", "adamw"), ("disk", "host")])
def test_compiled_offloaded_trains_bitwise_as_eager(tmp_path, store, opt):
    ref = _model()
    want = _train(ref, ref, _opt(ref, opt))
    model = _offloaded(_model(), store, tmp_path)
    rec = Recorder("aot_eager")
    got = _train(model, torch.compile(model, backend=rec), _opt(model, opt))
    assert rec.graphs, "nothing was compiled"
    _assert_no_headroom_in(rec.graphs)
    for step, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"loss of step {step}"
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k


def test_compiled_offloaded_summing_on_the_device_trains_bitwise_as_eager(tmp_path):
    # grad_accumulation="device": the sums are formed in the offload's gradient hooks, outside
    # the compiled graphs; two micro-batches per step, a DiskStore, HostOptimizer
    def train(model, fn, opt):
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):
                (fn(torch.randint(0, 50, (4, 6), generator=g)).square().mean() / 2).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    ref = _model()
    want = train(ref, ref, _opt(ref, "adamw"))
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "p"),
                   grad_accumulation="device")
    from headroom.residency import state_of

    held = []
    real = type(state_of(model))._hold
    rec = Recorder("aot_eager")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(state_of(model)), "_hold",
                   lambda self, *a, **k: (held.append(1), real(self, *a, **k))[1])
        got = train(model, torch.compile(model, backend=rec), _opt(model, "host"))
    assert rec.graphs and held
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_each_block_is_one_graph_and_breaks_only_at_block_edges(tmp_path):
    # the graph of one block compiled on its own: the offloaded model must contain it whole
    block = _model().layers[0]
    alone = Recorder()
    torch.compile(copy.deepcopy(block), backend=alone)(torch.randn(2, 6, 16))
    (block_graph,) = alone.graphs
    torch._dynamo.reset()
    counters.clear()
    plain = _model()
    plain_rec = Recorder()
    torch.compile(plain, backend=plain_rec)(torch.randint(0, 50, (2, 6)))
    plain_breaks = set(counters["graph_break"])
    torch._dynamo.reset()
    counters.clear()

    model = _offloaded(_model(), "cpu", tmp_path)
    rec = Recorder()
    cm = torch.compile(model, backend=rec)
    for b in BATCHES:
        cm(torch.randint(0, 50, (b, 6))).sum().backward()
    _assert_no_headroom_in(rec.graphs)
    # static, then dynamic batch: one graph each for the blocks (the 3 blocks share it), and
    # no graph holding a piece of a block
    assert [_ops(g) for g in rec.graphs[:1]] == [_ops(block_graph)]
    assert len(rec.graphs) <= 2 * (len(plain_rec.graphs) + 1), [_ops(g) for g in rec.graphs]
    for gm in rec.graphs[1:]:
        ops = [o for o in _ops(gm) if "sym_size" not in o]
        assert ops == [o for o in _ops(block_graph) if "sym_size" not in o], ops
    # every break the offloaded model adds is at one of headroom's (disabled) hooks, which
    # only blocks and the root have
    for reason in set(counters["graph_break"]) - plain_breaks:
        assert "torch.compiler.disable" in reason, reason
    assert not counters["recompiles"] or sum(counters["recompiles"].values()) <= 2


@pytest.mark.slow
@pytest.mark.parametrize("store,opt", [("cpu", "sgd")])
def test_inductor_dynamic_batch_trains_like_compiled_plain(tmp_path, store, opt):
    """Default torch.compile (inductor; dynamic shapes once the batch size changes): close to
    the compiled plain model. SGD: Adam would turn rounding noise in gradients that are ~0 (the
    attention's key bias) into full-size steps, which no tolerance separates from a bug."""
    ref = _model()
    want = _train(ref, torch.compile(ref), _opt(ref, opt.removeprefix("host-")), (2, 3))
    model = _offloaded(_model(), store, tmp_path)
    got = _train(model, torch.compile(model), _opt(model, opt), (2, 3))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_hf_model_compiled_offloaded_is_bitwise_eager(make):
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store="cpu")
    rec = Recorder("aot_eager")
    cm = torch.compile(model, backend=rec)
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (ref, model)]
    for b in (2, 3):
        ids = torch.randint(0, ref.config.vocab_size, (b, 8), generator=g)
        for m, o in ((ref, opts[0]), (cm, opts[1])):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    assert rec.graphs, "nothing was compiled"
    _assert_no_headroom_in(rec.graphs)
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_compiled_offloaded_on_the_accelerator_trains_like_compiled_plain(tmp_path, store):
    from tests.conftest import accelerator_type

    dev = accelerator_type()
    ref = _model().to(dev)
    model = _model()
    st = hr.DiskStore(tmp_path / "params") if store == "disk" else "cpu"
    hr.offload(model, device=dev, store=st)
    opts = (torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
            hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    runs = (torch.compile(ref), torch.compile(model))
    for b in (2, 3, 4):
        x = torch.randint(0, 50, (b, 6), generator=g).to(dev)
        losses = []
        for run, opt in zip(runs, opts, strict=True):
            loss = run(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0])
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k].to(dev), v, msg=k)
