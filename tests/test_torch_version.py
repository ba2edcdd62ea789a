"""The torch versions headroom claims: an older torch is refused at import, naming the version
installed and the one needed, and pyproject.toml and the Makefile state the same oldest one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import headroom

REPO = Path(__file__).resolve().parents[1]
NEED = ".".join(map(str, headroom._TORCH_MIN))


@pytest.mark.parametrize("version", ["2.6.0", "2.9.1+cu128", "1.13.1"])
def test_an_older_torch_is_refused_naming_both_versions(version):
    with pytest.raises(ImportError, match=rf"needs torch>={NEED}; torch {re.escape(version)} is"):
        headroom._check_torch(version)


@pytest.mark.parametrize("version", [NEED + ".0", NEED + ".0a0+gitabc", "2.14.1+cu130", "3.0.0",
                                     None])
def test_the_oldest_supported_torch_and_newer_are_accepted(version):
    headroom._check_torch(version)


def test_import_headroom_refuses_an_older_torch():
    # a stand-in for an old torch, imported before headroom as an application would
    code = ("import sys, types; sys.modules['torch'] = types.SimpleNamespace(__version__='2.6.0')\n"
            "try:\n    import headroom\nexcept ImportError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert f"refused: headroom needs torch>={NEED}; torch 2.6.0 is installed" in out.stdout, (
        out.stdout, out.stderr)


def test_pyproject_and_the_makefile_state_the_same_oldest_torch():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'"torch>=(\d+\.\d+)"', pyproject)[1] == NEED
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"TORCH_oldest := torch==(\d+\.\d+)\.", makefile)[1] == NEED
