"""`load_weights` / `save_weights`: a model's tensors from and to safetensors, via its store.

One file or a folder as ``save_pretrained`` writes it, read and written a few megabytes of rows
at a time where the parameter rests, so a model built on ``meta`` is never whole in memory.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from headroom.checkpoint._file import (
    DTYPES,
    CheckpointCorruptError,
    available_memory,
    build_header,
    fsync_dir,
    remove_stale_temps,
    store_slices,
    write_file,
    write_tensors,
)
from headroom.checkpoint._names import checkpoint_names, module_tensors, refuse_quantized
from headroom.residency import offload_states, quantize_block
from headroom.store import (
    MAX_HEADER_BYTES,
    SafetensorsFile,
    TensorInfo,
    open_regular,
)
from headroom.transfer import ParamBinding, binding

__all__ = ["load_weights", "save_weights"]

_INDEX = "model.safetensors.index.json"
# save_pretrained's shard names, or with a tag when the folder holds that name already (the
# previous save's, kept until the new index lands).
_SHARD = re.compile(r"model(-[0-9a-f]{8})?-\d{5}-of-\d{5}\.safetensors")
# `__metadata__` key of each tensor's [dtype code, shape, 8 hex digits of CRC32C] (JSON).
_RECORD = "headroom_crc32c"
_FIX = ("download or save the checkpoint again, or pass verify=False to load it as it is")
_AGAIN = "write the checkpoint again"
_MIXED = f"the index and its shards come from different saves; {_AGAIN}"
# Bytes per chunk: two in flight plus a dtype conversion bound what a load adds to memory.
_CHUNK = 8 << 20


@dataclass
class _Target:
    """One tensor of the model (tied parameters are one target with several names)."""

    tensor: torch.Tensor
    buffer: bool
    names: list[str] = field(default_factory=list)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def _sources(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The files of the checkpoint at ``path``, and its index's name -> file map (if any)."""
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} (neither a file nor a folder)")
    # model.safetensors before an index, as from_pretrained looks: both read the same files.
    single = path / "model.safetensors"
    if single.exists():
        return [_inside(path, single.name, None)], None
    index = path / _INDEX
    if index.exists():
        weight_map = _read_index(index)
        files = [_inside(path, f, index) for f in dict.fromkeys(weight_map.values())]
        return list({os.path.normpath(f): f for f in files}.values()), weight_map
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors file in {str(path)!r}")
    shards = [f.name for f in found if _SHARD.fullmatch(f.name)]
    if shards:
        raise ValueError(f"{str(path)!r} holds shards ({', '.join(shards[:3])}) but no {_INDEX}"
                         " (an interrupted save, or a copy that missed it); write the checkpoint"
                         " again, or copy the index too")
    return [_inside(path, f.name, None) for f in found], None


