"""Fuzzing the checkpoint readers (`hr.load`, `hr.load_weights`) with hand-edited files: only the
documented errors (a ValueError naming the file, FileNotFoundError), no file opened outside the
checkpoint's folder, no allocation beyond the file's size."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

import headroom as hr
from headroom.checkpoint._file import seal_header
from headroom.store import SafetensorsFile

from . import _save_child as child

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as s  # noqa: E402

SETTINGS = settings(max_examples=200, deadline=10_000, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

_json = s.recursive(
    s.one_of(s.none(), s.booleans(), s.integers(-3, 2**70), s.floats(allow_nan=False),
             s.text(max_size=4), s.sampled_from(["model/0.weight", "json/0", "1", "inf"])),
    lambda inner: s.one_of(
        s.lists(inner, max_size=3),
        s.dictionaries(s.sampled_from(["__tensor__", "__tuple__", "__float__", "lr", "0",
                                       "step", "x"]), inner, max_size=3)),
    max_leaves=8)


def _paths(v, prefix=()):
    """Every place in a JSON value, as key paths."""
    yield prefix
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, (*prefix, i))


def _set(v, path, new):
    if not path:
        return new
    v[path[0]] = _set(v[path[0]], path[1:], new)
    return v


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small hr.save checkpoint: model, AdamW state, extras with a tensor and a tuple."""
    m = child.model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.ones(2, 8)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("fz") / "c.safetensors"
    hr.save(path, m, opt, extra={"t": torch.ones(2), "tup": (1, 2.5), "f": float("inf")})
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = json.loads(header["__metadata__"]["headroom"])
    return raw, n, header, meta


def _load_checked(path: Path) -> None:
    m = child.model(3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        hr.load(path, m, opt)
    except (ValueError, FileNotFoundError) as e:  # CheckpointCorruptError is a ValueError
        assert str(path) in str(e), f"{type(e).__name__} does not name the file: {e}"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 64 * size + (4 << 20)


@SETTINGS
@given(data=s.data())
def test_fuzz_hr_load_of_edited_metadata(saved, data, tmp_path):
    """Any value at any place of the headroom JSON, the header checksum recomputed (as someone
    editing the file would): loads, or a ValueError naming the file; nothing else."""
    raw, n, header, meta = saved
    meta = json.loads(json.dumps(meta))
    where = data.draw(s.sampled_from([p for p in _paths(meta) if p[:1] != ("header_crc32c",)]))
    meta = _set(meta, where, data.draw(_json))
    if not isinstance(meta, dict):
        meta = {"header_crc32c": "00000000", "x": meta}
    meta = {"header_crc32c": "00000000", **{k: v for k, v in meta.items()
                                           if k != "header_crc32c"}}
    h = {**header, "__metadata__": {"headroom": json.dumps(meta)}}
    blob = json.dumps(h, separators=(",", ":")).encode()
    blob = seal_header(blob + b" " * (-len(blob) % 8))
    path = tmp_path / "c.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    _load_checked(path)


@SETTINGS
@given(data=s.data())
def test_fuzz_hr_load_of_damaged_bytes(saved, data, tmp_path):
    """Flipped bytes, a changed header length, cut or appended bytes anywhere in the file."""
    raw = bytearray(saved[0])
    for _ in range(data.draw(s.integers(1, 3))):
        kind = data.draw(s.sampled_from(["flip", "length", "cut", "append"]))
        if kind == "flip" and raw:
            i = data.draw(s.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(s.integers(1, 255))
        elif kind == "length":
            raw[:8] = struct.pack("<Q", data.draw(s.one_of(
                s.integers(0, 2**64 - 1), s.integers(0, len(raw) + 16))))
        elif kind == "cut":
            raw = raw[:data.draw(s.integers(0, len(raw)))]
        else:
            raw += data.draw(s.binary(min_size=1, max_size=16))
    path = tmp_path / "c.safetensors"
    path.write_bytes(bytes(raw))
    _load_checked(path)


_names = s.one_of(
    s.sampled_from(["A", "B", "missing.safetensors", "../out/model.safetensors", "OUTABS",
                    "link.safetensors", "dirlink/model.safetensors", "/proc/self/mem",
                    "./A", "sub/../A", "", ".", "..", "/", "\\x00"]),
    s.integers(), s.none(), s.lists(s.integers(), max_size=2), s.text(max_size=6))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("fzw")
    hr.save_weights(child.model(0), root / "w", max_shard_size=768)
    hr.save_weights(child.model(1), root / "out")
    return root


@SETTINGS
@given(data=s.data())
def test_fuzz_load_weights_index_and_shards(shards, data, tmp_path, monkeypatch):
    """An index whose entries name anything (other shards, missing files, paths out of the
    folder, links out, non-strings), over shards with flipped bytes: loads, or ValueError /
    FileNotFoundError naming the cause; no file outside the folder is opened."""
    folder = tmp_path / "w"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(shards / "w", folder)
    out = shards / "out"
    if not (folder / "link.safetensors").is_symlink():
        (folder / "link.safetensors").symlink_to(out / "model.safetensors")
        (folder / "dirlink").symlink_to(out)
    meta = json.loads((folder / "model.safetensors.index.json").read_text())
    wm = meta["weight_map"]
    files = sorted(set(wm.values()))
    alias = {"A": files[0], "B": files[-1], "OUTABS": str(out / "model.safetensors")}
    for name in data.draw(s.lists(s.sampled_from(sorted(wm) + ["extra"]), max_size=3)):
        value = data.draw(_names)
        wm[name] = alias.get(value, value) if isinstance(value, str) else value
    if data.draw(s.booleans()):
        shard = folder / data.draw(s.sampled_from(files))
        raw = bytearray(shard.read_bytes())
        i = data.draw(s.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(s.integers(1, 255))
        shard.write_bytes(bytes(raw))
    (folder / "model.safetensors.index.json").write_text(json.dumps({**meta, "weight_map": wm}))
    opened = []
    init = SafetensorsFile.__init__

    def spy(self, p):
        opened.append(os.path.realpath(p))
        init(self, p)

    monkeypatch.setattr(SafetensorsFile, "__init__", spy)
    try:
        hr.load_weights(child.model(5), folder)
    except (ValueError, FileNotFoundError) as e:
        assert str(folder) in str(e), f"{type(e).__name__} does not name the folder: {e}"
    finally:
        monkeypatch.undo()
    root = os.path.realpath(folder)
    assert all(os.path.commonpath([p, root]) == root for p in opened), opened
