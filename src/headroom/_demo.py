"""``headroom demo``: headroom's features on small models, each measured live against plain PyTorch.

Every number printed is measured in this run by ``hr.track_memory``, and every "exact" is a
``torch.equal`` (or, for the loss over classes, ``torch.testing.assert_close``) check.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import headroom as hr
from headroom.memory import format_bytes


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class DemoNet(nn.Module):
    """A residual MLP classifier: enough structure for a readable per-module report."""

    def __init__(self, in_features: int = 64, dim: int = 256, depth: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(in_features, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _task(n: int, in_features: int, classes: int, generator: torch.Generator):
    """A learnable synthetic task: labels from a fixed random teacher network."""
    teacher = torch.randn(in_features, classes, generator=generator)
    x = torch.randn(n, in_features, generator=generator)
    return x, (x @ teacher).argmax(dim=1)


def _mib(n: int) -> str:
    return f"{n / 2**20:7.2f} MiB"


def _train(model, opt, x_all, y_all, steps: int, *, bar=None, mem=None) -> None:
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        idx = torch.randint(0, x_all.shape[0], (128,), generator=g)
        loss = F.cross_entropy(model(x_all[idx]), y_all[idx])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if bar is not None:
            bar.update(1)
            if step % 10 == 0 and mem is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", peak=format_bytes(mem.peak))


def progress(total: int, desc: str) -> Any:
    """A progress bar on stderr when a terminal; none in a file or pipe (a line per redraw)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=None)


def _part_track(steps: int, out: Path, plot: bool) -> list[Path]:
    print("== 1. where memory goes: hr.track_memory on a training run")
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x_all, y_all = _task(8192, 64, 10, g)
    model = DemoNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def accuracy() -> float:
        with torch.no_grad():
            return (model(x_all[:2048]).argmax(1) == y_all[:2048]).float().mean().item()

    before = accuracy()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        with progress(steps, "training") as bar:
            _train(model, opt, x_all, y_all, steps, bar=bar, mem=mem)
    print(f"trained {steps} steps: accuracy {before:.1%} -> {accuracy():.1%}\n")
    mem.report()
    written = [out.with_suffix(".json")]
    mem.to_json(written[0])
    if plot:
        written.append(out.with_suffix(".png"))
        mem.plot(written[1], title=f"headroom demo: {steps} steps of DemoNet (cpu)")
    return written


def _part_offload(steps: int) -> None:
    print("\n== 2. parameters, gradients and Adam state on disk: hr.offload + hr.HostOptimizer")
    g = torch.Generator().manual_seed(0)
    x_all, y_all = _task(4096, 64, 10, g)
    torch.manual_seed(0)
    plain = DemoNet(depth=8)
    model = copy.deepcopy(plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    with hr.track_memory(model=plain, optimizer=plain_opt) as mem_plain:
        _train(plain, plain_opt, x_all, y_all, steps)
    with tempfile.TemporaryDirectory(prefix="headroom-demo-") as tmp:
        hr.offload(model, device="cpu", store=hr.DiskStore(Path(tmp) / "params"), prefetch=1)
        opt = hr.HostOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            lr=1e-3,
            state_store=hr.DiskStore(Path(tmp) / "adam"),
        )
        largest = max(sum(p.numel() for p in blk.parameters()) for blk in model.blocks)
        outside = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
        budget = (2 * largest + outside) * 4
        with hr.track_memory() as mem:
            _train(model, opt, x_all, y_all, steps)
        opt.close()
        hr.unoffload(model)
    exact = all(
        torch.equal(a, b)
        for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
    )
    print(f"{'max resident, ' + str(steps) + ' steps':<28}{'plain':>12}{'offloaded':>14}")
    for cat in ("parameters", "gradients", "optimizer_state"):
        print(
            f"{cat:<28}{_mib(mem_plain.max_by_category[cat]):>12}"
            f"{_mib(mem.max_by_category[cat]):>14}"
        )
    print(f"{'peak, all categories':<28}{_mib(mem_plain.peak):>12}{_mib(mem.peak):>14}")
    print(
        f"offload keeps at most 2 of 8 blocks on the device ({_mib(budget).strip()} with the "
        "small layers outside blocks); the host optimizer streams slices, reusing their buffers"
    )
    print(f"parameters after training bitwise equal to plain AdamW(fused=True): {exact}")


def _part_convert() -> None:
    print("\n== 3. keep less for backward: hr.convert, fine-tuning only the norms")

    def cnn() -> nn.Module:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in [(3, 32), (32, 64), (64, 64), (64, 128)]:
            layers += [nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU()]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))

    x = torch.randn(16, 3, 32, 32)
    results = {}
    for name, model in (("plain", cnn()), ("converted", hr.convert(cnn()))):
        for m in model.modules():
            for p in m.parameters(recurse=False):
                p.requires_grad_(isinstance(m, nn.BatchNorm2d))
        with hr.track_memory(model=model) as mem:
            loss = model(x).square().mean()
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results[name] = (mem.max_by_category["activations"], loss.detach(), grads)
    (a_plain, l_plain, g_plain), (a_conv, l_conv, g_conv) = results["plain"], results["converted"]
    exact = torch.equal(l_plain, l_conv) and all(
        torch.equal(a, b) for a, b in zip(g_plain, g_conv, strict=True)
    )
    print(
        f"activations saved for backward: plain {_mib(a_plain)}, converted {_mib(a_conv)}"
        f" ({a_conv / a_plain:.0%}); loss and gradients bitwise equal: {exact}"
    )


