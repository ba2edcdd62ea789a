"""Guards around an offloaded model's root and blocks: failures, dtype/device moves, wrappers.

Module hooks miss what an offloaded model must react to: a ``KeyboardInterrupt`` skips even
``always_call`` forward hooks, ``.half()``/``.to()`` go through ``Module._apply``, and a backward
that broke off leaves no trace until the parameters are listed. So the root and each block get a
subclass of their own class (as ``parametrize`` and ``fully_shard`` do, keeping its name) that
routes those to the offload state, gives a plain ``copy.deepcopy`` and pickle
(`headroom.residency._copy`), and has `_events.guard_members`; `remove` restores the class.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Protocol

import torch
import torch.nn as nn

from headroom.residency import _dtensor, _events
from headroom.transfer import keep_for_child

__all__ = ["Role", "guarded_state", "install", "remove"]

_ROLE = "_headroom_role"
_OFFLOAD = "_headroom_offload"  # the offload state, on the offloaded module
#: The attributes `offload` sets on modules: what a copy that drops the offload leaves out.
MODULE_ATTRS = (_OFFLOAD, _ROLE)
_CLASSES: dict[type, type] = {}


class Role(Protocol):
    """What a guarded module asks of its offload state."""

    def call_failed(self, module: nn.Module) -> None:
        """The module's call raised (anything, ``KeyboardInterrupt`` included); must not raise."""

    def apply(self, module: nn.Module, fn: Any, recurse: bool, base: Any) -> nn.Module:
        """Handle ``module._apply(fn, recurse)``; ``base`` is the original class's ``_apply``."""

    def settle(self) -> None:
        """Parameters are about to be listed: finish any clean-up still pending."""


def _guarded_class(cls: type) -> type:
    sub = _CLASSES.get(cls)
    if sub is not None:
        return sub

    def __call__(self, *args, **kwargs):
        role = self.__dict__.get(_ROLE)
        if role is not None:  # the root's role is the offload state itself
            _dtensor.check_not_sharding(self, listing=False,
                                        whole=getattr(role, "state", role) is role)
        try:
            return cls.__call__(self, *args, **kwargs)
        except BaseException:
            role = self.__dict__.get(_ROLE)
            if role is not None:
                role.call_failed(self)
            raise

    def _apply(self, fn, recurse=True):
        role = self.__dict__.get(_ROLE)
        if role is None:
            return cls._apply(self, fn, recurse)
        return role.apply(self, fn, recurse, cls._apply)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        role = self.__dict__.get(_ROLE)
        if role is not None:
            _dtensor.check_not_sharding(self, listing=True, recurse=recurse)
            role.settle()
        return cls.named_parameters(self, prefix, recurse, remove_duplicate)

    def __deepcopy__(self, memo):
        role = self.__dict__.get(_ROLE)
        if role is None:  # not guarded any more: the copy module's own way
            return copy._reconstruct(self, memo, *self.__reduce_ex__(4))
        from headroom.residency._copy import deepcopy_offloaded

        return deepcopy_offloaded(self, getattr(role, "state", role), cls, memo,
                                  leave_out=MODULE_ATTRS)

    def __reduce_ex__(self, protocol):
        # pickled as the plain copy under the original class (the guarded one is not
        # importable), loaded as operator.getitem([copy], 0): no headroom needed
        if self.__dict__.get(_ROLE) is None:
            return cls.__reduce_ex__(self, protocol)
        plain = copy.deepcopy(self)
        keep_for_child(plain)  # see its NOTE
        return operator.getitem, ([plain], 0)

    def __copy__(self):
        # copy.copy would otherwise go through __reduce_ex__ above: a shallow copy stays one
        return copy._reconstruct(self, None, *cls.__reduce_ex__(self, 4))

    sub = type(cls.__name__, (cls,), {
        # not traced by torch.compile (only this frame: the module's forward still is)
        "__call__": torch.compiler.disable(__call__, recursive=False),
        "__deepcopy__": __deepcopy__,
        "__reduce_ex__": __reduce_ex__,
        "__copy__": __copy__,
        "_apply": _apply,
        "named_parameters": named_parameters,
        **_events.guard_members,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_headroom_base": cls,
    })
    _CLASSES[cls] = sub
    return sub


def install(module: nn.Module, role: Role) -> None:
    """Route ``module``'s call, ``_apply`` and parameter listing to ``role``."""
    module.__dict__[_ROLE] = role
    if "_headroom_base" not in type(module).__dict__:
        module.__class__ = _guarded_class(type(module))


def remove(module: nn.Module) -> None:
    """Undo `install`: the original class again, no role."""
    module.__dict__.pop(_ROLE, None)
    base = type(module).__dict__.get("_headroom_base")
    if base is not None:
        module.__class__ = base


def guarded_state(module: nn.Module) -> Any:
    """The offload state of a guarded module (an offloaded root or block), or None."""
    role = module.__dict__.get(_ROLE)
    return None if role is None else getattr(role, "state", role)
