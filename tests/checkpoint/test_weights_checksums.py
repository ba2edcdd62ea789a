"""save_weights records each tensor's dtype, shape and CRC32C; load_weights verifies them: a
flipped bit or a header edited in place is refused, never loaded as other values, and the files
stay what from_pretrained and the safetensors package read."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import struct
import warnings
from pathlib import Path

import crc32c
import pytest
import torch
from torch import nn

import headroom as hr
from headroom.checkpoint import _file, _weights
from headroom.store import DiskStore

from . import _save_child as child

INDEX = "model.safetensors.index.json"


def _values(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


def _edit(path: Path, old: bytes, new: bytes, *, after: bytes = b"") -> None:
    """Replace the first ``old`` (after ``after``) in ``path``'s header by ``new``, in place."""
    assert len(old) == len(new)
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    start = raw.index(after, 8, 8 + n) + len(after)
    i = raw.index(old, start, 8 + n)
    raw[i:i + len(old)] = new
    path.write_bytes(bytes(raw))


def _flip(path: Path, tensor: str, byte: int = 5, bit: int = 3) -> None:
    """Flip one bit of ``tensor``'s data in ``path``."""
    n, header = _header(path)
    at = 8 + n + header[tensor]["data_offsets"][0] + byte
    raw = bytearray(path.read_bytes())
    raw[at] ^= 1 << bit
    path.write_bytes(bytes(raw))


def _offload(m: nn.Module, store) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hr.offload(m, device="cpu", store=store)


# ----------------------------------------------------------------- what the files hold
@pytest.mark.parametrize("store, dtype", [("none", torch.float32), ("cpu", torch.float32),
                                          ("disk", torch.float32), ("disk", torch.bfloat16)],
                         ids=["module", "host", "disk", "disk-bf16"])
def test_record_is_the_crc32c_of_the_bytes_in_the_file_and_other_readers_ignore_it(
        tmp_path, store, dtype):
    """The model's own memory, a host store's, or streamed from a DiskStore (and cast to bf16
    on the way): each shard records, for its own tensors, the dtype and shape of its header and
    the CRC32C of the bytes in the file; `safetensors.torch.load_file` reads the shards
    unchanged."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    m = child.model(0)
    if store != "none":
        _offload(m, "cpu" if store == "cpu" else DiskStore(tmp_path / "s"))
    size = 3 * 64 * dtype.itemsize  # two tensors per shard
    files = hr.save_weights(m, tmp_path / "w", max_shard_size=size - 1, dtype=dtype)
    assert len(files) == 4 and files[-1].name == INDEX
    seen = set()
    for f in files[:-1]:
        n, header = _header(f)
        meta = header.pop("__metadata__")
        assert meta["format"] == "pt"
        record = json.loads(meta["headroom_crc32c"])
        assert record.keys() == header.keys()
        raw = f.read_bytes()
        for name, e in header.items():
            a, b = e["data_offsets"]
            crc = crc32c.crc32c(raw[8 + n + a:8 + n + b])
            assert record[name] == [e["dtype"], e["shape"], f"{crc:08x}"]
        with safe_open(str(f), "pt") as sf:
            assert sf.metadata() == meta
        for name, v in load_file(str(f)).items():
            assert torch.equal(v, child.model(0).state_dict()[name].to(dtype)), name
        seen |= header.keys()
    assert seen == set(child.model(0).state_dict())


def test_from_pretrained_reads_a_folder_save_weights_wrote(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    src = transformers.LlamaForCausalLM(cfg)
    want = _values(src)
    _offload(src, DiskStore(tmp_path / "s"))
    for shard in ("5GB", "20KB"):
        out = tmp_path / f"w{shard}"
        files = hr.save_weights(src, out, max_shard_size=shard)
        assert (len(files) > 2) == (shard == "20KB")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            back = transformers.LlamaForCausalLM.from_pretrained(out)
        assert _equal(_values(back), want)
        target = transformers.LlamaForCausalLM(cfg)
        hr.load_weights(target, out)  # verified
        assert _equal(_values(target), want)


def test_a_file_without_a_record_loads_as_before(tmp_path):
    """save_file's output (no headroom metadata): nothing to verify, loads with verify=True."""
    from safetensors.torch import save_file

    save_file(child.model(0).state_dict(), str(tmp_path / "w.safetensors"),
              metadata={"format": "pt"})
    m = child.model(5)
    hr.load_weights(m, tmp_path / "w.safetensors")
    assert _equal(_values(m), _values(child.model(0)))


