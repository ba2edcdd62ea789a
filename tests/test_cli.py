"""The `headroom` command: help, demo and profile, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from headroom.cli import main


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "headroom.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )


def assert_real_png(path) -> None:
    from PIL import Image

    img = Image.open(path).convert("RGB")
    assert img.size[0] >= 800 and img.size[1] >= 400
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20, "the plot is blank"


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines()
              if line.startswith("    ") and line.split()[0] in ("demo", "profile")]
    assert listed == ["demo", "profile"], out  # each command listed once


def test_demo_trains_and_reports(tmp_path, capsys, one_thread):
    """On one intra-op thread (see `one_thread`): each part compares with plain PyTorch in this
    process under the same setting; a busy machine no longer stalls its many small ops."""
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "demo")]) == 0
    out, err = capsys.readouterr()
    assert "\r" not in err  # no progress bar into a file or a pipe
    assert "trained 3 steps" in out
    assert "optimizer_state" in out
    # the other parts check their own exactness against plain PyTorch and print the verdict
    assert "parameters after training bitwise equal to plain AdamW(fused=True): True" in out
    assert "loss and gradients bitwise equal: True" in out
    assert "loss and gradients match" in out
    assert "from_pretrained reads the fine-tuned values: True" in out
    assert "resting on disk" in out and "gradients bitwise equal: True" in out
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["peak"] > 0 and data["peak_by_category"]["optimizer_state"] > 0
    assert_real_png(tmp_path / "demo.png")


def test_demo_draws_its_progress_bar_only_on_a_terminal(monkeypatch):
    import io

    from headroom._demo import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, drawn in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress(5, "training") as bar:
            for _ in range(5):
                bar.update(1)
        assert ("\r" in stream.getvalue()) is drawn, stream.getvalue()
        assert bool(stream.getvalue()) is drawn


SCRIPT = """
import sys
import torch
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters())
steps = int(sys.argv[1])
for i in range(steps):
    model(torch.randn(16, 32)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if len(sys.argv) > 2 and i == 2:
        raise ValueError("boom at step 2")
print("script done", __name__)
"""


def test_profile_writes_report_json_and_png(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    r = run_cli("profile", "train.py", "5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "script done __main__" in r.stdout
    assert "optimizer_state" in r.stdout
    data = json.loads((tmp_path / "headroom_report.json").read_text())
    params = (32 * 64 + 64 + 64 + 1) * 4
    assert data["max_by_category"]["parameters"] == params
    assert data["max_by_category"]["optimizer_state"] == 2 * params + 4 * 4
    assert (tmp_path / "headroom_report.txt").read_text().startswith("headroom memory report")
    assert_real_png(tmp_path / "headroom_report.png")


def test_profile_reports_up_to_a_failure_then_the_error(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    r = run_cli("profile", "--out", "fail", "train.py", "10", "fail", cwd=tmp_path)
    assert r.returncode == 1
    assert "ValueError: boom at step 2" in r.stderr
    assert "script done" not in r.stdout
    data = json.loads((tmp_path / "fail.json").read_text())
    assert data["max_by_category"]["optimizer_state"] > 0  # steps before the failure are there
    assert (tmp_path / "fail.png").exists()


def test_profile_missing_script_is_a_clear_error(tmp_path, capsys):
    assert main(["profile", str(tmp_path / "nope.py")]) == 2
    assert "no such script" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["headroom_no_such_module", "no.such.module",
                                  "headroom.no_such_module", ".relative"])
def test_profile_missing_module_is_a_clear_error(capsys, name):
    """One line and exit code 2, also for a dotted name whose parent package is missing."""
    path = sys.path[:]
    assert main(["profile", "-m", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"headroom profile: no module named {name!r}")
    assert err.count("\n") == 1
    assert sys.path == path


def test_profile_module_whose_package_fails_to_import(tmp_path, monkeypatch, capsys):
    """A parent package that raises on import: one line naming its error, exit code 2."""
    pkg = tmp_path / "hr_broken_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import hr_missing_dependency\n")
    (pkg / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "-m", "hr_broken_pkg.train"]) == 2
    err = capsys.readouterr().err
    assert err == ("headroom profile: error while finding module 'hr_broken_pkg.train'"
                   " (ModuleNotFoundError: No module named 'hr_missing_dependency')\n")
    sys.modules.pop("hr_broken_pkg", None)


def test_profile_in_process_restores_argv_and_path(tmp_path, capsys):
    script = tmp_path / "tiny.py"
    script.write_text("import sys, torch\nassert sys.argv[1:] == ['a', 'b']\nx = torch.ones(256)\n")
    argv, path = sys.argv[:], sys.path[:]
    out = str(tmp_path / "r")
    assert main(["profile", "--no-plot", "--quiet", "--out", out, str(script), "a", "b"]) == 0
    assert sys.argv == argv and sys.path == path
    assert json.loads((tmp_path / "r.json").read_text())["max_by_category"]["other"] == 1024
    capsys.readouterr()


OFFLOAD_SCRIPT = """
import tempfile, warnings
import torch, torch.nn as nn
import headroom as hr
warnings.simplefilter("ignore")
with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])
hr.offload(model, device="cpu", store=hr.DiskStore(tempfile.mkdtemp()), prefetch=0)
opt = hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
for _ in range(2):
    model(torch.randn(8, 128)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_profile_counts_offloaded_device_copies_as_parameters(tmp_path):
    """The model is built on meta inside the profiled script: the only parameter bytes in
    memory are the device copies the offload layer fills block by block."""
    (tmp_path / "train.py").write_text(OFFLOAD_SCRIPT)
    r = run_cli("profile", "--no-plot", "train.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "headroom_report.json").read_text())
    block = (128 * 128 + 128) * 4
    assert block <= data["max_by_category"]["parameters"] <= 2 * block  # prefetch=0
    assert data["rss"]["peak"] >= data["rss"]["start"] > 0
    assert "process RSS" in (tmp_path / "headroom_report.txt").read_text()
