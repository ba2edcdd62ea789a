"""hr.save / hr.load: safetensors + JSON, atomic, bitwise resume on CPU in fp32."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import crc32c
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import headroom as hr
from headroom.checkpoint import _checkpoint
from tests.optim._models import (
    assert_params_equal,
    assert_state_equal,
    make_model,
    train,
)

STEPS = 50


def _optimizer(kind, model, tmp_path, tag):
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), fused=True, **kw)
    if kind == "host":
        return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    # 1 KiB: the embedding and the blocks' weights still take 2-3 slices each
    return hr.HostOptimizer(model.parameters(), torch.optim.AdamW, slice_bytes=1024,
                            state_store=hr.DiskStore(tmp_path / f"state-{tag}"), **kw)


def _sched(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


@pytest.mark.parametrize("kind", ["torch", "host", "disk"])
def test_save_kill_load_resumes_bitwise(tmp_path, kind):
    ref_model = make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_sched = _sched(ref)
    train(ref_model, ref, range(STEPS), accum=2, clip=0.05, sched=ref_sched)

    model = make_model()
    opt = _optimizer(kind, model, tmp_path, "a")
    sched = _sched(opt)
    train(model, opt, range(STEPS // 2), accum=2, clip=0.05, sched=sched)
    path = tmp_path / "ckpt.safetensors"
    hr.save(path, model, opt, extra={"step": STEPS // 2, "sched": sched.state_dict()})
    # "kill": nothing of the first run survives but the file
    if hasattr(opt, "close"):
        opt.close()
    del model, opt, sched
    gc.collect()

    model = make_model(seed=123)  # different initial values, overwritten by load
    opt = _optimizer(kind, model, tmp_path, "b")
    sched = _sched(opt)
    extra = hr.load(path, model, opt)
    sched.load_state_dict(extra["sched"])
    assert extra["step"] == STEPS // 2
    train(model, opt, range(STEPS // 2, STEPS), accum=2, clip=0.05, sched=sched)
    assert_params_equal(ref_model, model)
    assert_state_equal(ref, opt)


def test_file_is_plain_safetensors_with_json(tmp_path):
    model = make_model()
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    path = tmp_path / "c.safetensors"
    hr.save(path, model, opt)
    tensors = load_file(path)  # a standard safetensors reader, no pickle anywhere
    assert torch.equal(tensors["model/head.weight"], model.head.weight)
    assert torch.equal(tensors["optimizer/0/exp_avg"], opt.state[model.emb.weight]["exp_avg"])
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["headroom"])
    assert meta["optimizer"]["inner_class"] == "AdamW"
    assert meta["optimizer"]["params"][0] == {"name": "emb.weight", "shape": [37, 16]}
    assert meta["optimizer"]["groups"][0]["hparams"]["lr"] == 1e-2


def test_save_is_atomic(tmp_path, monkeypatch):
    model = make_model()
    path = tmp_path / "c.safetensors"
    hr.save(path, model)
    old = path.read_bytes()
    saved = model.head.weight.detach().clone()
    with torch.no_grad():
        model.head.weight.add_(1.0)
    calls = {"n": 0}
    real = _checkpoint._Item.chunks

    def failing(item):
        for chunk in real(item):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(28, "No space left on device")
            yield chunk

    monkeypatch.setattr(_checkpoint._Item, "chunks", failing)
    with pytest.raises(OSError, match="No space"):
        hr.save(path, model)
    assert path.read_bytes() == old  # the previous checkpoint is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temp file left
    fresh = make_model()
    with torch.no_grad():
        fresh.head.weight.zero_()
    hr.load(path, fresh)
    assert torch.equal(fresh.head.weight, saved)


def test_bad_input(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = tmp_path / "c.safetensors"
    with pytest.raises(TypeError, match="no pickled objects"):
        hr.save(path, model, opt, extra={"obj": object()})
    assert not path.exists()
    hr.save(path, model, opt)
    with pytest.raises(ValueError, match="does not match the model"):
        hr.load(path, torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="shape mismatch"):
        hr.load(path, make_model(vocab=38))
    other = make_model()
    with pytest.raises(ValueError, match="SGD"):
        hr.load(path, other, torch.optim.SGD(other.parameters(), lr=0.1))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a headroom checkpoint"):
        hr.load(tmp_path / "plain.safetensors", model)


# ----------------------------------------------------------------------------- integrity
def _header(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw, n, json.loads(raw[8:8 + n])


def _flip(path, pos):
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))


def _raises_corrupt(match):
    """``pytest.raises`` for `hr.CheckpointCorruptError` (a ValueError) with ``match``."""
    return pytest.raises(ValueError, match=match)


def _values(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _offloaded(tmp_path, seed, tag):
    model = make_model(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store=hr.DiskStore(tmp_path / f"params-{tag}"))
    return model


def test_every_tensor_and_the_header_carry_a_crc32c(tmp_path):

    transformers = pytest.importorskip("transformers")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(2))
    path = tmp_path / "c.safetensors"
    hr.save(path, model, opt, extra={"t": torch.arange(3)})
    raw, n, header = _header(path)
    meta = json.loads(header.pop("__metadata__")["headroom"])
    assert meta["version"] == 2 and set(meta["crc32c"]) == set(header)
    for name, info in header.items():  # CRC32C of the bytes as they lie in the file
        a, b = info["data_offsets"]
        assert int(meta["crc32c"][name], 16) == crc32c.crc32c(raw[8 + n + a:8 + n + b]), name
    own = meta["header_crc32c"]
    zeroed = raw[8:8 + n].replace(f'\\"header_crc32c\\": \\"{own}\\"'.encode(),
                                  b'\\"header_crc32c\\": \\"00000000\\"', 1)
    assert int(own, 16) == crc32c.crc32c(zeroed)
    # still a standard safetensors file
    with safe_open(path, framework="pt") as f:
        assert torch.equal(f.get_tensor("model/head.weight"), model.head.weight)
    sd = transformers.modeling_utils.load_state_dict(str(path))
    assert torch.equal(sd["optimizer/0/exp_avg"], opt.state[model.emb.weight]["exp_avg"])


def _corrupt_target(path, where):
    """A byte position inside ``where``: a tensor name, or 'metadata' (a digit of lr)."""
    raw, n, header = _header(path)
    if where == "metadata":
        return raw.index(b'\\"lr\\": 0.01', 8) + len(b'\\"lr\\": 0.0')
    a, b = header[where]["data_offsets"]
    return 8 + n + (a + b) // 2


@pytest.mark.parametrize(("kind", "where"), [
    ("memory", "metadata"), ("memory", "model/blocks.1.fc2.weight"),
    ("memory", "optimizer/20/exp_avg_sq"),
    # a model in a store is verified tensor by tensor (next test); its header still first
    ("disk", "metadata"),
])
def test_flipped_byte_is_caught_before_anything_changes(tmp_path, kind, where):
    model = make_model() if kind == "memory" else _offloaded(tmp_path, 0, "a")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    path = tmp_path / "c.safetensors"
    hr.save(path, model, opt)
    _flip(path, _corrupt_target(path, where))
    fresh = make_model(seed=5) if kind == "memory" else _offloaded(tmp_path, 5, "b")
    fresh_opt = hr.HostOptimizer(fresh.parameters(), torch.optim.AdamW, lr=0.5)
    before = _values(fresh)
    name = "header" if where == "metadata" else where
    with _raises_corrupt(rf"{str(path)!r}.*{name}.*changed nothing") as e:
        hr.load(path, fresh, fresh_opt)
    assert isinstance(e.value, hr.CheckpointCorruptError)
    after = _values(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    assert len(fresh_opt.state) == 0 and fresh_opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(("kind", "big"), [("memory", True), ("disk", True), ("disk", False)])
@pytest.mark.parametrize("where", ["model/blocks.1.fc2.weight", "optimizer/20/exp_avg_sq"])
def test_bigger_than_memory_is_verified_tensor_by_tensor(tmp_path, kind, big, where,
                                                         monkeypatch):
    """A file bigger than half the memory, or a model whose parameters rest in a store:
    each tensor is verified (ahead, on a helper thread) before any of it is loaded."""
    model = make_model() if kind == "memory" else _offloaded(tmp_path, 0, "a")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    path = tmp_path / "c.safetensors"
    hr.save(path, model, opt)
    saved = _values(model)
    _flip(path, _corrupt_target(path, where))
    fresh = make_model(seed=5) if kind == "memory" else _offloaded(tmp_path, 5, "b")
    fresh_opt = hr.HostOptimizer(fresh.parameters(), torch.optim.AdamW, lr=0.5)
    before = _values(fresh)
    names = list(before)
    if big:  # as if the file were bigger than half the available memory
        monkeypatch.setattr(_checkpoint, "available_memory", lambda: 0, raising=False)
    if where.startswith("model/"):  # the 10th tensor: the 9 before it are loaded
        loaded = names.index(where.removeprefix("model/"))
        assert loaded == 9
    else:  # optimizer state comes after the whole model
        loaded = len(names)
    with _raises_corrupt(rf"{str(path)!r}.*{where}.*already loaded the tensors stored before"):
        hr.load(path, fresh, fresh_opt)
    after = _values(fresh)
    assert all(torch.equal(after[n], saved[n]) for n in names[:loaded])
    assert all(torch.equal(after[n], before[n]) for n in names[loaded:])  # corrupt one incl.
    if loaded < len(names):
        assert len(fresh_opt.state) == 0 and fresh_opt.param_groups[0]["lr"] == 0.5
    # an intact checkpoint then loads over whatever was left
    hr.save(path, model, opt)
    hr.load(path, fresh, fresh_opt)
    assert all(torch.equal(v, saved[n]) for n, v in _values(fresh).items())
    assert_state_equal(opt, fresh_opt)


def test_verify_ahead_stays_within_its_window(tmp_path):
    from headroom.checkpoint._file import Reader

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(12)])
    path = tmp_path / "c.safetensors"
    hr.save(path, model)
    with Reader(str(path), verify=True) as r:
        names = sorted(r.names(), key=lambda k: r.entries[k][2])
        size = 64 * 64 * 4
        r.verify_ahead(names, window=3 * size)
        ahead = r._ahead
        deadline = time.monotonic() + 10
        while len(ahead._crcs) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # it could only go further by ignoring the window
        assert len(ahead._crcs) == 3
        for i, name in enumerate(names):  # each use lets it go one further
            got = r.tensor(name)
            assert torch.equal(got, model[i].weight)
            deadline = time.monotonic() + 10
            want = min(len(names), i + 4)
            while len(ahead._crcs) < want and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(ahead._crcs) == want
        del got
    assert ahead._thread is not None and not ahead._thread.is_alive()


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_interrupted_load_stops_its_checksum_thread(tmp_path, exc, monkeypatch):
    model = _offloaded(tmp_path, 0, "a")
    opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    train(model, opt, range(2))
    path = tmp_path / "c.safetensors"
    hr.save(path, model, opt)
    saved = _values(model)
    fresh = _offloaded(tmp_path, 5, "b")
    fresh_opt = hr.HostOptimizer(fresh.parameters(), torch.optim.AdamW, lr=0.5)
    real, calls = _checkpoint.Reader.tensor, []

    def failing(self, name):
        calls.append(name)
        if len(calls) == 3:
            raise exc("interrupted")
        return real(self, name)

    monkeypatch.setattr(_checkpoint.Reader, "tensor", failing)
    # one tensor ahead at most: the helper is waiting for the load when it fails
    monkeypatch.setattr(_checkpoint, "_AHEAD_MIN", 1)
    monkeypatch.setattr(_checkpoint, "_AHEAD_MAX", 1)
    with pytest.raises(exc):
        hr.load(path, fresh, fresh_opt)
    assert not [t for t in threading.enumerate() if t.name == "headroom-verify"]
    monkeypatch.setattr(_checkpoint.Reader, "tensor", real)
    hr.load(path, fresh, fresh_opt)  # then loads whole
    assert all(torch.equal(v, saved[n]) for n, v in _values(fresh).items())
    assert_state_equal(opt, fresh_opt)


@pytest.mark.parametrize("cut", ["empty", "length", "header", "data", "last byte"])
def test_truncated_file_names_the_file(tmp_path, cut):
    model = make_model()
    path = tmp_path / "c.safetensors"
    hr.save(path, model)
    raw, n, _ = _header(path)
    keep = {"empty": 0, "length": 5, "header": 8 + n // 2, "data": (8 + n + len(raw)) // 2,
            "last byte": len(raw) - 1}[cut]
    path.write_bytes(raw[:keep])
    with _raises_corrupt(rf"{str(path)!r}.*truncated") as e:
        hr.load(path, make_model(seed=1))
    assert isinstance(e.value, hr.CheckpointCorruptError)


def test_broken_header_or_metadata_json_names_the_file(tmp_path):

    model = make_model()
    path = tmp_path / "c.safetensors"
    hr.save(path, model)
    raw = bytearray(path.read_bytes())
    raw[8] = ord("x")  # the header's opening brace
    path.write_bytes(bytes(raw))
    with _raises_corrupt(rf"{str(path)!r}.*not valid JSON"):
        hr.load(path, model)
    # an unverified (version 1) file whose headroom metadata is broken JSON
    bad = tmp_path / "bad.safetensors"
    save_file({"model/x": torch.zeros(2)}, str(bad), metadata={"headroom": '{"format": "head'})
    with _raises_corrupt(rf"{str(bad)!r}.*metadata is not valid"):
        hr.load(bad, model)


def test_version_1_checkpoints_still_load(tmp_path):

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(2))
    # a version 1 file as the writer before checksums made it, but built by safetensors itself
    meta = {"format": "headroom-checkpoint", "version": 1, "model": list(model.state_dict()),
            "extra": {"step": 2}}
    tensors = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    old = tmp_path / "v1.safetensors"
    save_file(tensors, str(old), metadata={"headroom": json.dumps(meta)})
    fresh = make_model(seed=9)
    assert hr.load(old, fresh) == {"step": 2}
    assert_params_equal(model, fresh)
    # and one of this writer without checksums, optimizer included
    older = tmp_path / "v1b.safetensors"
    _checkpoint._save(older, model, opt, extra=None, checksums=False)
    assert "crc32c" not in _header(older)[2]["__metadata__"]["headroom"]
    fresh = make_model(seed=9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    hr.load(older, fresh, fresh_opt)
    assert_params_equal(model, fresh)
    assert_state_equal(opt, fresh_opt)


# ---------------------------------------------------------------------------- temp files
def _dead_pid():

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True)
    return int(proc.stdout)


def test_stale_temp_files_of_dead_processes_are_removed(tmp_path):


    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = _dead_pid()
        names = {
            "dead": f".c.safetensors.tmp-{host}-{dead}-0badf00d",
            "same pid, earlier process": f".c.safetensors.tmp-{host}-{os.getpid()}-0badf00d",
            "live": f".c.safetensors.tmp-{host}-{live.pid}-0badf00d",
            "other host": f".c.safetensors.tmp-not{host}-{dead}-0badf00d",
            "other target": f".d.safetensors.tmp-{host}-{dead}-0badf00d",
        }
        for n in names.values():
            (tmp_path / n).write_bytes(b"x" * 1000)
        hr.save(tmp_path / "c.safetensors", make_model())
        left = {p.name for p in tmp_path.iterdir()}
    finally:
        live.kill()
        live.wait(timeout=60)
    assert names["dead"] not in left and names["same pid, earlier process"] not in left
    assert {names["live"], names["other host"], names["other target"]} <= left
    assert "c.safetensors" in left


_CHILD = """
import sys
import torch
import headroom as hr
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
hr.save(sys.argv[1], model)
print("saved", flush=True)
while True:
    hr.save(sys.argv[1], model)
