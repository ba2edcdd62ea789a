"""hr.patch_causal_lm on tiny transformers causal LMs: the model's own loss and gradients, no
``tokens x vocab`` logits, eval unchanged, Trainer and LoRA, failures and undo."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import headroom as hr
from headroom.residency._offload import state_of
from tests.heads._lm_models import FAMILIES, VOCAB, tiny_causal_lm

B, S = 2, 32
TOKENS = B * S


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that is not trained on
    labels[1, -3:] = -100  # padding
    return ids, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, **kw)
    out.loss.backward()
    return out, _grads(model)


def _assert_same(got, want, **tol):
    (out, grads), (ref, ref_grads) = got, want
    torch.testing.assert_close(out.loss, ref.loss, **tol)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **tol, msg=n)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_the_models_own(family):
    model = tiny_causal_lm(family).train()
    ids, labels = _batch()
    ref = _step(model, ids, labels)
    assert ref[0].logits.shape == (B, S, VOCAB)
    handle = hr.patch_causal_lm(model)
    assert handle.softcap == (0.5 if family.startswith("gemma") else None)
    for _ in range(2):  # the first call checks the logits of one position, the second none
        got = _step(model, ids, labels)
        assert got[0].logits is None
        _assert_same(got, ref)


class MaxNumel(TorchDispatchMode):
    """The largest tensor any op creates, forward and backward (an independent count)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_no_logits_in_training(family):
    model = tiny_causal_lm(family).train()
    ids, labels = _batch()
    logits_bytes = TOKENS * VOCAB * 4

    def measure():
        model.zero_grad(set_to_none=True)
        with MaxNumel() as seen, hr.track_memory(model=model) as mem:
            model(ids, labels=labels).loss.backward()
        return seen.largest, mem.peak

    plain_largest, plain_peak = measure()
    assert plain_largest >= TOKENS * VOCAB  # the count sees the logits when they exist
    handle = hr.patch_causal_lm(model)
    measure()  # the first call keeps one position per sequence for its check
    largest, peak = measure()
    # nothing larger than the biggest weight (its gradient: vocab x 32); logits are 2x that
    assert largest <= max(p.numel() for p in model.parameters()) < TOKENS * VOCAB
    # the weights, their gradients (a tied embedding's two parts are summed: one more) and the
    # loss's buffers: a chunk of at most half the rows' logits (two with a soft cap), and small
    # change; the plain run holds several logits-sized tensors on top
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peak <= 3 * params + logits_bytes + (1 << 20)
    assert plain_peak - peak >= logits_bytes
    handle.remove()


def test_eval_and_no_labels_run_as_before():
    model = tiny_causal_lm("gemma2")
    ids, labels = _batch()
    model.eval()
    with torch.no_grad():
        ref_eval = model(ids, labels=labels)
    model.train()
    ref_train_logits = model(ids).logits
    hr.patch_causal_lm(model)
    model.eval()
    with torch.no_grad():
        out = model(ids, labels=labels)
    assert torch.equal(out.loss, ref_eval.loss) and torch.equal(out.logits, ref_eval.logits)
    model.train()
    assert torch.equal(model(ids).logits, ref_train_logits)


def test_num_items_in_batch_shift_labels_and_positional_labels():
    model = tiny_causal_lm("qwen2").train()
    ids, labels = _batch()
    n = torch.tensor(71)
    shifted = torch.cat([labels[:, 1:], torch.full((B, 1), -100)], 1)
    refs = [_step(model, ids, labels, num_items_in_batch=n)]
    # labels by position: every leading parameter of forward before it, by position
    names = ["input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds",
             "labels"]
    assert list(inspect.signature(model.forward).parameters)[:6] == names
    hr.patch_causal_lm(model)
    _assert_same(_step(model, ids, labels, num_items_in_batch=n), refs[0])
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=None, shift_labels=shifted)
    assert out.loss is None and out.logits.shape == (B, S, VOCAB)  # no labels: not patched
    model.zero_grad(set_to_none=True)
    out = model(ids, None, None, None, None, labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, _step(model, ids, labels)[0].loss)


def test_shift_labels_with_labels_given():
    # transformers uses shift_labels as given (no shift) when both are passed
    model = tiny_causal_lm("llama").train()
    ids, labels = _batch()
    other = torch.randint(0, VOCAB, (B, S))
    ref = _step(model, ids, labels, shift_labels=other)
    hr.patch_causal_lm(model)
    _assert_same(_step(model, ids, labels, shift_labels=other), ref)


