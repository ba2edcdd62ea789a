"""RowStreamer: row slices of host tensors streamed to the device with prefetch, gradient rows
streamed back. The accelerator path's bookkeeping runs on the CPU with a stand-in device module
whose streams and events do nothing but keep a trace: every slice delivered once, in order,
bitwise equal; the compute stream waits for each slice's copy; a staging or device buffer is
refilled only after the copy out of it (or the compute reading it) is done; pushes land once,
in order, exactly. Real asynchrony is covered by the gpu-marked tests."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from headroom.store import PinnedPool
from headroom.transfer import RowStreamer
from tests.conftest import DEVICES


class _Event:
    _ids = itertools.count()

    def __init__(self, trace: list) -> None:
        self.id = next(self._ids)
        self.trace = trace
        self.stream = None
        self.done = False

    def record(self, stream=None) -> None:
        self.stream = stream
        self.done = False
        self.trace.append(("record", self.id, stream.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        assert self.stream is not None, "synchronize on an event never recorded"
        self.done = True
        self.trace.append(("sync", self.id))


class _Stream:
    def __init__(self, name: str, trace: list) -> None:
        self.name = name
        self.trace = trace

    def wait_event(self, ev: _Event) -> None:
        assert ev.stream is not None, "waiting on an event never recorded"
        self.trace.append(("wait", self.name, ev.id))

    def synchronize(self) -> None:
        pass


class TracingDeviceModule:
    """Stands in for torch.cuda: do-nothing streams and events that log what they are asked."""

    def __init__(self) -> None:
        self.trace: list = []
        self.compute = _Stream("compute", self.trace)
        self._n = 0

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        return _Event(self.trace)

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        self._n += 1
        return _Stream(f"side{self._n}", self.trace)

    def current_stream(self, device=None):
        return self.compute

    def stream(self, s):
        return contextlib.nullcontext()


def streamer_on_cpu(prefetch: int = 1) -> tuple[RowStreamer, TracingDeviceModule]:
    """A RowStreamer taking its accelerator path on the CPU, with its trace."""
    s = RowStreamer("cpu", prefetch=prefetch)
    mod = TracingDeviceModule()
    s._use_streams(mod, PinnedPool(pin=False))
    s._trace = mod.trace
    return s, mod


def _bounds(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, n)) for a in range(0, n, size)]


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_stream_delivers_each_slice_once_in_order_exact(prefetch):
    w = torch.randn(103, 7)
    b = torch.randn(103)
    s, mod = streamer_on_cpu(prefetch)
    bounds = _bounds(103, 10)  # 11 slices, the last one partial
    got = []
    w.requires_grad_()
    for start, stop, (ws, none, bs) in s.stream([w, None, b], bounds):
        assert none is None
        assert torch.is_grad_enabled() and not ws.requires_grad  # no context leaks out
        assert ws.shape == (stop - start, 7)
        # the compute stream waited for this slice's copy (recorded on the side stream)
        last_wait = [e for e in mod.trace if e[0] == "wait" and e[1] == "compute"][-1]
        rec = next(e for e in mod.trace if e[0] == "record" and e[1] == last_wait[2])
        assert rec[2] == s._h2d.name
        got.append((start, stop, ws.clone(), bs.clone()))
        mod.trace.append(("used", start // 10))
    assert [(a, c) for a, c, _, _ in got] == bounds
    for start, stop, ws, bs in got:
        assert torch.equal(ws, w[start:stop]) and torch.equal(bs, b[start:stop])
    ring = prefetch + 1
    # a pageable source goes through staging: exactly `ring` buffers per tensor, reused in turn
    stages = [e for e in mod.trace if e[0] == "stage"]
    assert [e[1] for e in stages] == [j for j in range(11) for _ in range(2)]
    assert all(e[2] == e[1] % ring for e in stages)
    assert len({e[3] for e in stages}) == 2 * min(ring, 11)
    h2d = [e for e in mod.trace if e[0] == "h2d"]
    assert len({e[3] for e in h2d}) == 2 * min(ring, 11)  # device buffers: a ring too


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stream_ring_never_refills_a_buffer_in_use(prefetch):
    """Refilling slot k for slice j needs (a) the copy out of its staging for slice j - ring to
    be finished (host sync) and (b) the side stream to wait for compute to finish slice j - ring
    (an event recorded after that slice was used)."""
    w = torch.randn(64, 4)
    s, mod = streamer_on_cpu(prefetch)
    ring = prefetch + 1
    bounds = _bounds(64, 8)
    copy_event: dict[int, int] = {}  # slice -> id of the event recorded after its copy
    for i, _ in enumerate(s.stream([w], bounds)):
        mod.trace.append(("used", i))
    t = mod.trace
    for pos, e in enumerate(t):
        if e[0] == "h2d":
            nxt = next(x for x in t[pos:] if x[0] == "record")
            copy_event[e[1]] = nxt[1]
    for pos, e in enumerate(t):
        if e[0] == "stage" and e[1] >= ring:
            prev = copy_event[e[1] - ring]
            assert ("sync", prev) in t[:pos], f"staging slot refilled for slice {e[1]} in flight"
        if e[0] == "h2d" and e[1] >= ring:
            used = t.index(("used", e[1] - ring))
            released = [x[1] for x in t[used:pos] if x[0] == "record" and x[2] == "compute"]
            waits = [x[2] for x in t[used:pos] if x[0] == "wait" and x[1] == s._h2d.name]
            assert set(released) & set(waits), f"slice {e[1]} copied over a buffer in use"
    # prefetch: slice i + prefetch is issued before slice i is handed to compute
    for i in range(len(bounds) - prefetch):
        assert t.index(("used", i)) > max(
            p for p, x in enumerate(t) if x[0] == "h2d" and x[1] == i + prefetch)


def test_stream_pinned_source_goes_direct_and_casts_exactly(monkeypatch):
    w = torch.randn(50, 3).to(torch.bfloat16)
    s, mod = streamer_on_cpu(1)
    # a pinned host store's tensor (pinning needs an accelerator runtime): no staging copy
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    out = [(a, c, r.clone()) for a, c, (r,) in s.stream([w], _bounds(50, 16),
                                                          dtype=torch.float32)]
    assert not [e for e in mod.trace if e[0] == "stage"]
    # the host waits once, at the end, for the last copy (so it may write the source again)
    last = [e for e in mod.trace if e[0] == "record" and e[2] == s._h2d.name][-1]
    assert mod.trace[-1] == ("sync", last[1])
    for a, c, r in out:
        assert r.dtype == torch.float32 and torch.equal(r, w[a:c].float())


def test_stream_closed_early_orders_and_returns_staging():
    w = torch.randn(40, 2)
    s, mod = streamer_on_cpu(2)
    pool = s._pool
    gen = s.stream([w], _bounds(40, 5))
    next(gen)
    gen.close()
    assert pool.total_bytes > 0 and sum(len(v) for v in pool._free.values()) == 3
    issued = {e[1] for e in mod.trace if e[0] == "h2d"}
    assert issued == {0, 1, 2}


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("accumulate", [False, True])
def test_push_lands_each_slice_once_in_order_exact(prefetch, accumulate):
    s, mod = streamer_on_cpu(prefetch)
    dst = torch.randn(30, 5)
    dst_b = torch.randn(30, dtype=torch.bfloat16)
    expect, expect_b = dst.clone(), dst_b.clone()
    for start, stop in _bounds(30, 4):
        g = s.out("w", (stop - start, 5), torch.float32)
        g.copy_(torch.randn(stop - start, 5))
        gb = torch.randn(stop - start)
        if accumulate:
            expect[start:stop] += g
            expect_b[start:stop] += gb.to(torch.bfloat16)
        else:
            expect[start:stop] = g
            expect_b[start:stop] = gb
        s.push("w", dst[start:stop], g, accumulate=accumulate)
        s.push("b", dst_b[start:stop], gb, accumulate=accumulate)
    s.finish()
    assert torch.equal(dst, expect) and torch.equal(dst_b, expect_b)
    t = mod.trace
    ring = max(2, prefetch + 1)
    pushes = [e for e in t if e[0] == "push" and e[1] == "w"]
    lands = [e for e in t if e[0] == "land" and e[1] == "w"]
    assert [e[3] for e in lands] == [e[3] for e in pushes]  # once each, in push order
    outs = [e for e in t if e[0] == "out"]
    assert len({e[3] for e in outs}) == ring  # device buffers reused in a ring
    for pos, e in enumerate(t):
        if e[0] == "out":  # a buffer is handed out again only after its last push landed
            earlier = [x for x in t[:pos] if x[0] == "push" and x[3] == e[3]]
            if earlier:
                assert ("land", "w", e[2], e[3]) in t[t.index(earlier[-1]):pos]
    assert not any(s._slots["w"]) and not s._outs


def test_push_checks_shape_and_prefetch():
    s = RowStreamer("cpu")
    with pytest.raises(ValueError, match="rows of shape"):
        s.push("w", torch.zeros(3, 2), torch.zeros(2, 2), accumulate=False)
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        RowStreamer("cpu", prefetch=-1)
    with pytest.raises(ValueError, match="host tensors"):
        next(s.stream([torch.zeros(2, 2, device="meta")], [(0, 2)]))


def test_cpu_path_is_views_and_synchronous():
    w = torch.randn(10, 3)
    s = RowStreamer("cpu")
    assert not s.accelerated
    for a, c, (r,) in s.stream([w], _bounds(10, 4)):
        assert r.data_ptr() == w[a:c].data_ptr()
    dst = torch.zeros(10, 3)
    s.push("w", dst[2:5], torch.ones(3, 3), accumulate=True)
    assert dst[2:5].sum() == 9  # landed at once


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_accelerator_stream_and_push_exact(pinned, prefetch):
    dev = DEVICES[-1]
    w = torch.randn(5000, 64)
    if pinned:
        w = w.pin_memory()
    s = RowStreamer(dev, prefetch=prefetch)
    acc = torch.zeros(64, device=dev)
    dst = torch.zeros(5000, 64)
    for a, c, (r,) in s.stream([w], _bounds(5000, 700)):
        acc += r.sum(0)
        g = s.out("w", (c - a, 64), torch.float32)
        torch.mul(r, 2.0, out=g)
        s.push("w", dst[a:c], g, accumulate=False)
    s.finish()
    assert torch.equal(dst, w * 2.0)
    ref = torch.zeros(64, device=dev)
    for a, c in _bounds(5000, 700):
        ref += w[a:c].to(dev).sum(0)
    assert torch.equal(acc, ref)


def test_staging_reused_across_passes_and_cache_dropped_past_its_limit(monkeypatch):
    from headroom.transfer import _rows

    w = torch.randn(64, 8)
    s, mod = streamer_on_cpu(1)
    for _ in s.stream([w], _bounds(64, 16)):
        pass
    held = s._pool.total_bytes
    first = {e[3] for e in mod.trace if e[0] == "stage"}
    assert held == 2 * 16 * 8 * 4  # the ring's two staging buffers, cached for the next pass
    mod.trace.clear()
    for _ in s.stream([w], _bounds(64, 16)):
        pass
    assert {e[3] for e in mod.trace if e[0] == "stage"} == first and s._pool.total_bytes == held
    monkeypatch.setattr(_rows, "_ROW_STAGING_CACHE", held - 1)
    for _ in s.stream([w], _bounds(64, 16)):
        pass
    assert s._pool.total_bytes == 0
