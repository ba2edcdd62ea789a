"""check_device: a device that exists here, with an explicit index, or an error naming the fix."""

from __future__ import annotations

import pytest
import torch

from headroom.transfer import check_device
from tests.conftest import accelerator_type


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend this machine has two cuda devices, the current one being 0."""
    acc = torch.accelerator
    monkeypatch.setattr(acc, "is_available", lambda: True)
    monkeypatch.setattr(acc, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(acc, "current_device_index", lambda: 0)
    monkeypatch.setattr(acc, "device_count", lambda: 2)


def test_cpu_is_plain_cpu_like_tensor_device():
    assert check_device("cpu") == torch.device("cpu") == torch.zeros(1).device
    assert check_device("cpu:0") == torch.zeros(1, device="cpu:0").device
    assert check_device(torch.device("cpu")) == torch.device("cpu")


def test_bad_devices():
    with pytest.raises(ValueError, match="'cdua' is not a torch device"):
        check_device("cdua")
    with pytest.raises(ValueError, match="meta.*cannot compute"):
        check_device("meta")


@pytest.mark.skipif(accelerator_type() == "cuda", reason="cuda exists here")
def test_missing_accelerator_is_named_with_the_fix():
    with pytest.raises(RuntimeError, match=r"'cuda:1' is not available on this machine.*"
                                           r"use device='cpu'.*DiskStore"):
        check_device("cuda:1")


def test_accelerator_gets_an_index(fake_cuda):
    assert check_device("cuda") == torch.device("cuda", 0)
    assert check_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match=r"'cuda:2' is not available: only 2 cuda device"):
        check_device("cuda:2")
    with pytest.raises(RuntimeError, match="no xpu accelerator"):
        check_device("xpu")


@pytest.mark.gpu
def test_real_accelerator_matches_tensor_device():
    dev = check_device(accelerator_type())
    assert dev.index is not None
    assert torch.zeros(1, device=accelerator_type()).device == dev


def test_an_accelerator_without_streams_is_refused_where_copies_start(fake_cuda, monkeypatch):
    """MPS has no side streams and events to order copies with: offload, the host optimizer's
    device path and streamed heads refuse it at construction, naming what is supported."""
    import types

    import headroom as hr
    from headroom.store import HostStore
    from headroom.transfer import Mover, RowStreamer, Stash, stream_module

    monkeypatch.setattr(torch, "get_device_module",
                        lambda device=None: types.SimpleNamespace(synchronize=lambda: None))
    dev = torch.device("cuda", 0)
    for make in (lambda: stream_module(dev), lambda: Mover(dev, HostStore()),
                 lambda: RowStreamer(dev), lambda: Stash(dev, None)):
        with pytest.raises(RuntimeError, match=r"has no Stream, Event, stream, current_stream"
                                               r".*CUDA.*device='cpu'"):
            make()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    before = [p for p in model.parameters()]
    with pytest.raises(RuntimeError, match="has no Stream"):
        hr.offload(model, device="cuda", store="cpu")
    assert list(model.parameters()) == before  # refused before anything changed
