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
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from tests.distributed import _workers as w

W = "tests.distributed._fsdp_workers"
_HAS_RESET = hasattr(FSDPParamGroup, "_reset_iter_state")  # not in torch 2.11 and older
CASES = {
    "refusals": ("refusals", dict(tmp=True)),
    "host_opt": ("train", dict()),
    "torch_opt": ("train", dict(host=False)),
    "accumulate": ("train", dict(micro=2)),
    "bf16": ("train", dict(bf16=True, clip=None)),
    "partial": ("train", dict(partial=True)),
    "padded": ("train", dict(classes=5)),
    "final": ("train", dict(final=True, clip=None, micro=2)),
    "checkpoint": ("checkpoint", dict(tmp=True)),
    "unoffload": ("unoffload", dict()),
    "offload_interrupted": ("offload_interrupted", dict()),
    "tracking": ("tracking", dict()),
    "tracking_offloaded": ("tracking", dict(offloaded=True)),
    "tracking_disk": ("tracking", dict(offloaded=True, store="disk", tmp=True)),
    "convert": ("convert", dict()),
    # Each rank's shards on its own DiskStore.
    "host_opt_disk": ("train", dict(store="disk", tmp=True)),
    "accumulate_disk": ("train", dict(store="disk", micro=2, tmp=True)),
    "bf16_disk": ("train", dict(store="disk", bf16=True, clip=None, tmp=True)),
    "bf16_accumulate_disk": ("train", dict(store="disk", bf16=True, micro=2, tmp=True)),
    "partial_disk": ("train", dict(store="disk", partial=True, tmp=True)),
    "padded_disk": ("train", dict(store="disk", classes=5, tmp=True)),
    "state_disk": ("train", dict(store="disk", state_disk=True, micro=2, tmp=True)),
    "prefetch0_disk": ("train", dict(store="disk", prefetch=0, tmp=True)),
    "final_disk": ("train", dict(store="disk", final=True, clip=None, micro=2, tmp=True)),
    "prefetch2_disk": ("train", dict(store="disk", prefetch=2, tmp=True)),
    "no_reset_disk": ("train", dict(store="disk", no_reset=True, tmp=True)),
    "checkpoint_disk": ("checkpoint", dict(store="disk", tmp=True)),
    "unoffload_disk": ("unoffload", dict(store="disk", tmp=True)),
    "offload_interrupted_disk": ("offload_interrupted", dict(store="disk", tmp=True)),
    "failures_disk": ("failures", dict(tmp=True)),
    "direct_access_disk": ("direct_access", dict(tmp=True)),
    "compiled": ("compiled", dict()),
    "moves": ("moves", dict()),
    "refused_swap": ("offload_refused_swap", dict()),
    "refused_swap_disk": ("offload_refused_swap", dict(store="disk", tmp=True)),
    "optimizer_before": ("optimizer_before", dict()),
    "optimizer_before_disk": ("optimizer_before", dict(store="disk", tmp=True)),
    "moves_disk": ("moves", dict(store="disk", tmp=True)),
    "llama_ckpt_disk": ("llama", dict(mode="ckpt", store="disk", tmp=True)),
    "llama_lora": ("llama", dict(mode="lora")),
    "llama_lora_disk": ("llama", dict(mode="lora", store="disk", tmp=True)),
    "compiled_inductor_disk": ("compiled", dict(store="disk", backend="inductor", tmp=True)),
}
WORLD4 = ["host_opt", "accumulate", "host_opt_disk", "accumulate_disk", "padded_disk"]
TRAIN = ["host_opt", "torch_opt", "accumulate", "bf16", "partial", "padded", "final"]
TRAIN_DISK = ["host_opt", "accumulate", "bf16", "bf16_accumulate", "partial", "padded", "state",
              "prefetch0", "prefetch2", "final", "no_reset"]


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
def test_offload_onto_a_disk_store_of_an_earlier_run_is_refused(world2):
    for r in world2["refusals"]:
        msg = r["offload_disk_reopened"]
        assert msg.startswith("RuntimeError: DiskStore(") and "already holds" in msg, msg
        assert "overwrite=True" in msg and "torch.distributed.checkpoint" in msg
        assert r["reopened_untouched"] == 1
        msg = r["held_sums"]
        assert msg.startswith("NotImplementedError: grad_accumulation='device' is not"), msg
        assert "leave the default" in msg and r["held_untouched"] == 1
        assert "set_requires_gradient_sync(False)" in msg


