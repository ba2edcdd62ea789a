"""The dry run of `hr.offload_activations` (what `hr.estimate` runs) against the feature itself:
its options (``modules``) and defaults (``prefetch``) give the peak the tracker measures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import headroom as hr
from headroom.activations import DEFAULT_MIN_BYTES, DEFAULT_PREFETCH

MIN = 1 << 14


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                            for _ in range(4)])
    return model, (torch.randn(128, 64),)


def _measured(model, args, store, **options) -> int:
    def step():
        with hr.offload_activations(store=store, min_bytes=MIN, **options):
            model(*args).sum().backward()
        model.zero_grad()

    step()
    with hr.track_memory(model=model) as mem:
        step()
    return mem.peak


def _estimated(model, args, **what_if) -> int:
    return hr.estimate(model, args, optimizer=None,
                       offload_activations={"min_bytes": MIN, **what_if}).peak


def test_default_prefetch_is_the_features(tmp_path):
    model, args = _model()
    measured = _measured(model, args, hr.DiskStore(tmp_path / "a"))
    est = _estimated(model, args)
    assert est == _estimated(model, args, prefetch=DEFAULT_PREFETCH)
    # prefetch 0 (what the dry run took before) refills one storage at a time: far lower
    assert _estimated(model, args, prefetch=0) < 0.8 * measured
    assert abs(est - measured) <= 0.05 * measured, (est, measured)
    assert DEFAULT_PREFETCH == 256 << 20 and DEFAULT_MIN_BYTES == 1 << 20


def test_refill_ahead_to_the_byte(tmp_path):
    """The dry run is the feature's own keeper: with its default refill-ahead budget the peak
    is the measured one to the byte (in the step whose disk writes kept up with the forward:
    the dry run takes writes as done at once)."""
    model, args = _model()
    store = hr.DiskStore(tmp_path / "a")

    def step():
        with hr.offload_activations(store=store, min_bytes=MIN):
            model(*args).sum().backward()
        model.zero_grad()

    step()
    peaks = []
    for _ in range(3):
        with hr.track_memory(model=model) as mem:
            step()
        peaks.append(mem.peak)
    assert _estimated(model, args) == min(peaks)


def test_modules_as_measured(tmp_path):
    """Only what the listed modules save moves, given by name or as the model's submodules.

    With ``prefetch=0`` the forward waits for each copy, so the measured peak does not depend
    on how fast the disk writes (the dry run takes writes as done at once)."""
    model, args = _model()
    measured = _measured(model, args, hr.DiskStore(tmp_path / "a"), modules=[model[1]],
                         prefetch=0)
    by_name = _estimated(model, args, modules=["1"], prefetch=0)
    assert by_name == _estimated(model, args, modules=[model[1]], prefetch=0)
    assert abs(by_name - measured) <= 0.05 * measured, (by_name, measured)
    # the modules make a difference: neither nothing nor everything moves
    assert by_name < hr.estimate(model, args, optimizer=None).peak
    assert by_name > _estimated(model, args, prefetch=0)
    # and with the feature's default prefetch
    assert _estimated(model, args, modules=["1"]) == \
        _estimated(model, args, modules=[model[1]], prefetch=DEFAULT_PREFETCH)


def test_bad_modules_name_the_cause():
    model, args = _model()
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        _estimated(model, args, modules=["nope"])
    with pytest.raises(ValueError, match="qualified names or submodules"):
        _estimated(model, args, modules=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        _estimated(model, args, prefetch=-1)
