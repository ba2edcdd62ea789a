"""How long a step takes under a plan: compute, recompute and transfers, from declared speeds.

The model is deliberately simple and additive: ``time = FLOPs / flops + bytes moved / bandwidth``
for each transfer, with no overlap credited (headroom overlaps prefetch and optimizer I/O with
compute, so real steps are at most this long when the speeds are right). FLOPs come from
PyTorch's ``FlopCounterMode`` over the dry run (matmuls, convolutions and attention; element-wise
ops count zero). The compute speed of ``cpu`` is measured once per process with a matmul; other
devices and bandwidths are declared (`Speeds`) and can be given by the caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

_measured_cpu: float | None = None


@dataclass(frozen=True)
class Speeds:
    """Speeds the time model uses (operations or bytes per second).

    Attributes:
        flops: sustained FLOP/s of the device on the model's matmuls and convolutions.
        host: host <-> device bytes/s (for ``cpu`` nothing moves: memory is shared).
        disk: disk read/write bytes/s.
        host_step: bytes/s at which the host optimizer streams state through an update.
    """

    flops: float
    host: float
    disk: float
    host_step: float = 4e9


def default_speeds(device: str) -> Speeds:
    """``cpu``: FLOP/s measured here; accelerators: conservative declared figures."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return Speeds(flops=cpu_flops(), host=float("inf"), disk=1e9)
    return Speeds(flops=50e12, host=12e9, disk=2e9)


def cpu_flops() -> float:
    """FLOP/s of a 512 x 512 fp32 matmul on this CPU (median of a few runs, cached)."""
    global _measured_cpu
    if _measured_cpu is None:
        a = torch.randn(512, 512)
        b = torch.randn(512, 512)
        a @ b
        times = []
        for _ in range(5):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
        times.sort()
        _measured_cpu = 2 * 512**3 / max(times[len(times) // 2], 1e-9)
    return _measured_cpu


def count_flops(run) -> int:
    """Total FLOPs of ``run()`` (forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        run()
    return counter.get_total_flops()
