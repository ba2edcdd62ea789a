"""Quantized parameters rest packed and stream as they are (torchao, bitsandbytes; CPU).

Each kind is checked against the same quantized model kept resident: forward, the gradients of
the trainable parameters and of the input, several optimizer steps, inference (no grad), in
host memory and on a DiskStore, bitwise.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import state_of
from headroom.store import DiskStore, HostStore
from tests.residency._quant import (
    AO,
    BNB,
    KINDS,
    dequantized,
    kind_param,
    qnet,
    quantize_linears,
    quantized_bytes,
)

STORES = ["cpu", "disk"]
# bytes per weight at rest, scales included, for these 8192-weight matrices (int4 weight-only on
# the CPU keeps one 4-bit value per byte, plus a scale and zero point per group of 32; 4-bit
# bitsandbytes adds fixed code books, 1 KiB for double quantization's, to 0.5)
_MAX_BYTES_PER_PARAM = {"ao_int8": 1.1, "ao_int4": 1.3, "ao_fp8": 1.1, "bnb_int8": 1.1,
                        "bnb_nf4": 0.6, "bnb_nf4_dq": 0.7, "bnb_fp4_dq": 0.7}


def _store(kind: str, tmp_path):
    return "cpu" if kind == "cpu" else DiskStore(tmp_path / "store")


def _offload(model: nn.Module, store, **kw) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cpu+cpu "saves nothing"
        return hr.offload(model, device="cpu", store=store, **kw)


def _batch(g: torch.Generator, d: int = 64) -> torch.Tensor:
    return torch.randn(4, 5, d, generator=g).requires_grad_(True)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, g: torch.Generator):
    outs = []
    for _ in range(steps):
        x = _batch(g)
        y = model(x)
        y.square().mean().backward()
        outs.append((y.detach(), x.grad))
        opt.step()
        opt.zero_grad()
    return outs


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            out[n] = p.detach().clone() if not hasattr(p, "_source") else p.clone()
    return out


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", kind_param())
def test_training_over_a_packed_base_is_exact(kind, store, tmp_path):
    """Forward, input and parameter gradients, and SGD steps of the trainable parameters are
    bitwise those of the resident quantized model."""
    ref = qnet(kind)
    model = copy.deepcopy(ref)
    _offload(model, _store(store, tmp_path))
    state = state_of(model)
    assert len(state.packed) == 6  # fc1 and fc2 of 3 blocks
    if store == "disk":
        opt = hr.HostOptimizer(_trainable(model), torch.optim.SGD, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(_trainable(model), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(_trainable(ref), lr=0.1, momentum=0.9)
    got = _train(model, opt, 3, torch.Generator().manual_seed(1))
    want = _train(ref, ref_opt, 3, torch.Generator().manual_seed(1))
    for (y, gx), (ry, rgx) in zip(got, want, strict=True):
        assert torch.equal(y, ry)
        assert torch.equal(gx, rgx)
    vals = _values(model)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.equal(vals[n], p.detach()), n
    # quantized weights are what they were, and their device copies hold no memory at rest
    for q in state.packed:
        assert all(t.untyped_storage().nbytes() == 0 for t in q.parts.values())
        assert type(q.param) is type(ref.get_parameter(q.name))
    with torch.no_grad():  # inference too (bitsandbytes repacks 4-bit weights for it)
        x = torch.randn(2, 3, 64)
        assert torch.equal(model(x), ref(x))
        assert torch.equal(model(x), ref(x))
    for q in state.packed:
        assert all(t.untyped_storage().nbytes() == 0 for t in q.parts.values())


@pytest.mark.parametrize("kind", kind_param())
def test_store_holds_the_quantized_bytes(kind, tmp_path):
    """The store keeps each quantized weight at its quantized size: its parts, byte for byte
    what the library holds, never a dequantized copy."""
    ref = qnet(kind)
    model = copy.deepcopy(ref)
    store = DiskStore(tmp_path / "store")
    _offload(model, store)
    state = state_of(model)
    plain = sum(p.numel() * p.element_size() for s in state.slots for p in (s.param,))
    quant = 0
    for q in state.packed:
        name = q.name
        owner = ref.get_submodule(name.rsplit(".", 1)[0])
        want = quantized_bytes(ref.get_parameter(name), owner)
        got = sum(store.get(h.key).nbytes for h in q.handles.values())
        assert got == want == q.nbytes, name
        # and far below the weight's floating-point size
        numel = owner.in_features * owner.out_features
        assert got <= numel * _MAX_BYTES_PER_PARAM[kind], name
        quant += got
    assert store.used_bytes == plain + quant
    # nothing but the packed parts and the plain parameters rests there
    assert len(store.keys()) == len(state.slots) + sum(len(q.handles) for q in state.packed)


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq", "bnb_int8"]))
def test_at_most_prefetch_plus_one_blocks_on_the_device(kind):
    """During forward and backward, the device holds the packed parts of at most
    ``prefetch + 1`` blocks (plus nothing else of them)."""
    model = qnet(kind, n=4)
    _offload(model, "cpu", prefetch=1)
    state = state_of(model)
    per_block = max(sum(q.nbytes for q in b.packed) for b in state.blocks)
    seen = []

    def device_bytes(*_):
        seen.append(sum(t.untyped_storage().nbytes() for q in state.packed
                        for t in q.parts.values()))

    for layer in model.layers:
        layer.register_forward_pre_hook(device_bytes)
        layer.register_full_backward_hook(device_bytes)
    model(_batch(torch.Generator().manual_seed(0))).sum().backward()
    assert len(seen) == 8 and max(seen) > 0
    assert max(seen) <= 2 * per_block
    device_bytes()
    assert seen[-1] == 0


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq", "bnb_int8"]))
def test_activation_checkpointing_composes(kind, store, tmp_path):
    ref = qnet(kind, ckpt=True)
    model = copy.deepcopy(ref)
    _offload(model, _store(store, tmp_path))
    g = torch.Generator().manual_seed(3)
    x = _batch(g)
    xr = x.detach().clone().requires_grad_(True)
    model(x).square().sum().backward()
    ref(xr).square().sum().backward()
    assert torch.equal(x.grad, xr.grad)
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.equal(got[n].clone(), p.grad), n


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", kind_param())
def test_state_dict_copy_and_unoffload(kind, store, tmp_path):
    """``state_dict()`` gives the resident model's entries (bitsandbytes' quant_state keys
    too), ``copy.deepcopy`` a plain quantized copy, `hr.unoffload` the quantized weights back."""
    ref = qnet(kind)
    model = copy.deepcopy(ref)
    _offload(model, _store(store, tmp_path))
    want = ref.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert type(got[k]) is type(v), k
        if hasattr(v, "dequantize"):
            assert torch.equal(got[k].dequantize(), v.dequantize()), k
        else:
            assert torch.equal(got[k], v), k
    x = torch.randn(2, 3, 64)
    c = copy.deepcopy(model)
    assert type(c.layers[0].fc1.weight) is type(ref.layers[0].fc1.weight)
    hr.unoffload(model)
    for m in (c, model):
        w = m.layers[1].fc2.weight
        assert type(w) is type(ref.layers[1].fc2.weight) and w.device.type == "cpu"
        assert torch.equal(dequantized(w), dequantized(ref.layers[1].fc2.weight))
        assert torch.equal(m(x), ref(x))


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4"]))
def test_model_moves_and_modes_keep_packed_weights(kind):
    ref = qnet(kind)
    model = copy.deepcopy(ref)
    _offload(model, "cpu")
    masters = [q.param for q in state_of(model).packed]
    model.to("cpu")
    model.float()
    model.eval()
    model.train()
    assert [q.param for q in state_of(model).packed] == masters
    x = torch.randn(2, 3, 64)
    assert torch.equal(model(x), ref(x))


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kind", kind_param(["ao_int8", "ao_fp8"]))
def test_a_quantized_weight_that_requires_grad_is_refused(kind, tmp_path):
    # (bitsandbytes' weights are integers: torch itself refuses requires_grad there)
    model = qnet(kind)
    w = model.layers[0].fc1.weight
    w.requires_grad_(True)
    before = {n: p for n, p in model.named_parameters()}
    store = DiskStore(tmp_path / "store")
    with pytest.raises(ValueError, match="requires grad.*do not train"):
        _offload(model, store)
    assert {n: p for n, p in model.named_parameters()} == before  # nothing changed
    assert store.keys() == []
    w.requires_grad_(False)
    _offload(model, store)
    model.layers[2].fc2.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="was set to require grad after hr.offload"):
        model(torch.randn(2, 3, 64))
    model.layers[2].fc2.weight.requires_grad_(False)
    model(torch.randn(2, 3, 64))  # and the model runs again


@pytest.mark.skipif(not all(k in KINDS for k in BNB), reason="bitsandbytes kinds")
@pytest.mark.parametrize("kind", kind_param(["bnb_nf4"]))
def test_bitsandbytes_weight_not_quantized_yet_is_refused(kind):
    import bitsandbytes as bnb

    model = nn.Sequential(nn.Linear(64, 64), bnb.nn.Linear4bit(64, 64, quant_type="nf4"))
    model[1].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="not quantized yet"):
        _offload(model, "cpu", blocks=[model[0], model[1]])


class _Opaque(torch.Tensor):
    """A wrapper subclass that cannot be rebuilt from its inner tensors."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride):
        raise NotImplementedError("opaque")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return _Opaque(args[0].inner.detach())
        raise NotImplementedError(func)


