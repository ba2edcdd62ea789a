"""Stores: host memory and disk keep tensors exactly, row access, budgets, errors, reopening."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from headroom.store import (
    DiskStore,
    Handle,
    HostStore,
    StoreCorruptError,
    StoreFullError,
    resolve_store,
)
from headroom.store import _disk as disk_mod
from tests.conftest import accelerator_type


@pytest.fixture(params=["host", "disk"])
def store(request, tmp_path):
    s = HostStore() if request.param == "host" else DiskStore(tmp_path / "s", threads=2)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_put_read_roundtrip_is_exact(store, dtype):
    x = (torch.randn(5, 7) * 100).to(dtype)
    h = store.put("x", x)
    assert h == Handle.of("x", (5, 7), dtype) and h.nbytes == x.numel() * x.element_size()
    assert torch.equal(store.read(h).result(), x)
    out = torch.empty_like(x)
    assert store.read(h, out=out).result() is out and torch.equal(out, x)


def test_alloc_is_zero_and_write_overwrites(store):
    h = store.alloc("z", (3, 4), torch.float32)
    assert torch.equal(store.read(h).result(), torch.zeros(3, 4))
    y = torch.randn(3, 4)
    store.write(h, y).result()
    assert torch.equal(store.read(h).result(), y)
    h0 = store.alloc("scalar", (), torch.float32)
    store.write(h0, torch.tensor(2.5)).result()
    assert store.read(h0).result().item() == 2.5


def test_rows_slice_and_indices(store):
    x = torch.randn(10, 3)
    h = store.put("x", x)
    assert torch.equal(store.read_rows(h, slice(2, 6)).result(), x[2:6])
    rows = torch.tensor([0, 1, 2, 5, 7, 8])  # two runs and a single row
    assert torch.equal(store.read_rows(h, rows).result(), x[rows])
    src = torch.randn(len(rows), 3)
    store.write_rows(h, rows, src).result()
    expect = x.clone()
    expect[rows] = src
    assert torch.equal(store.read(h).result(), expect)
    store.write_rows(h, slice(9, 10), torch.ones(1, 3)).result()
    expect[9] = 1
    assert torch.equal(store.read(h).result(), expect)
    with pytest.raises(ValueError, match="sorted"):
        store.read_rows(h, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="out of range"):
        store.read_rows(h, torch.tensor([10]))
    with pytest.raises(ValueError, match="step 1"):
        store.read_rows(h, slice(0, 10, 2))


def test_operations_on_one_key_run_in_issue_order(store):
    h = store.alloc("k", (1000,), torch.float32)
    for i in range(20):
        store.write(h, torch.full((1000,), float(i)))
    assert torch.equal(store.read(h).result(), torch.full((1000,), 19.0))


def test_errors_name_cause_and_fix(store):
    h = store.put("x", torch.zeros(2, 2))
    with pytest.raises(KeyError, match="already in"):
        store.put("x", torch.zeros(1))
    with pytest.raises(TypeError, match="dtype mismatch.*float32.*float64"):
        store.write(h, torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape mismatch"):
        store.write(h, torch.zeros(4))
    store.free(h)
    with pytest.raises(KeyError, match="not in"):
        store.read(h)
    assert "x" not in store


def test_budget_full_error(tmp_path):
    for s in (HostStore(max_bytes=100), DiskStore(tmp_path / "b", max_bytes=100)):
        s.put("a", torch.zeros(20))  # 80 bytes
        with pytest.raises(StoreFullError, match=r"store full: budget 100 bytes, need 160"):
            s.put("b", torch.zeros(20))
        assert s.keys() == ["a"] and s.used_bytes == 80
        s.free(s.get("a"))
        s.put("b", torch.zeros(20))  # freed bytes count again
        s.close()


def test_disk_not_writable_and_disk_full(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="not writable"):
        DiskStore(blocker / "sub")
    s = DiskStore(tmp_path / "d")
    monkeypatch.setattr(disk_mod.shutil, "disk_usage", lambda p: SimpleNamespace(free=10))
    with pytest.raises(StoreFullError, match="disk full.*needs 400 bytes, 10 free"):
        s.alloc("big", (100,), torch.float32)
    monkeypatch.undo()
    h = s.alloc("w", (100,), torch.float32)

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod.os, "pwritev", enospc)
    with pytest.raises(StoreFullError, match="disk full while writing"):
        s.write(h, torch.ones(100)).result()
    monkeypatch.undo()
    s.close()


def test_disk_store_reopens_in_another_process(tmp_path):
    s = DiskStore(tmp_path / "r")
    x = torch.randn(64, 8)
    s.put("layer.0.weight", x)
    s.put("half", x.to(torch.bfloat16))
    s.close()
    script = textwrap.dedent(f"""
        import torch
        from headroom.store import DiskStore
        s = DiskStore({str(tmp_path / "r")!r})
        assert sorted(s.keys()) == ["half", "layer.0.weight"], s.keys()
        w = s.read(s.get("layer.0.weight")).result()
        s.write(s.get("half"), (w * 2).to(torch.bfloat16)).result()
        s.close()
        print(float(w.sum()))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert float(r.stdout) == float(x.sum())
    s2 = DiskStore(tmp_path / "r")
    assert torch.equal(s2.read(s2.get("half")).result(), (x * 2).to(torch.bfloat16))
    s2.close()


