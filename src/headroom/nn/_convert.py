"""``convert(model)``: swap ``torch.nn`` layers for their memory-saving ``headroom.nn`` twins."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from headroom.nn import _activation, _conv, _dropout, _linear, _norm, _pad, _pool
from headroom.nn._common import install_root_hooks, seed_consumer

# Every public module class defined in these modules is the twin of the torch.nn class of its name.
_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    getattr(nn, name): twin
    for module in (_activation, _conv, _dropout, _linear, _norm, _pad, _pool)
    for name, twin in vars(module).items()
    if isinstance(twin, type) and issubclass(twin, nn.Module) and not name.startswith("_")
    and twin.__module__ == module.__name__
}
_TWINS = frozenset(_SWAPS.values())

# --- classes for subclasses of the swapped layers ------------------------------------------------
#
# A subclass of a swapped class (timm's Conv2dSame) becomes ``class Sub(Sub, twin)``: its own
# methods come first, and where they call up into the torch.nn class they reach the twin.
# Classes made on the fly that expect ``__bases__[0]`` (or ``_headroom_base``) to be the class
# they wrap (parametrize's, hr.offload's guard) are rebuilt over the converted class instead.
# An uninitialized lazy module would turn into its torch.nn class at its first forward: left
# alone.

_DERIVED: dict[type, type] = {}


def _rebuild(original: type) -> nn.Module:
    """Unpickling (and deep copy) of a converted subclass: a bare instance of its class."""
    cls = _derived(original, _first_swappable(original))
    return cls.__new__(cls)


def _reduce_ex(self, protocol):
    cls = type(self)
    original = cls.__dict__.get("_hr_subclass_of")
    if original is None:  # a class derived from ours (hr.offload's guard): the default
        return object.__reduce_ex__(self, protocol)
    return (_rebuild, (original,), self.__dict__)


def _first_swappable(cls: type) -> type | None:
    return next((c for c in cls.__mro__ if c in _SWAPS), None)


def _derived(cls: type, base: type) -> type:
    """``class cls(cls, twin of base)``, made once per class."""
    new = _DERIVED.get(cls)
    if new is None:
        new = type(
            cls.__name__,
            (cls, _SWAPS[base]),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
                "_hr_subclass_of": cls,
                "__reduce_ex__": _reduce_ex,
            },
        )
        _DERIVED[cls] = new
    return new


def _rebased(cls: type, onto: type, **extra) -> type:
    """``cls``'s own namespace over ``onto`` instead of its own base, made once per pair."""
    new = _DERIVED.get((cls, onto))
    if new is None:
        names = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
        new = _DERIVED[(cls, onto)] = type(cls.__name__, (onto,), {**names, **extra})
    return new


def _converted(cls: type) -> bool:
    return any(c in _TWINS for c in cls.__mro__)


def _target(module: nn.Module, cls: type | None = None) -> type | str | None:
    """The class ``module`` converts to, why it is left alone, or None (no twin, or done)."""
    cls = type(module) if cls is None else cls
    if cls in _SWAPS:
        return _SWAPS[cls]
    if _converted(cls):
        return None
    guarded = cls.__dict__.get("_headroom_base")  # hr.offload's guarded class
    if isinstance(guarded, type):
        inner = _target(module, guarded)
        return _rebased(cls, inner, _headroom_base=inner) if isinstance(inner, type) else inner
    if parametrize.is_parametrized(module) and cls.__bases__:
        inner = _target(module, cls.__bases__[0])
        return _rebased(cls, inner) if isinstance(inner, type) else inner
    base = _first_swappable(cls)
    if base is None:
        return None
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return (
            "an uninitialized lazy module: it becomes a plain torch.nn class at its first "
            "forward; run one forward, then convert"
        )
    return _derived(cls, base)


# --- the report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertReport:
    """What :func:`convert` did to each layer of a model.

    Attributes:
        converted: ``(name, class name, what it became)`` per converted module.
        left_alone: ``(name, class name, why)`` per leaf module left as it is.
    """

    converted: tuple[tuple[str, str, str], ...]
    left_alone: tuple[tuple[str, str, str], ...]

    def __str__(self) -> str:
        lines = [
            f"hr.convert: {len(self.converted)} modules converted, "
            f"{len(self.left_alone)} left alone"
        ]
        for title, rows in (("converted", self.converted), ("left alone", self.left_alone)):
            if rows:
                lines.append(f"{title}:")
                width = max(len(name or "(root)") for name, _, _ in rows)
                for name, cls, what in rows:
                    lines.append(f"  {name or '(root)':<{width}}  {cls}: {what}")
        return "\n".join(lines)


_NO_TWIN = (
    "no headroom.nn layer (its backward needs what PyTorch keeps, or PyTorch keeps nothing)"
)


