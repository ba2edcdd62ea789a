"""The one owner of headroom's saved-tensor hooks: how its users of them compose.

[Note: saved-tensor hooks] PyTorch applies only the innermost ``saved_tensors_hooks`` pair to a
saved tensor. headroom has two kinds of users: *observers*, which must see every saved tensor and
learn when autograd lets go of it (the memory tracker), and one *keeper*, which decides what
autograd keeps in place of the tensor (activation offload keeps a ticket to a store). Pushed
separately, the inner one would hide saved tensors from the outer one. So each of them enters here,
and headroom pushes one pair that does all of it: every observer sees the tensor, then the keeper
(if any) packs it. Entering and leaving is last in, first out, like PyTorch's own stack; a hook
pushed by someone else in between (a checkpoint region) stays innermost, as it would without
headroom. ``headroom.nn``'s own per-op hooks run only where no other hooks are active
(``nn._common.hooks_free``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["Keeper", "Observer", "keeping", "observing"]


class Observer(Protocol):
    def observe(self, t: torch.Tensor) -> Any:
        """See a tensor being saved; return a token autograd keeps with it (its release means
        autograd let go of the tensor), or ``None``."""


class Keeper(Protocol):
    def pack(self, t: torch.Tensor) -> Any:
        """What autograd keeps instead of ``t``."""

    def unpack(self, packed: Any) -> torch.Tensor:
        """The tensor back, for backward."""


@dataclass(slots=True, eq=False)
class _Saved:
    """What autograd keeps when observers are active: the keeper's object, and their tokens."""

    kept: Any
    tokens: tuple


_observers: list[Observer] = []
_keepers: list[Keeper] = []
_pushed: list[saved_tensors_hooks] = []  # the pairs this module entered, innermost last


def _push() -> None:
    observers = tuple(_observers)
    keeper = _keepers[-1] if _keepers else None

    def pack(t: torch.Tensor) -> Any:
        tokens = tuple(tok for o in observers if (tok := o.observe(t)) is not None)
        kept = keeper.pack(t) if keeper is not None else t
        return _Saved(kept, tokens) if tokens else kept

    def unpack(saved: Any) -> torch.Tensor:
        kept = saved.kept if isinstance(saved, _Saved) else saved
        return keeper.unpack(kept) if keeper is not None else kept

    pair = saved_tensors_hooks(pack, unpack)
    pair.__enter__()
    _pushed.append(pair)


def _pop() -> None:
    _pushed.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _entered(users: list, user: Any) -> Iterator[None]:
    users.append(user)
    _push()
    try:
        yield
    finally:
        _pop()
        users.remove(user)


def observing(observer: Observer) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``observer`` sees every tensor autograd saves on this thread."""
    return _entered(_observers, observer)


def keeping(keeper: Keeper) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``keeper`` decides what autograd keeps for each saved tensor."""
    return _entered(_keepers, keeper)