def test_resolve_store():
    s = resolve_store("cpu", "cpu")
    assert isinstance(s, HostStore) and not s.pinned
    assert resolve_store(s, "cpu") is s
    with pytest.raises(ValueError, match="unknown store 'gpu'"):
        resolve_store("gpu", "cpu")


def test_host_tensor_is_zero_copy():
    s = HostStore()
    h = s.put("x", torch.ones(3))
    t = s.host_tensor(h)
    t.add_(1)
    assert torch.equal(s.read(h).result(), torch.full((3,), 2.0))


@pytest.mark.gpu
def test_pinned_host_store_on_accelerator():
    from headroom.store import pinned_bytes

    base = pinned_bytes()
    s = resolve_store("cpu", accelerator_type())
    assert s.pinned
    h = s.put("x", torch.randn(1000))
    assert s.host_tensor(h).is_pinned()
    assert pinned_bytes() - base == s.spent_bytes > 0  # one slab, counted as spent
    h2 = s.alloc("y", (1000,), torch.float32)  # carved from the same slab
    assert s.host_tensor(h2).is_pinned() and pinned_bytes() - base == s.spent_bytes
    s.free(h)
    s.free(h2)
    assert pinned_bytes() == base  # the slab went back to the system


def test_disk_stats_and_page_cache_off(tmp_path):
    s = DiskStore(tmp_path / "p", page_cache=False, threads=2)
    x = torch.randn(128, 64)
    h = s.put("x", x)
    assert torch.equal(s.read(h).result(), x)
    assert torch.equal(s.read_rows(h, torch.tensor([3, 4, 9])).result(), x[[3, 4, 9]])
    st = s.stats()
    assert st["bytes_written"] == x.numel() * 4 and st["reads"] == 2
    assert st["bytes_read"] == (128 + 3) * 64 * 4 and st["read_busy_s"] > 0
    assert st["writes"] == 1 and st["write_busy_s"] > 0
    # one thread at a time here: a read never shared the disk with a write
    assert st["read_write_overlap_s"] == 0
    s.write_rows(h, slice(2, 5), x[2:5].clone()).result()
    assert s.stats()["bytes_written"] == (128 + 3) * 64 * 4
    s.close()


def test_disk_large_reads_split_across_threads(tmp_path):
    s = DiskStore(tmp_path / "p", threads=4)
    x = torch.randn(2100, 1024)  # 8.2 MiB: read as several requests at once
    h = s.put("x", x)
    before = s.stats()["reads"]
    out = torch.empty_like(x)
    assert s.read(h, out=out).result() is out and torch.equal(out, x)
    assert s.stats()["reads"] - before > 1
    rows = torch.cat([torch.arange(0, 900), torch.arange(1000, 2100)])
    assert torch.equal(s.read_rows(h, rows).result(), x[rows])
    assert torch.equal(s.read_rows(h, slice(7, 2099)).result(), x[7:2099])
    # later operations on the key still wait for every piece
    s.write(h, torch.zeros_like(x))
    assert s.read(h).result().abs().sum() == 0
    s.close()


def test_disk_split_read_error_reaches_the_caller(tmp_path):
    s = DiskStore(tmp_path / "p", threads=4)
    h = s.put("x", torch.randn(2100, 1024))
    s.flush()
    os_file = s.file_of(h)
    with open(os_file, "r+b") as f:
        f.truncate(1 << 20)  # the later pieces hit the end of the file
    with pytest.raises(StoreCorruptError, match="the file is shorter than the tensor"):
        s.read(h).result()
    s.close()