def test_bf16_model_within_bf16_tolerance():
    model = tiny_causal_lm("gemma3", dtype=torch.bfloat16).train()
    ids, labels = _batch()
    ref = _step(model, ids, labels)
    hr.patch_causal_lm(model)
    got = _step(model, ids, labels)
    assert got[0].loss.dtype == torch.float32  # as the model's own loss (logits.float())
    # the model rounds its logits to bf16 before the loss; the patch keeps them in fp32
    _assert_same(got, ref, rtol=2e-2, atol=2e-3)


def test_under_trainer_equals_plain(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids, labels = _batch(seed=i)
            return {"input_ids": ids[0], "labels": labels[0]}

    def train(patch):
        torch.manual_seed(0)
        model = tiny_causal_lm("llama")
        handle = hr.patch_causal_lm(model) if patch else None
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(patch)), max_steps=3, per_device_train_batch_size=2,
            gradient_accumulation_steps=2, learning_rate=1e-2, report_to=[], use_cpu=True,
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
            dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if handle is not None:
            assert handle.active and handle._checked
        return model, losses

    plain, plain_losses = train(False)
    patched, losses = train(True)
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses))
    for (n, a), b in zip(patched.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


@pytest.mark.parametrize("order", ["patch_then_lora", "lora_then_patch"])
def test_with_lora(order):
    peft = pytest.importorskip("peft")
    model = tiny_causal_lm("mistral")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                          init_lora_weights=False)
    ids, labels = _batch()
    lora = peft.get_peft_model(model, cfg).train()
    ref = _step(lora, ids, labels)
    assert all("lora_" in n for n in ref[1])
    # the transformers model inside (as when it is patched before get_peft_model), or the
    # peft model around it
    handle = hr.patch_causal_lm(lora.get_base_model() if order == "patch_then_lora" else lora)
    got = _step(lora, ids, labels)
    assert got[0].logits is None
    _assert_same(got, ref)
    handle.remove()


def test_lora_on_lm_head_is_refused():
    peft = pytest.importorskip("peft")
    model = tiny_causal_lm("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(TypeError, match="plain nn.Linear.*keep lm_head out of target_modules"):
        hr.patch_causal_lm(lora)
    # patched first, adapter on lm_head afterwards: refused at the next training call
    model = tiny_causal_lm("llama")
    hr.patch_causal_lm(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head"])).train()
    ids, labels = _batch()
    with pytest.raises(RuntimeError, match="output layer is now .*LoRA on lm_head"):
        lora(ids, labels=labels)


def test_unknown_logit_transform_is_refused():
    # a model that scales its logits (as Cohere's logit_scale does) would get another loss
    model = tiny_causal_lm("llama").train()
    model.lm_head.register_forward_hook(lambda m, a, out: out * 0.25)
    hr.patch_causal_lm(model)
    ids, labels = _batch()
    with pytest.raises(RuntimeError, match="logits are not lm_head.*logit scale"):
        model(ids, labels=labels)


def test_undo_double_patch_and_context_manager():
    model = tiny_causal_lm("gpt2").train()
    ids, labels = _batch()
    ref = _step(model, ids, labels)
    handle = hr.patch_causal_lm(model)
    with pytest.raises(RuntimeError, match="already patched"):
        hr.patch_causal_lm(model)
    handle.remove()
    handle.remove()  # idempotent
    assert not handle.active
    out = _step(model, ids, labels)
    assert out[0].logits.shape == (B, S, VOCAB)
    _assert_same(out, ref)
    with hr.patch_causal_lm(model) as handle:
        assert model(ids, labels=labels).logits is None
    assert model(ids, labels=labels).logits is not None
    with pytest.raises(TypeError, match="plain nn.Linear"):
        hr.patch_causal_lm(torch.nn.Linear(3, 3))


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_forward_leaves_nothing_armed(exc):
    model = tiny_causal_lm("llama").train()
    ids, labels = _batch()
    ref = _step(model, ids, labels)
    hr.patch_causal_lm(model)
    _step(model, ids, labels)  # past the first call's check

    def boom(*a):
        raise exc("injected")

    h = model.model.layers[0].register_forward_pre_hook(boom)
    with pytest.raises(exc, match="injected"):
        model(ids, labels=labels)
    h.remove()
    # the output layer called directly returns its full logits, and training goes on exactly
    hidden = torch.randn(B, S, 32)
    assert model.lm_head(hidden).shape == (B, S, VOCAB)
    _assert_same(_step(model, ids, labels), ref)


def _offloaded_grads(model):
    # an offloaded parameter's gradient rests in the store (p.grad reads it)
    return {n: p.grad.detach().to("cpu").clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("slice_size", [None, 4096])
@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("family,head_in_block", [("llama", True), ("llama", False),
                                                  ("gpt2", False)])
def test_offloaded_model_equals_the_plain_one(family, head_in_block, store, slice_size,
                                              tmp_path):
    # lm_head as a block of its own (fetched for its forward, and again for backward), or with
    # the parameters outside the blocks (resident from forward to the end of backward); GPT-2's
    # is tied to the embedding. Slices of the vocabulary read the weight again in backward;
    # automatic ones here take the path that forms the gradients in forward.
    torch.manual_seed(0)
    plain = tiny_causal_lm(family, layers=2).train()
    model = copy.deepcopy(plain)
    ids, labels = _batch()
    ref = _step(plain, ids, labels)
    layers = model.model.layers if family == "llama" else model.transformer.h
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # store="cpu" on the CPU saves nothing: it says so
        hr.offload(model, device="cpu",
                   store="cpu" if store == "cpu" else hr.DiskStore(tmp_path / "s"),
                   blocks=None if head_in_block else list(layers))
    blocks = [b.name for b in state_of(model).blocks]
    assert ("lm_head" in blocks) == head_in_block
    handle = hr.patch_causal_lm(model, slice_size=slice_size)
    for _ in range(2):  # the first call checks one position's logits
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels)
        assert out.logits is None
        out.loss.backward()
        _assert_same((out, _offloaded_grads(model)), ref)
    handle.remove()
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels)  # unpatched: the model's own loss, as before
    assert out.logits.shape == (B, S, VOCAB)




def test_offloaded_on_disk_trains_like_plain_with_host_optimizer(tmp_path):
    # the use this is for: a model bigger than memory, its loss without logits, steps by
    # HostOptimizer; the weights after three steps are those of plain SGD with momentum on
    # the plain model (Adam would magnify the rounding of near-zero gradients)
    torch.manual_seed(0)
    plain = tiny_causal_lm("gpt2", layers=2).train()
    model = copy.deepcopy(plain)
    hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / "s"))
    hr.patch_causal_lm(model, slice_size=4096)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    for seed in range(3):
        ids, labels = _batch(seed)
        for m, o in ((plain, ref_opt), (model, opt)):
            o.zero_grad(set_to_none=True)
            m(ids, labels=labels).loss.backward()
            o.step()
    got = model.state_dict()
    for n, p in plain.state_dict().items():
        torch.testing.assert_close(got[n].to("cpu"), p, msg=n)


