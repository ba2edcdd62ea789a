"""`headroom estimate` and `headroom plan` from a tiny local config (nothing downloaded)."""

from __future__ import annotations

import json
import re

import pytest

from headroom.cli import main

pytest.importorskip("transformers")

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 100}


@pytest.fixture(autouse=True)
def _declared_speeds(monkeypatch):
    """The plan's choice never depends on this machine's measured speeds (nor measures them)."""
    from headroom.fit import Speeds, _plan

    monkeypatch.setattr(_plan, "default_speeds", lambda *a: Speeds(
        matmul=1e10, conv=1e10, memory=1e10, op=1e-5, disk_read=1e9, disk_write=5e8))
    yield


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def test_estimate_prints_table_and_writes_json(config, tmp_path, capsys):
    out_json = tmp_path / "e.json"
    rc = main(["estimate", "--config", str(config), "--batch", "2", "--seq", "16",
               "--device", "cuda", "--optimizer", "adamw", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "LlamaForCausalLM" in out and "headroom memory estimate" in out
    assert "caching allocator model" in out and "what would cut the peak most" in out
    data = json.loads(out_json.read_text())
    assert data["estimate"]["device"] == "cuda:0" and data["estimate"]["peak"] > 0


def test_plan_prints_python_that_applies_it(config, tmp_path, capsys):
    """0.9 of the peak: the first plan estimated whole fits (activation offload to disk), so
    the command makes one whole dry run; the code of plans with hr.HostOptimizer and hr.offload
    is compiled in tests/planner/test_plan.py."""
    assert main(["estimate", "--config", str(config), "--batch", "2", "--seq", "16",
                 "--device", "cpu", "--no-advice", "--json", str(tmp_path / "e.json")]) == 0
    assert "what would cut" not in capsys.readouterr().out
    peak = json.loads((tmp_path / "e.json").read_text())["estimate"]["peak"]
    capsys.readouterr()
    rc = main(["plan", "--config", str(config), "--batch", "2", "--seq", "16", "--device",
               "cpu", "--budget", str(int(peak * 0.9)), "--disk", str(tmp_path / "stores")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "headroom plan for cpu" in out and "# apply it:" in out
    code = out.split("# apply it:\n", 1)[1]
    assert "hr.HostOptimizer(" in code or "opt = torch.optim.AdamW(" in code
    compile(code, "<plan>", "exec")  # apply-ready Python


def test_plan_with_fp32_masters(config, capsys):
    """A bf16 model with a budget its plain step fits: plain, unless masters are asked for."""
    args = ["plan", "--config", str(config), "--batch", "2", "--seq", "16", "--device", "cpu",
            "--dtype", "bf16", "--budget", "1GiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing: the plain step fits" in out and "fp32 masters" not in out
    assert main([*args, "--fp32-masters"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state and step on host (hr.HostOptimizer)" in out
    assert "fp32 masters, gradients and state" in out
    assert "hr.HostOptimizer(" in out.split("# apply it:\n", 1)[1]
    assert main([*args, "--no-fp32-masters"]) == 0
    assert "fp32 masters" not in capsys.readouterr().out


def test_plan_with_the_lm_loss_patch(tmp_path, capsys):
    """A vocabulary of 32000: the logits and their gradient are most of the step; a budget
    only the LM-loss patch meets (on cpu, without a disk)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "vocab_size": 32000}))
    base = ["--config", str(path), "--batch", "2", "--seq", "64", "--device", "cpu"]
    assert main(["estimate", *base, "--no-advice", "--json", str(tmp_path / "e.json")]) == 0
    peak = json.loads((tmp_path / "e.json").read_text())["estimate"]["peak"]
    capsys.readouterr()
    args = ["plan", *base, "--budget", str(int(peak * 0.7))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the LM loss without logits (hr.patch_causal_lm" in out
    code = out.split("# apply it:\n", 1)[1]
    assert "hr.patch_causal_lm(model)" in code
    compile(code, "<plan>", "exec")
    assert main([*args, "--no-lm-loss"]) == 1
    assert "lm_loss=None allows hr.patch_causal_lm" in capsys.readouterr().err


def test_errors(config, tmp_path, capsys):
    rc = main(["plan", "--config", str(config), "--device", "cpu", "--budget", "1KiB"])
    assert rc == 1
    assert "smallest estimated peak" in capsys.readouterr().err
    assert main(["estimate", "--config", str(tmp_path / "missing.json")]) == 2
    assert "no such config file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["estimate", "--config", str(tmp_path / "bad.json")]) == 2
    assert "model_type" in capsys.readouterr().err
    assert main(["estimate", "--config", str(config), "--no-advice", "--budget", "lots"]) == 2
    assert "bytes" in capsys.readouterr().err


def test_config_errors_are_one_line_naming_the_file(tmp_path, capsys):
    """No traceback, exit code 2, the file and the problem on one line."""
    cases = {
        "notjson.json": ("not json", "is not JSON"),
        "list.json": ("[1, 2]", "model_type"),
        "two.json": (json.dumps({**CONFIG, "num_hidden_layers": "two"}),
                     "not a valid 'llama' config.*num_hidden_layers"),
    }
    for name, (text, problem) in cases.items():
        (tmp_path / name).write_text(text)
        assert main(["estimate", "--config", str(tmp_path / name), "--no-advice"]) == 2, name
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert name in err and re.search(problem, err), err
    path = tmp_path / "short.json"
    path.write_text(json.dumps({**CONFIG, "max_position_embeddings": 64}))
    assert main(["estimate", "--config", str(path), "--seq", "65", "--no-advice"]) == 2
    err = capsys.readouterr().err
    assert "--seq 65 is longer than the 64 positions" in err and "short.json" in err, err
    assert main(["plan", "--config", str(path), "--seq", "65", "--budget", "1GiB"]) == 2
    assert "--seq 64 or less" in capsys.readouterr().err


def test_estimate_of_one_fsdp2_rank(config, tmp_path, capsys):
    peaks = {}
    for world in ("1", "2"):
        out_json = tmp_path / f"w{world}.json"
        assert main(["estimate", "--config", str(config), "--batch", "2", "--seq", "16",
                     "--device", "cuda", "--world-size", world, "--json", str(out_json)]) == 0
        assert f"one of {world} FSDP2 ranks" in capsys.readouterr().out
        data = json.loads(out_json.read_text())["estimate"]
        assert data["options"]["world_size"] == int(world)
        peaks[world] = data["peak_by_category"]["parameters"]
    assert peaks["2"] < peaks["1"]
    assert main(["estimate", "--config", str(config), "--world-size", "0"]) == 2
    assert "--world-size must be at least 1" in capsys.readouterr().err
