"""Freeing and refilling a tensor's memory without replacing the tensor."""

from __future__ import annotations

import torch

__all__ = ["resize_storage"]


def resize_storage(tensor: torch.Tensor, nbytes: int) -> None:
    """Resize ``tensor``'s storage to ``nbytes`` (0 frees it, keeping the tensor object valid).

    Autograd keeps references to tensors, not bytes, so a storage freed after forward can be
    refilled before backward. An op (unlike ``UntypedStorage.resize_``), so dispatch-mode
    trackers such as `headroom.track_memory` see the memory come and go.
    """
    torch.ops.inductor.resize_storage_bytes_(tensor, nbytes)
