"""Shared test configuration: the `gpu` marker and the devices tests parametrize over."""

from __future__ import annotations

import pytest
import torch


def accelerator_type() -> str | None:
    """The available accelerator's device type (e.g. ``"cuda"``), or ``None``."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type
    if torch.cuda.is_available():
        return "cuda"
    return None


DEVICES = ["cpu"] + ([accelerator_type()] if accelerator_type() else [])


def pytest_collection_modifyitems(config, items):
    if accelerator_type() is not None:
        return
    skip = pytest.mark.skip(reason="needs an accelerator (none available here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
