"""Small VGG-like and ResNet-like models for the headroom.nn tests.

The builders are the benchmark's (``benchmarks/_selective.py``) at test sizes, so the tests
check bitwise the very architectures ``benchmarks/selective_layers.py`` times.
"""

from __future__ import annotations

from benchmarks import _selective
from benchmarks._selective import CASES, BasicBlock
from benchmarks._selective import set_case as trainable
from torch import nn

__all__ = ["CASES", "BasicBlock", "resnet_like", "trainable", "vgg_like"]


def vgg_like(width: int = 8, classes: int = 5) -> nn.Module:
    """Two stages of two Conv-BatchNorm-ReLU and a max-pool, for 16x16 inputs."""
    return _selective.vgg_like(width, classes, size=16, stages=2, hidden=32)


def resnet_like(width: int = 8, classes: int = 5) -> nn.Module:
    """3x3 stem, max-pool, two BasicBlocks (the second with stride 2 and a downsample)."""
    return _selective.resnet_like(width, classes, stem=3, blocks=(1, 1))
