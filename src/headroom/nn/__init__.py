"""Memory-saving layers: each subclasses its ``torch.nn`` twin, saves for backward only what
this backward needs, bitwise ``torch.nn``'s results (``docs/selective_layers.md``); ``convert``.
"""

from headroom.nn._activation import Hardtanh, LeakyReLU, ReLU, ReLU6
from headroom.nn._conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
)
from headroom.nn._convert import ConvertReport, convert, convert_report
from headroom.nn._dropout import Dropout
from headroom.nn._linear import Linear
from headroom.nn._norm import BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm, LayerNorm
from headroom.nn._pad import (
    ReflectionPad1d,
    ReflectionPad2d,
    ReflectionPad3d,
    ReplicationPad1d,
    ReplicationPad2d,
    ReplicationPad3d,
)
from headroom.nn._pool import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AdaptiveMaxPool1d,
    AdaptiveMaxPool2d,
    AdaptiveMaxPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)

__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d",
    "AdaptiveMaxPool3d",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Conv1d",
    "ConvertReport",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "Dropout",
    "GroupNorm",
    "Hardtanh",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "ReLU",
    "ReLU6",
    "ReflectionPad1d",
    "ReflectionPad2d",
    "ReflectionPad3d",
    "ReplicationPad1d",
    "ReplicationPad2d",
    "ReplicationPad3d",
    "convert",
    "convert_report",
]
