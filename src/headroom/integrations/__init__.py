"""What the libraries around an offloaded model need (`_peft`, `_ddp`), subscribed to
residency's events on import; ``hr.offload`` imports it before its first model."""

from headroom.integrations import _ddp, _peft  # noqa: F401  (subscribe)
from headroom.integrations._peft import init_adapters

__all__ = ["init_adapters"]
