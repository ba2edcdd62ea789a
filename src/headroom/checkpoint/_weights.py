"""`load_weights` / `save_weights`: a model's tensors from and to safetensors, via its store.

The checkpoint may be one file or a folder as ``save_pretrained`` writes it (``model.safetensors``,
or shards with ``model.safetensors.index.json``). Each tensor is read a few megabytes of rows at
a time and written where the parameter rests: the store of an offloaded model (host memory or a
`DiskStore`), or the tensor itself. So a model built on ``meta`` and offloaded is filled without
ever existing whole in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from headroom.checkpoint._names import checkpoint_names
from headroom.transfer import SafetensorsFile, Store, TensorInfo, binding, safetensors_dtypes

__all__ = ["load_weights", "save_weights"]

_ATTR = "_headroom_offload"
_INDEX = "model.safetensors.index.json"
# File bytes read per chunk. Two chunks in flight (one being written while the next is
# read) plus a dtype conversion bound the memory a load adds, whatever the model's size.
_CHUNK = 8 << 20


@dataclass
class _Target:
    """One tensor of the model (tied parameters are one target with several names)."""

    tensor: torch.Tensor
    buffer: bool
    names: list[str] = field(default_factory=list)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r} (neither a file nor a folder)")
    index = path / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{str(index)!r} is not a valid safetensors index ({e}); write the checkpoint"
                " again"
            ) from None
        return [path / f for f in dict.fromkeys(weight_map.values())]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors file in {str(path)!r}")
    return found


def _targets(model: nn.Module) -> list[_Target]:
    by_id: dict[int, _Target] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        prefix = f"{mname}." if mname else ""
        items = [(n, t, False) for n, t in m._parameters.items()]
        items += [(n, t, True) for n, t in m._buffers.items()
                  if n not in m._non_persistent_buffers_set]
        for n, t, is_buffer in items:
            if t is None:
                continue
            tgt = by_id.setdefault(id(t), _Target(t, is_buffer))
            if prefix + n not in tgt.names:
                tgt.names.append(prefix + n)
            if (m, n) not in tgt.owners:
                tgt.owners.append((m, n))
    return list(by_id.values())


def _offload_states(model: nn.Module) -> dict[int, object]:
    """Module id -> the offload state of the offloaded (sub)model it belongs to."""
    out: dict[int, object] = {}
    for m in model.modules():
        state = getattr(m, _ATTR, None)
        if state is not None:
            for sub in m.modules():
                out[id(sub)] = state
    return out


def load_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> None:
    """Fill ``model``'s parameters and persistent buffers from safetensors files.

    Works on an offloaded model (the values go straight into its store, host memory or disk,
    a few megabytes at a time) and on an ordinary one; a model built on ``meta`` gets its
    values here instead of being initialized at random (see `hr.offload`). Names are the
    model's ``state_dict()`` keys; tied parameters need only one of their names in the files
    (``save_pretrained`` writes one). Values are converted to the parameter's dtype when the
    file's differs. Everything is checked before anything is written.

    Args:
        model: the model (offloaded or not). Not during its forward or backward.
        path: a ``.safetensors`` file, or a folder with ``model.safetensors`` or shards and
            their ``model.safetensors.index.json`` (what ``save_pretrained`` writes).
        strict: the files must hold every parameter and persistent buffer of the model and
            nothing else. With ``strict=False`` extra tensors are ignored, and parameters
            missing from the files keep their values (or, created on ``meta``, are initialized
            by their module when first needed).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: missing or unexpected keys, or shape mismatches (all named), or a damaged
            file or index (named).
        RuntimeError: the model is in the middle of a forward or backward.

    Example:
        >>> with torch.device("meta"):                                # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> hr.offload(model, device="cuda", store=hr.DiskStore("/scratch/w"))   # doctest: +SKIP
        >>> hr.load_weights(model, "checkpoint_dir")                  # doctest: +SKIP
    """
    states = _offload_states(model)
    for state in {id(s): s for s in states.values()}.values():
        if state._bwd or state._root_running or state._active:
            raise RuntimeError("load_weights during the model's forward or backward; call it"
                               " between steps")
        state.drop_announced()  # values about to be written: prefetched copies would be stale
    files = [SafetensorsFile(p) for p in _files(Path(path))]
    try:
        where: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
        for f in files:
            for name, info in f.tensors.items():
                where.setdefault(name, (f, info))
        # A wrapped model (PEFT) takes its base checkpoint; see headroom.checkpoint._names.
        plan, problems = _match(checkpoint_names(model, _targets(model), where), where, strict)
        if problems:
            raise ValueError(
                f"the checkpoint at {str(path)!r} does not match the model: "
                + "; ".join(problems)
                + ("" if not strict else ". Pass strict=False to load the tensors that match")
            )
        for tgt, name in plan:
            f, info = where[name]
            _load_one(tgt, f, info, states)
    finally:
        for f in files:
            f.close()


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
    if strict and missing:
        problems.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                        f" ({len(missing)} in all)")
    if strict and unexpected:
        problems.append(f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
                        f" ({len(unexpected)} in all)")
    return plan, problems


@torch.no_grad()
def _load_one(tgt: _Target, f: SafetensorsFile, info: TensorInfo, states: dict) -> None:
    t = tgt.tensor
    b = binding(t) if not tgt.buffer else None
    if b is not None:
        host = b.store.host_tensor(b.handle)
        if host is not None:
            _stream(f, info, _into_tensor(host))
        else:
            _stream(f, info, _into_store(b.store, b.handle))
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
    _stream(f, info, _into_tensor(t.detach()))


def _into_tensor(dst: torch.Tensor) -> Callable:
    def write(a: int, b: int, src: torch.Tensor | None) -> Future | None:
        part = dst[a:b] if dst.dim() else dst
        if src is None:  # read straight into it
            return part
        part.copy_(src.reshape(part.shape))
        return None

    write.direct = dst.device.type == "cpu" and dst.is_contiguous()  # type: ignore[attr-defined]
    write.dtype = dst.dtype  # type: ignore[attr-defined]
    return write


def _into_store(store: Store, handle) -> Callable:
    def write(a: int, b: int, src: torch.Tensor | None) -> Future | None:
        if not handle.shape:
            return store.write(handle, src.reshape(()).contiguous())
        return store.write_rows(handle, slice(a, b), src.contiguous())

    write.direct = False  # type: ignore[attr-defined]
    write.dtype = handle.dtype  # type: ignore[attr-defined]
    return write


def _stream(f: SafetensorsFile, info: TensorInfo, write: Callable) -> None:
    """Copy a tensor from the file in chunks of rows: read chunk i+1 while chunk i is written."""
    rows = info.shape[0] if info.shape else 1
    per = max(1, _CHUNK // max(1, info.row_nbytes)) if info.shape else 1
    rest = info.shape[1:]
    direct = write.direct and write.dtype == info.dtype
    bufs: list[torch.Tensor | None] = [None, None]
    pending: list[Future | None] = [None, None]
    for i, a in enumerate(range(0, rows, per)):
        b = min(a + per, rows)
        k = i % 2
        if pending[k] is not None:
            pending[k].result()  # its buffer is reused below
            pending[k] = None
        shape = (b - a, *rest) if info.shape else ()
        if direct:
            f.read_rows(info.name, a, b, write(a, b, None))
            continue
        n = (b - a) * info.row_nbytes if info.shape else info.nbytes
        if bufs[k] is None or bufs[k].numel() < n:
            bufs[k] = torch.empty(n, dtype=torch.uint8)
        buf = bufs[k][:n].view(info.dtype).view(shape)
        f.read_rows(info.name, a, b, buf)
        src = buf if buf.dtype == write.dtype else buf.to(write.dtype)
        pending[k] = write(a, b, src)
    for p in pending:
        if p is not None:
            p.result()


# ------------------------------------------------------------------------------ save_weights
_CODES = {v: k for k, v in safetensors_dtypes().items()}
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _size(v: int | str) -> int:
    if isinstance(v, int):
        return v
    s = v.strip().upper().replace(" ", "")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * _UNITS[unit])
    return int(s)


def save_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write ``model``'s parameters and persistent buffers as safetensors, as
    ``save_pretrained`` does: ``model.safetensors``, or shards with their
    ``model.safetensors.index.json``, so ``from_pretrained`` (and `load_weights`) read them.

    An offloaded model's parameters are streamed from its store a few megabytes at a time,
    never gathered in memory. Tied parameters are written once, under their first name (their
    module registration order: the embedding before an output head tied to it), as
    ``save_pretrained`` does. A Hugging Face model's ``config`` (and generation config) is
    written beside them. Each file is written under a temporary name and renamed when complete.

    Args:
        model: the model (offloaded or not); not during its forward or backward.
        path: the folder to write into (created if missing).
        max_shard_size: bytes per file (an int, or a string such as ``"5GB"``/``"500MiB"``).
            A tensor larger than this gets a file of its own.
        dtype: cast floating-point tensors to this dtype in the files (e.g. ``torch.bfloat16``);
            by default each keeps its own.

    Returns:
        The files written (the index last, if any).

    Raises:
        RuntimeError: the model is in the middle of a forward or backward.
        TypeError: a dtype safetensors cannot hold.

    Example:
        >>> hr.save_weights(model, "finetuned")                               # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("finetuned")                 # doctest: +SKIP
    """
    states = _offload_states(model)
    for state in {id(s): s for s in states.values()}.values():
        if state._bwd or state._root_running or state._active:
            raise RuntimeError("save_weights during the model's forward or backward; call it"
                               " between steps")
        state.init_pending()  # values for what was created on meta and never loaded
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    items = []
    for tgt in _targets(model):
        t = tgt.tensor
        if t.device.type == "meta" and binding(t) is None:
            raise RuntimeError(f"{tgt.names[0]!r} is on the meta device and has no values;"
                               " load or initialize it before saving")
        to = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if to not in _CODES:
            raise TypeError(f"cannot save {tgt.names[0]!r}: safetensors has no {to}")
        items.append((tgt.names[0], tgt, to, t.numel() * to.itemsize))
    limit = _size(max_shard_size)
    shards: list[list] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it[3] > limit:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it[3]
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written = []
    for name, shard in zip(names, shards, strict=True):
        _write_shard(out / name, shard)
        written.append(out / name)
    if n > 1:
        index = {"metadata": {"total_size": sum(it[3] for it in items)},
                 "weight_map": {it[0]: name for name, shard in zip(names, shards, strict=True)
                                for it in shard}}
        tmp = out / (_INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=2))
        os.replace(tmp, out / _INDEX)
        written.append(out / _INDEX)
    for attr in ("config", "generation_config"):
        cfg = getattr(model, attr, None)
        if cfg is not None and callable(getattr(cfg, "save_pretrained", None)):
            cfg.save_pretrained(out)
    return written


