"""A training script as ``accelerate launch --cpu --num_processes 2`` runs it on each process.

The documented multi-process recipe (hr.offload, then ``model = hr.data_parallel(model)``, then
``accelerator.prepare(optimizer, loader)`` without the model) and, in the same job, plain
accelerate (``prepare(model, optimizer, loader)``, which wraps DDP); with ``accumulate``,
``backward`` and ``clip_grad_norm_``. Each rank writes its results to ``<dir>/rank<R>.pt``.

Usage: accelerate launch --cpu --num_processes 2 tests/integrations/_accelerate_train.py DIR STORE
       (tests/integrations/test_accelerate.py runs it; STORE is ``cpu`` or ``disk``)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import headroom as hr
from tests.integrations._models import llama, optimizer, state, token_ids

ACCUM = 2
MICRO = 4  # micro-batches per rank: 2 optimizer steps


def _accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a fresh process-wide state for each run of the job
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)


def _train(out: Path, store: str | None) -> tuple[list[float], dict]:
    acc = _accelerator()
    model = llama()
    loader = torch.utils.data.DataLoader(token_ids(2 * 2 * MICRO), batch_size=2)
    if store is None:  # plain accelerate: prepare wraps the model in DDP
        opt = optimizer(model, False)
        model, opt, loader = acc.prepare(model, opt, loader)
    else:  # the headroom recipe: offload, then hr.data_parallel, then prepare the rest
        st = hr.DiskStore(out / f"store{acc.process_index}") if store == "disk" else "cpu"
        hr.offload(model, device=acc.device, store=st)
        model = hr.data_parallel(model)
        opt = optimizer(model, True)
        opt, loader = acc.prepare(opt, loader)
    norms = []
    for x in loader:
        with acc.accumulate(model):
            acc.backward(model(input_ids=x, labels=x).loss)
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), 0.5).item())
            opt.step()
            opt.zero_grad()
    if store is None:
        return norms, state(acc.unwrap_model(model))
    # A checkpoint of the inner model and the optimizer, loaded into a fresh offloaded pair.
    ck = out / f"ck{acc.process_index}.safetensors"
    hr.save(ck, model.module, opt)
    fresh = hr.offload(llama(), device=acc.device, store="cpu")
    fresh_opt = optimizer(fresh, True)
    hr.load(ck, fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(state(model.module).values(),
                                                  state(fresh).values(), strict=True))
    return norms, state(model.module)


def main(out_dir: str, store: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device="cpu" with a host store saves nothing
        ref_norms, ref_state = _train(out, None)
        norms, got = _train(out, store)
    import torch.distributed as dist

    torch.save({"rank": dist.get_rank(), "world": dist.get_world_size(), "norms": norms,
                "ref_norms": ref_norms, "state": got, "ref_state": ref_state},
               out / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
