"""Device names, storages and accelerator allocator numbers, for the memory tracker."""

from __future__ import annotations

import torch

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):  # a DTensor: this rank's bytes are its local shard's
        t = local
    elif hasattr(type(t), "__tensor_flatten__"):
        return None  # a wrapper subclass (torchao's quantized tensors): its bytes are its inner
        # tensors' (see `inner_tensors`); its own storage is a placeholder, also on meta
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse tensors, subclasses without storage
        return None
    if st.device.type == "meta" and type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
        return None  # a wrapper subclass's placeholder in a dry run (values elsewhere)
    if st.device.type != "meta" and st.nbytes():
        try:
            st.data_ptr()
        except RuntimeError:  # a wrapper subclass's placeholder (values elsewhere): no memory
            return None
    return st


def inner_tensors(t: torch.Tensor, owner: object = None) -> list[torch.Tensor]:
    """The plain tensors holding a quantized weight's values, or ``[t]`` for any other tensor:
    a wrapper subclass's inner tensors (torchao), a bitsandbytes weight with its ``quant_state``
    tensors (4-bit) or its ``SCB`` scales (8-bit; on ``owner.state`` after a forward)."""
    if isinstance(getattr(t, "_local_tensor", None), torch.Tensor):
        return [t]
    if not hasattr(type(t), "__tensor_flatten__"):
        return [t, *_bnb_state(t, owner)]
    try:
        names, _ = t.__tensor_flatten__()
    except Exception:  # noqa: BLE001 - not splittable: counted as nothing
        return []
    out = []
    for n in names:
        inner = getattr(t, n, None)
        if isinstance(inner, torch.Tensor):
            out += inner_tensors(inner)
    return out


def _bnb_state(t: torch.Tensor, owner: object) -> list[torch.Tensor]:
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return []
    qs = getattr(t, "quant_state", None)
    if qs is not None:  # Params4bit
        s2 = getattr(qs, "state2", None) if getattr(qs, "nested", False) else None
        found = [getattr(qs, "absmax", None), getattr(qs, "code", None),
                 getattr(qs, "offset", None), getattr(s2, "absmax", None),
                 getattr(s2, "code", None)]
        return [x for x in found if isinstance(x, torch.Tensor)]
    scb = getattr(t, "SCB", None)  # Int8Params
    if scb is None and hasattr(t, "has_fp16_weights"):
        scb = getattr(getattr(owner, "state", None), "SCB", None)
    return [scb] if isinstance(scb, torch.Tensor) else []


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    index = device.index if device.index is not None else _current_index(device.type)
    return f"{device.type}:{index}"


def _current_index(device_type: str) -> int:
    mod = getattr(torch, device_type, None)
    try:
        return int(mod.current_device())  # type: ignore[union-attr]
    except Exception:
        return 0


def allocator_bytes(device: str) -> tuple[int, int] | None:
    """``(allocated, reserved)`` of an accelerator's caching allocator, or ``None``."""
    dtype, _, index = device.partition(":")
    mod = getattr(torch, dtype, None)
    if dtype == "cpu" or mod is None or not hasattr(mod, "memory_allocated"):
        return None
    try:
        idx = int(index) if index else None
        return int(mod.memory_allocated(idx)), int(mod.memory_reserved(idx))
    except Exception:
        return None


def allocator_active(device: str) -> int | None:
    """Bytes in active blocks of a CUDA-like caching allocator, or ``None``."""
    dtype, _, index = device.partition(":")
    mod = getattr(torch, dtype, None)
    if dtype == "cpu" or mod is None or not hasattr(mod, "memory_stats"):
        return None
    try:
        return int(mod.memory_stats(int(index) if index else None)["active_bytes.all.current"])
    except Exception:
        return None
