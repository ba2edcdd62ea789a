"""Reading safetensors files row range by row range, without mapping them into memory.

``safetensors.safe_open`` maps the file, so every page read stays resident in the process until
it is closed. Here tensors are read with ``preadv`` into buffers the caller owns, a few megabytes
at a time: the pages stay in the OS page cache, not in the process.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from headroom.store._segments import crc

__all__ = ["MAX_HEADER_BYTES", "DuplicateKey", "HeaderError", "SafetensorsFile", "TensorInfo",
           "buffer_view", "crc_of_file", "open_regular", "parse_header", "pread_into",
           "safetensors_dtypes", "unique_keys"]

_CODES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _code, _name in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _name):
        _CODES[_code] = getattr(torch, _name)


def safetensors_dtypes() -> dict[str, torch.dtype]:
    """The safetensors dtype codes this reader knows, and their torch dtypes."""
    return dict(_CODES)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def row_nbytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


class HeaderError(ValueError):
    """What is wrong with a safetensors header (each reader words its own error around it)."""


# What the ``safetensors`` package accepts: no longer header, no value above Rust's ``usize``.
MAX_HEADER_BYTES = 100_000_000
_USIZE = (1 << 64) - 1


def _constant(name: str):
    raise ValueError(f"{name} is not JSON")


class DuplicateKey(ValueError):
    """A JSON object names one key twice (a parser would silently keep the last value)."""


def unique_keys(pairs: list) -> dict:
    """``json.loads``'s ``object_pairs_hook`` that refuses a key named twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKey(f"the key {dup!r} appears twice in one object")
    return out


def _count(v: object, what: str, name: str) -> int:
    # bool is an int in Python, and json gives floats for 2.0: both are refused, as in Rust.
    if type(v) is not int or not 0 <= v <= _USIZE:
        raise HeaderError(f"tensor {name!r}'s {what} holds {v!r}, not an integer in 0..2**64-1")
    return v