def _part_classes() -> None:
    print("\n== 4. cross-entropy over 131072 classes without the batch x classes logits")
    torch.manual_seed(0)
    b, d, c = 256, 64, 131072
    x = torch.randn(b, d, requires_grad=True)
    w = (torch.randn(c, d) * 0.05).requires_grad_()
    y = torch.randint(0, c, (b,))
    out = {}
    for name, fn in (
        ("plain", lambda: F.cross_entropy(x @ w.T, y)),
        ("headroom", lambda: hr.linear_cross_entropy(x, w, y)),
    ):
        x.grad = w.grad = None
        with hr.track_memory() as mem:
            loss = fn()
            loss.backward()
        out[name] = (mem.peak - 2 * w.numel() * 4, loss.detach(), w.grad.clone())
    (p_plain, l_plain, g_plain), (p_ours, l_ours, g_ours) = out["plain"], out["headroom"]
    torch.testing.assert_close(l_ours, l_plain)
    torch.testing.assert_close(g_ours, g_plain)
    print(
        f"peak beyond the weight and its gradient: plain {_mib(p_plain)}, "
        f"linear_cross_entropy {_mib(p_ours)}; loss and gradients match "
        "(torch.testing.assert_close)"
    )


def _part_hf() -> None:
    print("\n== 5. a Hugging Face model from its safetensors: on disk, fine-tuned in bf16, saved")
    try:
        import transformers
    except ImportError:
        print("skipped: transformers is not installed (pip install transformers)")
        return
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    cfg = transformers.GPT2Config(n_layer=4, n_embd=384, n_head=6, vocab_size=8192,
                                  n_positions=64, bos_token_id=0, eos_token_id=0)
    with tempfile.TemporaryDirectory(prefix="headroom-demo-") as tmp:
        ckpt, out = Path(tmp) / "pretrained", Path(tmp) / "finetuned"
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(
            ckpt, max_shard_size="8MB")  # stands in for a downloaded checkpoint
        with torch.device("meta"):  # shapes only: never whole in memory
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with hr.track_memory() as mem:
            hr.offload(model, device="cpu", store=hr.DiskStore(Path(tmp) / "weights"))
            hr.load_weights(model, ckpt)
            opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                   state_store=hr.DiskStore(Path(tmp) / "adam"))
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
            losses = []
            for _ in range(3):  # a few steps on one batch
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            files = hr.save_weights(model, out, max_shard_size="8MB")
            opt.close()
        n = sum(p.numel() for p in model.parameters())
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        same = all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    state = n * (2 + 4 + 4 + 8)  # bf16 weights, fp32 gradients, fp32 masters, Adam moments
    print(f"GPT-2-like model, {n / 1e6:.0f}M bf16 parameters; training state (weights, fp32"
          f" gradients, fp32 masters, Adam) {_mib(state).strip()} on disk")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; process RSS grew"
          f" by {_mib(mem.rss['peak'] - mem.rss['start']).strip()} (tracked tensors peaked at"
          f" {_mib(mem.peak).strip()})")
    print(f"saved back as {len(files) - 1} shards and their index; from_pretrained reads the"
          f" fine-tuned values: {same}")


def _part_activations() -> None:
    print("\n== 6. what backward needs rests on disk: hr.offload_activations")
    torch.manual_seed(0)
    plain = nn.Sequential(*[_Block(256) for _ in range(6)])
    ours = copy.deepcopy(plain)
    x = torch.randn(8, 128, 256)
    with tempfile.TemporaryDirectory(prefix="headroom-demo-") as tmp:
        store = hr.DiskStore(Path(tmp) / "activations")
        with hr.track_memory() as mem_plain:
            plain(x).square().mean().backward()
        with hr.track_memory() as mem_ours, hr.offload_activations(
                store=store, min_bytes=256 << 10, prefetch=4 << 20):
            ours(x).square().mean().backward()
        store.close()
    exact = all(torch.equal(a.grad, b.grad)
                for a, b in zip(plain.parameters(), ours.parameters(), strict=True))
    on_disk = mem_ours.resting_max.get("disk", {}).get("activations", 0)
    act_plain = mem_plain.max_by_category["activations"]
    print(f"activations in RAM at their peak: plain {_mib(act_plain)},"
          f" offloaded {_mib(mem_ours.max_by_category['activations'])} (up to"
          f" {_mib(on_disk).strip()} resting on disk); peak of the step: plain"
          f" {_mib(mem_plain.peak).strip()}, offloaded {_mib(mem_ours.peak).strip()}")
    print(f"gradients bitwise equal: {exact}")


def run_demo(*, steps: int = 300, out: Path = Path("headroom_demo"), plot: bool = True) -> int:
    """Run the six parts; write the first part's JSON (and PNG) with prefix ``out``."""
    if steps < 1:
        print("headroom demo: --steps must be at least 1", file=sys.stderr)
        return 2
    written = _part_track(steps, Path(out), plot)
    _part_offload(min(steps, 30))
    _part_convert()
    _part_classes()
    _part_hf()
    _part_activations()
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