def _what(cls: type) -> str:
    twin = next(c for c in cls.__mro__ if c in _TWINS)
    if cls is twin:
        return f"headroom.nn.{twin.__name__}"
    if "_headroom_base" in cls.__dict__:
        return f"hr.offload's guard, now over headroom.nn.{twin.__name__}"
    if "_hr_subclass_of" in cls.__dict__:
        base = _first_swappable(cls.__dict__["_hr_subclass_of"])
        return (
            f"subclass of torch.nn.{base.__name__}: its own methods kept, over "
            f"headroom.nn.{twin.__name__}"
        )
    return f"{cls.__name__} over headroom.nn.{twin.__name__}"


def convert_report(model: nn.Module) -> ConvertReport:
    """Which modules of ``model`` are headroom layers, and why the other leaf modules are not
    (on a converted model: what :func:`convert` did; on another: what it would leave alone)."""
    converted, left = [], []
    for name, m in model.named_modules():
        cls = type(m)
        if _converted(cls):
            converted.append((name, cls.__name__, _what(cls)))
            continue
        target = _target(m)
        if isinstance(target, str):
            left.append((name, cls.__name__, target))
        elif target is None and not m._modules:
            left.append((name, cls.__name__, _NO_TWIN))
        elif isinstance(target, type):
            left.append((name, cls.__name__, "not converted yet (call hr.convert)"))
    return ConvertReport(tuple(converted), tuple(left))


# --- convert -------------------------------------------------------------------------------------


def _shallow_copy(module: nn.Module) -> nn.Module:
    # Not copy.copy, whose __reduce_ex__ a parametrized module's class refuses.
    new = object.__new__(type(module))
    new.__dict__.update(module.__dict__)
    for key, value in list(new.__dict__.items()):
        if isinstance(value, dict | set | list):
            # One level deep: the same Parameters, buffers and hooks, in containers of its own.
            new.__dict__[key] = copy.copy(value)
    if module.__dict__.get("_is_fsdp_managed_module"):
        # FSDP2 swaps parameters in the original module's dict around each forward: share it.
        new.__dict__["_parameters"] = module._parameters
    return new


def _copy_tree(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    new = _shallow_copy(module)
    memo[id(module)] = new
    for name, child in module._modules.items():
        new._modules[name] = None if child is None else _copy_tree(child, memo)
    return new


def convert(model: nn.Module, *, inplace: bool = False, verbose: bool = False) -> nn.Module:
    """Swap ``torch.nn`` layers for ``headroom.nn`` layers that save only what backward needs.

    Layers of the ``torch.nn`` classes named in ``headroom.nn.__all__`` become that headroom
    class (``isinstance``, ``state_dict`` keys, parameters, buffers and hooks unchanged); a
    subclass of one (timm's ``Conv2dSame``) becomes ``class Sub(Sub, headroom twin)``, its own
    methods kept; an uninitialized lazy module is left alone (convert after its first forward).
    Outputs and gradients are bitwise the unconverted model's, and no byte more than PyTorch's
    is kept. Converting twice changes nothing.

    Args:
        model: the model (or a single layer) to convert.
        inplace: ``False`` (default) returns a new module tree holding the *same* Parameter and
            buffer objects and hooks as ``model`` (one optimizer trains both; no parameter
            memory duplicated), ``model`` unchanged. ``True`` converts ``model``'s own modules.
        verbose: print the :class:`ConvertReport` (what was converted, what was left alone
            and why; :func:`convert_report` gives it as data).

    Returns:
        The converted model. ``model`` itself when ``inplace=True`` or when nothing needed
        converting.

    Raises:
        TypeError: if ``model`` is not an ``nn.Module``.

    Example:
        >>> import torch, headroom as hr
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
        >>> fast = hr.convert(model)
        >>> type(fast[0]).__module__
        'headroom.nn._conv'

    Note:
        Double backward (``create_graph=True``) through converted layers raises an error.
        The root gets a forward pre-hook and an always-called forward hook, where activations
        settle what they keep (see ``docs/selective_layers.md``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"convert() expects a torch.nn.Module, got {type(model).__name__}; "
            "pass the model (or layer) itself."
        )
    if not any(isinstance(_target(m), type) for m in model.modules()):
        if verbose:
            print(convert_report(model))
        return model
    root = model if inplace else _copy_tree(model, {})
    for m in root.modules():
        target = _target(m)
        if isinstance(target, type):
            m.__class__ = target
    _seed_sequential_consumers(root)
    install_root_hooks(root)
    if verbose:
        print(convert_report(root))
    return root


def _seed_sequential_consumers(root: nn.Module) -> None:
    # In an nn.Sequential the layer after a ReLU is its consumer: a ReLU deciding in forward
    # (under the caller's hooks) is right from the first forward.
    for m in root.modules():
        cls = type(m)
        if cls.__dict__.get("_headroom_base", cls) is not nn.Sequential:
            continue
        children = [c for c in m._modules.values() if c is not None]
        for relu, nxt in zip(children, children[1:], strict=False):
            if type(relu) is _activation.ReLU and hasattr(nxt, "_hr_saves_input"):
                seed_consumer(relu, nxt)
