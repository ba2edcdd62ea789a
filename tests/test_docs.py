"""Every ```python block of README.md and docs/*.md runs as shown.

Each page runs as a notebook would: its blocks in order, top to bottom, in one fresh Python
process whose working directory is an empty temporary folder (paths in the docs are relative).
Nothing is added: a page defines every name it uses, creates the small checkpoints it loads and
closes what it opens; its device is ``"cuda" if torch.cuda.is_available() else "cpu"``, so
pages run on this machine whatever it has. A failure names the page and line of the block.

Two kinds of blocks are marked, with an HTML comment on the line before the fence:

    <!-- docs-test: multi-process 2 -->       a script for several processes (torch.distributed,
                                             hr.data_parallel, FSDP2, accelerate): its first
                                             line says how to start it; run here on its own
                                             under ``torchrun --standalone`` with that many
                                             processes (gloo on loopback), not in the page
    <!-- docs-test: syntax only (a signature listing) -->   checked for syntax only; a few at most

The pages share one cache of the CPU speeds ``hr.plan`` and the advice of reports measure
(measured once per test run, in a temporary ``XDG_CACHE_HOME``, as it is once per machine for
a user).
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
PAGE_TIMEOUT_S = 240
RANKS_TIMEOUT_S = 150

# Runs a page's blocks in one namespace; each block is compiled under its page's name with its
# own line numbers, so a traceback points at the page's line.
RUNNER = """\
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for path, line, code in blocks:
    try:
        exec(compile("\\n" * line + code, path, "exec"), namespace)
    except BaseException:
        print(f"\\ndocs-test: the block at {path}:{line} failed", file=sys.stderr)
        raise
"""


@dataclass(frozen=True)
class Block:
    page: str    # relative to the repository
    line: int    # the line of the opening fence, 1-based
    code: str    # dedented
    mark: str    # the docs-test mark, "" if none

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            m = MARK.search(lines[k]) if k >= 0 else None
            out.append(Block(str(page.relative_to(ROOT)), i + 1,
                             textwrap.dedent("\n".join(lines[i + 1:j])),
                             m.group(1) if m else ""))
            i = j
        i += 1
    return out


BLOCKS = {str(p.relative_to(ROOT)): _blocks(p) for p in PAGES}
ALL = [b for blocks in BLOCKS.values() for b in blocks]
RUNNABLE = [page for page, blocks in BLOCKS.items() if any(not b.mark for b in blocks)]
MULTI = [b for b in ALL if b.mark.startswith("multi-process")]


def _env(cache: Path) -> dict[str, str]:
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else ""),
            "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(cache), "MPLBACKEND": "Agg",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_DISABLED": "true"}


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    log = cwd / "docs-test.log"
    with open(log, "w") as f:  # a file, not a pipe: a chatty child never blocks on it
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -1, f"timed out after {timeout} s\n" + log.read_text()[-6000:]
    return proc.returncode, log.read_text()


@pytest.fixture(scope="session")
def speeds_cache(tmp_path_factory) -> Path:
    """A cache folder, shared by the xdist workers, holding this machine's measured speeds."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    cache = shared / "docs-cache"
    cache.mkdir(exist_ok=True)
    probe = shared / "docs-disk"  # the pages' temporary folders are on this file system
    probe.mkdir(exist_ok=True)
    with open(shared / "docs-cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "headroom" / "speeds.json").exists():
            # NOTE: both keys a page can ask for: its disk= folder's file system (hr.plan) and
            # the default temporary folder (the advice of every report and estimate, hr.plan
            # without disk=); without the second, each page would measure it again (seconds).
            code = (f"from headroom.planner import measure_speeds; "
                    f"measure_speeds({str(probe)!r}); measure_speeds()")
            rc, out = _run([sys.executable, "-c", code], probe, _env(cache), PAGE_TIMEOUT_S)
            assert rc == 0, out[-3000:]
    return cache


def test_marks_are_known_and_syntax_only_is_rare():
    marks = [b.mark for b in ALL if b.mark]
    unknown = [m for m in marks if not re.fullmatch(r"multi-process \d+|syntax only \(.+\)", m)]
    assert not unknown, f"unknown docs-test marks: {unknown}"
    assert sum(m.startswith("syntax only") for m in marks) <= 3


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_block_parses_and_uses_relative_paths(block):
    tree = ast.parse(block.code, filename=block.where)
    absolute = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                and isinstance(n.value, str) and re.match(r"/(scratch|data|tmp|home)\b", n.value)]
    assert not absolute, f"{block.where}: absolute paths {absolute}; use relative ones"


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_runs(page, tmp_path, speeds_cache):
    """The page's unmarked blocks, in order, in one fresh interpreter."""
    blocks = [[page, b.line, b.code] for b in BLOCKS[page] if not b.mark]
    (tmp_path / "docs-blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "docs-runner.py").write_text(RUNNER)
    rc, out = _run([sys.executable, "docs-runner.py", "docs-blocks.json"], tmp_path,
                   _env(speeds_cache), PAGE_TIMEOUT_S)
    assert rc == 0, f"{page}:\n{out[-6000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", MULTI, ids=lambda b: b.where)
def test_multi_process_block_runs(block, tmp_path):
    """A multi-process block, saved as a script, under torchrun with its processes (gloo)."""
    ranks = int(block.mark.split()[1])
    first = block.code.lstrip().splitlines()[0]
    assert first.startswith("# ") and "torchrun" in first, (
        f"{block.where}: the first line says how to start the script (# run with: torchrun ...)")
    # compiled with the page's line numbers, so a traceback points at the page
    (tmp_path / "train.py").write_text(
        f"exec(compile({chr(10) * (block.line) + block.code!r}, {block.page!r}, 'exec'))\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "train.py"]
    rc, out = _run(cmd, tmp_path, _env(tmp_path / "cache"), RANKS_TIMEOUT_S)
    assert rc == 0, f"{block.where}:\n{out[-6000:]}"
