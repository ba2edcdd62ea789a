"""Finding blocks: the units of a model that are fetched to the device and released together."""

from __future__ import annotations

from collections import defaultdict

import torch.nn as nn

__all__ = ["check_blocks", "find_blocks", "with_outside_blocks"]


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The largest group of similar sibling modules: a transformer's layers, a CNN's stages.

    Of the groups of two or more same-class children holding parameters, the one with the most
    parameter bytes wins (ties: an ``nn.ModuleList``/``nn.Sequential`` parent, then the first
    found), in registration order; empty when the model has no repeated structure.
    """
    best: list[nn.Module] = []
    best_key: tuple[int, int] = (0, 0)
    for parent in model.modules():
        groups: dict[type, list[nn.Module]] = defaultdict(list)
        seen: set[int] = set()
        for child in parent.children():
            # ModuleList/ModuleDict have no forward: their members are the candidates.
            if id(child) in seen or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                continue
            seen.add(id(child))
            groups[type(child)].append(child)
        container = int(isinstance(parent, (nn.ModuleList, nn.Sequential)))
        for members in groups.values():
            members = [m for m in members if _param_bytes(m) > 0]
            if len(members) < 2:
                continue
            key = (sum(_param_bytes(m) for m in members), container)
            if key > best_key:
                best, best_key = members, key
    return best


def check_blocks(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Validate user-given blocks: submodules of ``model``, not the model, not nested, unique;
    raises ValueError naming the offending block."""
    if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise ValueError("blocks must be a list of submodules (or an nn.ModuleList), not a module")
    blocks = list(blocks)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for b in blocks:
        if not isinstance(b, nn.Module):
            raise ValueError(f"blocks must be nn.Module submodules, got {type(b).__name__}")
        if b is model:
            raise ValueError("the model itself cannot be a block; pass its layers instead")
        if id(b) not in names:
            raise ValueError(f"block {type(b).__name__} is not a submodule of the model")
    if len({id(b) for b in blocks}) != len(blocks):
        raise ValueError("blocks lists the same module twice")
    ids = {id(b) for b in blocks}
    for b in blocks:
        for sub in b.modules():
            if sub is not b and id(sub) in ids:
                raise ValueError(
                    f"block {names[id(sub)]!r} is nested inside block {names[id(b)]!r}; blocks"
                    " must not overlap — pass either the outer one or the inner ones"
                )
    return blocks


def with_outside_blocks(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Add, as blocks of their own, modules outside the found blocks holding at least half the
    largest block (an untied embedding or head); in module order."""
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]
    threshold = max(_param_bytes(b) for b in blocks) // 2

    def holds_block(name: str) -> bool:
        return name == "" or any(bn.startswith(name + ".") for bn in block_names)

    extra: list[nn.Module] = []
    ids = {id(b) for b in blocks}
    stack = [model]
    while stack:
        m = stack.pop()
        for child in m.children():
            if id(child) in ids:
                continue
            if holds_block(names.get(id(child), "")):
                stack.append(child)
            elif _param_bytes(child) >= threshold > 0:  # split if repeated itself (an encoder)
                sub = find_blocks(child)
                extra.extend(with_outside_blocks(child, sub) if sub else [child])
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted([*blocks, *extra], key=lambda m: order[id(m)])
