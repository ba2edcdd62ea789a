"""Data parallel on ``torch.distributed`` for models with offloaded parts; used-only sync."""

from headroom.distributed._data_parallel import DataParallel, data_parallel
from headroom.distributed._reducer import CollectiveError

__all__ = ["CollectiveError", "DataParallel", "data_parallel"]