def test_offloaded_output_layer_whose_output_is_detached_is_refused():
    # the loss of an offloaded output layer travels through its output in autograd
    model = tiny_causal_lm("llama", layers=2).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store="cpu")
    model.lm_head.register_forward_hook(lambda m, a, out: out.detach())
    hr.patch_causal_lm(model, slice_size=4096)
    ids, labels = _batch()
    with pytest.raises(RuntimeError, match="logits do not depend on its output layer"):
        model(ids, labels=labels)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_offloaded_failure_mid_step_leaves_the_next_steps_exact(where):
    # a forward stopped after the output layer's hooks ran, or a loss whose backward raised
    # (double backward is refused) after the carry handed it its gradient: the next steps
    # are the plain model's
    torch.manual_seed(0)
    plain = tiny_causal_lm("llama", layers=2).train()
    model = copy.deepcopy(plain)
    ids, labels = _batch()
    ref = _step(plain, ids, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store="cpu")
    hr.patch_causal_lm(model, slice_size=4096)
    model(ids, labels=labels).loss.backward()  # past the first call's check
    if where == "forward":
        def boom(*a):
            raise KeyboardInterrupt("injected")

        h = model.lm_head.register_forward_hook(boom)
        with pytest.raises(KeyboardInterrupt, match="injected"):
            model(ids, labels=labels)
        h.remove()
    else:
        with pytest.raises(RuntimeError, match="double backward"):
            model(ids, labels=labels).loss.backward(create_graph=True)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=labels)
        out.loss.backward()
        _assert_same((out, _offloaded_grads(model)), ref)


def test_compiled_patched_model_equals_the_models_own():
    # torch.compile of the patched model: the loss is one custom operator inside the graph, the
    # rest inductor's; loss and gradients as the eager model's own (inductor's kernels differ in
    # rounding: assert_close), and still no tokens x vocab logits
    torch._dynamo.reset()
    model = tiny_causal_lm("llama").train()
    ids, labels = _batch()
    ref = _step(model, ids, labels)
    hr.patch_causal_lm(model)
    compiled = torch.compile(model, backend="inductor")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = compiled(ids, labels=labels)
        out.loss.backward()
        assert out.logits is None
        _assert_same((out, _grads(model)), ref, rtol=1e-4, atol=1e-5)
