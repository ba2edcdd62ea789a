"""FSDP2 (fully_shard) with headroom on CPU with gloo: the wrong orders refused at the call,
each rank's local shards in its store and training bitwise equal to FSDP2 alone, memory
tracking of a rank's shards, hr.convert of a sharded model.

Each world size runs all its cases in one set of spawned processes (a module-scoped fixture).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import _workers as w

W = "tests.distributed._fsdp_workers"
CASES = {
    "refusals": ("refusals", dict(tmp=True)),
    "host_opt": ("train", dict()),
    "torch_opt": ("train", dict(host=False)),
    "accumulate": ("train", dict(micro=2)),
    "bf16": ("train", dict(bf16=True, clip=None)),
    "partial": ("train", dict(partial=True)),
    "checkpoint": ("checkpoint", dict(tmp=True)),
    "unoffload": ("unoffload", dict()),
    "offload_interrupted": ("offload_interrupted", dict()),
    "tracking": ("tracking", dict()),
    "tracking_offloaded": ("tracking", dict(offloaded=True)),
    "convert": ("convert", dict()),
}
WORLD4 = ["host_opt", "accumulate"]


def _spawn(world: int, names: list[str], tmp) -> dict:
    jobs = []
    for n in names:
        fn, kw = CASES[n]
        kw = dict(kw)
        if kw.get("tmp"):
            kw["tmp"] = str(tmp / f"{n}-{world}")
        jobs.append((f"{W}:{fn}", kw))
    return w.run_named(world, dict(zip(names, jobs, strict=True)))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(2, list(CASES), tmp_path_factory.mktemp("fsdp2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _spawn(4, WORLD4, tmp_path_factory.mktemp("fsdp4"))


# ------------------------------------------------------------------ wrong orders
def test_offload_of_sharded_model_on_disk_is_refused(world2):
    for r in world2["refusals"]:
        assert r["offload_disk"].startswith("NotImplementedError")
        assert "store='cpu'" in r["offload_disk"]


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("where", ["block", "root"])
def test_fully_shard_over_offloaded_model_is_refused(world2, store, where):
    for r in world2["refusals"]:
        msg = r[f"shard_offloaded_{store}_{where}"]
        assert msg.startswith("RuntimeError: fully_shard cannot wrap a model offloaded"), msg
        assert "fully_shard each block, then the root" in msg and "hr.unoffload" in msg


def test_fully_shard_inside_an_offloaded_block_is_refused_at_forward(world2):
    for r in world2["refusals"]:
        assert r["shard_offloaded_inner"].startswith("RuntimeError: fully_shard cannot wrap")


def test_right_order_after_a_refusal_trains(world2):
    for r in world2["refusals"]:
        assert r["refused_then"].startswith("RuntimeError: fully_shard cannot wrap")
        assert r["right_order_grads"] == 14  # every parameter of Net got its gradient


@pytest.mark.parametrize("key", ["data_parallel", "data_parallel_offloaded"])
def test_data_parallel_of_sharded_model_is_refused(world2, key):
    for r in world2["refusals"]:
        assert r[key].startswith("RuntimeError: hr.data_parallel cannot wrap a fully_shard'ed")


def test_ddp_over_offloaded_model_is_refused(world2):
    for r in world2["refusals"]:
        assert "hr.data_parallel(model)" in r["ddp_offloaded"]


def test_dtensor_into_a_store_is_an_error(world2):
    for r in world2["refusals"]:
        for k in ("disk_put_dtensor", "disk_write_dtensor", "host_put_dtensor"):
            assert r[k].startswith("TypeError") and "to_local()" in r[k], (k, r[k])
        assert r["disk_keys_after"] == 0  # the refused put left nothing behind


def test_dtensor_parameters_outside_fsdp_are_refused(world2):
    for r in world2["refusals"]:
        assert r["offload_tp"].startswith("RuntimeError: hr.offload: parameter 'weight' is a"
                                          " DTensor that FSDP2")


def test_host_optimizer_state_on_disk_for_shards_is_refused_when_built(world2):
    for r in world2["refusals"]:
        assert r["host_opt_state_disk"].startswith("NotImplementedError: state_store=")
        assert "state_store='cpu'" in r["host_opt_state_disk"]


def test_host_optimizer_over_shards_it_cannot_step_is_refused_when_built(world2):
    for r in world2["refusals"]:
        got = r["host_opt_unoffloaded_bf16"]
        assert got.startswith("NotImplementedError: HostOptimizer cannot step a sharded"), got
        assert "hr.offload(model" in got


# ------------------------------------------------------------------ the contract
def _equal(results, key_got="got", key_ref="ref"):
    for rank, r in enumerate(results):
        assert r[key_got].keys() == r[key_ref].keys()
        for n in r[key_ref]:
            assert torch.equal(r[key_got][n], r[key_ref][n]), (rank, n)


@pytest.mark.parametrize("case", ["host_opt", "torch_opt", "accumulate", "bf16", "partial"])
def test_offloaded_shards_train_bitwise_like_fsdp2(world2, case):
    _equal(world2[case])
    for r in world2[case]:
        assert all(r["in_store"].values()) and r["in_store"]  # shards live in the store
        # Only this rank's shards: 1/world of the model (no padding with these shapes).
        assert r["stored_bytes"] == r["store_used"] == r["local_bytes"]
        assert r["units"] == (2 if case == "partial" else 4)


@pytest.mark.parametrize("case", WORLD4)
def test_offloaded_shards_train_bitwise_like_fsdp2_4_ranks(world4, case):
    _equal(world4[case])
    full = sum(t.nbytes for t in world4[case][0]["ref"].values()) * 4
    for r in world4[case]:
        assert r["stored_bytes"] * 4 == full


def test_dcp_round_trip_lands_in_the_store(world2):
    _equal(world2["checkpoint"])
    for r in world2["checkpoint"]:
        assert torch.equal(r["out"], r["out_ref"])
        assert r["in_store"].all()


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Three jobs: 2 ranks train and save; 4 ranks load, train and save; 2 ranks load, train."""
    tmp = str(tmp_path_factory.mktemp("reshard"))
    fn = f"{W}:resharded"
    return [
        w.run_named(2, {"job": (fn, dict(tmp=tmp, save_to="a", first=0))})["job"],
        w.run_named(4, {"job": (fn, dict(tmp=tmp, load_from="a", save_to="b", first=2))})["job"],
        w.run_named(2, {"job": (fn, dict(tmp=tmp, load_from="b", first=4))})["job"],
    ]


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and len(a) > 28, what  # 14 parameters, their Adam state
    for k in a:
        assert torch.equal(a[k], b[k]), (what, k)