def test_disk_deferred_scale_reads_as_if_written(tmp_path):
    """scale_ records an in-place scaling: later reads (whole, rows) apply it bitwise as the op
    on the whole value would; a whole write replaces it; a row write, flush and file_of write
    it out first; free forgets it; reads issued before it are not scaled."""
    mul, fmul = torch.ops.aten.mul_.Tensor, torch.ops.aten._foreach_mul_.Tensor
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    a, b = torch.tensor(0.3), torch.tensor(1.7)
    want = x.clone()
    torch._foreach_mul_([want], a)
    want.mul_(b)
    s = DiskStore(tmp_path / "s", threads=2)
    h = s.put("g", x)
    early = s.read(h)
    s.scale_(h, fmul, a)
    s.scale_(h, mul, b)
    assert torch.equal(early.result(), x)
    assert torch.equal(s.read(h).result(), want)
    assert torch.equal(s.read_rows(h, slice(1, 4)).result(), want[1:4])
    assert torch.equal(s.read_rows(h, torch.tensor([0, 5])).result(), want[[0, 5]])
    s.write_rows(h, slice(0, 1), torch.zeros(1, 5)).result()  # the other rows keep the scaling
    assert "g" not in s._scales
    assert torch.equal(s.read(h).result(), torch.cat([torch.zeros(1, 5), want[1:]]))
    s.scale_(h, mul, a)
    s.write(h, x).result()  # replaced whole: the scaling is gone
    assert torch.equal(s.read(h).result(), x)
    s.scale_(h, mul, a)
    s.close()  # flushes: the file holds the scaled value
    s = DiskStore(tmp_path / "s", verify=True)
    assert torch.equal(s.read(s.get("g")).result(), x * a)
    s.scale_(s.get("g"), mul, a)
    s.free(s.get("g"))
    assert not s._scales
    s.close()


@pytest.mark.parametrize("exc", [OSError(5, "injected"), KeyboardInterrupt()])
def test_disk_deferred_scale_kept_when_writing_it_out_fails_to_start(tmp_path, monkeypatch,
                                                                    exc):
    """An error or Ctrl-C as the write that carries the scaling out is queued (flush, row
    write): the scaling stays recorded, reads still apply it once, and a later flush writes
    it out."""
    mul = torch.ops.aten.mul_.Tensor
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    a = torch.tensor(0.3)
    s = DiskStore(tmp_path / "s", threads=2)
    h = s.put("g", x)
    s.scale_(h, mul, a)
    real = DiskStore._submit_parts

    def failing(self, key, parts, result, *, write=False, finish=None):
        if write:
            raise exc
        return real(self, key, parts, result, write=write, finish=finish)

    monkeypatch.setattr(DiskStore, "_submit_parts", failing)
    for fail in (s.flush, lambda: s.write_rows(h, slice(0, 1), torch.zeros(1, 3))):
        with pytest.raises(type(exc)):
            fail()
        assert torch.equal(s.read(h).result(), x * a)
        assert torch.equal(s.read_rows(h, slice(1, 3)).result(), (x * a)[1:3])
    monkeypatch.setattr(DiskStore, "_submit_parts", real)
    s.close()
    s = DiskStore(tmp_path / "s", verify=True)
    assert torch.equal(s.read(s.get("g")).result(), x * a)
    s.close()


def test_disk_deferred_scale_kept_when_its_write_out_fails(tmp_path, monkeypatch):
    """The write that carries a scaling out fails before a byte reaches the file (a full
    disk): the flush raises, the file holds the value before the scaling, and reads still
    apply it; the next flush writes it out."""
    from headroom.store import StoreFullError

    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    a = torch.tensor(0.3)
    s = DiskStore(tmp_path / "s", threads=2)
    h = s.put("g", x)
    s.scale_(h, torch.ops.aten.mul_.Tensor, a)

    def full(*args, **kw):
        raise OSError(28, "No space left on device (injected)")

    with monkeypatch.context() as m:
        m.setattr(s, "_pwrite_extents", full)
        with pytest.raises(StoreFullError):
            s.flush()
    assert torch.equal(s.read(h).result(), x * a)
    assert torch.equal(s.read_rows(h, slice(2, 4)).result(), (x * a)[2:4])
    s.close()
    s = DiskStore(tmp_path / "s", verify=True)
    assert torch.equal(s.read(s.get("g")).result(), x * a)
    s.close()


def test_disk_deferred_scale_killed_before_written_reopens_unscaled(tmp_path):
    """kill -9 after scale_ and before anything wrote it out: the tensor reopens as it was
    (its last completed write), intact; a tensor whose scaling a flush wrote out keeps it."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from headroom.store import DiskStore
        s = DiskStore({str(tmp_path / "k")!r})
        x = torch.arange(12.0).reshape(3, 4)
        a, b = s.put("a", x), s.put("b", x)
        s.scale_(b, torch.ops.aten.mul_.Tensor, torch.tensor(2.0))
        s.flush()
        s.scale_(a, torch.ops.aten.mul_.Tensor, torch.tensor(3.0))
        assert torch.equal(s.read(a).result(), x * 3)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == -9, r.stderr
    x = torch.arange(12.0).reshape(3, 4)
    s = DiskStore(tmp_path / "k", verify=True)  # nothing written since the flush
    assert torch.equal(s.read(s.get("a")).result(), x)
    assert torch.equal(s.read(s.get("b")).result(), x * 2)
    s.close()
