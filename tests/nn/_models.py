"""Small VGG-like and ResNet-like models built from torch.nn, for the headroom.nn tests."""

from __future__ import annotations

import torch
from torch import nn


def vgg_like(width: int = 8, classes: int = 5) -> nn.Module:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, width),
        *block(width, width),
        nn.MaxPool2d(2),
        *block(width, 2 * width),
        *block(2 * width, 2 * width),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * 4 * 4, 32),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(32, classes),
    )


class BasicBlock(nn.Module):
    """torchvision's BasicBlock shape: one inplace ReLU module used twice."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet_like(width: int = 8, classes: int = 5) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        BasicBlock(width, width),
        BasicBlock(width, 2 * width, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, classes),
    )


def trainable(model: nn.Module, case: str) -> None:
    """Set requires_grad for one of the cases: all, input, norm, surgical, none."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    surgical = convs[len(convs) // 2]
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if case == "all":
                p.requires_grad_(True)
            elif case == "norm":
                p.requires_grad_(isinstance(m, nn.BatchNorm2d))
            elif case == "surgical":
                p.requires_grad_(m is surgical)
            else:
                p.requires_grad_(False)


CASES = ("all", "input", "norm", "surgical", "none")
