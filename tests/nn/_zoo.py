"""CNNs built from ``torch.nn`` for hr.convert's tests and benchmarks: VGG-like and ResNet-like,
MobileNetV2-like, MobileNetV3-like (squeeze-excitation), UNet, DenseNet-like, DCGAN's
discriminator and generator, memsave_torch's three conv models, a classifier head with dropout,
and transformers' ResNet/ConvNeXt/ViT/MobileNetV2 from configs; and the cases of what trains.

The tests build them at small sizes (``tests/nn/_models.py``), the benchmarks
(``benchmarks/selective_layers.py``, ``benchmarks/convert_memory.py``) at full size, so the models
the tests check bitwise are the very models the benchmarks time and measure. The builders of
``BUILDERS`` take a ``scale`` (1 = test size, larger for the benchmarks) and return the model and
an input shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

CASES = ("all", "input", "norm", "surgical", "none")


def vgg_like(
    width: int = 64, classes: int = 10, size: int = 64, *, stages: int = 3, hidden: int = 256
) -> nn.Module:
    """``stages`` x (two 3x3 Conv-BatchNorm-ReLU, MaxPool2d(2)), then Linear-ReLU-Dropout-Linear.

    Stage ``i`` has ``width * 2**i`` channels; ``size`` is the input's height and width.
    """
    layers: list[nn.Module] = []
    cin = 3
    for i in range(stages):
        cout = width * 2**i
        for _ in range(2):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
            cin = cout
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(
        *layers,
        nn.Flatten(),
        nn.Linear(cin * (size >> stages) ** 2, hidden),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(hidden, classes),
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


def resnet_like(
    width: int = 32,
    classes: int = 10,
    *,
    stem: int = 7,
    blocks: tuple[int, ...] = (2, 2, 2, 2),
) -> nn.Module:
    """ResNet layout: a ``stem``x``stem`` convolution (stride 2 if ``stem > 3``), max-pool,
    ``len(blocks)`` stages of BasicBlocks (stage ``i``: ``width * 2**i`` channels, ``blocks[i]``
    blocks, stride 2 from the second stage on), global average pool, fc. The defaults are
    ResNet-18's layout.
    """
    stages: list[nn.Module] = []
    cin = width
    for i, count in enumerate(blocks):
        cout = width * 2**i
        for j in range(count):
            stages.append(BasicBlock(cin, cout, 2 if i > 0 and j == 0 else 1))
            cin = cout
    return nn.Sequential(
        nn.Conv2d(3, width, stem, 2 if stem > 3 else 1, stem // 2, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        *stages,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(cin, classes),
    )


NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def set_case(model: nn.Module, case: str) -> None:
    """Set ``requires_grad`` of every parameter for one of :data:`CASES`.

    ``all``: every parameter; ``norm``: the affine parameters of the normalization layers
    (BatchNorm, GroupNorm, LayerNorm and their subclasses); ``surgical``: the 2-d convolution
    in the middle of the network (the middle convolution or linear layer where there are fewer
    than three); ``input`` and ``none``: no parameter (in ``input`` the caller makes the input
    require grad).
    """
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if len(convs) < 3:
        convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd | nn.Linear)]
    surgical = convs[len(convs) // 2]
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if case == "all":
                p.requires_grad_(True)
            elif case == "norm":
                p.requires_grad_(isinstance(m, NORMS))
            elif case == "surgical":
                p.requires_grad_(m is surgical)
            else:
                p.requires_grad_(False)


# --------------------------------------------------------------------------------- MobileNetV2


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 project, ReLU6 in place."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden)]
            layers.append(nn.ReLU6(inplace=True))
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


def mobilenet_v2_like(width: int = 16, classes: int = 10, *, stages=None) -> nn.Module:
    """Stem, inverted residual stages ``(expand, channels, repeats, stride)``, 1x1 head conv,
    global pool, dropout and a linear classifier (torchvision's layout, fewer stages)."""
    stages = stages or ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 2, 2))
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, 2, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU6(inplace=True),
    ]
    cin = width
    for expand, cout, repeats, stride in stages:
        for i in range(repeats):
            layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
            cin = cout
    last = 4 * cin
    layers += [nn.Conv2d(cin, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6(inplace=True)]
    return nn.Sequential(
        *layers,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(last, classes),
    )


# --------------------------------------------------------------------------------- MobileNetV3


class SqueezeExcite(nn.Module):
    """``x * hardsigmoid(fc2(relu(fc1(pool(x)))))``: the product keeps ``x`` (unconverted op)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, max(8, c // 4), 1)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(max(8, c // 4), c, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class MBv3Block(nn.Module):
    def __init__(self, cin: int, hidden: int, cout: int, stride: int, se: bool, act) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if hidden != cin:
            layers += [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), act()]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            act(),
        ]
        if se:
            layers.append(SqueezeExcite(hidden))
        layers += [nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


def mobilenet_v3_like(width: int = 16, classes: int = 10) -> nn.Module:
    """MobileNetV3-small's layout, shortened: ReLU blocks with squeeze-excitation, then
    Hardswish blocks, a 1x1 head, pool and a Hardswish/Dropout classifier."""
    relu, hswish = (lambda: nn.ReLU(inplace=True)), (lambda: nn.Hardswish(inplace=True))
    w = width
    blocks = [
        (w, w, w, 2, True, relu),
        (w, 4 * w, 2 * w, 2, False, relu),
        (2 * w, 6 * w, 2 * w, 1, True, relu),
        (2 * w, 6 * w, 3 * w, 2, True, hswish),
        (3 * w, 8 * w, 3 * w, 1, True, hswish),
    ]
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 2, 1, bias=False),
        nn.BatchNorm2d(w),
        nn.Hardswish(inplace=True),
        *[MBv3Block(*b) for b in blocks],
        nn.Conv2d(3 * w, 12 * w, 1, bias=False),
        nn.BatchNorm2d(12 * w),
        nn.Hardswish(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(12 * w, 32 * w),
        nn.Hardswish(inplace=True),
        nn.Dropout(0.2),
        nn.Linear(32 * w, classes),
    )


# --------------------------------------------------------------------------------- UNet


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """UNet: ``depth`` levels of double convolutions and max-pools, a bottleneck, transposed
    convolutions up, skip connections concatenated, a 1x1 head."""

    def __init__(self, width: int = 16, classes: int = 2, depth: int = 3) -> None:
        super().__init__()
        self.downs = nn.ModuleList()
        cin = 3
        for i in range(depth):
            self.downs.append(_double_conv(cin, width * 2**i))
            cin = width * 2**i
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(cin, 2 * cin)
        self.ups = nn.ModuleList()
        self.convs = nn.ModuleList()
        c = 2 * cin
        for _ in range(depth):
            self.ups.append(nn.ConvTranspose2d(c, c // 2, 2, 2))
            self.convs.append(_double_conv(c, c // 2))
            c //= 2
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, conv in zip(self.ups, self.convs, strict=True):
            x = conv(torch.cat([skips.pop(), up(x)], 1))
        return self.head(x)


# --------------------------------------------------------------------------------- DenseNet


class DenseLayer(nn.Module):
    """torchvision's dense layer: BN-ReLU-1x1 conv (bottleneck), BN-ReLU-3x3 conv (growth)."""

    def __init__(self, cin: int, growth: int, bn_size: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.ModuleDict):
    def __init__(self, layers: int, cin: int, growth: int) -> None:
        super().__init__()
        for i in range(layers):
            self[f"denselayer{i + 1}"] = DenseLayer(cin + i * growth, growth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


def densenet_like(growth: int = 8, classes: int = 10, *, blocks=(3, 3, 3)) -> nn.Module:
    """torchvision's DenseNet layout, smaller: stem, dense blocks with transitions (BN-ReLU-1x1
    conv-avg-pool), final BN-ReLU, pool and classifier."""
    c = 2 * growth
    layers: list[nn.Module] = [
        nn.Conv2d(3, c, 3, padding=1, bias=False),
        nn.BatchNorm2d(c),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    for i, n in enumerate(blocks):
        layers.append(DenseBlock(n, c, growth))
        c += n * growth
        if i < len(blocks) - 1:
            layers += [
                nn.BatchNorm2d(c),
                nn.ReLU(inplace=True),
                nn.Conv2d(c, c // 2, 1, bias=False),
                nn.AvgPool2d(2),
            ]
            c //= 2
    return nn.Sequential(
        *layers,
        nn.BatchNorm2d(c),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, classes),
    )


# --------------------------------------------------------------------------------- DCGAN


def dcgan_discriminator(width: int = 16) -> nn.Module:
    """DCGAN's discriminator for 64x64 images: strided convolutions, BatchNorm and in-place
    LeakyReLU(0.2), a 4x4 convolution to one logit and a sigmoid."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 4, 2, 1, bias=False),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(w, 2 * w, 4, 2, 1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(2 * w, 4 * w, 4, 2, 1, bias=False),
        nn.BatchNorm2d(4 * w),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(4 * w, 8 * w, 4, 2, 1, bias=False),
        nn.BatchNorm2d(8 * w),
        nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(8 * w, 1, 4, 1, 0, bias=False),
        nn.Sigmoid(),
    )


def dcgan_generator(width: int = 16, nz: int = 32) -> nn.Module:
    """DCGAN's generator: transposed convolutions from a ``nz`` x 1 x 1 code to 64x64 images,
    BatchNorm and in-place ReLU, tanh."""
    w = width
    return nn.Sequential(
        nn.ConvTranspose2d(nz, 8 * w, 4, 1, 0, bias=False),
        nn.BatchNorm2d(8 * w),
        nn.ReLU(True),
        nn.ConvTranspose2d(8 * w, 4 * w, 4, 2, 1, bias=False),
        nn.BatchNorm2d(4 * w),
        nn.ReLU(True),
        nn.ConvTranspose2d(4 * w, 2 * w, 4, 2, 1, bias=False),
        nn.BatchNorm2d(2 * w),
        nn.ReLU(True),
        nn.ConvTranspose2d(2 * w, w, 4, 2, 1, bias=False),
        nn.BatchNorm2d(w),
        nn.ReLU(True),
        nn.ConvTranspose2d(w, 3, 4, 2, 1, bias=False),
        nn.Tanh(),
    )


# --------------------------------------------------------------------------------- memsave's


def memsave_conv(channels: int = 16, relu: bool = False, classes: int = 10, size: int = 16):
    """memsave_torch's "deepmodel" (``relu=False``) and "deeprelumodel" (``relu=True``) layout:
    a 3x3 convolution, max-pool and ReLU, ten 3x3 convolutions (each followed by a ReLU in the
    second), a 4x4 max-pool and a linear layer; ``size`` is the input's height and width."""
    c = channels
    body: list[nn.Module] = []
    for _ in range(10):
        body.append(nn.Conv2d(c, c, 3, padding=1, bias=False))
        if relu:
            body.append(nn.ReLU())
    out = (size + 1) // 2
    out = (out + 2 - 4) // 4 + 1
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1, bias=False),
        nn.MaxPool2d(3, 2, 1),
        nn.ReLU(),
        *body,
        nn.MaxPool2d(4, 4, 1),
        nn.Flatten(),
        nn.Linear(c * out * out, classes),
    )


def memsave_conv_relu_pool(channels: int = 16, blocks: int = 3, classes: int = 10, size: int = 32):
    """memsave_torch's "deeprelupoolmodel" layout: a convolution, max-pool and ReLU, then
    ``blocks`` x (3x3 convolution, ReLU, max-pool), a linear layer."""
    c = channels
    body: list[nn.Module] = []
    for _ in range(blocks):
        body += [nn.Conv2d(c, c, 3, padding=1, bias=False), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    out = size
    for _ in range(blocks + 1):
        out = (out + 1) // 2
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1, bias=False),
        nn.MaxPool2d(3, 2, 1),
        nn.ReLU(),
        *body,
        nn.Flatten(),
        nn.Linear(c * out * out, classes),
    )