@torch.no_grad()
def _write_shard(path: Path, shard: list) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tgt, to, nbytes in shard:
        header[name] = {"dtype": _CODES[to], "shape": list(tgt.tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for _, tgt, to, _ in shard:
            for chunk in _chunks(tgt.tensor, to):
                f.write(memoryview(chunk.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _chunks(t: torch.Tensor, to: torch.dtype):
    """``t``'s values in ``to``, a few megabytes of rows at a time, read from its store if it
    rests in one."""
    b = binding(t)
    if b is not None:
        host = b.store.host_tensor(b.handle)
        h = b.handle
        if host is None and h.shape:
            per = max(1, _CHUNK // max(1, h.row_nbytes))
            nxt = b.store.read_rows(h, slice(0, min(per, h.shape[0])))
            for a in range(0, h.shape[0], per):
                cur = nxt
                stop = min(a + per, h.shape[0])
                if stop < h.shape[0]:  # the next slice is read while this one is written
                    nxt = b.store.read_rows(h, slice(stop, min(stop + per, h.shape[0])))
                yield cur.result().to(to).contiguous()
            return
        t = host if host is not None else b.store.read(h).result()
    t = t.detach()
    if not t.dim():
        yield t.to("cpu", to).reshape(1)
        return
    per = max(1, _CHUNK // max(1, t[0].numel() * t.element_size()))
    for a in range(0, t.shape[0], per):
        yield t[a:a + per].to("cpu", to).contiguous()
