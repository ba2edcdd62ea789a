"""LoRA through ``peft`` over a quantized base resting packed, against plain PEFT (CPU).

The base: a tiny Llama whose decoder linears are quantized (torchao int8 / int4 weight-only,
bitsandbytes NF4 with double quantization, LLM.int8), offloaded to host memory or a DiskStore.
Orders: quantize, offload, wrap; quantize, wrap, offload. Adapters trained with ``torch.optim``
and ``hr.HostOptimizer``, with and without gradient checkpointing; losses, adapters and greedy
``generate()`` bitwise those of the same quantized PEFT model kept resident. The adapters stay on
the device (``hr.offload``'s default ``adapters="device"``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import headroom as hr
from headroom.residency import offload_states
from headroom.transfer import binding
from tests.integrations._models import interrupt_lora_step
from tests.residency._quant import kind_param, quantize_linears

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS = 3
KINDS = ["ao_int8", "ao_int4", "bnb_nf4_dq", "bnb_int8"]


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hr.offload with device='cpu'")
        warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass.*")
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
        yield


def _base(kind: str, *, ckpt: bool = False, vocab: int = 96):
    torch.manual_seed(0)
    # (64 wide: bitsandbytes repacks 4-bit weights for its CPU kernel at inference, which
    # needs rows of at least one 64-value block)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg)
    quantize_linears(model.model.layers, kind)
    for p in model.parameters():
        p.requires_grad_(False)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def _wrap(model):
    torch.manual_seed(5)  # the adapters' initialization draws random numbers
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                          lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


def _optimizer(model, opt: str):
    params = [p for p in model.parameters() if p.requires_grad]
    if opt == "host":
        return hr.HostOptimizer(params, torch.optim.AdamW, lr=1e-2, fused=False)
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _train(model, opt, vocab: int = 96) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    model.train()
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _adapters(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def _generate(model) -> torch.Tensor:
    model.eval()
    ids = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)


def _store(store: str, tmp_path):
    return "cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w")


def _state(model):
    (_, _, state), = offload_states(model)
    return state


@pytest.mark.parametrize("opt", ["torch", "host"])
@pytest.mark.parametrize("order", ["offload_wrap", "wrap_offload"])
@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("kind", kind_param(KINDS))
def test_lora_over_a_quantized_base_trains_like_resident(kind, store, order, opt, tmp_path):
    """The adapters stay on the device (ordinary parameters: any optimizer steps them, on a
    DiskStore base too)."""
    ref = _wrap(_base(kind))
    want = _train(ref, _optimizer(ref, "torch"))
    if order == "offload_wrap":
        model = _base(kind)
        hr.offload(model, device="cpu", store=_store(store, tmp_path))
        model = _wrap(model)
    else:
        model = _wrap(_base(kind))
        hr.offload(model, device="cpu", store=_store(store, tmp_path))
    state = _state(model)
    assert len(state.packed) == 14  # 7 linears in each of 2 layers, resting packed
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert len(lora) == 12 and all(binding(p) is None and type(p) is torch.nn.Parameter
                                   for p in lora)
    assert not state.slots or not any(s.param.requires_grad for s in state.slots)
    assert _train(model, _optimizer(model, opt)) == want
    got, adapters = _adapters(model), _adapters(ref)
    assert got.keys() == adapters.keys() and len(got) == 12
    for k, v in adapters.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(_generate(model), _generate(ref))


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq"]))
def test_gradient_checkpointing_composes(kind, store, tmp_path):
    ref = _wrap(_base(kind, ckpt=True))
    want = _train(ref, _optimizer(ref, "torch"))
    model = _base(kind, ckpt=True)
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    model = _wrap(model)
    assert _train(model, _optimizer(model, "host")) == want
    got = _adapters(model)
    for k, v in _adapters(ref).items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq"]))
def test_adapter_save_pretrained_and_reload(kind, tmp_path):
    """Adapters saved from the offloaded model load into a resident quantized model and give
    its outputs."""
    model = _base(kind)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    model = _wrap(model)
    _train(model, _optimizer(model, "host"))
    model.save_pretrained(tmp_path / "adapter")
    fresh = peft.PeftModel.from_pretrained(_base(kind), tmp_path / "adapter")
    got = _adapters(fresh)
    want = _adapters(model)
    for k, v in want.items():
        assert torch.equal(got[k.replace(".default", "")] if k not in got else got[k], v), k
    assert torch.equal(_generate(fresh), _generate(model))


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq"]))
def test_interrupted_step_over_a_quantized_base_retries_exactly(kind, where, tmp_path):
    """Ctrl-C in a LoRA step over a quantized base on a DiskStore: nothing was half-applied (the
    optimizer had not stepped, the base is unchanged); the retried training is bitwise the
    resident model's."""
    ref = _wrap(_base(kind))
    want = _train(ref, _optimizer(ref, "torch"))
    model = _base(kind)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    model = _wrap(model)
    opt = _optimizer(model, "host")
    interrupt_lora_step(model, where)
    opt.zero_grad()
    assert _train(model, opt) == want
    got, exp = _adapters(model), _adapters(ref)
    assert got.keys() == exp.keys() and all(torch.equal(got[k], exp[k]) for k in got)


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq"]))
def test_a_real_vocabulary_puts_the_head_in_a_block_of_its_own_and_trains_exactly(kind,
                                                                                    tmp_path):
    # 32k classes: the output layer (8 MiB) is a block of its own, fetched beside the
    # quantized decoder layers; LoRA training stays bitwise the resident quantized model's
    ref = _wrap(_base(kind, vocab=32000))
    want = _train(ref, _optimizer(ref, "torch"), vocab=32000)
    for store in ("cpu", "disk"):
        model = _base(kind, vocab=32000)
        hr.offload(model, device="cpu", store=_store(store, tmp_path))
        (_, _, state), = offload_states(model)
        assert state.blocks[-1].module is model.lm_head
        model = _wrap(model)
        assert _train(model, _optimizer(model, "torch"), vocab=32000) == want, store
