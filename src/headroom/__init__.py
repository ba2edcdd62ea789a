"""headroom: train and run PyTorch models that do not fit in accelerator memory.

Parameters, gradients, optimizer state and activations can rest in host memory or on disk and
stream to the device just in time, with exact results. See ``docs/`` and ``README.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# NOTE: public names resolve lazily (but see `offload` below) so `import headroom` stays cheap (no
# matplotlib) and each layer loads only when used. The table is the public API contract.
_EXPORTS: dict[str, str] = {
    # memory/
    "track_memory": "headroom.memory",
    "MemoryTracker": "headroom.memory",
    # transfer/
    "DiskStore": "headroom.transfer",
    "StoreCorruptError": "headroom.transfer",
    # offload/
    "offload": "headroom.offload",
    "unoffload": "headroom.offload",
    "describe": "headroom.offload",
    "HostOptimizer": "headroom.offload",
    "save": "headroom.offload",
    "load": "headroom.offload",
    "load_weights": "headroom.offload",
    "save_weights": "headroom.offload",
    "CheckpointCorruptError": "headroom.offload",
    # nn/
    "convert": "headroom.nn",
    # heads/
    "linear_cross_entropy": "headroom.heads",
    "linear_loss": "headroom.heads",
    "HugeClassifier": "headroom.heads",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from headroom.memory import MemoryTracker as MemoryTracker
    from headroom.memory import track_memory as track_memory


# NOTE: `headroom.offload` is both a subpackage and the public function `hr.offload`. Importing a
# subpackage binds it as an attribute of its parent, so the function is bound here, after the
# subpackage is loaded; later imports of its submodules no longer touch this name.
from headroom.offload import offload as offload  # noqa: E402

_EXPORTS.pop("offload")


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'headroom' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
