"""Loading a quantized base without the whole model in memory (CPU).

- built on ``meta``, offloaded, then ``hr.load_weights(model, path, quantize=fn)``: each block
  read from the checkpoint, quantized, and put in the store packed, one block in memory at a
  time (the tracker's peak of host tensors against the block's size);
- transformers' own ``BitsAndBytesConfig`` / ``TorchAoConfig`` loads, then ``hr.offload``.

Each against the same quantized model kept resident, bitwise.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import headroom as hr
from headroom.residency import state_of
from tests.residency._quant import kind_param, quantize_linears

transformers = pytest.importorskip("transformers")

KINDS = ["ao_int8", "ao_int4", "bnb_nf4_dq", "bnb_int8"]


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hr.offload with device='cpu'")
        warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
        yield


def _config(layers: int = 2, hidden: int = 64):
    return transformers.LlamaConfig(vocab_size=96, hidden_size=hidden,
                                    intermediate_size=2 * hidden, num_hidden_layers=layers,
                                    num_attention_heads=2, num_key_value_heads=1,
                                    max_position_embeddings=16)


def _saved(tmp_path, cfg):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "base")
    return model


def _store(store: str, tmp_path):
    return "cpu" if store == "cpu" else hr.DiskStore(tmp_path / "w")


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("kind", kind_param(KINDS))
def test_load_weights_quantizes_each_block_into_the_store(kind, store, tmp_path):
    cfg = _config()
    ref = _saved(tmp_path, cfg)
    quantize_linears(ref.model.layers, kind)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    hr.load_weights(model, tmp_path / "base", quantize=lambda b: quantize_linears(b, kind))
    state = state_of(model)
    assert len(state.packed) == 14 and len(state.slots) == 7  # norms, embedding, head
    st = state.store
    # nothing of the full-precision linears is left in the store: their parts only
    keys = st.keys()  # a Store, not a dict
    lin = [k for k in keys if "_proj" in k]
    assert lin and all("#" in k for k in lin)
    assert st.used_bytes == sum(s.binding.handle.nbytes for s in state.slots) + sum(
        q.nbytes for q in state.packed)
    assert torch.equal(_logits(model), _logits(ref))
    hr.unoffload(model)
    assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq"]))
def test_quantized_load_holds_about_one_block_in_memory(kind, tmp_path):
    """Host tensors alive at once while loading 8 blocks into a DiskStore: one block's values
    and their quantized form, not the model."""
    cfg = _config(layers=8, hidden=256)
    _saved(tmp_path, cfg)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    block = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    total = sum(p.numel() * 4 for p in model.parameters())
    with hr.track_memory() as mem:
        hr.load_weights(model, tmp_path / "base", quantize=lambda b: quantize_linears(b, kind))
    peak = mem.stats("cpu").peak
    assert total > 8 * block and peak < 2.5 * block, (peak, block, total)
    assert len(state_of(model).packed) == 8 * 7


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("how", ["torchao", "bnb_nf4", "bnb_int8"])
def test_transformers_quantization_configs_then_offload(how, store, tmp_path):
    """A model transformers quantized while loading (TorchAoConfig, BitsAndBytesConfig), then
    hr.offload: its quantized weights rest packed, and forward, LoRA training and generate are
    those of the model kept resident."""
    pytest.importorskip("torchao" if how == "torchao" else "bitsandbytes")
    peft = pytest.importorskip("peft")
    _saved(tmp_path, _config())
    if how == "torchao":
        from torchao.quantization import Int8WeightOnlyConfig

        q = transformers.TorchAoConfig(Int8WeightOnlyConfig())
    elif how == "bnb_nf4":
        q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.float32)
    else:
        q = transformers.BitsAndBytesConfig(load_in_8bit=True)

    def load():
        m = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "base", quantization_config=q, device_map="cpu", dtype=torch.float32)
        torch.manual_seed(5)
        return peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))

    def train(m):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2,
                                foreach=False)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(2):
            ids = torch.randint(0, 96, (2, 8), generator=g)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    ref = load()
    model = load()
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    state = state_of(model)
    assert len(state.packed) == 14
    assert train(model) == train(ref)
    assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize("kind", kind_param(["ao_int8"]))
def test_interrupted_quantizing_load_then_a_retry_is_refused_and_a_fresh_load_is_exact(
        kind, tmp_path):
    # Ctrl-C in quantize= at the second block leaves the first blocks quantized: a second
    # load_weights would write full-precision bytes into their packed parts (before: EFAULT
    # from the read, or bytes written where the placeholder storage points); it is refused
    # before anything is written, naming the fix, which then loads exactly
    cfg = _config(layers=3)
    ref = _saved(tmp_path, cfg)
    quantize_linears(ref.model.layers, kind)
    calls = []

    def interrupted(block):
        calls.append(block)
        quantize_linears(block, kind)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    with pytest.raises(KeyboardInterrupt):
        hr.load_weights(model, tmp_path / "base", quantize=interrupted)
    with pytest.raises(TypeError, match="quantized weights.*nothing was written.*on meta again"):
        hr.load_weights(model, tmp_path / "base", quantize=lambda b: quantize_linears(b, kind))
    # a model quantized outside headroom is refused the same way
    plain = transformers.LlamaForCausalLM(cfg)
    quantize_linears(plain.model.layers, kind)
    with pytest.raises(TypeError, match="quantized weights"):
        hr.load_weights(plain, tmp_path / "base")
    state_of(model).store.close()
    with torch.device("meta"):  # the fix the error names
        model = transformers.LlamaForCausalLM(cfg)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w2"))
    hr.load_weights(model, tmp_path / "base", quantize=lambda b: quantize_linears(b, kind))
    assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize("kind", kind_param(["ao_int8", "bnb_nf4_dq"]))
def test_hr_save_and_load_of_a_quantized_base_are_refused_naming_the_fix(kind, tmp_path):
    # hr.save wrote the packed weight's placeholder (torchao: NotImplementedError mid-write);
    # it is refused before a file is opened, and hr.load before it writes into the model
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    quantize_linears(model.model.layers, kind)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    before = _logits(model)
    with pytest.raises(TypeError, match="hr.save cannot handle quantized weights.*"
                                        "nothing was written.*save_pretrained"):
        hr.save(tmp_path / "ck", model)
    assert not (tmp_path / "ck").exists()
    plain = transformers.LlamaForCausalLM(_config())
    hr.save(tmp_path / "plain", plain)
    with pytest.raises(TypeError, match="hr.load cannot handle quantized weights"):
        hr.load(tmp_path / "plain", model, strict=False)
    assert torch.equal(_logits(model), before)


@pytest.mark.parametrize("kind", kind_param(["ao_int8"]))
@pytest.mark.parametrize("where", ["block", "outside"])
def test_quantized_load_checked_tensor_by_tensor_names_what_was_loaded(where, kind, tmp_path,
                                                                       monkeypatch):
    """A checkpoint verified tensor by tensor (bigger than half the memory: forced) with a
    flipped bit: each tensor is checked once, and the error says what was loaded: the tensors
    outside blocks load first, then block after block."""
    from headroom.checkpoint import _weights
    from tests.checkpoint.test_weights_checksums import _flip

    monkeypatch.setattr(_weights, "available_memory", lambda: 0, raising=False)
    torch.manual_seed(0)
    hr.save_weights(transformers.LlamaForCausalLM(_config()), tmp_path / "w")
    victim = "model.layers.1.mlp.up_proj.weight" if where == "block" else "model.norm.weight"
    _flip(tmp_path / "w" / "model.safetensors", victim)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_config())
    hr.offload(model, device="cpu", store="cpu")
    checked, real = [], _weights._verify
    monkeypatch.setattr(_weights, "_verify", lambda f, info, *a: checked.append(info) or real(
        f, info, *a))
    want = (r"the blocks before it in this load were loaded and quantized; it and the blocks"
            r" after it are unchanged" if where == "block" else
            r"the \d+ tensors before it in this load were loaded; it, the \d+ after it and the"
            r" blocks to quantize are unchanged")
    with pytest.raises(hr.CheckpointCorruptError, match=want):
        hr.load_weights(model, tmp_path / "w", quantize=lambda b: quantize_linears(b, kind))
    assert len(checked) == len({id(i) for i in checked})  # none checked twice
