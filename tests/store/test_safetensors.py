"""The safetensors reader's header checks, against the `safetensors` package's verdicts on the
same bytes: what the package refuses is refused here too (with a ValueError naming the file),
and what is read here matches what the package reads."""

from __future__ import annotations

import json
import struct
import time
import tracemalloc

import pytest
import torch

from headroom.store import SafetensorsFile, safetensors_dtypes

st = pytest.importorskip("safetensors.torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as s  # noqa: E402

CODES = safetensors_dtypes()


def _blob(header, data: bytes = b"", raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _theirs(blob: bytes):
    try:
        return st.load(blob)
    except Exception:  # noqa: BLE001 - the package raises SafetensorError and others
        return None


def _ours(blob: bytes, tmp_path) -> dict | None:
    path = tmp_path / "f.safetensors"
    path.write_bytes(blob)
    try:
        f = SafetensorsFile(path)
    except ValueError as e:
        assert str(path) in str(e), e  # names the file
        return None
    with f:
        out = {}
        for name, info in f.tensors.items():
            t = torch.empty(info.shape, dtype=info.dtype)
            rows = info.shape[0] if info.shape else 1
            f.read_rows(name, 0, rows, t)
            out[name] = t
        return out


def _agree(blob: bytes, tmp_path, *, stricter: bool = False) -> bool | None:
    """Compare verdicts; return whether it was accepted. ``stricter``: we may refuse what the
    package accepts (duplicate keys, a lone surrogate in a name)."""
    theirs, ours = _theirs(blob), _ours(blob, tmp_path)
    if ours is None:
        assert theirs is None or stricter, "refused here, accepted by safetensors"
        return False
    assert theirs is not None, "accepted here, refused by safetensors"
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
        assert torch.equal(ours[k].reshape(-1).view(torch.uint8),
                           theirs[k].reshape(-1).view(torch.uint8))
    return True


def _f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


OK = {"a": _f32([2], 0, 8)}
CASES = {
    "valid": (OK, b"\1" * 8, None, True),
    "float shape": ({"a": _f32([2.0], 0, 8)}, b"\0" * 8, None, False),
    "string shape": ({"a": _f32(["2"], 0, 8)}, b"\0" * 8, None, False),
    "bool shape": ({"a": _f32([True], 0, 4)}, b"\0" * 4, None, False),
    "negative shape": ({"a": _f32([-2], 0, 8)}, b"\0" * 8, None, False),
    "shape beyond u64": ({"a": _f32([2**64], 0, 8)}, b"\0" * 8, None, False),
    "float offset": (None, b"\0" * 8, b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.0]}}',
                     False),
    "three offsets": ({"a": {**_f32([2], 0, 8), "data_offsets": [0, 8, 8]}}, b"\0" * 8, None,
                      False),
    "UTF-16 header": (None, b"\0" * 8, json.dumps(OK).encode("utf-16"), False),
    "BOM": (None, b"\0" * 8, b"\xef\xbb\xbf" + json.dumps(OK).encode(), False),
    "integer metadata": ({"__metadata__": {"x": 1}, **OK}, b"\0" * 8, None, False),
    "list metadata": ({"__metadata__": [], **OK}, b"\0" * 8, None, False),
    "null metadata": ({"__metadata__": None, **OK}, b"\0" * 8, None, True),
    "trailing junk": (OK, b"\0" * 9, None, False),
    "short data": (OK, b"\0" * 7, None, False),
    "trailing NUL in header": (None, b"\0" * 8, json.dumps(OK).encode() + b"\0", False),
    "padding spaces": (None, b"\0" * 8, b" " + json.dumps(OK).encode() + b"   ", True),
    "nested 100,000 deep": (None, b"", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                            False),
    "top-level list, nested": (None, b"", b"[" * 100_000 + b"]" * 100_000, False),
    "overlap": ({"a": _f32([2], 0, 8), "b": _f32([1], 4, 8)}, b"\0" * 8, None, False),
    "gap": ({"a": _f32([1], 4, 8)}, b"\0" * 8, None, False),
    "reversed offsets": ({"a": _f32([0], 8, 0)}, b"\0" * 8, None, False),
    "dtype size vs offsets": ({"a": {**_f32([2], 0, 8), "dtype": "F16"}}, b"\0" * 8, None,
                              False),
    "out of order": ({"b": _f32([1], 4, 8), "a": _f32([1], 0, 4)}, bytes(range(8)), None, True),
    "zero-size tensors": ({"a": _f32([0], 0, 0), "b": _f32([3, 0], 0, 0)}, b"", None, True),
    "scalar": ({"a": _f32([], 0, 4)}, b"\0\0\x80\x3f", None, True),
    "NaN in header": (None, b"\0" * 8,
                      b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"z":NaN}', False),
    "lower-case dtype": ({"a": {**_f32([2], 0, 8), "dtype": "f32"}}, b"\0" * 8, None, False),
    "missing dtype": ({"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, False),
    "entry not an object": ({"a": 5}, b"", None, False),
    "extra field": ({"a": {**_f32([2], 0, 8), "x": 1}}, b"\0" * 8, None, True),
    "lone surrogate": (None, b"\0" * 8,
                       b'{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', False),
    "long integer": (None, b"\0" * 8,
                     b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,8]}}',
                     False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_header_verdicts_match_the_safetensors_package(case, tmp_path):
    """Each of these was accepted here (and loaded) or raised a raw error (RecursionError) before;
    the package refuses them."""
    header, data, raw, accepted = CASES[case]
    blob = _blob(header, data, raw)
    assert (_theirs(blob) is not None) == accepted  # the package's verdict, as recorded
    assert _agree(blob, tmp_path) == accepted


