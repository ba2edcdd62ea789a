"""headroom: train and run PyTorch models that do not fit in accelerator memory.

Parameters, gradients, optimizer state and activations can rest in host memory or on disk and
stream to the device just in time, with exact results. See ``docs/`` and ``README.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public names resolve lazily, so `import headroom` stays cheap (no matplotlib) and each layer
# loads only when used. The table is the public API contract.
_EXPORTS: dict[str, str] = {
    # memory/
    "track_memory": "headroom.memory",
    "MemoryTracker": "headroom.memory",
    # transfer/
    "DiskStore": "headroom.transfer",
    "StoreCorruptError": "headroom.transfer",
    # residency/
    "offload": "headroom.residency",
    "unoffload": "headroom.residency",
    "describe": "headroom.residency",
    "prefetch": "headroom.residency",
    "init_adapters": "headroom.residency",
    # optim/
    "HostOptimizer": "headroom.optim",
    # checkpoint/
    "save": "headroom.checkpoint",
    "load": "headroom.checkpoint",
    "load_weights": "headroom.checkpoint",
    "save_weights": "headroom.checkpoint",
    "CheckpointCorruptError": "headroom.checkpoint",
    # activations/
    "offload_activations": "headroom.activations",
    # nn/
    "convert": "headroom.nn",
    # heads/
    "linear_cross_entropy": "headroom.heads",
    "linear_loss": "headroom.heads",
    "HugeClassifier": "headroom.heads",
    "patch_causal_lm": "headroom.heads",
    # distributed/
    "data_parallel": "headroom.distributed",
    # fit/
    "estimate": "headroom.fit",
    "Estimate": "headroom.fit",
    "plan": "headroom.fit",
    "Plan": "headroom.fit",
    "PlanError": "headroom.fit",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from headroom.memory import MemoryTracker as MemoryTracker
    from headroom.memory import track_memory as track_memory


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'headroom' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