def classifier_head(features: int = 256, classes: int = 10) -> nn.Module:
    """Linear-ReLU-Dropout-Linear on ``features``-wide inputs."""
    return nn.Sequential(
        nn.Linear(features, features), nn.ReLU(), nn.Dropout(0.5), nn.Linear(features, classes)
    )


# --------------------------------------------------------------------------------- transformers


class Logits(nn.Module):
    """A Hugging Face image classifier as a tensor -> tensor module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def hf_model(kind: str, scale: int = 1) -> nn.Module:
    """transformers' ``resnet`` (basic blocks), ``convnext``, ``vit`` or ``mobilenet_v2``
    image classifier from a small config (random weights), wrapped in :class:`Logits`."""
    import transformers as tf

    s = scale
    if kind == "resnet":
        cfg = tf.ResNetConfig(
            embedding_size=16 * s,
            hidden_sizes=[16 * s, 32 * s, 64 * s, 128 * s],
            depths=[1, 1, 1, 1],
            layer_type="basic",
            num_labels=5,
        )
        return Logits(tf.ResNetForImageClassification(cfg))
    if kind == "convnext":
        cfg = tf.ConvNextConfig(
            hidden_sizes=[16 * s, 32 * s, 64 * s, 128 * s], depths=[1, 1, 1, 1], num_labels=5
        )
        return Logits(tf.ConvNextForImageClassification(cfg))
    if kind == "vit":
        cfg = tf.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32 * s,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64 * s,
            num_labels=5,
        )
        return Logits(tf.ViTForImageClassification(cfg))
    if kind == "mobilenet_v2":
        cfg = tf.MobileNetV2Config(image_size=32, depth_multiplier=0.35 * s, num_labels=5)
        return Logits(tf.MobileNetV2ForImageClassification(cfg))
    raise ValueError(f"unknown transformers model {kind!r}")


# --------------------------------------------------------------------------------- the list

# name -> (build(scale) -> model, input shape(scale, batch))
BUILDERS: dict[str, tuple[Callable[[int], nn.Module], Callable[[int, int], tuple[int, ...]]]] = {
    "memsave_deepmodel": (
        lambda s: memsave_conv(16 * s, size=16 * s),
        lambda s, b: (b, 3, 16 * s, 16 * s),
    ),
    "memsave_deeprelumodel": (
        lambda s: memsave_conv(16 * s, relu=True, size=16 * s),
        lambda s, b: (b, 3, 16 * s, 16 * s),
    ),
    "memsave_deeprelupoolmodel": (
        lambda s: memsave_conv_relu_pool(16 * s, size=32 * s),
        lambda s, b: (b, 3, 32 * s, 32 * s),
    ),
    "mobilenet_v2_like": (lambda s: mobilenet_v2_like(8 * s), lambda s, b: (b, 3, 32 * s, 32 * s)),
    "mobilenet_v3_like": (lambda s: mobilenet_v3_like(8 * s), lambda s, b: (b, 3, 32 * s, 32 * s)),
    "unet": (lambda s: UNet(8 * s), lambda s, b: (b, 3, 32 * s, 32 * s)),
    "densenet_like": (lambda s: densenet_like(8 * s), lambda s, b: (b, 3, 32 * s, 32 * s)),
    "dcgan_discriminator": (lambda s: dcgan_discriminator(8 * s), lambda s, b: (b, 3, 64, 64)),
    "dcgan_generator": (lambda s: dcgan_generator(8 * s), lambda s, b: (b, 32, 1, 1)),
    "classifier_head": (lambda s: classifier_head(256 * s), lambda s, b: (b, 256 * s)),
    "hf_resnet": (lambda s: hf_model("resnet", s), lambda s, b: (b, 3, 32 * s, 32 * s)),
    "hf_convnext": (lambda s: hf_model("convnext", s), lambda s, b: (b, 3, 32 * s, 32 * s)),
    "hf_vit": (lambda s: hf_model("vit", s), lambda s, b: (b, 3, 32, 32)),
    "hf_mobilenet_v2": (lambda s: hf_model("mobilenet_v2", s), lambda s, b: (b, 3, 32, 32)),
}
