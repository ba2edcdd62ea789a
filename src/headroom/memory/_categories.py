"""The memory categories, the same everywhere: tracker, estimator and reports."""

from __future__ import annotations

from typing import Literal

Category = Literal["parameters", "gradients", "optimizer_state", "activations", "buffers", "other"]

CATEGORIES: tuple[Category, ...] = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "buffers",
    "other",
)

PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, BUFFERS, OTHER = range(len(CATEGORIES))

# A storage can be seen in several roles (a parameter is also saved for backward by the
# layer that uses it). The role that owns the bytes is the most durable one: these categories are
# never demoted by automatic rules, only by an explicit `annotate`.
STICKY = frozenset({PARAMETERS, GRADIENTS, OPTIMIZER_STATE, BUFFERS})


def category_index(category: str) -> int:
    """The index of ``category`` in :data:`CATEGORIES`.

    Raises:
        ValueError: if ``category`` is not one of :data:`CATEGORIES`.
    """
    try:
        return CATEGORIES.index(category)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(
            f"unknown memory category {category!r}; use one of {', '.join(CATEGORIES)}"
        ) from None


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact bytes below 1 KiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} TiB"
