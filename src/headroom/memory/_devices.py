"""Device names, storages and accelerator allocator numbers, for the memory tracker."""

from __future__ import annotations

import torch


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):  # a DTensor: this rank's bytes are its local shard's
        t = local
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse tensors, subclasses without storage
        return None
    if st.device.type != "meta" and st.nbytes():
        try:
            st.data_ptr()
        except RuntimeError:  # a wrapper subclass's placeholder (values elsewhere): no memory
            return None
    return st


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
