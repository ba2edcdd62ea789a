"""What the all-or-nothing step costs when the parameters rest on disk: ``atomic`` on and off.

A bf16 model on ``device="cpu"``, its parameters on a `hr.DiskStore` (page cache off, so every
byte goes to the disk), ``hr.HostOptimizer(AdamW)`` with fp32 masters and state in host memory
(the placement for a model whose masters and state fit in RAM but not its parameters too),
gradients summed where the model computes (``grad_accumulation="device"``), ``--accum``
micro-batches per step. Side by side in one process, their steps interleaved round by round:

* ``atomic``: ``HostOptimizer(..., atomic=True)`` (the default): before the step overwrites the
  masters and state in host memory, their old values are written to the parameters' disk, so
  a step failing part-way is undone.
* ``not_atomic``: ``atomic=False``: no such copies; a step failing part-way is reported as a
  mix of old and new values.
* ``reference``: the same model resident in RAM, fp32 masters and sums of the bf16 gradients
  kept by hand, ``torch.optim.AdamW(fused=True)`` on the masters.

Reports per step: wall time (median of ``--steps`` after a warm-up), the store's bytes read and
written, and checks that both headroom runs end bitwise equal to ``reference``. Writes
``benchmarks/results/atomic_step.json``.

    .venv/bin/python benchmarks/atomic_step.py
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
from grad_accumulation import build, collect, ratios, setup, timed_rounds

import headroom as hr

ROOT = Path(__file__).resolve().parent.parent


class Reference:
    """bf16 parameters in RAM, fp32 masters and fp32 sums of the gradients, fused AdamW."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.masters = [p.detach().float() for p in self.params]
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)
        self.opt = torch.optim.AdamW(self.masters, lr=1e-3, fused=True)

    def after_backward(self) -> None:
        for i, p in enumerate(self.params):
            g, p.grad = p.grad, None
            if self.sums[i] is None:
                self.sums[i] = g.float()
            else:
                self.sums[i].add_(g)

    @torch.no_grad()
    def step(self) -> None:
        for m, s in zip(self.masters, self.sums, strict=True):
            m.grad = s
        self.opt.step()
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)
            m.grad = None
        self.sums = [None] * len(self.params)


def main() -> None:
    args, root = setup(__doc__, "atomic_step", accum=2, steps=5)

    runs = {}
    for mode in ("reference", "atomic", "not_atomic"):
        model = build(args.width, args.blocks).to(torch.bfloat16)
        store = None
        if mode == "reference":
            opt = Reference(model)
        else:
            store = hr.DiskStore(root / f"params-{mode}", page_cache=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hr.offload(model, device="cpu", store=store, grad_accumulation="device")
            opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                   atomic=mode == "atomic")
        runs[mode] = {"model": model, "opt": opt, "store": store, "times": [], "read": [],
                      "written": []}
    n_params = sum(p.numel() for p in runs["reference"]["model"].parameters())
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(args.batch, args.width, generator=g).to(torch.bfloat16)
                for _ in range(args.accum)] for _ in range(args.steps + 1)]

    def step(mode, r, xs) -> None:
        for x in xs:
            (r["model"](x).float().square().mean() / len(xs)).backward()
            if mode == "reference":
                r["opt"].after_backward()
        r["opt"].step()
        if mode != "reference":
            r["opt"].zero_grad()

    timed_rounds(runs, batches, step)

    out = collect("atomic_step", args, runs, "reference", "exact_vs_reference", n_params)
    out["not_atomic_vs_atomic"] = ratios(out["results"]["not_atomic"], out["results"]["atomic"])
    print(f"{n_params / 1e6:.0f}M parameters (bf16), {args.accum} micro-batches of {args.batch}")
    for mode, res in out["results"].items():
        io = (f", disk read {res['disk_read_bytes_per_step'] / n_params:.1f} B/param, written"
              f" {res['disk_written_bytes_per_step'] / n_params:.1f} B/param (the kernel's"
              f" count: {res['os_written_bytes_per_step'] / n_params:.1f})"
              if "disk_read_bytes_per_step" in res else "")
        print(f"  {mode:>10}: {res['median_step_s']:.2f} s/step{io},"
              f" exact {res['exact_vs_reference']}")
    rounded = {k: round(v, 3) for k, v in out["not_atomic_vs_atomic"].items()}
    print("  not_atomic / atomic:", rounded)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("wrote", args.out)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
