"""VGG-like and ResNet-like CNNs built from ``torch.nn``, the cases of what trains, and the
dispatch mode that sees which storages a forward creates.

Shared by ``benchmarks/selective_layers.py`` (full size) and ``tests/nn`` (small sizes), so the
models the tests check bitwise are the very models the benchmark times and measures, the same way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

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


class CreatedStorages(TorchDispatchMode):
    """Weak references to every storage an op creates while the mode is active.

    ``refs`` maps a storage key to ``(weak reference, nbytes)``; after the forward, the storages
    whose reference is alive are what the graph (or the caller) still holds. With
    ``track_peak=True`` the mode also records ``peak``: the most bytes of created storages
    alive at once, checked after every op (the peak during the forward; O(live storages) per
    op, for measurements only).
    """

    def __init__(self, *, track_peak: bool = False) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.track_peak = track_peak
        self.peak = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                s = t.untyped_storage()
                if s._cdata not in self.refs:
                    self.refs[s._cdata] = entry = (StorageWeakRef(s), s.nbytes())
                    if self.track_peak:
                        self._live[s._cdata] = entry
        if self.track_peak:
            live = self._live
            for k in [k for k, (ref, _) in live.items() if ref.expired()]:
                del live[k]
            self.peak = max(self.peak, sum(n for _, n in live.values()))
        return out

    def live_bytes(self, skip: set[int] | frozenset[int] = frozenset()) -> int:
        """Bytes of the created storages still alive, except those whose key is in ``skip``."""
        return sum(n for k, (ref, n) in self.refs.items() if not ref.expired() and k not in skip)


class NumpyBuffers:
    """Bytes of NumPy-allocated buffers (NumPy reports them to ``tracemalloc`` in its own
    domain) that were allocated inside the ``with`` block and are still alive at its end:
    ``bytes`` after exit. Starts and stops ``tracemalloc`` if it was not running."""

    def __enter__(self) -> NumpyBuffers:
        import tracemalloc

        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        self._before = self._numpy_bytes()
        return self

    def __exit__(self, *exc) -> None:
        import tracemalloc

        self.bytes = max(0, self._numpy_bytes() - self._before)
        if self._started:
            tracemalloc.stop()

    @staticmethod
    def _numpy_bytes() -> int:
        import tracemalloc

        import numpy as np

        domain = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
        snap = tracemalloc.take_snapshot().filter_traces([domain])
        return sum(stat.size for stat in snap.statistics("filename"))


_warm = False


def forward_bytes(
    fn, exclude=(), *, track_peak: bool = True
) -> tuple[int, int, object]:
    """``(kept, peak, output)`` of ``fn()``, a forward: ``kept`` is the bytes of storages it
    created (dispatch mode) and NumPy buffers it allocated that are alive after it, ``peak`` the
    most bytes of created storages alive at once during it. The output's storage and those of
    ``exclude`` (parameters, buffers) are not counted."""
    global _warm
    if not _warm:
        # NOTE: the first op under a dispatch mode imports half of torch (dynamo, sympy);
        # with tracemalloc on, that makes every later snapshot slow.
        with CreatedStorages():
            torch.ones(1).add(1)
        _warm = True
    mode = CreatedStorages(track_peak=track_peak)
    with NumpyBuffers() as np_bufs, mode:
        out = fn()
    outs = out if isinstance(out, tuple | list) else (out,)
    skip = {t.untyped_storage()._cdata for t in (*exclude, *outs) if isinstance(t, torch.Tensor)}
    return mode.live_bytes(skip) + np_bufs.bytes, mode.peak, out
