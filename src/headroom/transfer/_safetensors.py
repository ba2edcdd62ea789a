"""Reading safetensors files row range by row range, without mapping them into memory.

``safetensors.safe_open`` maps the file: every page read stays resident in the process
(``RssFile``) until the file is closed, so loading a checkpoint that way grows the process by the
checkpoint's size. Here tensors are read with ``preadv`` into buffers the caller owns, a few
megabytes at a time; the pages stay in the OS page cache, not in the process. The format is the
published one: an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["HeaderError", "SafetensorsFile", "TensorInfo", "parse_header", "safetensors_dtypes"]

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


def parse_header(raw: bytes, base: int) -> tuple[dict[str, str], dict[str, TensorInfo], int]:
    """Parse the JSON header of a safetensors file whose data starts at byte ``base``.

    Returns the ``__metadata__`` strings, each tensor's `TensorInfo` (offsets in the file) in
    header order, and the data section's length. Checked: JSON object, known dtypes, each byte
    range the size its shape says, and the ranges tiling the data section (no overlap, no gap).

    Raises:
        HeaderError: saying which of these fails.
    """
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeaderError(f"its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise HeaderError("its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise HeaderError("its header's __metadata__ is not a JSON object")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, e in header.items():
        try:
            dtype = _CODES[e["dtype"]]
            shape = tuple(int(d) for d in e["shape"])
            begin, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"its header's entry for tensor {name!r} is malformed or of an"
                              " unknown dtype") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or end - begin != nbytes:
            raise HeaderError(f"tensor {name!r}'s shape and byte range disagree")
        tensors[name] = TensorInfo(name, dtype, shape, base + begin, nbytes)
        spans.append((begin, end))
    length = 0
    for begin, end in sorted(spans):
        if begin != length:
            raise HeaderError("its tensors' byte ranges overlap or leave gaps")
        length = end
    return meta, tensors, length


def _buffer_view(t: torch.Tensor) -> memoryview:
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class SafetensorsFile:
    """An open safetensors file: its header, and reads of whole tensors or row ranges.

    Args:
        path: the file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a safetensors file, or its header is truncated or broken (names the
            file).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.tensors, self.metadata = self._read_header()
        except BaseException:
            self.close()
            raise

    def _bad(self, why: str) -> ValueError:
        return ValueError(
            f"{str(self.path)!r} is not a readable safetensors file ({why}); the file may be"
            " truncated or damaged: write it again, or download it again"
        )

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > 100 << 20:
            raise self._bad(f"header length {n} beyond the file's {size} bytes")
        raw = os.pread(self._fd, n, 8)
        try:
            meta, tensors, length = parse_header(raw, 8 + n)
        except HeaderError as e:
            raise self._bad(str(e)) from None
        if 8 + n + length > size:
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
        view = _buffer_view(out)
        if len(view) != n:
            raise ValueError(f"read of {name!r} rows {start}:{stop}: buffer of {len(view)}"
                             f" bytes for {n}")
        while len(view):
            got = os.preadv(self._fd, [view], first)
            if got == 0:
                raise OSError(errno.EIO, f"unexpected end of {self.path}")
            view = view[got:]
            first += got
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)