def test_dcp_round_trip_to_another_world_size_is_exact(resharded):
    """Model and HostOptimizer state saved by 2 ranks, loaded by 4 (and 4 -> 2) through
    get_state_dict / set_state_dict, training on: bitwise FSDP2 alone doing the same."""
    (a, b, c) = resharded
    for job in (a, b, c):
        _equal(job)
        for r in job:
            assert r["in_store"].all() and len(r["in_store"]) == 14
    # Uneven, padded shards of the head's 5 rows: 3 + 2 on 2 ranks, 2 + 2 + 1 + 0 on 4.
    assert [int(r["rows"]) for r in b] == [2, 2, 1, 0]
    for job, tag in ((a, "a"), (b, "b")):
        _same(job[0]["saved_hr"], job[0]["saved_ref"], f"saved {tag}")
    for saved, loaded, tag in ((a, b, "2 -> 4"), (b, c, "4 -> 2")):
        for r in loaded:
            for side in ("hr", "ref"):
                _same(r[f"loaded_{side}"], saved[0][f"saved_{side}"], f"{tag} {side}")


def test_unoffload_puts_the_shards_back(world2):
    _equal(world2["unoffload"])
    for r in world2["unoffload"]:
        assert r["store_after"] == 0 and r["offloaded"] == 0


def test_an_interrupted_offload_leaves_the_model_as_fsdp2_had_it(world2):
    _equal(world2["offload_interrupted"])
    for r in world2["offload_interrupted"]:
        assert r["error"] == "KeyboardInterrupt"
        assert r["moved"] == 0 and r["recorded"] == 0
        assert r["again"] > 0


# ------------------------------------------------------------------ tracking, convert
@pytest.mark.parametrize("case", ["tracking", "tracking_offloaded"])
def test_track_memory_counts_the_local_shards(world2, case):
    for r in world2[case]:
        for cat, local in r["local"].items():
            assert abs(r["tracked"][cat] - local) <= 0.01 * local, (cat, r["tracked"], local)
        assert "no advice: the model is sharded with FSDP2" in r["report"]


def test_convert_of_sharded_model_copy(world2):
    _equal(world2["convert"])
    for r in world2["convert"]:
        assert r["converted"] == 1 and r["unchanged"] == 1


# ------------------------------------------------------------------ multi-node launch
def test_two_nodes_launched_by_torchrun(tmp_path):
    """Two "nodes" of one rank each on loopback, each its own ``torchrun --nnodes=2
    --node-rank=R`` (static rendezvous): FSDP2 + headroom bitwise like FSDP2 alone."""
    script = Path(__file__).with_name("_torchrun_train.py")
    port = w.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path if p)}
    procs = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc-per-node=1", f"--node-rank={node}",
                   f"--rdzv-endpoint=127.0.0.1:{port}", "--local-addr=127.0.0.1",
                   "--max-restarts=0", str(script), str(tmp_path)]
            with open(tmp_path / f"node{node}.log", "w") as log:  # no pipe to fill and block
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        end = time.monotonic() + 90
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        alive = [p for p in procs if p.poll() is None]
        for p in alive:  # torchrun stops its worker (in a session of its own) on SIGTERM
            p.terminate()
        for p in alive:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for node, p in enumerate(procs):
        log = (tmp_path / f"node{node}.log").read_text()
        assert p.returncode == 0, f"node {node} exited with {p.returncode}:\n{log[-3000:]}"
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for node, r in enumerate(res):
        assert r["env"] == {"RANK": node, "WORLD_SIZE": 2, "GROUP_RANK": node, "LOCAL_RANK": 0}
        assert torch.equal(r["loss"], r["loss_ref"])
    _equal(res)
    # Each node holds its own half of every weight.
    assert not torch.equal(res[0]["got"]["head.weight"], res[1]["got"]["head.weight"])
