"""`save` / `load`: model and optimizer checkpoints as one safetensors file, JSON inside, no pickle.

Tensors are named ``model/<state_dict key>`` and ``optimizer/<param index>/<state key>``; the
rest (optimizer class, hyperparameters, extras) is JSON under ``__metadata__["headroom"]``.
Checksums, temporary files and checked reading: `headroom.checkpoint._file`.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from headroom.checkpoint._file import (
    DTYPES,
    FORMAT,
    PLACEHOLDER,
    VERSION,
    CheckpointCorruptError,
    Reader,
    available_memory,
    build_header,
    fsync_dir,
    seal_header,
    store_slices,
    write_tensors,
)
from headroom.checkpoint._names import module_tensors, refuse_quantized
from headroom.optim import HostOptimizer, saved_view
from headroom.residency import offload_states
from headroom.store import Handle, Store
from headroom.transfer import binding

__all__ = ["CheckpointCorruptError", "load", "save"]

_CHUNK = 32 << 20
# How far `load`'s checksums may run ahead of the tensors it loads (an eighth of the available
# memory, within these bounds): what they read must still be in the page cache when used.
_AHEAD_MIN, _AHEAD_MAX = 64 << 20, 1 << 30

class _Item:
    """One tensor to write: in memory, or resting in a store (streamed in row slices)."""

    __slots__ = ("name", "dtype", "shape", "tensor", "store", "handle")

    def __init__(self, name: str, *, tensor: torch.Tensor | None = None,
                 store: Store | None = None, handle: Handle | None = None) -> None:
        self.name = name
        self.tensor = tensor
        self.store = store
        self.handle = handle
        self.dtype = tensor.dtype if tensor is not None else handle.dtype
        if self.dtype not in DTYPES:
            raise TypeError(f"cannot save {name!r}: dtype {self.dtype} has no safetensors code")
        self.shape = tuple(tensor.shape) if tensor is not None else handle.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def chunks(self) -> Iterator[tuple[torch.Tensor, bool]]:
        """The bytes to write, each with whether it is a copy (see `write_tensors`)."""
        h = self.handle
        src = self.tensor.detach() if self.tensor is not None else self.store.host_tensor(h)
        if src is not None:
            t = src.cpu().contiguous()
            yield t, t.data_ptr() != src.data_ptr()
            return
        # Disk reads overlap file writes (and the checksum of a slice, on the checksum
        # thread, overlaps its write too).
        slices = store_slices(self.store, h, _CHUNK) if h.shape else [self.store.read(h).result()]
        for t in slices:
            yield t, True


def _jsonable(value: Any, where: str, tensors: list[_Item]) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"json/{len(tensors)}"
        tensors.append(_Item(name, tensor=value.detach().cpu().clone()))
        return {"__tensor__": name}
    if isinstance(value, tuple):
        return {"__tuple__": [_jsonable(v, where, tensors) for v in value]}
    if isinstance(value, list):
        return [_jsonable(v, where, tensors) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, where, tensors) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        if isinstance(value, float) and not math.isfinite(value):
            return {"__float__": repr(value)}
        return value
    raise TypeError(
        f"cannot save {where}: {type(value).__name__} is not a tensor or JSON value (checkpoints "
        "hold no pickled objects); store it as a number, string, list or tensor"
    )


def _unjson(value: Any, get: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return get(value["__tensor__"])
        if "__tuple__" in value:
            return tuple(_unjson(v, get) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        return {k: _unjson(v, get) for k, v in value.items()}
    if isinstance(value, list):
        return [_unjson(v, get) for v in value]
    return value


def _named_tensors(model: nn.Module, *, fill: bool = True) -> dict[str, torch.Tensor]:
    """``state_dict(keep_vars=True)``, without materializing store-resident parameters."""
    # (An offloaded model's ``state_dict()`` would read every parameter into memory at once.)
    if not any(binding(p) is not None for p in model.parameters()):
        return dict(model.state_dict(keep_vars=True))
    for _, _, state in offload_states(model):
        if fill:
            state.init_pending()  # values for what was created on meta and never loaded
        else:
            state.drop_announced()  # values about to be written: prefetched copies would be stale
    return {name: t for name, _, _, t, _ in module_tensors(model)}


_QUANTIZED_FIX = (
    "hr.save and hr.load keep plain tensors only. Save what trains: PEFT's"
    " model.save_pretrained(dir) writes the adapters (the quantized base is reloaded from its"
    " own checkpoint), and torch.save(optimizer.state_dict()) the optimizer's state")


def _model_items(model: nn.Module) -> tuple[list[_Item], list[str]]:
    items = []
    named = _named_tensors(model)
    refuse_quantized(named.items(), "hr.save", _QUANTIZED_FIX)
    for name, t in named.items():
        b = binding(t) if isinstance(t, torch.Tensor) else None
        items.append(_Item(f"model/{name}", tensor=t) if b is None
                     else _Item(f"model/{name}", store=b.store, handle=b.handle))
    return items, list(named)


def _optimizer_items(
    optimizer: torch.optim.Optimizer, model: nn.Module, tensors: list[_Item]
) -> tuple[list[_Item], dict[str, Any]]:
    pname = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    if isinstance(optimizer, HostOptimizer):
        view = saved_view(optimizer)
        hparams, inner_class = view.groups, view.inner_class
        order = [ps.param for ps in view.params]
        states = [(ps.index, ps.state, ps.resting, ps.store) for ps in view.params
                  if ps.state is not None]
    else:
        sd = optimizer.state_dict()
        hparams = [({k: v for k, v in g.items() if k != "params"}, list(g["params"]))
                   for g in sd["param_groups"]]
        order, inner_class = [p for g in optimizer.param_groups for p in g["params"]], None
        states = [(idx, st, {}, None) for idx, st in sd["state"].items()]
    groups = [{"hparams": _jsonable(hp, f"param_groups[{gi}]", tensors), "params": indices}
              for gi, (hp, indices) in enumerate(hparams)]
    params = [{"name": pname.get(id(p)), "shape": list(p.shape)} for p in order]
    items: list[_Item] = []
    small: dict[str, dict[str, Any]] = {}
    for idx, st, resting, store in states:
        # resting state (and a store-resident bf16/fp16 parameter's master) streams from
        # its store; the rest (with an in-memory fp32 master) is saved from memory
        items += [_Item(f"optimizer/{idx}/{k}", store=store, handle=h) for k, h in resting.items()]
        items += [_Item(f"optimizer/{idx}/{k}", tensor=v) for k, v in st.items()
                  if isinstance(v, torch.Tensor)]
        small[str(idx)] = {k: _jsonable(v, f"state of parameter {idx}", tensors)
                           for k, v in st.items() if not isinstance(v, torch.Tensor)}
    meta = {"class": type(optimizer).__name__, "groups": groups, "params": params,
            "small": small}
    if inner_class is not None:
        meta["inner_class"] = inner_class
    return items, meta


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``) to one checksummed safetensors file, atomically.

    What rests on disk is streamed slice by slice; a crash mid-save leaves the old checkpoint
    intact. See docs/host_optimizer.md, "Checkpoints: `hr.save` / `hr.load`".

    Args:
        path: the file to write (conventionally ``*.safetensors``).
        model: the model; its ``state_dict()`` keys name the tensors. Store-resident
            parameters (``hr.offload``) are read from their store.
        optimizer: a `HostOptimizer` or any ``torch.optim`` optimizer over ``model``'s
            parameters.
        extra: JSON-friendly values to keep alongside (epoch, an LR scheduler's
            ``state_dict()``, ...); tensors inside are saved as tensors. Returned by `load`.

    Raises:
        TypeError: a value that is neither a tensor nor JSON (checkpoints hold no pickles).
        OSError: the file cannot be written (the old checkpoint, if any, is untouched).

    Example:
        >>> hr.save("ckpt.safetensors", model, opt, extra={"step": 100})   # doctest: +SKIP
    """
    _save(path, model, optimizer, extra=extra, checksums=True)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer`` keeps
    it as ``.optimizer``, Lightning's ``LightningOptimizer`` as ``._optimizer``): a checkpoint
    saved through the wrapper loads into the bare optimizer, and the other way round."""
    for _ in range(4):  # wrappers of wrappers, bounded
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def _save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    extra: Mapping[str, Any] | None,
    checksums: bool,
) -> None:
    """`save`; ``checksums=False`` writes a version 1 file (no checksums), as before them."""
    path = os.fspath(path)
    optimizer = unwrap_optimizer(optimizer)
    json_tensors: list[_Item] = []
    items, names = _model_items(model)
    meta: dict[str, Any] = {}
    if checksums:
        meta["header_crc32c"] = PLACEHOLDER
    meta.update({"format": FORMAT, "version": VERSION if checksums else 1, "model": names})
    if optimizer is not None:
        opt_items, meta["optimizer"] = _optimizer_items(optimizer, model, json_tensors)
        items += opt_items
    meta["extra"] = _jsonable(dict(extra or {}), "extra", json_tensors)
    items += json_tensors
    table = [(it.name, it.dtype, it.shape, it.nbytes) for it in items]

    def header(crcs: dict[str, int]) -> bytes:
        if checksums:  # zeros of the same width before the data is written, then every sum
            meta["crc32c"] = {it.name: f"{crcs[it.name] if crcs else 0:08x}" for it in items}
        blob = build_header({"headroom": json.dumps(meta)}, table)
        return seal_header(blob) if checksums else blob

    write_tensors(path, header, ((it.name, it.chunks()) for it in items), checksums=checksums)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


class _LazyState(Mapping):
    """One parameter's saved optimizer state, read from the file only when accessed."""

    def __init__(self, keys: list[str], small: dict[str, Any], get) -> None:
        self._keys = keys
        self._small = small
        self._get = get

    def __getitem__(self, k: str) -> Any:
        if k in self._small:
            return self._small[k]
        if k in self._keys:
            return self._get(k)
        raise KeyError(k)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._small) + self._keys)

    def __len__(self) -> int:
        return len(self._small) + len(self._keys)


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save` into ``model`` (and ``optimizer``) in place.

    Tensors stream into their stores (a checkpoint larger than RAM loads), each checked against
    its CRC32C; what a damaged file leaves loaded: see docs/host_optimizer.md, "Checkpoints:
    `hr.save` / `hr.load`".

    Args:
        path: the file `save` wrote.
        model: a model with the same ``state_dict()`` keys and shapes.
        optimizer: an optimizer over ``model``'s parameters, of the same class as saved.
        strict: require the model's keys to match the file's exactly.

    Returns:
        The ``extra`` values given to `save`.

    Raises:
        CheckpointCorruptError: (a ``ValueError``) the file is truncated, its header or
            metadata is unreadable, or a tensor or the header does not match its checksum;
            the message names the file, the tensor and what is left loaded.
        ValueError: not a headroom checkpoint; keys, shapes or optimizer layout differ
            (nothing is changed).
        FileNotFoundError: no file at ``path``.

    Example:
        >>> extra = hr.load("ckpt.safetensors", model, opt)   # doctest: +SKIP
    """
    return _load(path, model, optimizer, strict=strict, verify=True)


def _load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    strict: bool,
    verify: bool,
) -> dict[str, Any]:
    """`load`; ``verify=False`` skips the checksums (to measure what they cost)."""
    optimizer = unwrap_optimizer(optimizer)
    with Reader(os.fspath(path), verify=verify) as r:
        meta = r.meta
        _check_meta(r, meta)
        sd = _named_tensors(model, fill=False)  # about to be written: no need to initialize
        refuse_quantized(sd.items(), "hr.load", _QUANTIZED_FIX)
        _check_model(r, sd, meta["model"], strict)
        if optimizer is not None:
            if "optimizer" not in meta:
                raise ValueError(f"{r.path!r} holds no optimizer state (saved without optimizer)")
            _check_optimizer(optimizer, meta["optimizer"], r.path)
        avail = available_memory()
        in_store = any(binding(t) is not None for t in sd.values())
        if r.crcs and not in_store and r.data_bytes <= avail // 2:
            # All first, so a corrupt file changes nothing; the page cache keeps what it read.
            r.verify_all()
        elif r.crcs:
            # Each tensor in full before it is used, on a helper thread ahead of the load, so
            # the load's writes overlap the next tensors' reads.
            r.verify_ahead(sorted((k for k in r.names() if not k.startswith("json/")),
                                  key=lambda k: r.entries[k][2]),
                           window=max(_AHEAD_MIN, min(_AHEAD_MAX, avail // 8)))
        get = lambda name: r.tensor(name).clone()  # noqa: E731 - owns its memory
        extra = _unjson(meta.get("extra", {}), get)
        _load_model(r, sd, meta["model"])
        if optimizer is not None:
            _load_optimizer(r, optimizer, meta["optimizer"], get)
            if isinstance(optimizer, HostOptimizer):
                optimizer.reload_params()
        return extra


def _check_meta(r: Reader, meta: dict[str, Any]) -> None:
    """Check every field `load` reads before anything is loaded.

    The checksum misses a file edited by hand (checksum recomputed) or of version 1: such a file
    gets a `CheckpointCorruptError` naming the field, not a ``KeyError`` half-way through.
    """
    def bad(what: str) -> None:
        r._corrupt(f"its headroom metadata is malformed: {what}", edited=True)

    names = meta.get("model")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        bad(f"'model' is {_short(names)}, not a list of tensor names")
    if len(set(names)) != len(names):
        bad("'model' names a tensor twice")
    for n in names:
        if f"model/{n}" not in r.entries:
            bad(f"'model' lists {n!r}, but the file holds no tensor 'model/{n}'")
    _check_json(r, meta.get("extra", {}), "'extra'", bad)
    om = meta.get("optimizer")
    if om is None:
        return
    if not isinstance(om, dict):
        bad(f"'optimizer' is {_short(om)}, not an object")
    for key in ("class", "inner_class"):
        if key in om and not isinstance(om[key], str):
            bad(f"'optimizer.{key}' is {_short(om[key])}, not a class name")
    if "class" not in om:
        bad("'optimizer' has no 'class'")
    params, groups, small = om.get("params"), om.get("groups"), om.get("small")
    if not isinstance(params, list) or not all(
            isinstance(p, dict) and isinstance(p.get("shape"), list)
            and all(type(d) is int and d >= 0 for d in p["shape"])
            and isinstance(p.get("name"), (str, type(None))) for p in params):
        bad("'optimizer.params' is not a list of {name, shape} objects")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("hparams"), dict)
            and isinstance(g.get("params"), list) for g in groups):
        bad("'optimizer.groups' is not a list of {hparams, params} objects")
    listed = [i for g in groups for i in g["params"]]
    if sorted(listed, key=lambda i: (type(i) is not int, i if type(i) is int else 0)) != list(
            range(len(params))):
        bad(f"'optimizer.groups' list parameters {_short(listed)}, not each of the "
            f"{len(params)} parameter indices once")
    for gi, g in enumerate(groups):
        _check_json(r, g["hparams"], f"'optimizer.groups[{gi}].hparams'", bad)
    if not isinstance(small, dict):
        bad(f"'optimizer.small' is {_short(small)}, not an object")
    for idx, sm in small.items():
        if not (idx.isascii() and idx.isdigit() and int(idx) < len(params)):
            bad(f"'optimizer.small' has key {idx!r}, not the index of one of the "
                f"{len(params)} parameters")
        if not isinstance(sm, dict):
            bad(f"'optimizer.small[{idx!r}]' is {_short(sm)}, not an object")
        _check_json(r, sm, f"'optimizer.small[{idx!r}]'", bad)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_json(r: Reader, value: Any, where: str, bad: Callable[[str], None]) -> None:
    """Check that `_unjson` can decode ``value``: tensors it names exist, markers well formed."""
    stack = [value]
    while stack:  # iterative: the JSON may be deeply nested
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            if "__tensor__" in v:
                name = v["__tensor__"]
                if not isinstance(name, str) or name not in r.entries:
                    bad(f"{where} refers to tensor {_short(name)}, which the file does not hold")
            elif "__tuple__" in v:
                if not isinstance(v["__tuple__"], list):
                    bad(f"{where} holds a tuple that is not a list")
                stack.extend(v["__tuple__"])
            elif "__float__" in v:
                try:
                    float(v["__float__"])
                except (TypeError, ValueError):
                    bad(f"{where} holds float {_short(v['__float__'])}")
            else:
                stack.extend(v.values())


def _check_model(r: Reader, sd: dict[str, torch.Tensor], names: list[str], strict: bool) -> None:
    if strict:
        missing = [k for k in sd if k not in names]
        unexpected = [k for k in names if k not in sd]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {r.path!r} does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}; build the same model, or pass strict=False"
            )
    for name, t in sd.items():
        if name not in names:
            continue
        shape = r.shape(f"model/{name}")
        if shape != tuple(t.shape):
            raise ValueError(f"checkpoint {r.path!r}: shape mismatch for {name!r}: checkpoint "
                             f"{shape}, model {tuple(t.shape)}")


@torch.no_grad()
def _load_model(r: Reader, sd: dict[str, torch.Tensor], names: list[str]) -> None:
    for name, t in sd.items():
        if name not in names:
            continue
        src = r.tensor(f"model/{name}")
        r.changed = True
        b = binding(t)
        if b is None:
            t.data.copy_(src)
            continue
        h = b.handle
        if not h.shape:
            b.store.write(h, src.to(h.dtype).contiguous()).result()
            b.has_value = True
            continue
        per = max(1, _CHUNK // max(1, h.row_nbytes))
        futs: deque[Future] = deque()
        for a in range(0, h.shape[0], per):
            # Slices of the mapped file go to the store without a copy.
            part = src[a:a + per].to(h.dtype).contiguous()
            futs.append(b.store.write_rows(h, slice(a, a + part.shape[0]), part))
            if len(futs) > 2:
                futs.popleft().result()
        for fu in futs:
            fu.result()
        b.has_value = True


def _check_optimizer(optimizer: torch.optim.Optimizer, meta: dict[str, Any], path: str) -> None:
    is_host = isinstance(optimizer, HostOptimizer)
    cls_name = (optimizer.options.optimizer_class.__name__ if is_host
                else type(optimizer).__name__)
    saved_cls = meta.get("inner_class", meta["class"])
    if cls_name != saved_cls:
        raise ValueError(f"checkpoint {path!r} holds {saved_cls} state, the optimizer is "
                         f"{cls_name}")
    order = [p for g in optimizer.param_groups for p in g["params"]]
    if len(order) != len(meta["params"]):
        raise ValueError(f"checkpoint {path!r}: its optimizer has {len(meta['params'])} "
                         f"parameters, this one {len(order)}")
    for i, (p, info) in enumerate(zip(order, meta["params"], strict=True)):
        if list(p.shape) != info["shape"]:
            raise ValueError(f"checkpoint {path!r}: optimizer parameter {i} ({info.get('name')}):"
                             f" checkpoint shape {info['shape']}, parameter {list(p.shape)}")
    sizes = [len(g["params"]) for g in meta["groups"]]
    ours = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != ours:
        raise ValueError(f"checkpoint {path!r}: its optimizer's parameter groups hold {sizes} "
                         f"parameters, this one's {ours}; build the optimizer with the same groups")
    for gi, (saved, g) in enumerate(zip(meta["groups"], optimizer.param_groups, strict=True)):
        for k, v in saved["hparams"].items():
            if k in g and not _same_kind(v, g[k]):
                raise ValueError(
                    f"checkpoint {path!r}: hyperparameter {k!r} of parameter group {gi} is "
                    f"{_short(v)} where the optimizer has {_short(g[k])} (an edited file, or"
                    " another optimizer's); fix it in the file, or load without the optimizer")


def _same_kind(saved: Any, current: Any) -> bool:
    """Whether a saved hyperparameter (as JSON) can stand where ``current`` is: numbers for
    numbers, flags for flags, tuples of the same length; anything where either is None."""
    if saved is None or current is None:
        return True
    if isinstance(current, bool):
        return isinstance(saved, bool)
    if isinstance(current, (int, float, torch.Tensor)):
        return (isinstance(saved, (int, float)) and not isinstance(saved, bool)) or (
            isinstance(saved, dict) and ("__float__" in saved or "__tensor__" in saved))
    if isinstance(current, str):
        return isinstance(saved, str)
    if isinstance(current, (tuple, list)):
        items = saved.get("__tuple__") if isinstance(saved, dict) else saved
        return isinstance(items, list) and len(items) == len(current) and all(
            _same_kind(a, b) for a, b in zip(items, current, strict=True))
    return True


def _load_optimizer(r: Reader, optimizer: torch.optim.Optimizer, meta: dict[str, Any],
                    get: Callable[[str], torch.Tensor]) -> None:
    keys = r.names()
    groups = []
    for g in meta["groups"]:
        hp = _unjson(g["hparams"], get)
        groups.append({**hp, "params": g["params"]})
    state: dict[int, Any] = {}
    for idx, sm in meta["small"].items():
        prefix = f"optimizer/{idx}/"
        tkeys = [k[len(prefix):] for k in keys if k.startswith(prefix)]
        small = {k: _unjson(v, get) for k, v in sm.items()}
        # Clone (in `get`): the optimizer keeps these tensors, and they must own their
        # memory rather than point into the file's mapping, which closes with the file.
        state[int(idx)] = _LazyState(tkeys, small, lambda k, prefix=prefix: get(prefix + k))
    if not isinstance(optimizer, HostOptimizer):
        state = {i: dict(st) for i, st in state.items()}
    r.changed = True
    optimizer.load_state_dict({"state": state, "param_groups": groups})
