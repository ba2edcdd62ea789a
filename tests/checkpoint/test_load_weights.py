"""hr.load_weights: a model built on meta, offloaded, filled from safetensors as
save_pretrained writes them; exact against from_pretrained, clear errors, little memory."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.store import DiskStore
from headroom.transfer import binding

transformers = pytest.importorskip("transformers")
SRC = Path(hr.__file__).resolve().parents[1]


def _gpt2_cfg():
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2,
                                   bos_token_id=0, eos_token_id=0)


def _llama_cfg():
    return transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=4, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=16)


def _bert_cfg():
    return transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                   num_attention_heads=2, intermediate_size=64,
                                   max_position_embeddings=16)


MODELS = {
    "gpt2": (_gpt2_cfg, lambda: transformers.GPT2LMHeadModel),
    "llama": (_llama_cfg, lambda: transformers.LlamaForCausalLM),
    "bert": (_bert_cfg, lambda: transformers.BertForMaskedLM),
}


def _checkpoint(name: str, tmp_path: Path, **save_kw) -> tuple[nn.Module, Path]:
    """A model saved with save_pretrained in several shards, and from_pretrained of it."""
    cfg, cls = MODELS[name][0](), MODELS[name][1]()
    torch.manual_seed(0)
    src = cls(cfg)
    path = tmp_path / f"ckpt-{name}"
    src.save_pretrained(path, max_shard_size="20KB", **save_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = cls.from_pretrained(path)
    return ref, path


def _meta(name: str) -> nn.Module:
    cfg, cls = MODELS[name][0](), MODELS[name][1]()
    with torch.device("meta"):
        return cls(cfg)


def _offload(model, store):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hr.offload(model, device="cpu", store=store)


def _store(kind: str, tmp_path: Path):
    return "cpu" if kind == "cpu" else DiskStore(tmp_path / "store", threads=2)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_meta_model_loaded_from_shards_equals_from_pretrained(name, kind, tmp_path):
    ref, path = _checkpoint(name, tmp_path)
    assert (path / "model.safetensors.index.json").exists()  # really sharded
    model = _offload(_meta(name), _store(kind, tmp_path))
    hr.load_weights(model, path)
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    for (n, b), (_, c) in zip(ref.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(b, c), n  # buffers not in the files (rotary inv_freq) as the model
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    ref.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    ref.train(), model.train()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        for m, o in ((ref, opt_ref), (model, opt)):
            torch.manual_seed(2)  # same dropout masks
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k


def test_single_file_and_dtype_conversion(tmp_path):
    """A bf16 checkpoint into an fp32 model: the values are the bf16 ones, widened."""
    ref, _ = _checkpoint("gpt2", tmp_path)
    from safetensors.torch import save_file

    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in ref.state_dict().items()
          if k != "lm_head.weight"}  # tied: one name is enough
    save_file(sd, tmp_path / "w.safetensors")
    model = _offload(_meta("gpt2"), DiskStore(tmp_path / "s"))
    hr.load_weights(model, tmp_path / "w.safetensors")
    got = model.state_dict()
    for k, v in sd.items():
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], v.float()), k
    assert got["lm_head.weight"].data_ptr() == got["transformer.wte.weight"].data_ptr() or \
        torch.equal(got["lm_head.weight"], got["transformer.wte.weight"])


def test_plain_model_and_meta_model_without_offload(tmp_path):
    ref, path = _checkpoint("llama", tmp_path)
    plain = MODELS["llama"][1]()(_llama_cfg())
    hr.load_weights(plain, path)
    meta = _meta("llama")
    hr.load_weights(meta, path)  # materialized on the CPU
    for m in (plain, meta):
        for k, v in ref.state_dict().items():
            assert torch.equal(m.state_dict()[k], v), k


def test_mismatches_are_named_and_nothing_is_written(tmp_path):
    ref, path = _checkpoint("gpt2", tmp_path)
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    model = _offload(copy.deepcopy(ref), DiskStore(tmp_path / "s"))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    bad = dict(sd)
    bad.pop("transformer.h.1.mlp.c_fc.weight")
    bad["extra.weight"] = torch.zeros(2)
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=r"missing \['transformer\.h\.1\.mlp\.c_fc\.weight'\]"
                       r".*unexpected \['extra\.weight'\]"):
        hr.load_weights(model, tmp_path / "bad.safetensors")

    wrong = dict(sd)
    wrong["transformer.h.0.attn.c_attn.bias"] = torch.zeros(7)
    save_file(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match=r"shapes differ for transformer\.h\.0\.attn\.c_attn"
                       r"\.bias: checkpoint \[7\], model \[96\]"):
        hr.load_weights(model, tmp_path / "wrong.safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # nothing was written

    hr.load_weights(model, tmp_path / "bad.safetensors", strict=False)  # the rest loads

    (tmp_path / "trunc.safetensors").write_bytes((tmp_path / "bad.safetensors").read_bytes()[:64])
    with pytest.raises(ValueError, match="trunc.safetensors.*truncated or damaged"):
        hr.load_weights(model, tmp_path / "trunc.safetensors")
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json.*not a valid"):
        hr.load_weights(model, path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        hr.load_weights(model, tmp_path / "nothing-here")


class NoInit(nn.Module):
    """A module without reset_parameters (like transformers' Conv1D or RMSNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))

    def forward(self, x):
        return x @ self.w


def test_meta_module_without_initialization_needs_weights(tmp_path):
    def make():
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), NoInit()) for _ in range(2)])

    with torch.device("meta"):
        model = make()
    _offload(model, DiskStore(tmp_path / "s"))  # accepted: values may come from a checkpoint
    with pytest.raises(RuntimeError, match=r"0\.1\.w.*no reset_parameters.*hr\.load_weights"):
        model(torch.randn(2, 8))
    torch.manual_seed(0)
    src = make()
    for m in src.modules():
        if isinstance(m, NoInit):
            nn.init.normal_(m.w)
    from safetensors.torch import save_file

    save_file(src.state_dict(), tmp_path / "w.safetensors")
    hr.load_weights(model, tmp_path / "w.safetensors")
    x = torch.randn(2, 8)
    assert torch.equal(model(x), src(x))


