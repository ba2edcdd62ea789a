"""Given a memory budget, pick which headroom features to turn on (not built yet)."""

__all__: list[str] = []