"""


def test_kill_9_during_save_leaves_the_old_checkpoint_and_the_next_save_cleans_up(tmp_path):

    path = tmp_path / "c.safetensors"
    env = dict(os.environ, PYTHONPATH=str(Path(hr.__file__).parents[1]), OMP_NUM_THREADS="1")
    for _ in range(5):  # the kill may land between two saves (then there is no temp file)
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], env=env,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "saved"
            deadline = time.monotonic() + 60
            tmp = []
            while not tmp and time.monotonic() < deadline:
                tmp = [p for p in tmp_path.iterdir()
                       if p.name.startswith(".c.safetensors.tmp-") and p.stat().st_size > 0]
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=60)
            child.stdout.close()
        if tmp and tmp[0].exists():
            break
    assert tmp and tmp[0].exists(), "no save was caught mid-write"
    assert f"-{child.pid}-" in tmp[0].name
    # the previous checkpoint is intact (its checksums verify) and holds the child's model
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    fresh = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])
    hr.load(path, fresh)
    assert_params_equal(model, fresh)
    hr.save(path, fresh)  # the next save removes the dead process's temp file
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


@pytest.mark.parametrize("saved_through", ["wrapper", "bare"])
def test_an_optimizer_wrapper_saves_and_loads_as_its_optimizer(tmp_path, saved_through):
    """accelerate's AcceleratedOptimizer (what ``prepare`` returns) around a HostOptimizer with
    state on disk: a checkpoint saved through it loads into the bare optimizer and the other
    way round, exactly (before: refused as 'AcceleratedOptimizer state')."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)

    def make(tag):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
        opt = hr.HostOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                               state_store=hr.DiskStore(tmp_path / tag))
        return model, opt

    model, opt = make("a")
    for _ in range(2):
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    wrapped = acc.prepare_optimizer(opt)
    hr.save(tmp_path / "ck.safetensors", model, wrapped if saved_through == "wrapper" else opt)
    fresh, fresh_opt = make("b")
    target = fresh_opt if saved_through == "wrapper" else acc.prepare_optimizer(fresh_opt)
    assert type(target).__name__ == "AcceleratedOptimizer" or type(wrapped).__name__ == \
        "AcceleratedOptimizer"
    hr.load(tmp_path / "ck.safetensors", fresh, target)
    x = torch.randn(3, 6)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).sum().backward()
        o.step()
        o.zero_grad()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_a_tensor_with_no_rows_is_saved_checksummed_and_loaded(tmp_path, store):
    """A parameter with no rows (an empty head, a pruned layer) resting in a store: `save`
    and `save_weights` checksum it (that of no bytes) and it loads back."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        m[1].weight = torch.nn.Parameter(torch.randn(0, 4))
        m[1].bias = torch.nn.Parameter(torch.randn(0))
        return m

    model = build()
    where = hr.DiskStore(tmp_path / "store") if store == "disk" else "cpu"
    hr.offload(model, device="cpu", store=where, blocks=[model[0], model[1]])
    hr.save(tmp_path / "ck.safetensors", model)
    with safe_open(tmp_path / "ck.safetensors", "pt") as f:
        sums = json.loads(f.metadata()["headroom"])["crc32c"]
    assert sums["model/1.weight"] == f"{crc32c.crc32c(b''):08x}"
    back = build()
    with torch.no_grad():
        back[0].weight.zero_()
    hr.load(tmp_path / "ck.safetensors", back)
    assert torch.equal(back[0].weight, model[0].weight.detach().cpu())
    assert back[1].weight.shape == (0, 4)
    files = hr.save_weights(model, tmp_path / "weights")
    assert load_file(files[0])["1.weight"].shape == (0, 4)