# ------------------------------------------------------------------- damaged data
@pytest.mark.parametrize("shard", [4096, 768], ids=["one-file", "sharded"])
def test_a_flipped_data_bit_is_refused_and_the_model_is_unchanged(tmp_path, shard):
    """The old code loaded the flipped value without a word."""
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder, max_shard_size=shard)
    victim = "4.weight"  # in the second shard of two
    path = folder / ("model.safetensors" if shard == 4096 else
                     json.loads((folder / INDEX).read_text())["weight_map"][victim])
    _flip(path, victim)
    m = child.model(5)
    before = _values(m)
    with pytest.raises(hr.CheckpointCorruptError) as info:
        hr.load_weights(m, folder)
    msg = str(info.value)
    for part in (str(path), f"tensor '{victim}'", "has CRC32C", "save_weights recorded",
                 "the model is unchanged", "download or save the checkpoint again",
                 "verify=False"):
        assert part.lower() in msg.lower(), part
    assert _equal(_values(m), before)
    hr.load_weights(m, folder, verify=False)  # loads anyway: the flipped value with the rest
    want = _values(child.model(0))
    got = _values(m)
    assert not torch.equal(got[victim], want[victim])
    assert (got[victim] != want[victim]).sum() == 1
    assert all(torch.equal(got[k], want[k]) for k in want if k != victim)


@pytest.mark.parametrize("store", ["none", "cpu", "disk"])
def test_tensor_by_tensor_a_damaged_tensor_stops_the_load_before_it(tmp_path, store,
                                                                    monkeypatch):
    """A checkpoint bigger than half the available memory (forced here) is verified tensor by
    tensor: those before the damaged one are loaded, it and those after keep their values,
    whether they rest in the module, host memory or a DiskStore."""
    monkeypatch.setattr(_weights, "available_memory", lambda: 0, raising=False)
    hr.save_weights(child.model(0), tmp_path / "w")
    _flip(tmp_path / "w" / "model.safetensors", "3.weight", byte=250, bit=7)
    m = child.model(5)
    if store != "none":
        _offload(m, "cpu" if store == "cpu" else DiskStore(tmp_path / "s"))
    before, saved = _values(m), _values(child.model(0))
    with pytest.raises(hr.CheckpointCorruptError,
                       match=r"tensor '3\.weight'.*the 3 tensors before it in this load were"
                             r" loaded; it and the 2 after it are unchanged"):
        hr.load_weights(m, tmp_path / "w")
    got = _values(m)
    for i in range(child.LAYERS):
        k = f"{i}.weight"
        assert torch.equal(got[k], saved[k] if i < 3 else before[k]), k


# ------------------------------------------------------------------- edited headers
def test_a_header_dtype_changed_in_place_is_refused(tmp_path):
    """F32 -> I32 in the header (same length, same bytes): the old code loaded the float bits
    as integers, converted to float."""
    hr.save_weights(child.model(0), tmp_path / "w")
    path = tmp_path / "w" / "model.safetensors"
    _edit(path, b'"F32"', b'"I32"', after=b'"2.weight":')  # the header's, not the record's
    m = child.model(5)
    before = _values(m)
    with pytest.raises(hr.CheckpointCorruptError,
                       match=r"tensor '2\.weight' is I32 \[8, 8\] in its header, saved as F32"
                             r" \[8, 8\].*verify=False"):
        hr.load_weights(m, tmp_path / "w")
    assert _equal(_values(m), before)
    hr.load_weights(m, tmp_path / "w", verify=False)  # as it is: the bits read as integers
    want = child.model(0).state_dict()["2.weight"].view(torch.int32).float()
    assert torch.equal(m.state_dict()["2.weight"], want)


class _Square(nn.Module):
    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(24.0).reshape(shape))


def test_a_header_shape_changed_in_place_is_refused(tmp_path):
    """[4, 6] -> [6, 4] in the header, loaded into a [6, 4] parameter: the old code loaded the
    same bytes in the other shape."""
    hr.save_weights(_Square((4, 6)), tmp_path / "w")
    _edit(tmp_path / "w" / "model.safetensors", b'"shape":[4,6]', b'"shape":[6,4]')
    m = _Square((6, 4))
    with torch.no_grad():
        m.w.zero_()
    with pytest.raises(hr.CheckpointCorruptError,
                       match=r"tensor 'w' is F32 \[6, 4\] in its header, saved as F32 \[4, 6\]"):
        hr.load_weights(m, tmp_path / "w")
    assert not m.w.any()
    hr.load_weights(m, tmp_path / "w", verify=False)
    assert torch.equal(m.w, torch.arange(24.0).reshape(6, 4))