@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("where", ["block", "root", "parent"])
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


def test_plain_optimizer_and_host_clip_on_shards_on_disk_are_refused(world2):
    for r in world2["refusals"]:
        assert r["torch_opt_disk"].startswith("RuntimeError: AdamW cannot step parameters"
                                              " offloaded to a DiskStore"), r["torch_opt_disk"]
        assert "hr.HostOptimizer(model.parameters(), torch.optim.AdamW" in r["torch_opt_disk"]
        assert r["host_clip_disk"].startswith("RuntimeError: HostOptimizer.clip_grad_norm_ sees"
                                              " only this rank's shards")
        assert "torch.nn.utils.clip_grad_norm_(model.parameters()" in r["host_clip_disk"]


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


@pytest.mark.parametrize("case", TRAIN)
def test_offloaded_shards_train_bitwise_like_fsdp2(world2, case):
    _equal(world2[case])
    if case == "padded":  # host memory holds the padded shards FSDP2 all-gathers: on rank 1
        # a row of 16 and one element of the bias
        assert [r["stored_bytes"] - r["local_bytes"] for r in world2[case]] == [0, 4 * 17]
    for r in world2[case]:
        assert r["early"] == (14 * 3 if case == "final" else 0)  # stepped during backward
        assert all(r["in_store"].values()) and r["in_store"]  # shards live in the store
        if case == "padded":
            assert r["stored_bytes"] == r["store_used"]
            continue
        # Only this rank's shards: 1/world of the model (no padding with these shapes).
        assert r["stored_bytes"] == r["store_used"] == r["local_bytes"]
        assert r["units"] == (2 if case == "partial" else 4)


@pytest.mark.parametrize("case", TRAIN_DISK)
def test_shards_on_disk_train_bitwise_like_fsdp2(world2, case):
    prefetch = int(case[-1]) if case.startswith("prefetch") else 1
    _check_disk(world2[f"{case}_disk"], partial=case == "partial",
                state_on_disk=case == "state", prefetch=prefetch)
    for r in world2[f"{case}_disk"]:
        # final_backward: every shard (14 parameters) stepped during backward in each of
        # the 3 steps, as its reduce-scatter finished, bitwise the same; without it, none.
        assert r["early"] == (14 * 3 if case == "final" else 0)
        # FSDP2 of torch 2.11 and older has no _reset_iter_state: the rest is wrapped, and
        # trains alike
        reset = [] if case == "no_reset" or not _HAS_RESET else ["_reset_iter_state"]
        assert r["wrapped"] == [sorted(["unshard", "wait_for_unshard", *reset])] * r["units"]