def test_an_unsupported_tensor_subclass_is_refused_with_its_reason(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = nn.Parameter(_Opaque(torch.randn(8, 8)), requires_grad=False)
    with pytest.raises(ValueError, match="cannot be rebuilt from its inner tensors.*opaque"):
        _offload(model, DiskStore(tmp_path / "store"), blocks=[model[0], model[1]])


@pytest.mark.parametrize("store", [HostStore, DiskStore])
@pytest.mark.parametrize("kind", kind_param(["ao_int8"]))
def test_stores_refuse_a_wrapper_subclass_instead_of_reading_nothing(kind, store, tmp_path):
    lin = quantize_linears(nn.Sequential(nn.Linear(64, 64)), kind)[0]
    st = store() if store is HostStore else store(tmp_path / "store")
    with pytest.raises(TypeError, match="tensor subclass whose values are its inner tensors"):
        st.put("w", lin.weight)
    assert st.keys() == []


@pytest.mark.parametrize("kind", kind_param(AO[:1] + BNB[:1]))
def test_reopened_disk_store_takes_the_new_values(kind, tmp_path):
    """A packed weight whose parts are already in a reopened DiskStore is written again with
    the model's values (as plain parameters are)."""
    a = qnet(kind)
    _offload(a, DiskStore(tmp_path / "store"))
    state_of(a).store.close()
    b = qnet(kind, seed=5)
    ref = copy.deepcopy(b)
    _offload(b, DiskStore(tmp_path / "store"))
    x = torch.randn(2, 3, 64)
    assert torch.equal(b(x), ref(x))


# the rows of docs/lora.md's "Bytes per parameter" table, by the start of their first cell
LORA_PAGE_ROWS = {"ao_int8": "int8 (torchao", "bnb_nf4": "NF4 (bitsandbytes",
                  "bnb_nf4_dq": "NF4, double"}


@pytest.mark.parametrize("kind", kind_param(list(LORA_PAGE_ROWS)))
def test_bytes_per_weight_of_the_lora_page_are_the_packed_parts(kind):
    # docs/lora.md's table: bytes per weight counted from weights the libraries quantized,
    # rows of 8192 inputs (code books spread over more rows there: 2e-4 apart at most), and
    # one 70B decoder layer (855.6 M weights) at that rate
    import re
    from pathlib import Path

    from headroom.residency import packed_nbytes

    page = (Path(__file__).parents[2] / "docs" / "lora.md").read_text()
    line = next(x for x in page.splitlines() if x.startswith(f"| {LORA_PAGE_ROWS[kind]}"))
    per_weight, layer_gb = (float(v) for v in re.findall(r"\| ([\d.]+)(?: GB)? ", line + " ")[:2])
    m = nn.Sequential(nn.Linear(8192, 1024, bias=False)).to(torch.bfloat16)
    quantize_linears(m, kind, dtype=torch.bfloat16)
    assert abs(packed_nbytes(m[0].weight) / (8192 * 1024) - per_weight) <= 2e-4
    assert round(per_weight * 855.6e6 / 1e9, 3) == pytest.approx(layer_gb, abs=1e-3)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4", "bnb_int8"]))
def test_a_quantized_layer_replaced_after_offload_leaves_the_store(kind, store, tmp_path):
    """A quantized layer swapped out of an offloaded model leaves the store: its parts' keys
    are freed, the old layer computes as before over host copies of its parts, and the model
    runs bitwise like the resident one with the same replacement."""
    ref = qnet(kind)
    model = copy.deepcopy(ref)
    _offload(model, _store(store, tmp_path))
    state = state_of(model)
    old = model.layers[1].fc1
    keys = [h.key for q in state.packed if q.owners[0][0] is old for h in q.handles.values()]
    assert keys and all(k in state.store for k in keys)
    new = nn.Linear(64, 128)
    ref.layers[1].fc1 = copy.deepcopy(new)
    model.layers[1].fc1 = new
    assert len(state.packed) == 5 and not any(k in state.store for k in keys)
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        h = torch.randn(2, 3, 64)
        assert torch.equal(old(h), qnet(kind).layers[1].fc1(h))
        assert torch.equal(model(x), ref(x))
