"""Active-task residency and distributed sync of used gradients (not built yet)."""

__all__: list[str] = []