def _check_disk(results, *, partial: bool = False, state_on_disk: bool = False,
                prefetch: int = 1) -> None:
    _equal(results)
    for r in results:
        assert r["units"] == (2 if partial else 4)
        # The unpadded local shards, in the files and nowhere else: no parameter of an
        # offloaded unit holds host memory between steps.
        assert r["stored_bytes"] == r["on_disk"] == r["local_bytes"]
        assert all(r["in_store"].values()) and r["in_store"]
        assert r["resident"] == 0
        # During training, host memory held at most the shards of the unit being all-gathered
        # (each dropped once copied) and of the `prefetch` units read ahead, not all of them.
        assert 0 < r["peak_resident"] <= (1 + prefetch) * r["unit_bytes"]
        if r["units"] > 1 + prefetch:
            assert r["peak_resident"] < r["stored_bytes"]
        if prefetch == 0:  # one unit at a time: here a third of the shards or less
            assert (r["units"] - 1) * r["peak_resident"] <= r["stored_bytes"]
        # From the second forward-backward on (the order is learned), the units after the
        # first of each pass found their shards read ahead: in forward the three blocks, in
        # backward the two after the first (FSDP2 keeps the root unsharded through backward).
        per = (2 if partial else 5) if prefetch else 0
        assert r["ahead_used"] == (r["iterations"] - 1) * per
        # Every offloaded parameter was read for each all-gather (forward and backward).
        # (FSDP2 keeps the root, the head, unsharded from forward through backward.)
        assert r["reads"] >= 3 * (2 * len(r["in_store"]) - 2)
        # HostOptimizer's state: in host memory (two AdamW moments per shard), or on disk.
        assert r["opt_state_bytes"] == (0 if state_on_disk else 2 * r["all_local_bytes"])


@pytest.mark.parametrize("case", WORLD4)
def test_offloaded_shards_train_bitwise_like_fsdp2_4_ranks(world4, case):
    if case.endswith("_disk"):
        _check_disk(world4[case])
        return
    _equal(world4[case])
    full = sum(t.nbytes for t in world4[case][0]["ref"].values()) * 4
    for r in world4[case]:
        assert r["stored_bytes"] * 4 == full


@pytest.mark.parametrize("store", ["", "_disk"])
def test_dcp_round_trip_lands_in_the_store(world2, store):
    _equal(world2[f"checkpoint{store}"])
    for r in world2[f"checkpoint{store}"]:
        assert torch.equal(r["out"], r["out_ref"])
        assert r["in_store"].all()


