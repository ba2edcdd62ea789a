"""Reading and writing a DiskStore's metadata as a hand-editor would: the index with a valid
checksum of its own (so that what is tested is what the fields say, not the checksum), and
signed journal records."""

from __future__ import annotations

import json
from pathlib import Path

from headroom.store import _segments as seg


def read_index(folder: Path) -> dict:
    """The index's fields, its checksum field left out."""
    data = json.loads((folder / "index.json").read_bytes())
    data.pop("crc", None)
    return data


def sealed(data) -> bytes:
    """``data`` as an index file: compact JSON ending with the CRC32C of the bytes before it
    (``,"crc":"xxxxxxxx"}`` replacing the closing brace)."""
    body = json.dumps(data, separators=(",", ":")).encode()
    if not body.startswith(b"{"):
        return body  # not an object: nothing to seal
    return body[:-1] + b',"crc":"%08x"}' % seg.crc(body)


def write_index(folder: Path, data) -> None:
    (folder / "index.json").write_bytes(sealed(data))


def edit_index(folder: Path, edit) -> None:
    data = read_index(folder)
    edit(data)
    write_index(folder, data)


def signed(rec) -> bytes:
    """A journal line: ``<crc32c hex> <json>``."""
    body = json.dumps(rec, separators=(",", ":")).encode()
    return b"%08x %s\n" % (seg.crc(body), body)