def _read_index(index: Path) -> dict[str, str]:
    def bad(why: str) -> ValueError:
        return ValueError(f"{str(index)!r} is not a valid safetensors index ({why}); {_AGAIN}")

    with open(open_regular(index), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_HEADER_BYTES:
            raise bad(f"{size} bytes, more than an index of any model needs")
        raw = f.read()
    try:
        weight_map = json.loads(raw.decode("utf-8"))["weight_map"]
    except RecursionError:
        raise bad("JSON nested too deeply") from None
    except (ValueError, KeyError, TypeError) as e:  # JSON, UTF-8, no weight_map, not an object
        raise bad(f"{type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict):
        raise bad(f"its weight_map is a {type(weight_map).__name__}, not an object")
    for name, f in weight_map.items():
        if not isinstance(f, str):
            raise bad(f"its weight_map maps {name!r} to {f!r}, not to a file name")
    return weight_map


def _inside(folder: Path, name: str, index: Path | None) -> Path:
    """``folder / name``, refused unless it resolves inside ``folder`` (or, from the Hugging
    Face cache's ``snapshots/<revision>``, its ``blobs``): a hand-made index reads no other file."""
    where = f"the index {str(index)!r} names" if index is not None else f"{str(folder)!r} holds"
    parts = Path(name).parts
    if not name or "\0" in name or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"{where} file {name!r}, which is not a file name inside the"
                         f" checkpoint's folder; fix the index, or {_AGAIN}")
    root = os.path.realpath(folder)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    real = os.path.realpath(folder / name)
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise ValueError(f"{where} file {name!r}, a link that leads out of the checkpoint's"
                         f" folder (to {real!r}); replace the link by the file itself")
    if not os.path.exists(real):
        raise FileNotFoundError(f"{where} file {name!r}, which is missing; copy it into"
                                f" {str(folder)!r}, or {_AGAIN}")
    return folder / name


def _where(files: list[SafetensorsFile], weight_map: dict[str, str] | None,
           folder: Path) -> dict[str, tuple[SafetensorsFile, TensorInfo]]:
    """Each tensor's file and place: the file the index names, every tensor in one file only."""
    seen: dict[str, SafetensorsFile] = {}
    for f in files:
        for name in f.tensors:
            if name in seen:
                raise ValueError(
                    f"tensor {name!r} is in both {str(seen[name].path)!r} and {str(f.path)!r}"
                    f" (files of two saves?); {_AGAIN}, or remove the stale file")
            seen[name] = f
    if weight_map is not None:
        by_name = {os.path.normpath(f.path): f for f in files}
        for name, fname in weight_map.items():
            f = by_name[os.path.normpath(folder / fname)]
            if seen.get(name) is not f:
                raise ValueError(
                    f"{str(folder / _INDEX)!r} puts tensor {name!r} in {fname!r}, which does"
                    f" not hold it{'' if name not in seen else f' ({str(seen[name].path)!r} does)'}"
                    f": {_MIXED}")
        extra = [n for n in seen if n not in weight_map]
        if extra:
            raise ValueError(
                f"{str(folder / _INDEX)!r} does not list tensors its shards hold ({extra[:5]},"
                f" {len(extra)} in all, e.g. in {str(seen[extra[0]].path)!r}): {_MIXED}")
    return {name: (f, f.tensors[name]) for name, f in seen.items()}


def _targets(model: nn.Module) -> list[_Target]:
    by_id: dict[int, _Target] = {}
    for name, m, attr, t, is_buffer in module_tensors(model):
        tgt = by_id.setdefault(id(t), _Target(t, is_buffer))
        if name not in tgt.names:
            tgt.names.append(name)
        if (m, attr) not in tgt.owners:
            tgt.owners.append((m, attr))
    return list(by_id.values())


def _offload_states(model: nn.Module, what: str) -> dict[int, object]:
    """Module id -> the offload state of the offloaded (sub)model it belongs to."""
    out: dict[int, object] = {}
    for _, m, state in offload_states(model):
        if state.busy:
            raise RuntimeError(f"{what} during the model's forward or backward; call it"
                               " between steps")
        for sub in m.modules():
            out[id(sub)] = state
    return out


def load_weights(
    model: nn.Module, path: str | os.PathLike, *, strict: bool = True, verify: bool = True,
    quantize: Callable[[nn.Module], object] | None = None,
) -> None:
    """Fill ``model``'s parameters and persistent buffers from safetensors files.

    An offloaded model's values go straight into its store, a few megabytes at a time; one built
    on ``meta`` gets its values here. Names are ``state_dict()`` keys (tied parameters need one of
    theirs); values are cast to the parameter's dtype. Keys, shapes, headers and the checksums
    `save_weights` recorded are checked before they are written: see docs/offload.md, "Models
    bigger than RAM from their checkpoint" ("Checksums": what a damaged file leaves).

    Args:
        model: the model (offloaded or not). Not during its forward or backward.
        path: a ``.safetensors`` file, or a folder as ``save_pretrained`` writes it; its index
            may name files of the folder only (no ``..``, no link out but the Hugging Face
            cache's ``snapshots`` -> ``blobs``).
        strict: the files hold every parameter and persistent buffer and nothing else. With
            ``strict=False`` extra tensors are ignored and missing ones keep their values (or,
            created on ``meta``, are initialized by their module when first needed).
        verify: check the tensors against the checksums `save_weights` recorded; ``False`` loads
            a file whose checksums fail, and skips the checksum pass.
        quantize: for a model offloaded with ``hr.offload``: ``fn(block)``, called on each block
            once its values are read, quantizes it in place; the result rests packed, one block
            at full precision at a time (docs/lora.md, "The recipe"). Parameters outside the
            blocks load as they are.

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or a file its index names is missing.
        CheckpointCorruptError: (a ``ValueError``) a tensor or header does not match what was
            recorded; names the file, the tensor and what was loaded.
        ValueError: keys or shapes differ (all named); a damaged file or index, a tensor in two
            files, an index and shards of different saves or apart, a file outside the folder.
        RuntimeError: the model is in the middle of a forward or backward.

    Example:
        >>> with torch.device("meta"):                                # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> hr.offload(model, device="cuda", store=hr.DiskStore("/scratch/w"))   # doctest: +SKIP
        >>> hr.load_weights(model, "checkpoint_dir")                  # doctest: +SKIP
    """
    states = _offload_states(model, "load_weights")
    if quantize is not None and not states:
        raise ValueError(
            "load_weights(quantize=...) quantizes the blocks of a model offloaded with"
            " hr.offload as their values arrive; offload the model first, or load it and"
            " quantize it yourself")
    for state in {id(s): s for s in states.values()}.values():
        state.drop_announced()  # values about to be written: prefetched copies would be stale
    paths, weight_map = _sources(Path(path))
    files: list[SafetensorsFile] = []
    try:
        for p in paths:
            files.append(SafetensorsFile(p))
        where = _where(files, weight_map, Path(path))
        # Each file's record checked against its header (names, dtypes, shapes) before any data.
        records = {id(f): _check_record(f) for f in files} if verify else {}
        # A wrapped model (PEFT) takes its base checkpoint; see headroom.checkpoint._names.
        plan, problems = _match(checkpoint_names(model, _targets(model), where), where, strict)
        if problems:
            raise ValueError(
                f"the checkpoint at {str(path)!r} does not match the model: "
                + "; ".join(problems)
                + ("" if not strict else ". Pass strict=False to load the tensors that match")
            )
        refuse_quantized(
            [(name, tgt.tensor) for tgt, name in plan], "load_weights",
            "Load before quantizing: build the model on meta, hr.offload it, then"
            " hr.load_weights(model, path, quantize=fn) (a load with quantize= that was"
            " interrupted left its first blocks quantized: build the model on meta again)")
        sums = [(records.get(id(where[name][0])) or {}).get(name) for _, name in plan]
        checked = sum(where[name][1].nbytes for (_, name), c in zip(plan, sums, strict=True)
                      if c is not None)
        # NOTE: as `hr.load`: all first when the page cache keeps what that pass reads (a
        # damaged file changes nothing); otherwise each tensor just before it is written.
        first = checked > 0 and checked <= available_memory() // 2
        if first:
            for (_, name), c in zip(plan, sums, strict=True):
                if c is not None:
                    _verify(*where[name], c, "nothing was loaded: the model is unchanged")
        blocks = _by_block(plan, states) if quantize is not None else {}
        in_blocks = {id(tgt) for items in blocks.values() for tgt, _ in items}
        # the tensors outside blocks first, then block after block (each checked once)
        alone = [(t, c) for t, c in zip(plan, sums, strict=True) if id(t[0]) not in in_blocks]
        for i, ((tgt, name), c) in enumerate(alone):
            f, info = where[name]
            if c is not None and not first:
                after = f"the {len(alone) - i - 1} after it"
                rest = f", {after} and the blocks to quantize" if blocks else f" and {after}"
                _verify(f, info, c, f"the {i} tensors before it in this load were loaded; it"
                        f"{rest} are unchanged")
            _load_one(tgt, f, info, states)
        sums_of = {id(tgt): c for (tgt, _), c in zip(plan, sums, strict=True)}
        for (state, group), items in blocks.items():
            values = {}
            for tgt, name in items:
                f, info = where[name]
                c = sums_of[id(tgt)]
                if c is not None and not first:
                    _verify(f, info, c, "the blocks before it in this load were loaded and"
                            " quantized; it and the blocks after it are unchanged")
                slot = state.by_param[id(tgt.tensor)]
                v = torch.empty(tuple(info.shape), dtype=slot.binding.handle.dtype)
                _stream(f, info, v)
                values[id(slot)] = v
            quantize_block(state, group, values, quantize)
            del values
            for tgt, _ in items:  # quantize may have replaced them: let go of what they were
                tgt.owners.clear()
                tgt.tensor = None
    finally:
        for f in files:
            f.close()


def _by_block(plan: list, states: dict) -> dict:
    """(state, block) -> the plan's items whose parameter rests in that block, in order."""
    out: dict = {}
    for tgt, name in plan:
        if tgt.buffer:
            continue
        state = states.get(id(tgt.owners[0][0]))
        slot = state.by_param.get(id(tgt.tensor)) if state is not None else None
        if slot is None or slot.group is state.rest:
            continue
        out.setdefault((state, slot.group), []).append((tgt, name))
    return out


def _corrupt(f: SafetensorsFile, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{str(f.path)!r} does not match what save_weights wrote"
                                  f" ({why}): the file was damaged or edited since; {_FIX}")


def _check_record(f: SafetensorsFile) -> dict[str, int] | None:
    """The CRC32C `save_weights` recorded for each tensor of ``f`` (``None``: no record), once
    the record's names, dtypes and shapes are the header's: the data's checksum alone would
    miss a header edited in place (F32 -> I32, [4, 6] -> [6, 4] reinterpret the same bytes)."""
    raw = f.metadata.get(_RECORD)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        if not isinstance(record, dict):
            raise TypeError(f"a {type(record).__name__}, not an object")
        sums: dict[str, int] = {}
        for name, entry in record.items():
            code, shape, digits = entry
            if (not isinstance(code, str) or not isinstance(shape, list)
                    or not all(type(d) is int for d in shape) or not isinstance(digits, str)
                    or not re.fullmatch(r"[0-9a-f]{8}", digits)):
                raise ValueError(f"entry {name!r} is {entry!r}, not [dtype, shape, 8 hex digits]")
            sums[name] = int(digits, 16)
    except RecursionError:
        raise _corrupt(f, f"its {_RECORD} metadata is JSON nested too deeply") from None
    except (ValueError, TypeError) as e:  # JSON, an entry not a triple, a bad field
        raise _corrupt(f, f"its {_RECORD} metadata is unreadable: {e}") from None
    if record.keys() != f.tensors.keys():
        extra = [n for n in f.tensors if n not in record]
        gone = [n for n in record if n not in f.tensors]
        raise _corrupt(f, f"its header holds tensors {extra[:5]} it was not saved with, and"
                          f" lacks {gone[:5]} it was saved with")
    for name, info in f.tensors.items():
        code, shape, _ = record[name]
        now = DTYPES[info.dtype]
        if code != now or tuple(shape) != info.shape:
            raise _corrupt(f, f"tensor {name!r} is {now} {list(info.shape)} in its header,"
                              f" saved as {code} {shape}")
    return sums


def _verify(f: SafetensorsFile, info: TensorInfo, expected: int, state: str) -> None:
    """Check tensor ``info``'s bytes against their recorded CRC32C, or raise saying ``state``."""
    got = f.crc32c(info.name)
    if got != expected:
        raise CheckpointCorruptError(
            f"{str(f.path)!r} is damaged: tensor {info.name!r} (file bytes {info.offset}-"
            f"{info.offset + info.nbytes}) has CRC32C {got:08x}, save_weights recorded"
            f" {expected:08x}; {state}. {_FIX[0].upper()}{_FIX[1:]}"
        )


def _match(targets: list[_Target], where: dict, strict: bool):
    plan: list[tuple[_Target, str]] = []
    missing, shapes = [], []
    known: set[str] = set()
    for tgt in targets:
        known.update(tgt.names)
        name = next((n for n in tgt.names if n in where), None)
        if name is None:
            missing.append(tgt.names[0])
            continue
        shape = where[name][1].shape
        if shape != tuple(tgt.tensor.shape):
            shapes.append(f"{name}: checkpoint {list(shape)}, model {list(tgt.tensor.shape)}")
            continue
        plan.append((tgt, name))
    unexpected = [n for n in where if n not in known]
    problems = []
    if shapes:
        problems.append(f"shapes differ for {', '.join(shapes[:8])}")
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        if strict and names:
            problems.append(f"{what} {names[:8]}{' ...' if len(names) > 8 else ''}"
                            f" ({len(names)} in all)")
    return plan, problems


@torch.no_grad()
def _load_one(tgt: _Target, f: SafetensorsFile, info: TensorInfo, states: dict) -> None:
    t = tgt.tensor
    b = binding(t) if not tgt.buffer else None
    if b is not None:
        host = b.store.host_tensor(b.handle)
        _stream(f, info, host if host is not None else b)
        b.has_value = True
        return
    if t.device.type == "meta":
        state = states.get(id(tgt.owners[0][0]))
        device = state.device if state is not None else torch.device("cpu")
        new = torch.empty(t.shape, dtype=t.dtype, device=device)
        if not tgt.buffer:
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        for m, attr in tgt.owners:
            (m._buffers if tgt.buffer else m._parameters)[attr] = new
        t = new
    _stream(f, info, t.detach())


def _stream(f: SafetensorsFile, info: TensorInfo, dst: torch.Tensor | ParamBinding) -> None:
    """Copy a tensor from the file into ``dst`` (a tensor, or the store a binding names) in
    chunks of rows: read chunk i+1 while chunk i is written."""
    store = None if isinstance(dst, torch.Tensor) else dst.store
    dtype = dst.dtype if store is None else dst.handle.dtype
    rows = info.shape[0] if info.shape else 1
    per = max(1, _CHUNK // max(1, info.row_nbytes)) if info.shape else 1
    rest = info.shape[1:]
    # a host tensor of the file's dtype is read into straight
    direct = (store is None and dst.device.type == "cpu" and dst.is_contiguous()
              and dtype == info.dtype)
    bufs: list[torch.Tensor | None] = [None, None]
    pending: list[Future | None] = [None, None]
    for i, a in enumerate(range(0, rows, per)):
        b = min(a + per, rows)
        k = i % 2
        if pending[k] is not None:
            pending[k].result()  # its buffer is reused below
            pending[k] = None
        shape = (b - a, *rest) if info.shape else ()
        part = (dst[a:b] if dst.dim() else dst) if store is None else None
        if direct:
            f.read_rows(info.name, a, b, part)
            continue
        n = (b - a) * info.row_nbytes if info.shape else info.nbytes
        if bufs[k] is None or bufs[k].numel() < n:
            bufs[k] = torch.empty(n, dtype=torch.uint8)
        buf = bufs[k][:n].view(info.dtype).view(shape)
        f.read_rows(info.name, a, b, buf)
        src = buf if buf.dtype == dtype else buf.to(dtype)
        if part is not None:
            part.copy_(src.reshape(part.shape))
        elif dst.handle.shape:
            pending[k] = store.write_rows(dst.handle, slice(a, b), src.contiguous())
        else:
            pending[k] = store.write(dst.handle, src.reshape(()).contiguous())
    for p in pending:
        if p is not None:
            p.result()


# ------------------------------------------------------------------------------ save_weights
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _size(v: int | str) -> int:
    """``max_shard_size`` in bytes; refused unless a positive int or a size string."""
    fix = "pass a positive number of bytes, or a string such as '5GB' or '500MiB'"
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TypeError(f"max_shard_size={v!r} is a {type(v).__name__}; {fix}")
    n = v
    if isinstance(v, str):
        s = v.strip().upper().replace(" ", "")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if s.endswith(u)), None)
        try:
            n = int(float(s[: -len(unit)]) * _UNITS[unit]) if unit else int(s)
        except (ValueError, OverflowError):  # "abc", "nanGB", "infGB"
            raise ValueError(f"max_shard_size={v!r} is not a size; {fix}") from None
    if n <= 0:
        raise ValueError(f"max_shard_size={v!r} is not positive; {fix}")
    return n


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} is not a torch.dtype; pass one such as torch.bfloat16,"
                        " or None to keep each tensor's own")
    if not dtype.is_floating_point or dtype not in DTYPES:
        raise ValueError(
            f"dtype={dtype} is not a floating-point dtype safetensors holds (dtype= casts the"
            " floating-point tensors only, integer and bool ones keep theirs); pass"
            " torch.bfloat16, torch.float16 or torch.float32, or None")


