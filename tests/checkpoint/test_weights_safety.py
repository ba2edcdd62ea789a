"""save_weights / load_weights against stale files, interrupted saves, hand-edited indexes and
bad arguments: a folder loads as one whole checkpoint or fails with an error naming the cause."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

import headroom as hr
from headroom.store import SafetensorsFile

from . import _save_child as child

INDEX = "model.safetensors.index.json"


def _values(m) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _loaded(folder) -> dict[str, torch.Tensor]:
    m = child.model(99)
    hr.load_weights(m, folder)
    return _values(m)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# ------------------------------------------------------------------- stale files (item 4)
@pytest.mark.parametrize("old, new", [(256, 768), (768, 4096), (4096, 512), (512, 512)])
def test_save_over_another_save_loads_the_new_one_and_removes_the_old_files(tmp_path, old, new):
    """Any shard count over any other: the folder loads the new weights and holds only the new
    checkpoint's files (the old code left a sharded save's index and shards beside a single
    file, and loaded the old weights)."""
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder, max_shard_size=old)
    written = hr.save_weights(child.model(1), folder, max_shard_size=new)
    assert _equal(_loaded(folder), _values(child.model(1)))
    assert _files(folder) == {p.name for p in written}
    if new == old:  # the first save's names were taken: the second used tagged ones
        assert all(p.name.startswith("model-") and p.name.count("-") == 4
                   for p in written[:-1])
        hr.save_weights(child.model(2), folder, max_shard_size=new)  # and back to plain names
        assert _files(folder) == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)} | {
            INDEX}
        assert _equal(_loaded(folder), _values(child.model(2)))


# --------------------------------------------------------------- the index decides (item 5)
def _rewrite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    """A stale copy of a tensor in another shard than the index names: the old code loaded
    whichever file came first (here the stale one) without a word."""
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder, max_shard_size=768)
    index = json.loads((folder / INDEX).read_text())["weight_map"]
    first, second = sorted(set(index.values()))
    victim = next(k for k, f in index.items() if f == second)
    from safetensors.torch import load_file
    shard = load_file(str(folder / first))
    shard[victim] = torch.full((8, 8), 123.0)  # a stale copy where the index does not point
    _rewrite(folder / first, shard)
    m = child.model(5)
    before = _values(m)
    with pytest.raises(ValueError, match=f"'{victim}' is in both .*{first}.*{second}"):
        hr.load_weights(m, folder)
    assert _equal(_values(m), before)


def test_index_naming_the_wrong_shard_or_missing_a_tensor_is_refused(tmp_path):
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder, max_shard_size=768)
    meta = json.loads((folder / INDEX).read_text())
    wm = meta["weight_map"]
    names = sorted(wm)
    files = sorted(set(wm.values()))
    moved = dict(wm, **{names[0]: next(f for f in files if f != wm[names[0]])})
    (folder / INDEX).write_text(json.dumps({**meta, "weight_map": moved}))
    with pytest.raises(ValueError, match=f"puts tensor '{names[0]}' in .* which does not hold"):
        hr.load_weights(child.model(5), folder)
    (folder / INDEX).write_text(json.dumps({**meta, "weight_map": {
        k: v for k, v in wm.items() if k != names[0]}}))
    with pytest.raises(ValueError, match=f"does not list tensors its shards hold .*{names[0]}"):
        hr.load_weights(child.model(5), folder)


def test_shards_without_their_index_are_refused(tmp_path):
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder, max_shard_size=768)
    (folder / INDEX).unlink()
    with pytest.raises(ValueError, match="holds shards .* but no model.safetensors.index.json"):
        hr.load_weights(child.model(5), folder)


# ------------------------------------------------ interrupted saves, real signals (item 6)
@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", "headroom", "tests.checkpoint._save_child"])
    return c


def _run(ctx, *args) -> int:
    p = ctx.Process(target=child.save_and_signal, args=args)
    p.start()
    p.join(60)
    if p.is_alive():  # pragma: no cover - a hung child
        p.kill()
        p.join()
        pytest.fail(f"save_and_signal{args} hung")
    return p.exitcode


# Each signal on one layout (3 files -> 2), SIGKILL also on 2 -> 2 (new names), 3 -> 1, 1 -> 3.
@pytest.mark.parametrize("sig, old, new", [
    (signal.SIGINT, 512, 768), (signal.SIGTERM, 512, 768), (signal.SIGKILL, 512, 768),
    (signal.SIGKILL, 768, 768), (signal.SIGKILL, 512, 4096), (signal.SIGKILL, 4096, 512)])
def test_signal_at_every_boundary_of_a_save_leaves_the_old_or_the_new_checkpoint(
        tmp_path, ctx, old, new, sig, monkeypatch):
    """A child saves over a checkpoint and signals itself just before and just after each file
    rename or removal. The folder then loads as the old checkpoint or the new one, bitwise, and
    the next save leaves only its own files (the old code left mixes of old and new shards and a
    temporary file)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # as in the child: speed only
    base = tmp_path / "base"
    hr.save_weights(child.model(0), base, max_shard_size=old)
    old_values, new_values = _values(child.model(0)), _values(child.model(1))
    scratch = tmp_path / "count"
    shutil.copytree(base, scratch)
    total = _run(ctx, str(scratch), 1, new, 0, 0)
    assert 4 <= total < 250
    assert _equal(_loaded(scratch), new_values)
    seen = set()
    for stop in range(1, total + 1):
        folder = tmp_path / f"s{stop}"
        shutil.copytree(base, folder)
        code = _run(ctx, str(folder), 1, new, stop, int(sig))
        assert code != 0, f"the save ended before boundary {stop}"
        got = _loaded(folder)
        which = "old" if _equal(got, old_values) else "new" if _equal(got, new_values) else None
        assert which is not None, f"{sig!r} at boundary {stop} of {total}: a mix"
        seen.add(which)
        if sig == signal.SIGINT:  # the save cleaned up after itself on the way out
            assert not [n for n in _files(folder) if ".tmp-" in n]
        written = hr.save_weights(child.model(2), folder, max_shard_size=new)
        assert _files(folder) == {p.name for p in written}, f"leftovers after stop {stop}"
        assert _equal(_loaded(folder), _values(child.model(2)))
        shutil.rmtree(folder)
    assert seen == {"old", "new"}


