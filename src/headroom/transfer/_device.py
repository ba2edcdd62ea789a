"""`check_device`: turn a ``device=`` argument into a device that exists, or say why not."""

from __future__ import annotations

import torch

__all__ = ["check_device", "stream_module"]


def check_device(device: str | torch.device) -> torch.device:
    """The compute device ``device`` names, checked to exist here, with an explicit index.

    Every public entry point taking ``device=`` calls this first, so a missing accelerator is
    named at once. The result compares equal to ``tensor.device`` of tensors created there
    (``"cuda"`` becomes ``cuda:<current index>``, ``"cpu:0"`` becomes ``cpu``).

    Args:
        device: ``"cpu"``, an accelerator type ``torch.accelerator`` reports, optionally with
            an index, or a ``torch.device``.

    Returns:
        The normalized ``torch.device``.

    Raises:
        ValueError: ``device`` is not a torch device, or is ``"meta"`` (which cannot compute).
        RuntimeError: the accelerator (or that index of it) is not available on this machine.

    Example:
        >>> check_device("cpu")
        device(type='cpu')
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "meta":
        raise ValueError("device='meta' cannot compute; use 'cpu' or an accelerator")
    acc = torch.accelerator
    if not acc.is_available() or acc.current_accelerator().type != dev.type:
        raise RuntimeError(
            f"device {str(dev)!r} is not available on this machine (no {dev.type} accelerator"
            " found); use device='cpu' — with store=headroom.DiskStore(path) for tensors bigger"
            " than RAM — or run where the accelerator exists"
        )
    index = dev.index if dev.index is not None else acc.current_device_index()
    if index >= acc.device_count():
        raise RuntimeError(
            f"device {str(dev)!r} is not available: only {acc.device_count()} {dev.type}"
            " device(s); pick an index below that"
        )
    return torch.device(dev.type, index)


_NEEDS = ("Stream", "Event", "stream", "current_stream")


def stream_module(device: torch.device):
    """The device module (``torch.cuda``, ...) whose streams and events order the copies.

    Raises:
        RuntimeError: the accelerator has no streams and events (MPS).
    """
    mod = torch.get_device_module(device.type)
    missing = [n for n in _NEEDS if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(
            f"device {str(device)!r}: torch.{device.type} has no {', '.join(missing)}, which"
            " headroom needs to copy tensors on side streams ordered by events; offload, the"
            " host optimizer's accelerator path and streamed heads support CUDA (and ROCm) and"
            " accelerators with the same stream semantics (XPU). Use device='cpu' (with"
            " store=headroom.DiskStore(path) to go beyond RAM) on this machine"
        )
    return mod
