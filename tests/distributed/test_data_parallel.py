"""hr.data_parallel on CPU with gloo: replicas equal to each other and to a single-process
reference that averages the ranks' gradients; only used gradients travel; failures fail fast.

Spawning ranks costs seconds, so each world size runs all its cases in one set of processes
(a module-scoped fixture) and the tests check their parts of the results.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import _workers as w

CASES = {
    "different": dict(fn="multitask", kw=dict(case="different")),
    "same": dict(fn="multitask", kw=dict(case="same", announce=True)),
    "spare": dict(fn="multitask", kw=dict(case="different", spare=True)),
    "accumulate": dict(fn="multitask", kw=dict(case="different", micro=2)),
    "host_opt": dict(fn="multitask", kw=dict(case="different", host=True)),
    "host_opt_final": dict(fn="multitask", kw=dict(case="different", host=True, final=True)),
    "disk": dict(fn="multitask", kw=dict(case="different", host=True, store="disk")),
    "disk_summed_on_device": dict(fn="multitask", kw=dict(
        case="different", host=True, store="disk", micro=3, accumulation="device", final=True)),
    # Trainer's model.zero_grad(): a head this step did not use has no gradient, not the
    # stale one of the step it was last used in
    "disk_model_zero_grad": dict(fn="multitask", kw=dict(
        case="different", host=True, store="disk", micro=2, accumulation="device",
        zero="model")),
    "transformer": dict(fn="transformer", kw=dict()),
    "transformer_disk": dict(fn="transformer", kw=dict(store="disk")),
    "transformer_disk_summed": dict(fn="transformer", kw=dict(store="disk", micro=2,
                                                               accumulation="device")),
    "transformer_disk_fused": dict(fn="transformer", kw=dict(store="disk", fused=True)),
    "sgd": dict(fn="multitask", kw=dict(case="different", sgd=True)),
    "transformer_compiled": dict(fn="compiled_transformer", kw={}),
}
WORLD3 = ["different", "same", "accumulate", "sgd"]


def _spawn(world: int, names: list[str], tmp) -> dict:
    jobs = []
    for n in names:
        kw = dict(CASES[n]["kw"])
        if kw.get("store") == "disk":
            kw["tmp"] = str(tmp / f"{n}-{world}")
        jobs.append((CASES[n]["fn"], kw))
    return w.run_named(world, dict(zip(names, jobs, strict=True)))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _spawn(2, list(CASES), tmp_path_factory.mktemp("dp2"))


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return _spawn(3, WORLD3, tmp_path_factory.mktemp("dp3"))


def _reference(world: int, case: str, *, micro: int = 1, host: bool = False,
               spare: bool = False, sgd: bool = False) -> dict:
    """One process: each rank's gradient computed alone, averaged as DDP does (scaled by
    1/world, summed in rank order), then the same optimizer."""
    torch.manual_seed(0)
    model = w.MultiTask(spare=spare)
    opt = w.make_opt(model.parameters(), host, sgd)
    if host:  # HostOptimizer(fused=False) is torch's single-tensor path
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    params = dict(model.named_parameters())
    for step in range(w.STEPS):
        grads: dict[str, torch.Tensor] = {}
        for r in range(world):
            model.zero_grad(set_to_none=True)
            for m in range(micro):
                x, y = w.batch(r, step, m)
                (F.cross_entropy(model(x, w.tasks(case, r, step)), y) / micro).backward()
            for n, p in params.items():
                if p.grad is None:
                    continue
                g = p.grad * (1.0 / world)
                grads[n] = g if n not in grads else grads[n] + g
        for n, p in params.items():
            p.grad = grads.get(n)
        if spare:
            assert all(h.spare.grad is None for h in model.heads)
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _check(results: list[dict], ref: dict, exact: bool) -> None:
    first = results[0]
    for r, res in enumerate(results):
        for k, v in ref.items():
            assert torch.equal(res[k], first[k]), f"rank {r} differs from rank 0 in {k}"
            if exact:
                assert torch.equal(res[k], v), k
            else:
                torch.testing.assert_close(res[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _used_heads(case: str, world: int) -> set[int]:
    return {w.tasks(case, r, s) for r in range(world) for s in range(w.STEPS)}


@pytest.mark.parametrize("case", ["different", "same", "spare", "accumulate", "host_opt",
                                  "host_opt_final", "disk", "disk_summed_on_device",
                                  "disk_model_zero_grad", "sgd"])
def test_two_ranks_equal_the_averaged_reference_bitwise(world2, case):
    kw = CASES[case]["kw"]
    ref = _reference(2, kw["case"], micro=kw.get("micro", 1), host=kw.get("host", False),
                     spare=kw.get("spare", False), sgd=kw.get("sgd", False))
    _check(world2[case], ref, exact=True)


@pytest.mark.parametrize("case", WORLD3)
def test_three_ranks_equal_the_averaged_reference(world3, case):
    kw = CASES[case]["kw"]
    ref = _reference(3, kw["case"], micro=kw.get("micro", 1), sgd=kw.get("sgd", False))
    _check(world3[case], ref, exact=False)


def test_heads_no_rank_used_are_never_touched(world2):
    torch.manual_seed(0)
    init = w.MultiTask().state_dict()
    used = _used_heads("different", 2)
    assert used != set(range(w.HEADS))  # some heads are never used
    for t in range(w.HEADS):
        same = torch.equal(world2["different"][0][f"heads.{t}.weight"], init[f"heads.{t}.weight"])
        assert same == (t not in used), t  # no weight decay without a gradient


def test_only_the_used_heads_gradients_travel(world2):
    head_bytes = (8 * 3 + 3) * 4
    n_params = 2 * w.HEADS
    for step, sent in enumerate(world2["different"][0]["__sent__"].tolist()):
        used = {w.tasks("different", r, step) for r in range(2)}
        params = 2 * len(used)
        # The used-parameter bitmap, the used heads' gradients and one count per parameter.
        assert sent == n_params * 4 + len(used) * head_bytes + params * 4, step
    for step, sent in enumerate(world2["same"][0]["__sent__"].tolist()):
        assert sent == n_params * 4 + head_bytes + 2 * 4, step


def test_sums_of_no_sync_micro_batches_are_formed_on_the_device(world2):
    # Exactness is the averaged-reference test above; here: the option took effect. Each
    # rank's one head (weight and bias) gets a gradient in each of 3 micro-batches per step.
    for res in world2["disk_summed_on_device"]:
        assert int(res["__held__"]) == w.STEPS * 3 * 2
    assert all(int(res["__held__"]) == 0 for res in world2["disk"])


    # Several all-reduces in the last backward: each reads only its own gradients, so each
    # sum goes to the store once (the others' still summing), then the averaged one.
    for res in world2["transformer_disk_summed"]:
        assert res["pushed"] == [res["n_params"]] * w.STEPS


@pytest.mark.parametrize("case", ["transformer", "transformer_disk", "transformer_disk_summed",
                                  "transformer_disk_fused"])
def test_offloaded_transformer_equals_ddp_on_the_plain_model(world2, case):
    for r, res in enumerate(world2[case]):
        for k, v in res["ref"].items():
            assert torch.equal(res["got"][k], v), f"rank {r}: {k}"
            assert torch.equal(res["got"][k], world2[case][0]["got"][k]), f"rank {r}: {k}"


def test_compiled_offloaded_transformer_equals_ddp_on_the_plain_model(world2):
    # torch.compile(hr.data_parallel(model)): the reducer runs outside the graphs, the blocks
    # compile, and training stays bitwise that of DDP
    for r, res in enumerate(world2["transformer_compiled"]):
        assert res["graphs"] >= 1, f"rank {r}: nothing was compiled"
        for k, v in res["ref"].items():
            assert torch.equal(res["got"][k], v), f"rank {r}: {k}"


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_makes_the_others_fail_clearly(how):
    # A hang would leave rank 0 without a result when run() gives up.
    res = w.run(2, [("failing", dict(how=how))], timeout=120)
    status, msg = res.get((0, 0), ("missing", "rank 0 reported nothing"))
    assert status == "error", msg
    assert "CollectiveError" in msg and "another rank failed" in msg, msg
    if how == "raise":
        assert "timed out" in msg.lower(), msg  # gave up after its timeout, rank 1 still alive
        assert res[(0, 1)][0] == "error" and "injected failure" in res[(0, 1)][1]
    else:
        assert (0, 1) not in res  # killed: nothing reported


def test_without_torch_distributed_the_error_says_what_to_call():
    import headroom as hr

    model = w.MultiTask()
    with pytest.raises(RuntimeError, match="init_process_group"):
        hr.data_parallel(model)
