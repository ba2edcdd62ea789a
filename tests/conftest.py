"""Shared test configuration: the `gpu` marker, the devices tests parametrize over, fixtures."""

from __future__ import annotations

import signal

import pytest
import torch

# Tests of Ctrl-C send SIGINT to their own process. A suite started in the background by a
# non-interactive shell inherits SIGINT ignored, and Python then raises no KeyboardInterrupt:
# give those tests the handler an interactive run has.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (the folders of tiny models use it for every test).

    Their models are a few kilobytes: with several intra-op threads on a shared machine, OpenMP
    barriers dominate (10-100x slower). Results do not depend on it: every comparison runs both
    sides in one process under the same setting.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