@pytest.fixture(scope="module", params=["cpu", "disk"])
def resharded(request, tmp_path_factory):
    """Three jobs: 2 ranks train and save; 4 ranks load, train and save; 2 ranks load, train."""
    tmp = str(tmp_path_factory.mktemp("reshard"))
    fn, kw = f"{W}:resharded", dict(tmp=tmp, store=request.param)
    return [
        w.run_named(2, {"job": (fn, dict(kw, save_to="a", first=0))})["job"],
        w.run_named(4, {"job": (fn, dict(kw, load_from="a", save_to="b", first=2))})["job"],
        w.run_named(2, {"job": (fn, dict(kw, load_from="b", first=4))})["job"],
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


@pytest.mark.parametrize("store", ["", "_disk"])
def test_unoffload_puts_the_shards_back(world2, store):
    _equal(world2[f"unoffload{store}"])
    for r in world2[f"unoffload{store}"]:
        assert r["store_after"] == 0 and r["offloaded"] == 0


@pytest.mark.parametrize("store", ["", "_disk"])
def test_an_interrupted_offload_leaves_the_model_as_fsdp2_had_it(world2, store):
    _equal(world2[f"offload_interrupted{store}"])
    for r in world2[f"offload_interrupted{store}"]:
        assert r["error"] == "KeyboardInterrupt"
        assert r["moved"] == 0 and r["recorded"] == 0 and r["left"] == 0
        assert r["again"] > 0


def test_shards_on_disk_survive_failed_forward_backward_and_step(world2):
    _equal(world2["failures_disk"])  # each failed iteration run again: as FSDP2 alone
    for r in world2["failures_disk"]:
        for k in ("forward", "backward"):
            assert r[k] == r[k + "_ref"] == "Injected: "
        assert r["step"].startswith("OSError: [Errno 5] injected I/O error"), r["step"]
        assert r["undone"] == 1  # the failed step left every shard on disk as it was
        # A failed backward leaves read what FSDP2 had prefetched (layers[0]); FSDP2's
        # reset_iter_state gives it back.
        assert r["resident_before_reset"] == r["unit_bytes"] > 0
        assert r["resident_after_forward"] == r["resident_after_backward"] == 0
        assert r["resident"] == 0


# ------------------------------------------------------------------ tracking, convert
def test_shards_on_disk_read_and_written_directly_between_steps(world2):
    # p.to_local(), p.norm(), an EMA of the parameters: the stored values, bitwise (before,
    # these read a tensor without memory: a segfault); in-place writes land in the store
    for r in world2["direct_access_disk"]:
        for tag in ("fresh", "written", "trained"):
            for what in ("local", "norm", "full", "data", "at_rest"):
                assert r[f"{tag}_{what}"] is True, (tag, what)
        assert r["ema"] is True
    _equal(world2["direct_access_disk"])


@pytest.mark.parametrize("case", ["optimizer_before", "optimizer_before_disk"])
def test_optimizers_built_before_offload_step_exactly_or_are_refused(world2, case):
    for r in world2[case]:
        assert r["same_objects"] is True and r["unchanged"] is True
        assert "after this HostOptimizer was built" in r["host"]
        if case.endswith("disk"):
            assert "cannot step parameters offloaded to a DiskStore" in r["torch"]
    # host memory: the torch.optim optimizer built before trains on exactly; disk: a
    # HostOptimizer built after does
    _equal(world2[case])


@pytest.mark.parametrize("case", ["refused_swap", "refused_swap_disk"])
def test_an_offload_torch_cannot_swap_fails_clearly_and_changes_nothing(world2, case):
    for r in world2[case]:
        assert "weakref" in r["error"] and "nothing was offloaded" in r["error"], r["error"]
        assert r["not_offloaded"] is True
    _equal(world2[case])


@pytest.mark.parametrize("case", ["moves", "moves_disk"])
def test_dtype_conversions_of_offloaded_shards_are_refused_at_the_call(world2, case):
    # .half() on the disk store ran on silently in fp32, on a host store it failed in forward
    for r in world2[case]:
        for key in ("half", "block_double", "to_bf16"):
            assert "offloaded with hr.offload" in r[key] and "MixedPrecisionPolicy" in r[key]
        assert r["unchanged"] is True and r["after_unoffload"] is True
        # .to("cpu") and .float() after the optimizer keep the shards as they were: their
        # bindings, and the gradient hooks that step each inside the final backward
        assert r["bindings_kept"] is True and r["early"] == r["params"] * 3
    _equal(world2[case])  # training as FSDP2 alone after the same calls


@pytest.mark.parametrize("case", ["compiled", "compiled_inductor_disk"])
def test_compiled_sharded_model_trains_bitwise_like_fsdp2(world2, case):
    # torch.compile over FSDP2 + headroom (aot_eager, host memory; inductor, shards on disk)
    _equal(world2[case])
    assert all(r["losses_equal"] for r in world2[case])


@pytest.mark.parametrize("case", ["llama_ckpt_disk", "llama_lora", "llama_lora_disk"])
def test_transformers_llama_checkpointed_or_lora_trains_bitwise_like_fsdp2(world2, case):
    # a real model: gradient checkpointing, or LoRA on a frozen base (only the adapters
    # step), shards in host memory or on disk
    _equal(world2[case])
    for r in world2[case]:
        assert (r["trained"] < r["all"] / 10) if "lora" in case else r["trained"] == r["all"]


@pytest.mark.parametrize("case", ["tracking", "tracking_offloaded"])
def test_track_memory_counts_the_local_shards(world2, case):
    for r in world2[case]:
        for cat, local in r["local"].items():
            assert abs(r["tracked"][cat] - local) <= 0.01 * local, (cat, r["tracked"], local)
        assert "no advice: the model is sharded with FSDP2" in r["report"]


def test_track_memory_counts_shards_on_disk_while_they_are_read(world2):
    # At rest a DiskStore's shards hold no memory; while a unit is all-gathered its shards
    # are read into host memory, and those count as parameters (not as "other").
    for r in world2["tracking_disk"]:
        local = r["local"]["parameters"]
        assert r["tracked"]["parameters"] == 0
        assert 0 < r["max_parameters"] <= local
        assert r["tracked"]["gradients"] == r["local"]["gradients"]


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
