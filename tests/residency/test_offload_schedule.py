"""The schedule itself, not only its results: what is fetched, waited for and released when.

A recording mover logs every fetch and wait; hooks on the blocks log when each one computes, in
forward (its pre-hook, after headroom's) and in backward (a gradient inside it, computed by its
first backward kernel); the residency primitive logs releases. With prefetch, block i+1 is
requested before block i computes (and block i-1 before block i's backward); nothing is waited
for twice; releases come in order. Without these tests, a schedule that stopped fetching ahead
would still give exact results.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn as nn

import headroom as hr
from headroom.residency import _group
from headroom.store import DiskStore
from headroom.transfer import Mover

N = 4


class RecordingMover(Mover):
    log: list[tuple] = []
    serials = itertools.count()

    def fetch_many(self, items, **kw):
        tickets = super().fetch_many(items, **kw)
        for (handle, _), ticket in zip(items, tickets, strict=True):
            ticket.serial = next(self.serials)
            self.log.append(("fetch", handle.key, ticket.serial))
        return tickets

    def wait(self, ticket):
        self.log.append(("wait", None, ticket.serial))
        super().wait(ticket)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(N)])


def _run(monkeypatch, tmp_path, prefetch: int, store_kind: str) -> list[tuple]:
    log: list[tuple] = []
    RecordingMover.log = log
    monkeypatch.setattr(_group, "Mover", RecordingMover)
    release = _group.Residency.release

    def recording_release(self, group, *, quiet=False):
        if group.resident and group.module is not None:
            log.append(("release", group.name, None))
        release(self, group, quiet=quiet)

    monkeypatch.setattr(_group.Residency, "release", recording_release)
    model = _model()
    store = "cpu" if store_kind == "cpu" else DiskStore(tmp_path / "s", threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store=store, prefetch=prefetch)
    for i, block in enumerate(model):
        block.register_forward_pre_hook(lambda m, a, i=i: log.append(("compute", str(i), None)))

        # the gradient of the block's linear output exists once its first backward kernel ran
        def mark(m, args, out, i=i):
            out.register_hook(lambda g: log.append(("backward", str(i), None)))

        block[0].register_forward_hook(mark)
    log.clear()
    model(torch.randn(8, 16, requires_grad=True)).sum().backward()
    return log


def _first(log, kind, name) -> int:
    return next(i for i, (k, n, _) in enumerate(log) if k == kind and n is not None
                and (n == name or n.startswith(f"{name}.")))


@pytest.mark.parametrize("store_kind", ["cpu", "disk"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_fetches_ahead_by_prefetch_in_forward_and_backward(monkeypatch, tmp_path, prefetch,
                                                            store_kind):
    log = _run(monkeypatch, tmp_path, prefetch, store_kind)
    fwd = [i for i, e in enumerate(log) if e[0] == "compute"]
    bwd = [i for i, e in enumerate(log) if e[0] == "backward"]
    assert len(fwd) == N and len(bwd) == N
    fetches = [i for i, e in enumerate(log) if e[0] == "fetch"]
    for b in range(N):
        # forward: block b+k (k <= prefetch) is requested before block b computes
        for k in range(1, N - b):
            f = next(i for i in fetches if log[i][1].startswith(f"{b + k}.") and i < bwd[0])
            assert (f < fwd[b]) == (k <= prefetch), (b, k, log)
        # backward: block b-k is requested before block b's backward runs
        for k in range(1, b + 1):
            f = next(i for i in fetches if log[i][1].startswith(f"{b - k}.") and i > fwd[-1])
            assert (f < bwd[N - 1 - b]) == (k <= prefetch), (b, k, log)


@pytest.mark.parametrize("store_kind", ["cpu", "disk"])
def test_nothing_waited_twice_and_releases_in_order(monkeypatch, tmp_path, store_kind):
    log = _run(monkeypatch, tmp_path, 1, store_kind)
    waited = [t for k, _, t in log if k == "wait"]
    assert len(waited) == len(set(waited))
    fetched = {t for k, _, t in log if k == "fetch"}
    assert set(waited) <= fetched
    releases = [n for k, n, _ in log if k == "release"]
    half = releases.index(str(N - 1)) + 1  # forward releases end with the last block
    assert releases[:half] == [str(i) for i in range(N)]
    assert releases[half:] == [str(i) for i in reversed(range(N))]
