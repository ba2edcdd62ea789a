"""LoRA through ``peft`` on an offloaded base, in every order, against plain PEFT (fp32, CPU).

Orders: wrap then offload; offload then wrap; build on meta, wrap, offload to disk and load the
base checkpoint; load, offload, wrap. Each with ``store="cpu"`` and a `DiskStore`, with a
``torch.optim`` optimizer (where the store allows one) and ``hr.HostOptimizer``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import headroom as hr
from headroom.residency import state_of
from headroom.transfer import binding
from tests.integrations._models import interrupt_lora_step

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS = 3


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hr.offload with device='cpu'")
        yield


def _config():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=16)


def _base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config())


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0)


def _wrap(model):
    torch.manual_seed(5)  # the adapters' initialization draws random numbers
    return peft.get_peft_model(model, _lora_config())


def _store(kind: str, tmp_path):
    return "cpu" if kind == "cpu" else hr.DiskStore(tmp_path / "w")


def _optimizer(model, kind: str):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "host":
        return hr.HostOptimizer(params, torch.optim.AdamW, lr=1e-2, fused=False)
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _train(model, opt, steps: int = STEPS) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 96, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _values(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _reference():
    ref = _wrap(_base())
    init = _values(ref)
    losses = _train(ref, _optimizer(ref, "torch"))
    return ref, init, losses


def _check_adapters(model, where: str = "device", device: str = "cpu"):
    """The adapters rest in the store (``where="store"``) or stay on the device, ordinary
    parameters (the default); they train, the base does not."""
    lora = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    if where == "store":
        assert lora and all(binding(p) is not None for _, p in lora)
    else:
        assert lora and all(binding(p) is None and type(p) is torch.nn.Parameter
                            and p.device.type == device for _, p in lora)
    assert all(p.requires_grad for _, p in lora)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("adapters", ["device", "store"])
@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("opt", ["torch", "host"])
def test_offload_then_wrap_trains_like_plain_peft(store, opt, adapters, tmp_path):
    if store == "disk" and opt == "torch" and adapters == "store":
        pytest.skip("a torch.optim optimizer cannot step parameters on disk (tested below)")
    ref, init, losses = _reference()
    model = _base()
    hr.offload(model, device="cpu", store=_store(store, tmp_path), adapters=adapters)
    model = _wrap(model)
    _check_adapters(model, adapters)
    _assert_same(_values(model), init)  # the same initial adapters as plain PEFT
    plan, inner = hr.describe(model.base_model.model), model.base_model.model
    assert sum(len(b.params) for b in (*plan.blocks, plan.outside, plan.on_device)) == len(
        list(inner.parameters()))  # the adapters are in their layers' blocks, or kept
    if adapters == "store":
        assert len(plan.blocks[0].params) == 9 + 4 and not plan.on_device.params
    else:
        assert len(plan.blocks[0].params) == 9 and len(plan.on_device.params) == 8
        assert plan.device_budget == 2 * plan.largest_block_bytes + plan.outside.nbytes + sum(
            p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
    assert _train(model, _optimizer(model, opt)) == losses
    _assert_same(_values(model), _values(ref))


@pytest.mark.parametrize("adapters", ["device", "store"])
@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("opt", ["torch", "host"])
def test_wrap_then_offload_trains_like_plain_peft(store, opt, adapters, tmp_path):
    if store == "disk" and opt == "torch" and adapters == "store":
        pytest.skip("a torch.optim optimizer cannot step parameters on disk (tested below)")
    ref, init, losses = _reference()
    model = _wrap(_base())
    hr.offload(model, device="cpu", store=_store(store, tmp_path), adapters=adapters)
    _check_adapters(model, adapters)
    assert _train(model, _optimizer(model, opt)) == losses
    _assert_same(_values(model), _values(ref))


def test_torch_optimizer_on_disk_adapters_names_the_fix(tmp_path):
    model = _base()
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"), adapters="store")
    model = _wrap(model)
    opt = _optimizer(model, "torch")
    with pytest.raises(RuntimeError, match="HostOptimizer"):
        _train(model, opt, steps=1)


def _on_meta():
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(_config())


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_load_offload_wrap_trains_like_plain_peft(store, tmp_path):
    ref, init, losses = _reference()
    _base().save_pretrained(tmp_path / "base")
    model = _on_meta()
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    hr.load_weights(model, tmp_path / "base")
    model = _wrap(model)
    _check_adapters(model)
    _assert_same(_values(model), init)
    assert _train(model, _optimizer(model, "host")) == losses
    _assert_same(_values(model), _values(ref))


def test_wrap_on_meta_then_load_base_checkpoint(tmp_path):
    """meta -> get_peft_model -> offload to disk -> hr.load_weights(base): the base names map
    onto the wrapped layers (strictly); adapters come from where their values are."""
    ref = _wrap(_base())
    _base().save_pretrained(tmp_path / "base")
    ref.save_pretrained(tmp_path / "adapter")  # the adapters' initial values
    losses = _train(ref, _optimizer(ref, "torch"))
    model = _wrap(_on_meta())
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    hr.load_weights(model, tmp_path / "base")  # strict by default
    # The adapters PEFT made on meta have no values: never made up, nor initialized otherwise.
    assert all(v.is_meta for k, v in model.state_dict().items() if "lora_" in k)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="initial values are lost.*hr.init_adapters"):
        model(input_ids=ids)
    from safetensors.torch import load_file

    peft.set_peft_model_state_dict(model, load_file(tmp_path / "adapter" /
                                                    "adapter_model.safetensors"))
    assert _train(model, _optimizer(model, "host")) == losses
    _assert_same(_values(model), _values(ref))


def _reset_lora(model, seed: int) -> None:
    """What PEFT's initializer draws for every LoRA layer, in the model's order."""
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.reset_lora_parameters("default", True)


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_wrap_on_meta_then_init_adapters_trains_like_plain_peft(store, tmp_path):
    """meta -> get_peft_model -> offload -> hr.load_weights(base) -> hr.init_adapters: fresh
    adapters drawn by PEFT's own initializer (lora_B zero), training bitwise as plain PEFT
    from the same initial adapters; the base stays what the checkpoint holds."""
    _base().save_pretrained(tmp_path / "base")
    ref = _wrap(_base())
    _reset_lora(ref, 7)
    init = _values(ref)
    losses = _train(ref, _optimizer(ref, "torch"))
    model = _wrap(_on_meta())
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    hr.load_weights(model, tmp_path / "base")
    torch.manual_seed(7)
    names = hr.init_adapters(model)
    assert len(names) == 2 * 2 * 2 and all("lora_" in n for n in names)  # layers, q/v, A/B
    _assert_same(_values(model), init)
    assert all(not v.any() for k, v in init.items() if "lora_B" in k)
    assert all(v.abs().max() <= 1 / 32 ** 0.5 and v.std() > 0
               for k, v in init.items() if "lora_A" in k)  # kaiming_uniform_(a=sqrt 5) bound
    assert hr.init_adapters(model) == []  # nothing left without values: nothing redrawn
    _check_adapters(model, "store")  # created on meta: pending in the store
    assert _train(model, _optimizer(model, "host")) == losses
    _assert_same(_values(model), _values(ref))
    base = _values(_base())
    got = {k.removeprefix("base_model.model.").replace(".base_layer", ""): v
           for k, v in _values(model).items() if "lora_" not in k}
    _assert_same(got, base)


def test_init_adapters_refuses_what_it_cannot_draw(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="not offloaded"):
        hr.init_adapters(model)
    torch.manual_seed(5)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.LlamaForCausalLM(_config()), peft.LoraConfig(
            r=4, target_modules=["q_proj"], init_lora_weights="olora"))
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    with pytest.raises(RuntimeError, match="init_lora_weights='olora'.*reads the base weights"):
        hr.init_adapters(model)
    with pytest.raises(RuntimeError, match="initial values are lost"):  # still refused
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_load_weights_into_wrapped_model_is_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    base = _base()
    base.save_pretrained(tmp_path / "base")
    sd = load_file(tmp_path / "base" / "model.safetensors")
    model = _wrap(_on_meta())
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    short = dict(sd)
    del short["model.layers.1.self_attn.q_proj.weight"]
    save_file(short, tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match=r"missing \['base_model.model.model.layers.1.self_attn"
                                         r".q_proj.base_layer.weight'\]"):
        hr.load_weights(model, tmp_path / "short.safetensors")
    save_file({**sd, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        hr.load_weights(model, tmp_path / "extra.safetensors")
    hr.load_weights(model, tmp_path / "base")
    got = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    assert len(got) == len(sd)
    for k, v in got.items():
        want = sd[k.removeprefix("base_model.model.").replace(".base_layer", "")]
        assert torch.equal(v, want), k


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("safe", [False, True], ids=["merge", "safe-merge"])
def test_merge_and_unload_lands_in_the_store(store, safe, tmp_path):
    ref, _, _ = _reference()
    model = _base()
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    model = _wrap(model)
    _train(model, _optimizer(model, "host"))
    # safe_merge too on disk: the masters are StoreTensors, PEFT's NaN check reads the stored
    # base and its rebinding of the weight lands in the store
    merged = model.merge_and_unload(safe_merge=safe)
    want = ref.merge_and_unload(safe_merge=safe)
    _assert_same(_values(merged), _values(want))
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert len(state_of(merged).slots) == len(list(want.parameters()))
    ids = torch.randint(0, 96, (2, 8))
    assert torch.equal(merged(input_ids=ids).logits, want(input_ids=ids).logits)
    hr.save_weights(merged, tmp_path / "merged")  # streamed from the store
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    _assert_same(_values(back), _values(want))


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_adapter_save_pretrained_and_reload(store, tmp_path):
    model = _base()
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    model = _wrap(model)
    _train(model, _optimizer(model, "host"))
    base_before = {k: v for k, v in _values(model).items() if "lora_" not in k}
    model.save_pretrained(tmp_path / "adapter")
    trained = _values(model)
    plain = peft.PeftModel.from_pretrained(_base(), tmp_path / "adapter")
    _assert_same(_values(plain), trained)
    # ... and back into an offloaded base
    other = _base()
    hr.offload(other, device="cpu", store=_store(store, tmp_path / "2"))
    other = peft.PeftModel.from_pretrained(other, tmp_path / "adapter")
    _assert_same(_values(other), trained)
    # the base stayed untouched by training
    _assert_same({k: v for k, v in _values(model).items() if "lora_" not in k}, base_before)
    _assert_same({k.removeprefix("base_model.model.").replace(".base_layer", ""): v
                  for k, v in base_before.items()}, _values(_base()))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_interrupted_lora_step_on_disk_retries_exactly(where, tmp_path):
    """Ctrl-C in a LoRA step on a disk-resident base: the step is retried and training is
    bitwise that of plain PEFT (nothing was half-applied: the optimizer had not stepped)."""
    ref, _, losses = _reference()
    model = _base()
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "w"))
    model = _wrap(model)
    opt = _optimizer(model, "host")
    interrupt_lora_step(model, where)
    opt.zero_grad()
    if where == "forward":  # headroom's guards saw it; a backward cleans up at the next step
        assert not any(b.resident for b in state_of(model.base_model.model).blocks)
    assert _train(model, opt) == losses
    _assert_same(_values(model), _values(ref))


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_modules_to_save_after_offload(store, tmp_path):
    """modules_to_save copies a layer of the offloaded model (copy.deepcopy): the copy holds
    the stored values and is offloaded as a new trainable layer."""
    cfg = dict(target_modules=["q_proj"], modules_to_save=["lm_head"], lora_dropout=0.0)

    def wrap(m):
        torch.manual_seed(5)
        return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, **cfg))

    ref = wrap(_base())
    losses = _train(ref, _optimizer(ref, "host"))
    model = _base()
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    model = wrap(model)
    copy_ = model.base_model.model.lm_head.modules_to_save.default.weight
    assert binding(copy_) is not None and copy_.requires_grad
    assert _train(model, _optimizer(model, "host")) == losses
    _assert_same(_values(model), _values(ref))


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_deepcopy_of_offloaded_model_is_a_plain_copy(store, tmp_path):
    model = _base()
    want = _values(model)
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    dup = copy.deepcopy(model)
    assert type(dup) is transformers.LlamaForCausalLM  # not the guarded class
    assert all(binding(p) is None and p.device.type == "cpu" for p in dup.parameters())
    _assert_same(_values(dup), want)
    ids = torch.randint(0, 96, (2, 8))
    assert torch.equal(dup(input_ids=ids).logits, model(input_ids=ids).logits)
    assert not dup._forward_pre_hooks and not dup.model.layers[0]._forward_hooks


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_merge_adapter_and_unmerge_on_an_offloaded_base(store, tmp_path):
    ref, _, _ = _reference()
    model = _base()
    hr.offload(model, device="cpu", store=_store(store, tmp_path))
    model = _wrap(model)
    _train(model, _optimizer(model, "host"))
    ids = torch.randint(0, 96, (2, 8))
    for m in (ref, model):
        m.merge_adapter()
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    _assert_same(_values(model), _values(ref))
    for m in (ref, model):
        m.unmerge_adapter()
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    _assert_same(_values(model), _values(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("order", ["wrap-first", "offload-first"])
def test_lora_on_accelerator_matches_plain_peft(store, order, tmp_path):
    from tests.conftest import accelerator_type

    dev = accelerator_type()
    ref = _wrap(_base().to(dev))
    losses = []
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    model = _base()
    if order == "wrap-first":
        model = _wrap(model)
    hr.offload(model, device=dev, store=_store(store, tmp_path))
    if order == "offload-first":
        model = _wrap(model)
    _check_adapters(model, device=dev)
    opt = hr.HostOptimizer([p for p in model.parameters() if p.requires_grad],
                           torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (2, 8), generator=g).to(dev)
        for m, o, out in ((ref, opt_ref, losses), (model, opt, None)):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            if out is not None:
                out.append(loss.item())
            else:
                torch.testing.assert_close(loss.item(), losses[-1], rtol=1e-4, atol=1e-5)
    got, want = model.state_dict(), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), rtol=1e-4, atol=1e-5)


def test_clip_grad_norm_sees_only_the_adapters_after_offload_then_wrap():
    """get_peft_model freezes the base after hr.offload: frozen parameters outside the blocks
    (embedding, final norm, head) get no gradient, so clipping sees what plain PEFT sees."""

    def norms(offload: bool) -> list[float]:
        model = _base()
        if offload:
            hr.offload(model, device="cpu", store="cpu")
        model = _wrap(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(STEPS):
            ids = torch.randint(0, 96, (2, 8), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            out.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).item())
            opt.step()
            opt.zero_grad()
        return out

    assert norms(True) == norms(False)


def _two_adapters(store, tmp_path):
    """Adapters "one" and "two" on the base (offloaded first unless ``store`` is None), both
    trainable; each step uses one of them (set_adapter), so the other gets no gradient."""
    model = _base()
    if store is not None:
        hr.offload(model, device="cpu", store=_store(store, tmp_path))
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(model, cfg, adapter_name="one")
    model.add_adapter("two", cfg)
    return model


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_switching_adapters_with_model_zero_grad_steps_only_the_active_one(store, tmp_path):
    # model.zero_grad() (as transformers.Trainer clears) between steps: the adapter not used
    # in a step keeps its values, as plain PEFT with torch's AdamW does; before, HostOptimizer
    # stepped it again with the gradient of the step it was last used in.
    def train(model, opt):
        g = torch.Generator().manual_seed(1)
        for s in range(4):
            model.set_adapter("one" if s % 2 == 0 else "two")
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.requires_grad_(True)  # both adapters trainable, one used per step
            ids = torch.randint(0, 96, (2, 8), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            model.zero_grad()
        return _values(model)

    ref = _two_adapters(None, tmp_path)
    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False))
    model = _two_adapters(store, tmp_path)
    got = train(model, hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                        fused=False))
    _assert_same(got, want)
    fresh = _values(_two_adapters(None, tmp_path))
    for name in ("one", "two"):  # each adapter was trained in its steps
        k = next(k for k in want if f".lora_A.{name}." in k)
        assert not torch.equal(want[k], fresh[k]), k


def test_lora_over_a_bf16_base_in_host_memory_with_a_32k_vocabulary():
    """A bf16 base with a 32k vocabulary (the output layer a block of its own) in host memory on
    the CPU, LoRA on every linear layer, clipped: bitwise the resident PEFT model, and the frozen
    base is not copied per step (its device copies show the stored weights)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.n += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).requires_grad_(False)
    lora = peft.LoraConfig(r=8, target_modules="all-linear")
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(base), lora)
    hr.offload(base, device="cpu", store="cpu")
    assert [s.name for s in state_of(base).blocks[-1].slots] == ["lm_head.weight"]
    torch.manual_seed(1)
    model = peft.get_peft_model(base, lora)
    ids = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(0))
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
            for m in (ref, model)]
    copies = []
    for _ in range(3):
        losses = []
        for m, opt in zip((ref, model), opts, strict=True):
            Copies.n = 0
            with Copies():
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
            copies.append(Copies.n)
            torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(*losses)
    assert copies[-1] == copies[-2]  # forward and backward copy no more than the resident model
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