def test_duplicate_names_are_refused_here(tmp_path):
    """The package keeps one of two entries of the same name; which tensor is meant is unknown,
    so it is refused here."""
    raw = b'{"a":' + json.dumps(_f32([2], 0, 8)).encode() + b',"a":' + json.dumps(
        _f32([2], 0, 8)).encode() + b"}"
    assert _agree(_blob(None, b"\0" * 8, raw), tmp_path, stricter=True) is False


def test_oversized_header_length_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 150_000_000))
        f.truncate(150_000_016)
    tracemalloc.start()
    try:
        t = time.perf_counter()
        with pytest.raises(ValueError, match="above the 100000000 bytes"):
            SafetensorsFile(path)
        assert time.perf_counter() - t < 5
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------------------ fuzzing
_dims = s.one_of(s.integers(0, 4), s.integers(-3, 2**65), s.floats(0, 4), s.text(max_size=2),
                 s.booleans(), s.none())
_entry = s.fixed_dictionaries({
    "dtype": s.one_of(s.sampled_from(sorted(CODES)), s.text(max_size=4), s.integers()),
    "shape": s.one_of(s.lists(s.integers(0, 4), max_size=3), s.lists(_dims, max_size=3),
                      _dims),
    "offsets_delta": s.tuples(s.integers(-3, 3), s.integers(-3, 3)),
    "drop": s.sampled_from(["", "", "", "dtype", "shape", "data_offsets"]),
})
_meta = s.one_of(s.none(), s.dictionaries(s.text(max_size=3), s.one_of(
    s.text(max_size=3), s.integers(), s.none()), max_size=2))


@s.composite
def _files(draw):
    """Headers near valid ones: tiled offsets a few bytes off, odd shapes and dtypes, metadata
    of any kind, extra or missing data bytes, junk around the JSON."""
    header: dict = {}
    meta = draw(_meta)
    if meta is not None or draw(s.booleans()):
        header["__metadata__"] = meta
    offset = 0
    for i in range(draw(s.integers(0, 4))):
        e = draw(_entry)
        size = 1
        if isinstance(e["shape"], list) and all(type(d) is int and d >= 0 for d in e["shape"]):
            for d in e["shape"]:
                size *= d
        item = CODES[e["dtype"]].itemsize if e["dtype"] in CODES else 4
        n = min(size * item, 64)
        a, b = offset + e["offsets_delta"][0], offset + n + e["offsets_delta"][1]
        entry = {"dtype": e["dtype"], "shape": e["shape"], "data_offsets": [a, b]}
        entry.pop(e["drop"], None)
        header[f"t{i}"] = entry
        offset += n
    text = json.dumps(header).encode()
    text = draw(s.sampled_from([b"", b" ", b"\0", b"x"])) + text + draw(
        s.sampled_from([b"", b"   ", b"\0", b"}"]))
    if draw(s.booleans()):
        cut = draw(s.integers(0, len(text)))
        text = text[:cut] + draw(s.binary(max_size=3)) + text[cut:]
    data = draw(s.binary(min_size=max(0, offset - 2), max_size=offset + 2))
    length = len(text) + draw(s.sampled_from([0, 0, 0, 1, -1, 2**40]))
    return struct.pack("<Q", max(0, length) % 2**64) + text + data


@settings(max_examples=200, deadline=10_000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(blob=_files())
def test_fuzz_reader_agrees_with_safetensors_and_stays_within_the_file(blob, tmp_path):
    """Near-valid files: the reader refuses what the package refuses (a ValueError naming the
    file, never another exception), reads what it reads identically, and allocates no more than
    a small multiple of the file while parsing."""
    tracemalloc.start()
    try:
        accepted = _agree(blob, tmp_path, stricter=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(blob) + (1 << 20)
    if accepted:
        with SafetensorsFile(tmp_path / "f.safetensors") as f:
            assert all(i.offset + i.nbytes <= len(blob) for i in f.tensors.values())
