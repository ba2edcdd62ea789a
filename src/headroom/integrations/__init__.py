"""What the libraries around an offloaded model need, subscribed to residency's events.

Each module compensates for one peer: `_peft` (adapters' values, merges into a base on disk,
`init_adapters`), `_ddp` (DistributedDataParallel refused over an offloaded model). Importing
the package subscribes them (`headroom.residency.events`); ``hr.offload`` imports it before its
first model.
"""

from headroom.integrations import _ddp, _peft  # noqa: F401  (subscribe)
from headroom.integrations._peft import init_adapters

__all__ = ["init_adapters"]