def test_meta_model_not_loaded_is_initialized_as_built_on_cpu(tmp_path):
    """Parameters of a meta model that no checkpoint filled get their module's initialization
    when first needed, in registration order: the values of a model built on the CPU."""
    def make():
        return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 3))

    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = make()
    _offload(lazy, DiskStore(tmp_path / "s"))
    assert not binding(lazy[0].weight).has_value
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the global RNG untouched
    assert torch.equal(lazy(x), eager(x))


def test_loading_adds_only_a_small_window_of_memory(tmp_path):
    """A ~230 MB model loaded into a DiskStore in a fresh process: peak RSS grows by less than
    0.3x the model's size (the checkpoint is read a few megabytes at a time)."""
    cfg = transformers.GPT2Config(vocab_size=8192, n_positions=64, n_embd=1024, n_layer=4,
                                  n_head=8, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    src = transformers.GPT2LMHeadModel(cfg)
    size = sum(p.numel() * p.element_size() for p in src.parameters())
    src.save_pretrained(tmp_path / "ckpt", max_shard_size="100MB")
    del src
    script = textwrap.dedent(f"""
        import json, warnings, torch, transformers, headroom as hr
        warnings.simplefilter("ignore")
        def rss(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        cfg = transformers.GPT2Config.from_pretrained({str(tmp_path / 'ckpt')!r})
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(cfg)
        hr.offload(model, device="cpu", store=hr.DiskStore({str(tmp_path / 'store')!r}))
        before = rss("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # peak RSS from here on
        hr.load_weights(model, {str(tmp_path / 'ckpt')!r})
        print(json.dumps({{"before": before, "peak": rss("VmHWM")}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    growth = got["peak"] - got["before"]
    assert growth < 0.3 * size, (growth, size)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fine_tune_in_bf16_from_disk_and_save_back(name, tmp_path):
    """The whole use case on small models: built on meta, loaded from save_pretrained's shards
    into a DiskStore, fine-tuned in bf16 with HostOptimizer, saved back in shards that
    from_pretrained reads, equal to the same fine-tuning done without headroom (fp32 masters by
    hand)."""
    _, path = _checkpoint(name, tmp_path)
    cls = MODELS[name][1]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = cls.from_pretrained(path, dtype=torch.bfloat16).train()
    with torch.device("meta"):  # as transformers builds a bf16 model (fp32 rotary buffers)
        model = transformers.AutoModelForCausalLM.from_config(MODELS[name][0](),
                                                              dtype=torch.bfloat16)
    _offload(model, DiskStore(tmp_path / "weights", threads=2))
    hr.load_weights(model, path)  # fp32 files into bf16 parameters
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                           state_store=DiskStore(tmp_path / "state", threads=2))
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(masters, lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        for m in (ref, model):
            torch.manual_seed(2)
            m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        for mst, p in zip(masters, ref.parameters(), strict=True):
            mst.grad = p.grad.float()
            p.grad = None
        opt_ref.step()
        opt_ref.zero_grad()
        with torch.no_grad():
            for mst, p in zip(masters, ref.parameters(), strict=True):
                p.copy_(mst)
    out = tmp_path / "finetuned"
    files = hr.save_weights(model, out, max_shard_size="30KB")
    assert len(files) > 2 and files[-1].name == "model.safetensors.index.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = cls.from_pretrained(out, dtype=torch.bfloat16)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
