"""accelerate (prepare, accumulate, backward, clip_grad_norm_, save_state/load_state) with
hr.offload + hr.HostOptimizer: bitwise the run without headroom."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.integrations._models import (
    assert_same_state,
    count_holds,
    llama,
    offload,
    optimizer,
    state,
    token_ids,
)

pytest.importorskip("accelerate")

MODES = {"fp32": (torch.float32, "no"), "bf16-autocast": (torch.float32, "bf16"),
         "bf16-weights": (torch.bfloat16, "no")}
ACCUM = 2
MICRO = 8  # micro-batches: 4 optimizer steps


def _accelerator(mp: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # accelerate keeps one process-wide state; each run here starts from a fresh one.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, mixed_precision=mp)


def _run(mode: str, store: str | None, headroom: bool, tmp_path, *, resume_at: int | None,
         **offload_kw):
    """Train MICRO micro-batches; with ``resume_at``, save_state there and go on from a new
    model, optimizer and accelerator that load_state it."""
    dtype, mp = MODES[mode]
    data = token_ids(2 * MICRO)
    norms: list[float] = []

    def part(lo: int, hi: int, load: str | None, save: str | None, sub: str):
        acc = _accelerator(mp)
        model = offload(llama(dtype), store, tmp_path / sub, **offload_kw)
        opt = optimizer(model, headroom)
        dl = torch.utils.data.DataLoader(data[2 * lo:2 * hi], batch_size=2)
        model, opt, dl = acc.prepare(model, opt, dl)
        if load is not None:
            acc.load_state(load)
        for x in dl:
            with acc.accumulate(model):
                acc.backward(model(input_ids=x, labels=x).loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
                opt.step()
                opt.zero_grad()
        if save is not None:
            acc.save_state(save)
        return acc.unwrap_model(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if resume_at is None:
            model = part(0, MICRO, None, None, "a")
        else:
            ck = str(tmp_path / "ck")
            part(0, resume_at, None, ck, "a")
            model = part(resume_at, MICRO, ck, None, "b")
    return norms, state(model)


@pytest.mark.parametrize("mode", list(MODES))
def test_accelerate_loop_with_offload_and_host_optimizer_is_exact(mode, tmp_path):
    ref_norms, ref_state = _run(mode, None, mode == "bf16-weights", tmp_path / "ref",
                                resume_at=None)
    assert len(ref_norms) == MICRO // ACCUM and any(n > 1.0 for n in ref_norms)
    for store in ("cpu", "disk"):
        norms, st = _run(mode, store, True, tmp_path / store, resume_at=MICRO // 2)
        assert norms == ref_norms, store
        assert_same_state(ref_state, st)


@pytest.mark.parametrize("mode", ["fp32", "bf16-weights"])
def test_gradients_summed_on_the_device_are_exact(mode, tmp_path, monkeypatch):
    """hr.offload(grad_accumulation="device") under accelerate's accumulate(): its clipping
    reads the sums, the skipped steps and zero_grads of the first micro-batch leave them."""
    holds = count_holds(monkeypatch)
    ref_norms, ref_state = _run(mode, None, mode == "bf16-weights", tmp_path / "ref",
                                resume_at=None)
    for store in ("cpu", "disk"):
        norms, st = _run(mode, store, True, tmp_path / store, resume_at=MICRO // 2,
                         grad_accumulation="device")
        assert norms == ref_norms, store
        assert_same_state(ref_state, st)
    assert holds[0] > 0


# ------------------------------------------------------------------ several processes
@pytest.mark.slow
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_two_processes_with_data_parallel_recipe_is_exact(store, tmp_path):
    """``accelerate launch`` with 2 CPU processes (gloo): hr.offload, hr.data_parallel, then
    prepare(optimizer, loader), with accumulate and clip_grad_norm_: on each rank the same
    norms and the same parameters, bitwise, as plain accelerate (prepare wraps DDP)."""
    script = Path(__file__).with_name("_accelerate_train.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path if p)}
    # --multi_gpu picks accelerate's torchrun launcher (its --cpu launcher of several processes
    # needs MPI); the script's Accelerator(cpu=True) then runs on gloo.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), str(script), str(tmp_path), store]
    with open(tmp_path / "launch.log", "w") as log:  # no pipe to fill and block
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = (tmp_path / "launch.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for r, out in enumerate(res):
        assert (out["rank"], out["world"]) == (r, 2)
        assert len(out["ref_norms"]) == 2 and all(n > 0.5 for n in out["ref_norms"])  # clipped
        assert out["norms"] == out["ref_norms"]
        assert_same_state(out["ref_state"], out["state"])
    assert_same_state(res[0]["state"], res[1]["state"])  # the replicas agree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
