"""What a lower layer asks of a higher one without importing it.

A memory report ends with advice: what each technique would save, from dry runs of the step
with it (`headroom.fit`, the layer on top of every technique). The tracker asks
`advice_provider()` for the function that gives it; `headroom.fit` registers its own when
imported, and the first request loads it.
"""

from __future__ import annotations

from collections.abc import Callable

_advice: Callable[..., list[str]] | None = None


def set_advice_provider(fn: Callable[..., list[str]] | None) -> None:
    """Make ``fn`` give the advice of reports (``None``: the default, `headroom.fit`'s).

    ``fn(model, args, *, kwargs, loss_fn, optimizer, optimizer_kwargs, device, base, measured)``
    returns the lines of advice (see `headroom.fit._advice.advise`).
    """
    global _advice
    _advice = fn


def advice_provider() -> Callable[..., list[str]]:
    """The registered advice function, loading `headroom.fit` (which registers it) first."""
    if _advice is None:
        import headroom.fit  # noqa: F401  (registers its advice)
    if _advice is None:
        raise RuntimeError("headroom.fit registered no advice provider")
    return _advice