# ---------------------------------------------------------------- bad arguments (item 7)
@pytest.mark.parametrize("kw, err, match", [
    ({"dtype": torch.int8}, ValueError, "not a floating-point dtype"),
    ({"dtype": torch.bool}, ValueError, "not a floating-point dtype"),
    ({"dtype": "bf16"}, TypeError, "not a torch.dtype"),
    ({"max_shard_size": 0}, ValueError, "max_shard_size=0 is not positive"),
    ({"max_shard_size": -5}, ValueError, "max_shard_size=-5 is not positive"),
    ({"max_shard_size": "-1GB"}, ValueError, "not positive"),
    ({"max_shard_size": "abc"}, ValueError, "max_shard_size='abc' is not a size"),
    ({"max_shard_size": "nanGB"}, ValueError, "is not a size"),
    ({"max_shard_size": "infGB"}, ValueError, "is not a size"),
    ({"max_shard_size": True}, TypeError, "max_shard_size=True is a bool"),
    ({"max_shard_size": 1.5e9}, TypeError, "is a float"),
])
def test_bad_dtype_or_shard_size_is_refused_before_anything_is_written(tmp_path, kw, err, match):
    """The old code wrote float weights as int8 zeros and accepted sizes <= 0."""
    folder = tmp_path / "w"
    with pytest.raises(err, match=match):
        hr.save_weights(child.model(0), folder, **kw)
    assert not folder.exists()


def test_dtype_casts_floating_tensors_only(tmp_path):
    m = child.model(0)
    m.register_buffer("count", torch.arange(3))
    hr.save_weights(m, tmp_path / "w", dtype=torch.bfloat16)
    with SafetensorsFile(tmp_path / "w" / "model.safetensors") as f:
        assert f.tensors["count"].dtype == torch.int64
        assert f.tensors["0.weight"].dtype == torch.bfloat16
    for size in ("1KB", "0.5KiB", " 2 kb", 300):
        assert hr.save_weights(child.model(0), tmp_path / str(size), max_shard_size=size)


# ----------------------------------------------- index entries outside the folder (item 9)
def _sharded(tmp_path) -> tuple[Path, dict]:
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder, max_shard_size=768)
    return folder, json.loads((folder / INDEX).read_text())


def _point(folder: Path, meta: dict, value) -> None:
    wm = dict(meta["weight_map"])
    wm[sorted(wm)[0]] = value
    (folder / INDEX).write_text(json.dumps({**meta, "weight_map": wm}))


@pytest.mark.parametrize("value, match", [
    ("../elsewhere/x.safetensors", "not a file name inside the checkpoint's folder"),
    ("ABS", "not a file name inside the checkpoint's folder"),
    ("/proc/self/mem", "not a file name inside the checkpoint's folder"),
    ("sub/../../elsewhere/x.safetensors", "not a file name inside"),
    ("", "not a file name inside"),
    (5, "maps .* to 5, not to a file name"),
    (None, "not to a file name"),
    ("LINK", "a link that leads out of the checkpoint's folder"),
])
def test_index_entries_outside_the_folder_are_refused(tmp_path, value, match, monkeypatch):
    """The old code opened what the index named, wherever it was (or raised a raw TypeError /
    an OSError EIO without a file name)."""
    folder, meta = _sharded(tmp_path)
    outside = tmp_path / "elsewhere"
    hr.save_weights(child.model(7), outside)  # a valid file the index must not reach
    (tmp_path / "elsewhere" / "x.safetensors").symlink_to(outside / "model.safetensors")
    if value == "ABS":
        value = str(outside / "model.safetensors")
    if value == "LINK":
        (folder / "link.safetensors").symlink_to(outside / "model.safetensors")
        value = "link.safetensors"
    _point(folder, meta, value)
    opened = []
    init = SafetensorsFile.__init__
    monkeypatch.setattr(SafetensorsFile, "__init__",
                        lambda self, p: (opened.append(os.path.realpath(p)), init(self, p))[1])
    with pytest.raises(ValueError, match=match):
        hr.load_weights(child.model(5), folder)
    assert all(p.startswith(os.path.realpath(folder)) for p in opened)