def save_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write ``model``'s parameters and persistent buffers as ``save_pretrained`` does.

    ``model.safetensors``, or shards with their ``model.safetensors.index.json``, which
    ``from_pretrained`` (and `load_weights`) read; an offloaded model's parameters stream from its
    store. Tied parameters are written once, under their first name; a Hugging Face model's
    ``config`` (and generation config) beside them; each file's ``__metadata__`` records every
    tensor's dtype, shape and CRC32C. A save replaces the checkpoint in ``path`` as one unit
    (shards get new names, ``model-<tag>-00001-of-00003.safetensors``, when the folder holds the
    usual ones). See docs/offload.md, "Models bigger than RAM from their checkpoint".

    Args:
        model: the model (offloaded or not); not during its forward or backward.
        path: the folder to write into (created if missing).
        max_shard_size: bytes per file (a positive int, or a string such as ``"5GB"`` or
            ``"500MiB"``). A tensor larger than this gets a file of its own.
        dtype: cast floating-point tensors to this floating-point dtype in the files (e.g.
            ``torch.bfloat16``); integer and bool tensors keep theirs. By default each tensor
            keeps its own.

    Returns:
        The files written (the index last, if any).

    Raises:
        RuntimeError: the model is in the middle of a forward or backward.
        TypeError: a dtype safetensors cannot hold; ``max_shard_size`` or ``dtype`` of the
            wrong type.
        ValueError: ``max_shard_size`` not a positive size; ``dtype`` not floating-point.

    Example:
        >>> hr.save_weights(model, "finetuned")                               # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("finetuned")                 # doctest: +SKIP
    """
    _check_dtype(dtype)
    limit = _size(max_shard_size)
    states = _offload_states(model, "save_weights")
    for state in {id(s): s for s in states.values()}.values():
        state.init_pending()  # values for what was created on meta and never loaded
    out = Path(path)
    items = []
    for tgt in _targets(model):
        t = tgt.tensor
        if t.device.type == "meta" and binding(t) is None:
            raise RuntimeError(f"{tgt.names[0]!r} is on the meta device and has no values;"
                               " load or initialize it before saving")
        to = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if to not in DTYPES:
            raise TypeError(f"cannot save {tgt.names[0]!r}: safetensors has no {to}")
        items.append((tgt.names[0], tgt, to, t.numel() * to.itemsize))
    shards: list[list] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it[3] > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it[3]
    out.mkdir(parents=True, exist_ok=True)
    written = _write_checkpoint(out, shards)
    for attr in ("config", "generation_config"):
        cfg = getattr(model, attr, None)
        if cfg is not None and callable(getattr(cfg, "save_pretrained", None)):
            cfg.save_pretrained(out)
    return written


def _write_checkpoint(out: Path, shards: list[list]) -> list[Path]:
    """Write ``shards`` into ``out`` over the checkpoint there, as one unit (see `save_weights`)."""
    n = len(shards)
    before = {e.name for e in os.scandir(out)
              if e.name in ("model.safetensors", _INDEX) or _SHARD.fullmatch(e.name)}
    if n == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        while any(name in before or (out / name).exists() for name in names):
            tag = os.urandom(4).hex()
            names = [f"model-{tag}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written: list[Path] = []
    landed: list[Path] = []  # this save's files in place, not yet part of a checkpoint
    index = b""
    try:
        for name, shard in zip(names, shards, strict=True):
            _write_shard(out / name, shard)
            written.append(out / name)
            if n > 1:
                landed.append(out / name)
        if n > 1:
            fsync_dir(out)  # the shards' names are on disk before an index names them
            total = sum(it[3] for shard in shards for it in shard)
            index = json.dumps({
                "metadata": {"total_size": total},
                "weight_map": {it[0]: name for name, shard in zip(names, shards, strict=True)
                               for it in shard}}, indent=2).encode()
            write_file(out / _INDEX, lambda f: f.write(index))
            written.append(out / _INDEX)
        landed = []
    except BaseException:
        # An interrupt just after the index's rename leaves the new checkpoint in place: its
        # shards stay. Otherwise they were never named by an index and go.
        if landed and not _holds(out / _INDEX, index):
            for f in landed:
                with contextlib.suppress(OSError):
                    f.unlink()
        raise
    # Durably in place before anything old goes. Readers take model.safetensors before an
    # index, so an earlier one goes first: its removal is when a sharded save takes over.
    fsync_dir(out)
    keep = set(names) | ({_INDEX} if n > 1 else set())
    stale = sorted(before - keep, key=lambda f: f != "model.safetensors")
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    _remove_dead_temps(out)
    fsync_dir(out)
    return written


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


def _remove_dead_temps(out: Path) -> None:
    """Remove the temporary files that killed saves into ``out`` left (their process gone)."""
    targets = set()
    for e in os.scandir(out):
        m = re.fullmatch(r"\.(model[^/]*?\.safetensors(?:\.index\.json)?)\.tmp-.*", e.name)
        if m:
            targets.add(m.group(1))
    for target in targets:
        remove_stale_temps(str(out / target))


@torch.no_grad()
def _write_shard(path: Path, shard: list) -> None:
    table = [(name, to, tgt.tensor.shape, nbytes) for name, tgt, to, nbytes in shard]

    def header(sums: dict[str, int]) -> bytes:
        record = {name: [DTYPES[to], list(tgt.tensor.shape), f"{sums[name] if sums else 0:08x}"]
                  for name, tgt, to, _ in shard}
        # "format": "pt" is what from_pretrained looks for; metadata values are strings.
        return build_header(
            {"format": "pt", _RECORD: json.dumps(record, separators=(",", ":"))}, table)

    write_tensors(path, header, ((name, _chunks(tgt.tensor, to)) for name, tgt, to, _ in shard))


def _chunks(t: torch.Tensor, to: torch.dtype):
    """``t``'s values in ``to``, a few megabytes of rows at a time (from its store if it rests
    in one), each with whether it is a copy made for this."""
    b = binding(t)
    if b is not None:
        host = b.store.host_tensor(b.handle)
        h = b.handle
        if host is None and h.shape:
            for rows in store_slices(b.store, h, _CHUNK):
                yield rows.to(to).contiguous(), True
            return
        t = host if host is not None else b.store.read(h).result()
    t = t.detach()
    base = t.untyped_storage().data_ptr() if t.device.type == "cpu" else None
    if not t.dim():
        out = t.to("cpu", to).reshape(1)
        yield out, out.untyped_storage().data_ptr() != base
        return
    per = max(1, _CHUNK // max(1, math.prod(t.shape[1:]) * t.element_size()))
    for a in range(0, t.shape[0], per):
        out = t[a:a + per].to("cpu", to).contiguous()
        yield out, out.untyped_storage().data_ptr() != base