def _text(s: str, what: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise HeaderError(f"{what} {s!r} is not valid Unicode (a lone surrogate)") from None
    return s


def parse_header(raw: bytes, base: int) -> tuple[dict[str, str], dict[str, TensorInfo], int]:
    """Parse the JSON header of a safetensors file whose data starts at byte ``base``: its
    ``__metadata__`` strings, each tensor's `TensorInfo` in header order, and the data
    section's length. Checked as the ``safetensors`` package checks it (UTF-8 JSON, known
    dtypes, integers in ``0..2**64-1``, byte ranges tiling the data section in order).

    Raises:
        HeaderError: saying which of these fails.
    """
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"its header is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        header = json.loads(text, parse_constant=_constant, object_pairs_hook=unique_keys)
    except RecursionError:
        raise HeaderError("its header is JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN, a duplicate key, an integer too long
        raise HeaderError(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise HeaderError("its header is not a JSON object")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise HeaderError("its header's __metadata__ is not an object of strings")
    for k, v in meta.items():
        _text(k, "metadata key")
        _text(v, f"metadata value of {k!r}:")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, e in header.items():
        _text(name, "tensor name")
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise HeaderError(f"its header's entry for tensor {name!r} is not an object with"
                              " dtype, shape and data_offsets")
        dtype = _CODES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dtype is None:
            raise HeaderError(f"tensor {name!r} has dtype {e['dtype']!r}, which this reader"
                              f" does not know (it knows {', '.join(_CODES)})")
        shape, offsets = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
            raise HeaderError(f"tensor {name!r}'s shape is not a list or its data_offsets not"
                              " a pair")
        shape = tuple(_count(d, "shape", name) for d in shape)
        begin, end = (_count(x, "data_offsets", name) for x in offsets)
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
            if nbytes > _USIZE:  # bounded before the product grows: a shape can be long
                raise HeaderError(f"tensor {name!r}'s shape {list(shape)} overflows")
        if end < begin or end - begin != nbytes:
            raise HeaderError(f"tensor {name!r}'s shape and byte range disagree ({nbytes} bytes"
                              f" of {e['dtype']} for data_offsets [{begin}, {end}])")
        tensors[name] = TensorInfo(name, dtype, shape, base + begin, nbytes)
        spans.append((begin, end, name))
    length = 0
    for begin, end, name in sorted(spans):
        if begin != length:
            raise HeaderError(f"its tensors' byte ranges overlap or leave gaps (tensor {name!r}"
                              f" at [{begin}, {end}], the previous one ends at {length})")
        length = end
    return meta, tensors, length


def open_regular(path: str | os.PathLike, *, flags: int = os.O_RDONLY, mode: int = 0o644,
                 refuse: Callable[[], Exception] | None = None) -> int:
    """A descriptor of the regular file at ``path`` (read-only unless ``flags`` say otherwise;
    opened without blocking: a FIFO or device is refused at once, as ``refuse()`` if given).

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``path`` is not a regular file (named).
    """
    fd = os.open(path, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refuse() if refuse is not None else ValueError(
                f"{str(path)!r} is not a regular file (a device, FIFO or folder); point at the"
                " checkpoint file itself")
    except BaseException:
        os.close(fd)
        raise
    return fd


def buffer_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous host tensor's memory; the caller keeps ``t`` alive."""
    # Not ``t.numpy()``: that marks the storage non-resizable, and offloaded parameters resize it.
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def pread_into(fd: int, buf: memoryview, offset: int, short: type[OSError] = OSError,
               what: object = "file") -> None:
    """Fill ``buf`` from ``fd`` at ``offset``; raises ``short`` if the file ends first."""
    while len(buf):
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise short(errno.EIO, f"unexpected end of {what}")
        buf = buf[n:]
        offset += n


def crc_of_file(fd: int, start: int, length: int, buf: memoryview) -> int | None:
    """CRC32C of ``length`` bytes of ``fd`` at ``start`` read through ``buf`` (None: too short)."""
    value = 0
    while length:
        got = os.preadv(fd, [buf[:min(length, len(buf))]], start)
        if got == 0:
            return None
        value = crc(buf[:got], value)
        start, length = start + got, length - got
    return value


class SafetensorsFile:
    """An open safetensors file: its header, and reads of whole tensors or row ranges.

    Args:
        path: the file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file, not a safetensors file, or its header is truncated or
            broken, or it is longer than its header describes (names the file).
    """

    _fd = -1

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = open_regular(self.path)
        try:
            self.tensors, self.metadata = self._read_header()
        except BaseException:
            self.close()
            raise

    def _bad(self, why: str) -> ValueError:
        return ValueError(
            f"{str(self.path)!r} is not a readable safetensors file ({why}); the file may be"
            " truncated or damaged: write it again, or download it again")

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise self._bad(f"header length {n} beyond the file's {size} bytes, or above the"
                            f" {MAX_HEADER_BYTES} bytes safetensors allows")
        raw = os.pread(self._fd, n, 8)
        if len(raw) != n:
            raise self._bad(f"it ended while its header was read ({len(raw)} of {n} bytes)")
        try:
            meta, tensors, length = parse_header(raw, 8 + n)
        except HeaderError as e:
            raise self._bad(str(e)) from None
        if 8 + n + length != size:
            raise self._bad(f"its header describes {8 + n + length} bytes, the file has {size}")
        return tensors, meta

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Read rows ``start:stop`` of tensor ``name`` (all of a 0-dim tensor) into ``out``,
        a contiguous host tensor of the file's dtype and the rows' shape; returns ``out``."""
        info = self.tensors[name]
        if not info.shape:
            first, n = info.offset, info.nbytes
        else:
            rb = info.row_nbytes
            first, n = info.offset + start * rb, (stop - start) * rb
        view = buffer_view(out)
        if len(view) != n:
            raise ValueError(f"read of {name!r} rows {start}:{stop}: buffer of {len(view)}"
                             f" bytes for {n}")
        pread_into(self._fd, view, first, what=self.path)
        return out

    def crc32c(self, name: str, *, piece: int = 1 << 20) -> int:
        """CRC32C of tensor ``name``'s bytes, read ``piece`` bytes at a time into one buffer."""
        info = self.tensors[name]
        buf = memoryview(bytearray(min(piece, info.nbytes)))
        value = crc_of_file(self._fd, info.offset, info.nbytes, buf)
        if value is None:
            raise OSError(errno.EIO, f"unexpected end of {self.path}")
        return value

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    __del__ = close
