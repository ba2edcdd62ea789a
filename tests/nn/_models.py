"""Models for the headroom.nn tests, built from ``torch.nn``.

The builders are the benchmarks' (``benchmarks/_selective.py`` and ``benchmarks/_zoo.py``) at
test sizes, so the tests check bitwise the very architectures the benchmarks time and measure.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks import _selective
from benchmarks._selective import CASES, BasicBlock
from benchmarks._selective import set_case as trainable
from benchmarks._zoo import BUILDERS
from torch import nn

__all__ = ["CASES", "ZOO", "BasicBlock", "resnet_like", "trainable", "vgg_like"]


def vgg_like(width: int = 8, classes: int = 5) -> nn.Module:
    """Two stages of two Conv-BatchNorm-ReLU and a max-pool, for 16x16 inputs."""
    return _selective.vgg_like(width, classes, size=16, stages=2, hidden=32)


def resnet_like(width: int = 8, classes: int = 5) -> nn.Module:
    """3x3 stem, max-pool, two BasicBlocks (the second with stride 2 and a downsample)."""
    return _selective.resnet_like(width, classes, stem=3, blocks=(1, 1))


# name -> (build() -> model, input shape): every model of the benchmarks at test size, batch 2
ZOO: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "vgg_like": (vgg_like, (2, 3, 16, 16)),
    "resnet_like": (resnet_like, (2, 3, 16, 16)),
    **{
        name: ((lambda build=build: build(1)), shape(1, 2))
        for name, (build, shape) in BUILDERS.items()
    },
}
