"""release_pages: the pages of one host storage go back to the OS, and nothing else changes."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from headroom.store import release_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")

MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_storage_pages_leave_resident_memory_and_read_as_zeros():
    t = torch.ones(16 * MB, dtype=torch.uint8)  # resident: every page written
    keep = torch.full((4 * MB,), 7, dtype=torch.uint8)
    before = _rss()
    assert release_pages(t)
    after = _rss()
    assert before - after >= 15 * MB, (before, after)  # only whole pages inside t
    ptr, page = t.data_ptr(), 4096
    first = -(-ptr // page) * page - ptr  # first byte of the first whole page
    last = (ptr + t.numel()) // page * page - ptr
    assert int(t[first:last].sum()) == 0
    assert torch.equal(t[:first], torch.ones(first, dtype=torch.uint8))  # partial pages kept
    assert torch.equal(t[last:], torch.ones(t.numel() - last, dtype=torch.uint8))
    assert torch.equal(keep, torch.full((4 * MB,), 7, dtype=torch.uint8))
    t.fill_(3)  # the memory is still the tensor's: usable, and freed as usual
    assert int(t[::4096].sum()) == 3 * (16 * MB // 4096)


def test_memory_that_is_not_the_processes_own_is_left_alone():
    a = np.ones(4 * MB, dtype=np.uint8)
    lent = torch.from_numpy(a)  # NumPy's memory: not resizable
    shared = torch.ones(4 * MB, dtype=torch.uint8).share_memory_()
    small = torch.ones(100, dtype=torch.uint8)  # no whole page inside
    for t in (lent, shared, small):
        assert not release_pages(t)
        assert int(t.sum()) == t.numel()
    assert not release_pages(torch.ones(4 * MB, dtype=torch.uint8, device="meta"))


def test_switched_off_by_the_trim_variable(monkeypatch):
    monkeypatch.setenv("HEADROOM_TRIM_HEAP", "0")
    t = torch.ones(4 * MB, dtype=torch.uint8)
    assert not release_pages(t)
    assert int(t.sum()) == t.numel()
