"""What a lower layer asks of a higher one without importing it; imports nothing of headroom.

Reports get their advice from `advice_provider()` (`headroom.fit` registers it when imported,
through the loader the package root sets), and `hr.offload` loads `headroom.integrations` before
its first model through `load_integrations`.
"""

from __future__ import annotations

from collections.abc import Callable

_registered: Callable[..., list[str]] | None = None  # headroom.fit's
_override: Callable[..., list[str]] | None = None
_loader: Callable[[], None] | None = None  # imports headroom.fit (set by the package root)
_integrations: Callable[[], None] | None = None  # imports headroom.integrations (the root's)


def register_advice(fn: Callable[..., list[str]]) -> None:
    """Called by `headroom.fit` when imported: ``fn`` (`headroom.fit._advice.advise`) gives the
    lines of advice of reports."""
    global _registered
    _registered = fn


def set_loaders(*, advice: Callable[[], None], integrations: Callable[[], None]) -> None:
    """Called by the package root: ``advice()`` imports `headroom.fit` (which registers its
    advice), ``integrations()`` imports `headroom.integrations`."""
    global _loader, _integrations
    _loader, _integrations = advice, integrations


def set_advice_provider(fn: Callable[..., list[str]] | None) -> None:
    """Make ``fn`` give the advice of reports instead (``None``: `headroom.fit`'s again)."""
    global _override
    _override = fn


def advice_provider() -> Callable[..., list[str]]:
    """The function that gives advice, loading `headroom.fit` (which registers it) first."""
    if _override is not None:
        return _override
    if _registered is None and _loader is not None:
        _loader()
    if _registered is None:
        raise RuntimeError("headroom.fit registered no advice provider")
    return _registered


def load_integrations() -> None:
    """Import `headroom.integrations` (it subscribes to residency's events); cheap once done."""
    if _integrations is not None:
        _integrations()
