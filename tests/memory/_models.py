"""Models and steps shared by the estimator's feature tests and benchmarks/estimate_accuracy.py.

``build(name, offload=..., host=...)`` makes one of the models with headroom's features applied
as a user would; ``measure`` tracks a steady-state step under ``hr.track_memory``.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
from torch import nn

import headroom as hr


def mlp() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
                            for _ in range(4)], nn.Linear(128, 4))
    return model, (torch.randn(64, 128),)


def transformer() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), \
        (torch.randn(4, 32, 64),)


def gpt2() -> tuple[nn.Module, tuple]:
    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=500,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    return model, (torch.randint(0, 500, (4, 32)),)


MODELS = {"mlp": mlp, "transformer": transformer, "gpt2": gpt2}


def loss_fn(out) -> torch.Tensor:
    out = getattr(out, "logits", out)
    return out.float().square().mean()


def build(name: str, folder: Path, *, offload: tuple[str, int] | None = None,
          host: tuple[str, bool] | None = None):
    """The model ``name`` with `with_features`. Returns model, args, optimizer."""
    model, args = MODELS[name]()
    return model, args, with_features(model, folder, offload=offload, host=host)


def with_features(model: nn.Module, folder: Path, *, offload: tuple[str, int] | None = None,
                  host: tuple[str, bool] | None = None,
                  slice_bytes: int = 64 << 10) -> torch.optim.Optimizer:
    """``hr.offload(model, store, prefetch)`` (``"cpu"`` or ``"disk"``, in ``folder``) and the
    optimizer: ``hr.HostOptimizer(state, overlap)``, or ``torch.optim.AdamW`` when ``host`` is
    ``None``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # store="cpu" on a cpu device saves nothing: known
        if offload is not None:
            store, prefetch = offload
            hr.offload(model, device="cpu", prefetch=prefetch,
                       store="cpu" if store == "cpu" else hr.DiskStore(folder / "params"))
    if host is not None:
        state, overlap = host
        return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, overlap=overlap,
                                state_store="cpu" if state == "cpu"
                                else hr.DiskStore(folder / "state"), slice_bytes=slice_bytes)
    return torch.optim.AdamW(model.parameters())


def measure(model: nn.Module, args: tuple, opt, loss=loss_fn, *,
            steps: int = 1) -> hr.memory.MemoryTracker:
    """``hr.track_memory`` over a steady-state step (after a first one), run as a loop would:
    backward inside ``final_backward()`` for a host optimizer with overlap.

    With ``steps > 1`` each of that many steps is tracked and the one with the lowest peak is
    returned: the step in which the store's writes kept up with backward. `hr.estimate` takes
    store I/O as done at once; on a loaded machine a gradient whose disk write has not run yet
    is still in memory while the next block computes (about 7% over in a small model)."""
    final = getattr(opt, "final_backward", None)

    def step() -> None:
        with final() if final is not None else contextlib.nullcontext():
            loss(model(*args)).backward()
        opt.step()
        opt.zero_grad()

    step()
    best = None
    for _ in range(steps):
        with hr.track_memory(model=model, optimizer=opt) as mem:
            step()
        if best is None or mem.peak < best.peak:
            best = mem
    return best