def test_links_inside_the_folder_and_the_hub_cache_layout_load(tmp_path):
    """A link to a file of the same folder, and the Hugging Face cache's snapshot -> blobs
    links, are followed."""
    repo = tmp_path / "models--x--y"
    hr.save_weights(child.model(3), tmp_path / "src", max_shard_size=768)
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(tmp_path / "src"))):
        shutil.copy(tmp_path / "src" / f, repo / "blobs" / f"h{i}")
        (snap / f).symlink_to(Path("../../blobs") / f"h{i}")
    assert _equal(_loaded(snap), _values(child.model(3)))


# ----------------------------------------------- header lengths beyond reason (item 11)
def test_header_length_claiming_the_whole_file_fails_fast_without_reading_it(tmp_path):
    """hr.load and load_weights of a 200 MB (sparse) file whose header length claims all of it:
    refused before the header is read (the old code read all of it into memory first)."""
    path = tmp_path / "big.safetensors"
    size = 200_000_000
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", size - 8))
        f.truncate(size)
    tracemalloc.start()
    try:
        with pytest.raises(hr.CheckpointCorruptError, match="more than the 100000000"):
            hr.load(path, child.model(0))
        with pytest.raises(ValueError, match="above the 100000000 bytes"):
            hr.load_weights(child.model(0), path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


# ------------------------------------------- forged hr.save metadata (raw errors, last part)
def _forge(path: Path, edit) -> None:
    """Rewrite the headroom JSON of checkpoint ``path`` with ``edit(meta)``, checksum resealed."""
    from headroom.checkpoint._file import seal_header
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = json.loads(header["__metadata__"]["headroom"])
    edit(meta)
    header["__metadata__"]["headroom"] = json.dumps(meta)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob = seal_header(blob + b" " * (-len(blob) % 8))
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _saved(tmp_path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    m = child.model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    path = tmp_path / "c.safetensors"
    hr.save(path, m, opt)
    return path, m, opt


@pytest.mark.parametrize("edit, err, match", [
    (lambda m: m["optimizer"]["groups"][0]["hparams"].update(lr="fast"), ValueError,
     "hyperparameter 'lr' of parameter group 0 is 'fast'"),
    (lambda m: m["optimizer"]["groups"][0]["hparams"].update(betas=[0.9]), ValueError,
     "hyperparameter 'betas'"),
    (lambda m: m.update(model=5), hr.CheckpointCorruptError, "'model' is 5, not a list"),
    (lambda m: m.update(model=["nope"]), hr.CheckpointCorruptError, "holds no tensor 'model/nope'"),
    (lambda m: m["optimizer"]["small"].update(x={}), hr.CheckpointCorruptError,
     "'optimizer.small' has key 'x'"),
    (lambda m: m["optimizer"]["small"].update({"99": {}}), hr.CheckpointCorruptError,
     "has key '99'"),
    (lambda m: m["optimizer"].update(groups=[{"hparams": {}, "params": [0, 0]}]),
     hr.CheckpointCorruptError, "not each of the 6 parameter indices once"),
    (lambda m: m["optimizer"].update(groups=5), hr.CheckpointCorruptError, "'optimizer.groups'"),
    (lambda m: m["optimizer"].update(params=[{"shape": "x"}]), hr.CheckpointCorruptError,
     "'optimizer.params'"),
    (lambda m: m["optimizer"].update(small=[]), hr.CheckpointCorruptError, "'optimizer.small'"),
    (lambda m: m.update(optimizer=[]), hr.CheckpointCorruptError, "'optimizer' is \\[\\]"),
    (lambda m: m.update(extra={"a": {"__tensor__": "json/77"}}), hr.CheckpointCorruptError,
     "'extra' refers to tensor 'json/77'"),
    (lambda m: m.update(extra={"a": {"__float__": "fast"}}), hr.CheckpointCorruptError,
     "'extra' holds float 'fast'"),
    (lambda m: m.update(extra={"a": {"__tuple__": 3}}), hr.CheckpointCorruptError,
     "a tuple that is not a list"),
])
def test_forged_metadata_is_refused_before_anything_changes(tmp_path, edit, err, match):
    """A checkpoint edited by hand, its header checksum recomputed: the old code loaded
    ``lr: "fast"``, raised a raw TypeError for ``"model": 5`` and a ValueError about a bad
    ``small`` key after the model was already loaded."""
    path, _, _ = _saved(tmp_path)
    _forge(path, edit)
    m = child.model(4)
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    before, hp = _values(m), dict(opt.param_groups[0])
    with pytest.raises(err, match=match) as info:
        hr.load(path, m, opt)
    assert str(path) in str(info.value)
    assert _equal(_values(m), before) and not opt.state
    assert opt.param_groups[0]["lr"] == hp["lr"]