@pytest.mark.parametrize("old, new, match", [
    (b'\\"0.weight\\":[', b'\\"0.weighs\\":[', r"holds tensors \['0\.weight'\] it was not"
                                                  r" saved with, and lacks \['0\.weighs'\]"),
    (b"[8,8]", b"[8,x]", "headroom_crc32c metadata is unreadable"),
    (b'"headroom_crc32c":"{', b'"headroom_crc32c":"[', "headroom_crc32c metadata is unreadable"),
], ids=["name", "json", "not-an-object"])
def test_a_damaged_record_is_refused_and_verify_false_loads(tmp_path, old, new, match):
    hr.save_weights(child.model(0), tmp_path / "w")
    _edit(tmp_path / "w" / "model.safetensors", old, new)  # the first match: in the record
    m = child.model(5)
    before = _values(m)
    with pytest.raises(hr.CheckpointCorruptError, match=match):
        hr.load_weights(m, tmp_path / "w")
    assert _equal(_values(m), before)
    hr.load_weights(m, tmp_path / "w", verify=False)
    assert _equal(_values(m), _values(child.model(0)))


def test_a_changed_checksum_digit_is_refused(tmp_path):
    hr.save_weights(child.model(0), tmp_path / "w")
    path = tmp_path / "w" / "model.safetensors"
    digits = json.loads(_header(path)[1]["__metadata__"]["headroom_crc32c"])["1.weight"][2]
    other = ("0" if digits[0] != "0" else "1") + digits[1:]
    _edit(path, digits.encode(), other.encode())
    with pytest.raises(hr.CheckpointCorruptError,
                       match=rf"tensor '1\.weight' .* has CRC32C {digits}, save_weights"
                             rf" recorded {other}"):
        hr.load_weights(child.model(5), tmp_path / "w")


# ------------------------------------------------------------------ random single-bit flips
def test_random_single_bit_flips_are_refused_or_load_the_saved_values(tmp_path):
    """64 single-bit flips (half in the header, half in the data) of a small saved file: each
    is refused with a ValueError, or loads exactly the saved values; a flip in the data is
    always a CheckpointCorruptError. The old code loaded every data flip."""
    hr.save_weights(child.model(0), tmp_path / "w")
    good = (tmp_path / "w" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", good[:8])[0]
    saved = _values(child.model(0))
    rng = random.Random(0)
    spots = [rng.randrange(0, 8 + n) for _ in range(32)]
    spots += [rng.randrange(8 + n, len(good)) for _ in range(32)]
    bad = tmp_path / "bad"
    refused = 0
    for at in spots:
        raw = bytearray(good)
        raw[at] ^= 1 << rng.randrange(8)
        bad.mkdir(exist_ok=True)
        (bad / "model.safetensors").write_bytes(bytes(raw))
        m = child.model(5)
        try:
            hr.load_weights(m, bad)
        except ValueError as e:
            assert at < 8 + n or isinstance(e, hr.CheckpointCorruptError), (at, e)
            refused += 1
            continue
        assert at < 8 + n, f"a flip at data byte {at - 8 - n} loaded"
        assert _equal(_values(m), saved), f"a flip at header byte {at} loaded other values"
    assert refused >= 32
    shutil.rmtree(bad)


# ------------------------------------------------------------- failures while saving
@pytest.mark.parametrize("where", ["data", "seal"])
def test_an_exception_while_saving_leaves_the_previous_checkpoint(tmp_path, where,
                                                                  monkeypatch):
    """An exception while the data is written (a store read failing at the 4th tensor), or
    while the header is rewritten with the checksums: the previous checkpoint stays, verified,
    and no temporary file is left."""
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder)
    calls = 0
    chunks = _weights._chunks

    def failing_chunks(t, to):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise OSError("injected")
        return chunks(t, to)

    def failing_header(self):
        raise OSError("injected")

    if where == "data":
        monkeypatch.setattr(_weights, "_chunks", failing_chunks)
    else:
        monkeypatch.setattr(_file.Seal, "header", failing_header)
    with pytest.raises(OSError, match="injected"):
        hr.save_weights(child.model(1), folder)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    m = child.model(5)
    hr.load_weights(m, folder)
    assert _equal(_values(m), _values(child.model(0)))


def test_kill_before_the_checksums_are_written_leaves_the_previous_checkpoint(tmp_path):
    """A save killed (SIGKILL) once all its data is written, just before the header is
    rewritten with the checksums: the folder loads the previous checkpoint, verified, and the
    next save removes the dead temporary file."""
    folder = tmp_path / "w"
    hr.save_weights(child.model(0), folder)
    p = mp.get_context("spawn").Process(target=child.save_and_kill_at_seal, args=(str(folder), 1))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL
    assert [n for n in os.listdir(folder) if ".tmp-" in n]  # the killed save's file
    m = child.model(5)
    hr.load_weights(m, folder)
    assert _equal(_values(m), _values(child.model(0)))
    written = hr.save_weights(child.model(2), folder)
    assert sorted(os.listdir(folder)) == [p.name for p in written]
    hr.load_weights(m, folder)
    assert _equal(_values(m), _values(child.model(2)))
