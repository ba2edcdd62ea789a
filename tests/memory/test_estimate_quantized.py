"""hr.estimate and hr.plan for LoRA over a quantized base, against hr.track_memory on CPU.

A quantized weight weighs its packed parts (torchao's inner tensors; bitsandbytes' codes with
their absmax, code books and scales), resident or streamed by hr.offload; the optimizer keeps
state for the adapters only. Byte counts are checked against the tracker's measured step and
against the sizes counted from the libraries' own attributes (`quantized_bytes`).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import headroom as hr
from headroom.fit import estimate
from headroom.planner import Speeds, plan
from tests.residency._quant import kind_param, quantize_linears, quantized_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SPEEDS = Speeds(matmul=1e10, conv=1e10, memory=1e10, op=1e-5, disk_read=1e9, disk_write=5e8)
IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
KW = {"input_ids": IDS, "labels": IDS}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hr.offload with device='cpu'")
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
        yield


def lora_llama(kind: str, *, hidden: int = 64, layers: int = 2, targets="all-linear"):
    """A tiny Llama whose decoder linears are quantized and frozen, with LoRA (r=4) on
    ``targets``."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden,
                                   intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    quantize_linears(model.model.layers, kind)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(5)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


def loss_fn(out):
    return out.loss


def measure(model, opt):
    """The tracker's peak of a steady-state step (optimizer state made by a first step)."""
    def step():
        loss_fn(model(**KW)).backward()
        opt.step()
        opt.zero_grad()

    step()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step()
    return mem


def trained(model):
    return [p for p in model.parameters() if p.requires_grad]


def resting_bytes(model) -> int:
    """Every parameter's bytes as its library keeps it (quantized ones counted from their
    own attributes, not through headroom)."""
    owner = {id(m.weight): m for m in model.modules() if isinstance(
        getattr(m, "weight", None), torch.Tensor)}
    return sum(p.nbytes if type(p) is torch.nn.Parameter else quantized_bytes(p, owner[id(p)])
               for p in model.parameters())


def adam_state_bytes(model) -> int:
    """AdamW's state of the adapters: two moments each, and a 4-byte step per tensor."""
    return sum(2 * p.nbytes + 4 for p in trained(model))


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "ao_int4", "bnb_nf4_dq", "bnb_int8"]))
def test_estimate_prices_packed_weights_and_adapter_state(kind):
    model = lora_llama(kind)
    est = estimate(model, (), example_kwargs=KW, loss_fn=loss_fn, optimizer=torch.optim.AdamW,
                   device="cpu")
    mem = measure(model, torch.optim.AdamW(trained(model)))
    params, state = resting_bytes(model), adam_state_bytes(model)
    assert est.max_by_category["parameters"] == mem.max_by_category["parameters"] == params
    assert est.max_by_category["optimizer_state"] == mem.max_by_category["optimizer_state"] \
        == state
    for cat in ("gradients", "activations"):
        assert est.peak_by_category[cat] == mem.peak_by_category[cat], cat
    # the rest are temporaries ("other"): equal but for bitsandbytes' 4-bit backward, where
    # the dry run holds 8 KiB more of them at the peak (one (2, 8, 128) fp32 tensor here)
    assert abs(est.peak - mem.peak) <= 0.03 * mem.peak, (est.peak, mem.peak)


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq", "bnb_int8"]))
def test_estimate_of_a_streamed_quantized_base_as_measured(kind, tmp_path):
    """A base offloaded to a DiskStore: one block's packed parts on the device at a time (the
    what-if ``offload=`` and the offloaded model estimate the same step), adapters on the
    device for the whole step."""
    what_if = estimate(lora_llama(kind, layers=4), (), example_kwargs=KW, loss_fn=loss_fn,
                       optimizer=torch.optim.AdamW, device="cpu",
                       offload={"store": hr.DiskStore(tmp_path / "what_if")})
    model = lora_llama(kind, layers=4)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    est = estimate(model, (), example_kwargs=KW, loss_fn=loss_fn, optimizer=torch.optim.AdamW,
                   device="cpu")
    mem = measure(model, torch.optim.AdamW(trained(model)))
    assert what_if.peak == est.peak
    assert est.max_by_category["parameters"] == mem.max_by_category["parameters"]
    for cat in ("gradients", "optimizer_state", "activations"):
        assert est.peak_by_category[cat] == mem.peak_by_category[cat], cat
    assert abs(est.peak - mem.peak) <= 0.03 * mem.peak, (est.peak, mem.peak)
    # streamed: less than the base resting whole
    assert est.max_by_category["parameters"] < resting_bytes(lora_llama(kind, layers=4))


@pytest.mark.parametrize("kind", kind_param(["bnb_nf4"]))
def test_plan_streams_a_quantized_base_on_a_small_budget(kind, tmp_path):
    """Under a budget below the resident base, the plan streams the base from disk and trains
    the adapters on the device; the applied plan measures within the budget and trains as
    the resident quantized model does."""
    def build():
        return lora_llama(kind, hidden=256, layers=4, targets=["q_proj", "v_proj"])

    ref = build()
    opt = torch.optim.AdamW(trained(ref), lr=1e-2)
    plain = measure(ref, opt)
    assert plain.max_by_category["parameters"] > 0.5 * plain.peak
    budget = int(0.6 * plain.peak)
    p = plan(build(), (), example_kwargs=KW, loss_fn=loss_fn, budget=budget, device="cpu",
             optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, disk=tmp_path,
             speeds=SPEEDS)
    assert p.choice.params == "disk", str(p)
    assert "if p.requires_grad" in p.code()
    model, opt = p.apply(build())
    got = measure(model, opt)
    assert got.peak <= budget, (got.peak, budget, str(p))
    assert got.peak <= p.peak
    loss, want = (loss_fn(m(**KW)).item() for m in (model, ref))
    assert loss == want
