"""Accelerator-only: the GPU overhead benchmark runs end to end on small sizes (no timing
asserted; timings are reported by benchmarks/offload_overhead_gpu.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _bench_module():
    bench = Path(__file__).parents[2] / "benchmarks"
    spec = importlib.util.spec_from_file_location("offload_overhead_gpu",
                                                  bench / "offload_overhead_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(bench))  # it imports its CPU sibling, as a script run from there does
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench))
    return mod


def test_gpu_overhead_benchmark_runs_small():
    mod = _bench_module()
    device = torch.accelerator.current_accelerator()
    h2d, d2h = mod.bandwidth(device, nbytes=16 << 20, repeats=2)
    assert h2d > 0 and d2h > 0
    row = mod.bench(device, 1, 3, 256, 2, h2d, d2h)
    for key in ("offload_over_plain", "offload_over_transfer_bound"):
        assert math.isfinite(row[key]) and row[key] > 0
