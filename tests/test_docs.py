"""Every ```python block of README.md and docs/*.md runs, as written, on this machine.

Each block runs in a fresh namespace, in a temporary working directory (paths in the docs are
relative), one test per block, named ``file:line`` of its opening fence.

A block may leave names to the reader (``model``, ``x``, ``loader``, ...). It declares them in an
HTML comment on the line before its fence, which renders as nothing::

    <!-- docs-test: prelude mlp, batch -->
    ```python
    ...

Each prelude name is a short snippet in ``PRELUDES`` below, run before the block in the order
given (tiny shapes, so that every block takes seconds). A block that is deliberately not runnable
(a signature listing) says so, with its reason, and is checked only for syntax::

    <!-- docs-test: syntax only (a signature listing) -->

Without an accelerator, the device strings of a block are swapped for the CPU's (``"cuda"``,
``"cuda:0"``, ``f"cuda:{rank}"``, ``.cuda()`` -> ``"cpu"``), ``"nccl"`` for ``"gloo"``, and
transformers' ``bf16=True`` gets ``use_cpu=True``.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import accelerator_type

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")

PRELUDES: dict[str, str] = {
    # a small MLP of 4 blocks, its data and loss
    "mlp": """
        import torch
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(4)],
            torch.nn.Linear(64, 10))
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        loss_fn = torch.nn.functional.cross_entropy
        loader = [(x, y), (x, y)]
    """,
    "opt": """
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    """,
    # a checkpoint of `model` and an SGD host optimizer, as a run before a crash saved it
    "saved": """
        import headroom as hr
        hr.save("checkpoint.safetensors", model,
                hr.HostOptimizer(model.parameters(), torch.optim.SGD, lr=1e-3))
    """,
    # a trunk builder, sizes and (x, y, task) batches of a multi-task model
    "tasks": """
        import torch
        d, classes, tasks = 16, 4, 3
        build_trunk = lambda d: torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU())
        loss_fn = torch.nn.functional.cross_entropy
        batches = [(torch.randn(8, d), torch.randint(0, classes, (8,)), t) for t in (0, 2, 2, 1)]
        loader = batches

        class MultiTask(torch.nn.Module):  # as docs/multitask.md defines it
            def __init__(self, d, classes, tasks):
                super().__init__()
                self.trunk = build_trunk(d)
                self.heads = torch.nn.ModuleList(
                    torch.nn.Linear(d, classes) for _ in range(tasks))

            def forward(self, x, task):
                return self.heads[task](self.trunk(x))
    """,
    # one rank of a process group on loopback, and a model with `.blocks`
    "dist": """
        import os, socket, torch
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]),
                              RANK="0", WORLD_SIZE="1")

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
                self.head = torch.nn.Linear(32, 4)

            def forward(self, x):
                return self.head(self.blocks(x))

        build_model = Net
        x, y = torch.randn(8, 32), torch.randint(0, 4, (8,))
        loader = [(x, y), (x, y)]
        loss_fn = torch.nn.functional.cross_entropy
    """,
    # a tiny GPT-2 saved as a local checkpoint folder, its tokenizer-free data
    "checkpoint": """
        import torch, transformers
        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained("path/to/checkpoint")
        llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         vocab_size=128, bos_token_id=0, eos_token_id=0)
        transformers.LlamaForCausalLM(llama).save_pretrained("path/to/base")
    """,
    # a one-rank gloo group and an accelerate Accelerator in it (multi-process recipes)
    "accelerate_ranks": """
        import os, socket, torch
        import torch.distributed as dist
        from accelerate import Accelerator
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        dist.init_process_group("gloo", rank=0, world_size=1)
        acc = Accelerator(cpu=True)
        loader = torch.utils.data.DataLoader(ds, batch_size=2)
    """,
    "lm": """
        import torch, transformers
        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 128, (2, 16))
        batch = {"input_ids": ids, "labels": ids}
        ds = [{"input_ids": ids[0], "labels": ids[0]}] * 4
        loader = torch.utils.data.DataLoader(ds, batch_size=2)
    """,
    # a word-level tokenizer of the tiny GPT-2's 128 ids, and a text data set for TRL
    "tokenizer": """
        import datasets, tokenizers, transformers
        vocab = {f"w{i}": i for i in range(127)} | {"[UNK]": 127}
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", pad_token="w0", eos_token="w1")
        ds = datasets.Dataset.from_dict({"text": ["w5 w6 w7 w8", "w9 w10 w11"] * 2})
    """,
}


def _blocks() -> list:
    params = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                j = i + 1
                while lines[j].strip() != "```":
                    j += 1
                code = textwrap.dedent("\n".join(lines[start + 1:j]))
                k = start - 1
                while k >= 0 and not lines[k].strip():
                    k -= 1
                m = MARK.search(lines[k]) if k >= 0 else None
                mark = m.group(1) if m else ""
                rel = f"{page.relative_to(ROOT)}:{start + 1}"
                params.append(pytest.param(rel, code, mark, id=rel))
                i = j
            i += 1
    return params


BLOCKS = _blocks()


def _on_this_machine(code: str) -> str:
    if accelerator_type() == "cuda":
        return code
    code = re.sub(r"f\"cuda:\{[^}]*\}\"", '"cpu"', code)
    code = re.sub(r"\"cuda(:\d+)?\"", '"cpu"', code)
    code = re.sub(r"\.cuda\([^)]*\)", ".cpu()", code)
    code = code.replace("bf16=True", "bf16=True, use_cpu=True")  # transformers' CPU switch
    return code.replace('"nccl"', '"gloo"')


def test_every_page_has_runnable_blocks_only_where_marked():
    marks = [mark for _, code, mark in (p.values for p in BLOCKS)]
    unknown = [m for m in marks if m and not m.startswith(("prelude ", "syntax only"))]
    assert not unknown, f"unknown docs-test marks: {unknown}"
    # syntax-only blocks are the exception
    assert sum(m.startswith("syntax only") for m in marks) <= 3


@pytest.mark.parametrize(("where", "code", "mark"), BLOCKS)
def test_block_runs(where, code, mark, tmp_path, monkeypatch):
    tree = ast.parse(code, filename=where)  # every block parses
    absolute = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                and isinstance(n.value, str) and re.match(r"/(scratch|data|tmp|home)\b", n.value)]
    assert not absolute, f"{where}: absolute paths {absolute}; use relative ones"
    if mark.startswith("syntax only"):
        return
    names = [n.strip() for n in mark.removeprefix("prelude").split(",") if n.strip()]
    missing = [n for n in names if n not in PRELUDES]
    assert not missing, f"{where}: no prelude named {missing} in tests/test_docs.py"
    monkeypatch.chdir(tmp_path)
    # declared speeds: a plan in the docs does not measure this machine (seconds) first
    from headroom.fit import Speeds, _plan

    monkeypatch.setattr(_plan, "default_speeds", lambda *a: Speeds(
        matmul=1e10, conv=1e10, memory=1e10, op=1e-5, disk_read=1e9, disk_write=5e8))
    namespace: dict = {"__name__": "__docs__"}
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in names:
            exec(compile(textwrap.dedent(PRELUDES[name]), f"<prelude {name}>", "exec"),
                 namespace)
        exec(compile(_on_this_machine(code), where, "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        state = sys.modules.get("accelerate.state")
        if state is not None:  # accelerate keeps one process-wide state: not for the next block
            state.AcceleratorState._reset_state(True)
            state.GradientState._reset_state()
