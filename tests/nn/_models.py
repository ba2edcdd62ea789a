"""Models for the headroom.nn tests: the builders of ``tests/nn/_zoo.py`` at test sizes (the
benchmarks build the same at full size)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tests.nn import _zoo
from tests.nn._zoo import BUILDERS, CASES, NORMS, BasicBlock
from tests.nn._zoo import set_case as trainable

__all__ = ["CASES", "NORMS", "ZOO", "BasicBlock", "resnet_like", "trainable", "vgg_like"]


def vgg_like(width: int = 8, classes: int = 5) -> nn.Module:
    """Two stages of two Conv-BatchNorm-ReLU and a max-pool, for 16x16 inputs."""
    return _zoo.vgg_like(width, classes, size=16, stages=2, hidden=32)


def resnet_like(width: int = 8, classes: int = 5) -> nn.Module:
    """3x3 stem, max-pool, two BasicBlocks (the second with stride 2 and a downsample)."""
    return _zoo.resnet_like(width, classes, stem=3, blocks=(1, 1))


# name -> (build() -> model, input shape): every model of the benchmarks at test size, batch 2
ZOO: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "vgg_like": (vgg_like, (2, 3, 16, 16)),
    "resnet_like": (resnet_like, (2, 3, 16, 16)),
    **{
        name: ((lambda build=build: build(1)), shape(1, 2))
        for name, (build, shape) in BUILDERS.items()
    },
}
