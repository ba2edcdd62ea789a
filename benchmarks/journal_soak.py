"""A long training soak with everything a step writes on disk: are the DiskStores' journals and
folders bounded?

A small model (an embedding, 4 residual MLP blocks, a head: 26 parameter tensors) on
``device="cpu"``, its parameters on a `hr.DiskStore` (``params``), ``hr.HostOptimizer(AdamW)``
with its state on a second one (``state``), activations offloaded to a third
(``hr.offload_activations``, ``act``), for ``--steps`` steps with the stores' real compaction
threshold (``COMPACT_BYTES``, 4 MiB). The host optimizer reserves journal space for each whole
step, so the state store's journal is written only under a reservation.

Recorded, every ``--every`` steps and at the end, for each store: the journal's bytes, the
index's bytes, the folder's bytes (every file in it) and the number of compactions so far (a
count of ``Ledger._compact`` calls while training, besides the ones at opening); the largest
journal seen after any step; and whether the parameters end bitwise equal to plain
``torch.optim.AdamW(fused=True)`` trained on a copy with the same batches. Writes
``benchmarks/results/journal_soak.json``.

    .venv/bin/python benchmarks/journal_soak.py --steps 5000
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import headroom as hr
from headroom.transfer import _ledger

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' model
from tests.optim._models import make_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STORES = ("params", "state", "act")



def loss_fn(model: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randint(0, 37, (6, 7), generator=g), torch.randn(6, 7, 5, generator=g)
    return ((model(x) - y) ** 2).mean()


def folder_sizes(folder: Path) -> dict[str, int]:
    files = [f for f in folder.iterdir() if f.is_file()]
    return {"journal": (folder / _ledger.JOURNAL).stat().st_size,
            "index": (folder / _ledger.INDEX).stat().st_size,
            "folder": sum(f.stat().st_size for f in files), "files": len(files)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/journal_soak.json"))
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="journal-soak-"))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    folders = {n: root / n for n in STORES}

    compactions: collections.Counter[str] = collections.Counter()
    real_compact = _ledger.Ledger._compact

    def counted(self, *, clean: bool) -> None:
        compactions[self.path.name] += 1
        real_compact(self, clean=clean)

    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu": the mechanics, which is what is soaked
        hr.offload(model, device="cpu", store=hr.DiskStore(folders["params"]))
    state, act = hr.DiskStore(folders["state"]), hr.DiskStore(folders["act"])
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1,
                           state_store=state)
    _ledger.Ledger._compact = counted  # from here on: compactions while training
    samples, peak = [], dict.fromkeys(STORES, 0)
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss_fn(ref, i).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with hr.offload_activations(store=act, min_bytes=0):
            loss_fn(model, i).backward()
        opt.step()
        opt.zero_grad()
        for n, f in folders.items():
            peak[n] = max(peak[n], (f / _ledger.JOURNAL).stat().st_size)
        if (i + 1) % args.every == 0 or i + 1 == args.steps:
            samples.append({"step": i + 1, "seconds": round(time.perf_counter() - t0, 1),
                            **{n: {**folder_sizes(f), "compactions": compactions[n]}
                               for n, f in folders.items()}})
            print(json.dumps(samples[-1]), flush=True)
    exact = all(torch.equal(p.detach(), q.detach())
                for p, q in zip(ref.parameters(), model.parameters(), strict=True))
    _ledger.Ledger._compact = real_compact
    state.close()
    act.close()
    out = {
        "command": f"benchmarks/journal_soak.py --steps {args.steps} --every {args.every}",
        "commit": commit, "torch": torch.__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(), "compact_bytes": _ledger.COMPACT_BYTES,
        "steps": args.steps, "bitwise_equal_to_torch_adamw_fused": exact,
        "max_journal_bytes_after_a_step": peak,
        "max_folder_bytes": {n: max(s[n]["folder"] for s in samples) for n in STORES},
        "compactions": {n: compactions[n] for n in STORES},
        "samples": samples,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))


if __name__ == "__main__":
    main()
