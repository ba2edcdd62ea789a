"""headroom: train and run PyTorch models that do not fit in accelerator memory.

Parameters, gradients, optimizer state and activations can rest in host memory or on disk and
stream to the device just in time, with exact results. See ``docs/`` and ``README.md``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from typing import TYPE_CHECKING, Any

from headroom import _providers

__version__ = "0.1.0"

# NOTE: the oldest torch on which the whole suite passes (`make test-torch-range`; as
# pyproject.toml says): headroom uses a few private torch functions whose behaviour changed
# before it. An older torch is refused here, not by an error deep inside a layer.
_TORCH_MIN = (2, 13)


def _check_torch(version: str | None) -> None:
    """Raise ImportError when ``version`` (torch's) is older than `_TORCH_MIN`."""
    if version is None:
        return  # no torch installed: importing a layer says so
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is not None and (int(found[1]), int(found[2])) < _TORCH_MIN:
        need = ".".join(map(str, _TORCH_MIN))
        raise ImportError(
            f"headroom needs torch>={need}; torch {version} is installed. Upgrade it: "
            f"pip install 'torch>={need}'"
        )


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")  # imported already: the version that runs
    if torch is not None:
        return getattr(torch, "__version__", None)
    try:  # without importing torch, so that `import headroom` stays cheap
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


_check_torch(_torch_version())


def _load_fit() -> None:
    import headroom.fit  # noqa: F401  (registers the advice of memory reports)


def _load_integrations() -> None:
    import headroom.integrations  # noqa: F401  (subscribes to residency's events)


# The root, above every layer, tells _providers how to load fit/ and integrations/.
_providers.set_loaders(advice=_load_fit, integrations=_load_integrations)

# Public names (the API contract) resolve lazily: `import headroom` stays cheap.
_EXPORTS: dict[str, str] = {
    # memory/
    "track_memory": "headroom.memory",
    "MemoryTracker": "headroom.memory",
    # store/
    "DiskStore": "headroom.store",
    "StoreCorruptError": "headroom.store",
    # residency/
    "offload": "headroom.residency",
    "unoffload": "headroom.residency",
    "describe": "headroom.residency",
    "prefetch": "headroom.residency",
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
    # integrations/
    "init_adapters": "headroom.integrations",
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
