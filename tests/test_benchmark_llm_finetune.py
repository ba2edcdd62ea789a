"""benchmarks/llm_finetune.py on the CPU with a Llama of a few MB (``--tiny``), run as a user
runs it (tests never import from benchmarks/): the JSON's structure, headroom bitwise equal to
plain PyTorch, and the time budget that always leaves a JSON behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "llm_finetune.py"
TOOLS = ["plain", "fsdp2", "torchao", "deepspeed", "headroom", "headroom_plan"]


def _run(tmp_path: Path, *args: str, timeout: float = 240) -> dict:
    out = tmp_path / "llm.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--disk-dir", str(tmp_path), "--out", str(out),
         *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_tiny_run_is_complete_and_headroom_is_bitwise_plain(tmp_path):
    doc = _run(tmp_path, "--in-process", "--steps", "2", "--trace-dir", str(tmp_path))
    assert doc["complete"] is True and doc["partial"] is None
    assert doc["env"]["device_name"] == "cpu" and doc["env"]["matmul_tflops"] > 0
    assert doc["versions"]["torch"] and doc["versions"]["headroom"]
    assert doc["settings"]["tokens_per_step"] == 32 * 2 * 2
    assert doc["models"]["tiny"]["params"] > 0
    runs = {r["tool"]: r for r in doc["runs"]}
    assert sorted(runs) == sorted(TOOLS) and all(r["size"] == "tiny" for r in runs.values())
    # torchao needs an accelerator; DeepSpeed is not a test dependency: recorded, not failed
    assert runs["torchao"]["status"] == "skipped" and "accelerator" in runs["torchao"]["reason"]
    ds = runs["deepspeed"]
    assert ds["status"] == "ok" if ds.get("setup") else (
        ds["status"] == "skipped" and "not installed" in ds["reason"])
    for tool in ("plain", "fsdp2", "headroom", "headroom_plan"):
        r = runs[tool]
        assert r["status"] == "ok", r.get("traceback") or r
        assert r["fits"] is True and len(r["losses"]) == 3  # warm-up and 2 timed steps
        assert r["losses"][-1] < r["losses"][0]  # the same batches every step: it learns
        assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(128 / r["step_s"])
        assert r["model_tflops"] > 0 and r["fraction_of_matmul_rate"] > 0
        assert r["rss_peak_bytes"] >= r["rss_now_bytes"] > 0
        for key in ("disk_read_bytes_per_step", "disk_write_bytes_per_step"):
            assert r[key] >= 0
        assert doc["summary"][tool]["largest_fit"] == "tiny"
    assert all(runs[t]["setup"]["fp32_masters"] for t in ("plain", "fsdp2", "headroom"))
    # headroom's parameters rest in a DiskStore: its bytes per step are counted
    assert runs["headroom"]["setup"]["placement"] == "disk"
    assert runs["headroom"]["setup"]["grad_accumulation"] == "device"  # and still exact
    assert runs["headroom"]["setup"]["atomic"] is False  # parameters on disk, state in RAM
    for tool in ("plain", "headroom"):  # the optimizer's call, a part of the step
        assert 0 < runs[tool]["optimizer_step_call_s"] < runs[tool]["step_s"]
    assert runs["headroom"]["store_read_bytes_per_step"] > 0
    assert runs["headroom"]["store_write_bytes_per_step"] > 0
    # --trace-dir: one more step's sampled stacks, every thread (the host optimizer's too)
    stacks = (tmp_path / "headroom_tiny.stacks.txt").read_text()
    assert "== thread MainThread" in stacks and "== thread hr-host-step" in stacks
    assert "(step)" in runs["headroom"]["stack_samples_top"]
    assert "(setup_headroom)" in (tmp_path / "headroom_tiny.setup_stacks.txt").read_text()
    # the plan had to offload something to fit half of the plain step's estimated peak
    assert "nothing: the plain step fits" not in runs["headroom_plan"]["setup"]["choice"]
    # same initial values, same data, AdamW: bitwise the same parameters after training
    assert doc["exact_vs_plain"]["headroom"] is True
    assert doc["exact_vs_plain"]["headroom_plan"] is True
    assert doc["exact_vs_plain"]["fsdp2"] is True


def test_an_exhausted_budget_still_writes_the_json(tmp_path):
    doc = _run(tmp_path, "--in-process", "--budget-s", "1", "--tools", "plain,headroom")
    assert doc["complete"] is False and "want of time" in doc["partial"]
    assert [r["status"] for r in doc["runs"]] == ["skipped", "skipped"]
    assert all("time budget" in r["reason"] for r in doc["runs"])


def test_a_run_past_its_time_limit_is_stopped_and_recorded(tmp_path):
    """Each run is a process of its own with a time limit; one that overruns it is ended and
    recorded as such, and the benchmark goes on to write its JSON."""
    doc = _run(tmp_path, "--tools", "plain", "--max-child-s", "0.5", "--min-child-s", "0")
    (row,) = doc["runs"]
    assert row["status"] == "timeout" and "time limit" in row["error"], row
    assert doc["complete"] is False
    assert list(tmp_path.glob("llm_finetune_*")) == []  # scratch folders removed


def test_tiny_lora_over_an_int8_base_is_exact(tmp_path):
    """--mode lora --quant int8: PEFT LoRA over a torchao int8 base, resident, streamed by
    headroom and dispatched by accelerate; headroom's losses and adapter gradients and values
    bitwise the resident model's."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    doc = _run(tmp_path, "--in-process", "--steps", "2", "--mode", "lora", "--quant", "int8")
    assert doc["complete"] is True
    assert doc["settings"]["mode"] == "lora" and doc["settings"]["quant"] == "int8"
    runs = {r["tool"]: r for r in doc["runs"]}
    assert sorted(runs) == ["lora_accelerate", "lora_headroom", "lora_peft"]
    for tool in ("lora_peft", "lora_headroom"):
        r = runs[tool]
        assert r["status"] == "ok", r.get("traceback") or r
        assert len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0]
        assert "Int8WeightOnly" in r["setup"]["base"] and r["setup"]["adapters"] > 0
    # the int8 base: about a byte per weight (its fp32 embeddings and norms beside)
    assert runs["lora_headroom"]["setup"]["base_bytes"] == runs["lora_peft"]["setup"]["base_bytes"]
    lora = doc["lora"]
    assert doc["exact"] is True and lora["exact_vs_resident"]["lora_headroom"] is True
    ratios = lora["ratios_vs_resident"]["lora_headroom"]
    assert ratios["step_time"] > 0 and ratios["rss_peak"] > 0
    assert lora["peak_memory"]["lora_headroom"]["rss_peak_bytes"] > 0
