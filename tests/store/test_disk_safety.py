"""DiskStore crash safety and integrity: real kill -9, journal replay, checksums, locking."""

from __future__ import annotations

import errno
import gc
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import headroom
from headroom.store import DiskStore, StoreCorruptError, StoreFullError
from headroom.store import _disk as disk_mod
from headroom.store import _ledger as ledger_mod
from headroom.store import _segments as seg
from tests.store._crash_child import SHAPES, stream_ops

CHILD = Path(__file__).with_name("_crash_child.py")
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- helpers
class Child:
    """A child process running `_crash_child.py`, its output lines read by a thread."""

    def __init__(self, mode: str, folder: Path) -> None:
        # NOTE: the child imports the same headroom as this process (worktree or install).
        src = str(Path(headroom.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(ROOT)]),
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, str(CHILD), mode, str(folder)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line.strip())
        self._q.put(None)

    def wait_for(self, line: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                pytest.fail(f"child did not print {line!r} within {timeout}s")
            if got is None:
                self.proc.wait(timeout=30)
                pytest.fail(f"child exited before {line!r}: {self.proc.stderr.read()[-2000:]}")
            self.lines.append(got)
            if got.startswith(line):
                return

    def kill(self) -> list[str]:
        """SIGKILL the child; returns every line it printed (all describe completed work)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        return self._drain()

    def _drain(self) -> list[str]:
        while (got := self._q.get(timeout=30)) is not None:
            self.lines.append(got)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.lines

    def died(self, timeout: float = 60) -> list[str]:
        """Wait for the child to die on its own (it kills itself)."""
        self.proc.wait(timeout=timeout)
        return self._drain()


def _open(path, **kw) -> tuple[DiskStore, list[str]]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = DiskStore(path, **kw)
    return s, [str(x.message) for x in w]


def _snapshot(store: DiskStore, dest: Path) -> Path:
    """The folder as a process killed right now would leave it (all writes done, no close)."""
    shutil.copytree(store.path, dest, ignore=shutil.ignore_patterns(ledger_mod.LOCK))
    return dest


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _read(store: DiskStore, key: str) -> torch.Tensor:
    return store.read(store.get(key)).result()


# ---------------------------------------------------------------------- real kill -9
def test_kill_after_allocs_before_any_flush_keeps_every_tensor(tmp_path):
    """Killed before any flush/close (no index in the old store): everything reopens."""
    folder = tmp_path / "s"
    child = Child("allocs", folder)
    child.wait_for("ready")
    with pytest.raises(RuntimeError, match=rf"already open in process {child.proc.pid}"):
        DiskStore(folder)  # the live child holds the folder
    child.kill()
    s, warned = _open(folder)
    assert sorted(s.keys()) == ["rows", "w", "zeros"]
    assert torch.equal(_read(s, "w"), torch.arange(12.0).reshape(3, 4))
    assert torch.equal(_read(s, "zeros"), torch.zeros(5))
    assert torch.equal(_read(s, "rows"), torch.tensor([[0, 0], [0, 0], [1, 2], [3, 4], [0, 0],
                                                       [0, 0]]))
    assert any("was not closed" in m and "partly applied" in m for m in warned)
    h = s.alloc("new", (2,), torch.float32)  # a new file does not clobber an old one
    assert torch.equal(_read(s, "w"), torch.arange(12.0).reshape(3, 4))
    assert torch.equal(s.read(h).result(), torch.zeros(2))
    s.close()


def _stream_states(last: int) -> list[dict[str, torch.Tensor]]:
    """The tensors after each op of the child's stream: states[j] = after ops 0..j-1."""
    cur = {k: torch.zeros(shape) for k, shape in SHAPES.items()}
    states = [{k: v.clone() for k, v in cur.items()}]
    for key, rows, value in stream_ops(last + 1):
        if rows is None:
            cur[key].fill_(value)
        else:
            cur[key][rows[0]:rows[1]] = value
        states.append({k: v.clone() for k, v in cur.items()})
    return states


def test_kill_in_a_stream_of_writes_keeps_last_completed_writes(tmp_path):
    folder = tmp_path / "s"
    child = Child("stream", folder)
    child.wait_for("done 300")
    lines = child.kill()
    done = max(int(x.split()[1]) for x in lines if x.startswith("done"))
    states = _stream_states(done + 1)
    in_flight_key = list(stream_ops(done + 2))[done + 1][0]
    try:
        s, _ = _open(folder)
    except StoreCorruptError as e:  # the write in flight at the kill was torn
        assert e.keys == (in_flight_key,) and f"{in_flight_key!r}" in str(e)
        s, warned = _open(folder, recover=True)
        assert any("recover=True" in m for m in warned)
        with pytest.raises(StoreCorruptError, match="marked damaged"):
            _read(s, in_flight_key)
    assert sorted(s.keys()) == ["a", "b", "c"]
    for key in SHAPES:
        if key in s.damaged():
            continue
        got = _read(s, key)
        ok = torch.equal(got, states[done + 1][key])  # after the last completed write
        if key == in_flight_key:  # or the write in flight, if it reached the file whole
            ok = ok or torch.equal(got, states[done + 2][key])
        assert ok, f"{key} holds neither its last completed write nor the one in flight"
    s.close()


def test_kill_during_large_write_is_old_new_or_named_torn(tmp_path):
    folder = tmp_path / "s"
    child = Child("large", folder)
    child.wait_for("done 1 ")
    took = float(child.lines[-1].split()[2])
    child.wait_for("start 2")
    time.sleep(took / 2)  # into the middle of the next 128 MiB write
    lines = child.kill()
    started = max(int(x.split()[1]) for x in lines if x.startswith("start"))
    done = max(int(x.split()[1]) for x in lines if x.startswith("done"))
    try:
        s, _ = _open(folder)
        got = _read(s, "big")
        assert got[0] == got[-1] and float(got[0]) in (done, started)
        assert torch.equal(got, torch.full_like(got, float(got[0])))
    except StoreCorruptError as e:
        assert e.keys == ("big",) and "'big'" in str(e) and "in flight" in str(e)
        s, _ = _open(folder, recover=True)
        with pytest.raises(StoreCorruptError, match="'big'"):
            _read(s, "big")
    assert torch.equal(_read(s, "small"), torch.ones(10))
    s.close()


def test_kill_mid_write_torn_tensor_raises_and_recovers(tmp_path):
    """The child writes half of a tensor and SIGKILLs itself: a deterministic torn write."""
    folder = tmp_path / "s"
    child = Child("tear", folder)
    child.wait_for("ready")
    child.died()
    with pytest.raises(StoreCorruptError) as info:
        DiskStore(folder)
    msg = str(info.value)
    assert info.value.keys == ("torn",)
    assert str(folder) in msg and "000002-torn.bin" in msg and "bytes 0-4194304" in msg
    assert "recover=True" in msg and "hr.load" in msg
    s, warned = _open(folder, recover=True)
    assert any("'torn'" in m for m in warned)
    assert sorted(s.keys()) == ["keep", "torn"]
    assert torch.equal(_read(s, "keep"), torch.arange(10.0))
    assert s.damaged() == {"torn": [(0, 4 << 20)]}
    with pytest.raises(StoreCorruptError, match="'torn'.*marked damaged"):
        _read(s, "torn")
    s.close()
    s, _ = _open(folder, recover=True)  # still damaged: nothing rewrote it
    assert "torn" in s.damaged()
    h = s.get("torn")
    half = 1 << 19
    s.write_rows(h, slice(0, half), torch.full((half,), 3.0)).result()
    with pytest.raises(StoreCorruptError):  # half of it is still damaged
        _read(s, "torn")
    s.write_rows(h, slice(half, 2 * half), torch.full((half,), 4.0)).result()  # like hr.load
    assert torch.equal(_read(s, "torn"), torch.cat([torch.full((half,), 3.0),
                                                    torch.full((half,), 4.0)]))
    s.close()
    s, warned = _open(folder)
    assert s.damaged() == {} and not warned
    s.close()


def test_kill_during_offloaded_training_resumes_stored_values(tmp_path):
    import headroom as hr
    from tests.optim._models import Net, loss_fn, make_model

    folder = tmp_path / "params"
    child = Child("train", folder)
    child.wait_for("step 3")
    time.sleep(0.02)
    lines = child.kill()
    k = max(int(x.split()[1]) for x in lines if x.startswith("step"))
    ref_model = make_model(0)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    refs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child: the same reductions, bitwise the same values
    try:
        for i in range(k + 1):
            refs.append({n: p.detach().clone() for n, p in ref_model.named_parameters()})
            loss_fn(ref_model, i).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    refs.append({n: p.detach().clone() for n, p in ref_model.named_parameters()})
    with torch.device("meta"):
        model = Net()
    damaged: tuple[str, ...] = ()
    try:
        store, warned = _open(folder)
    except StoreCorruptError as e:  # a parameter or gradient write was torn by the kill
        assert e.keys and all(f"{key!r}" in str(e) for key in e.keys)
        damaged = e.keys
        store, warned = _open(folder, recover=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hr.offload(model, device="cpu", store=store)
    sd = {n: store.read(store.get(n)).result() for n in refs[0] if n not in damaged}
    assert sd, "every parameter damaged"
    for name, value in sd.items():
        assert torch.equal(value, refs[k][name]) or torch.equal(value, refs[k + 1][name]), \
            f"{name} is neither its value after step {k} nor after step {k + 1}"
    assert any(not torch.equal(v, refs[0][n]) for n, v in sd.items())  # not a fresh init
    assert any("was not closed" in m or "recover=True" in m for m in warned)
    store.close()


# ---------------------------------------------------------------------- checksums
def test_flipped_byte_is_caught_on_reopen_and_on_read(tmp_path):
    s = DiskStore(tmp_path / "s")
    x = torch.randn(64, 32)
    s.put("x", x)
    s.put("other", torch.ones(3))
    f = s.file_of(s.get("x"))
    s.close()
    _flip(f, 1000)
    with pytest.raises(StoreCorruptError) as info:
        DiskStore(tmp_path / "s")
    msg = str(info.value)
    assert info.value.keys == ("x",) and f.name in msg and "bytes 0-8192" in msg
    assert str(tmp_path / "s") in msg and "recover=True" in msg
    # opens; reads check by default when every read comes from the disk (page_cache=False)
    for kw in ({"page_cache": False}, {"verify_reads": True}):
        s = DiskStore(tmp_path / "s", verify=False, **kw)
        with pytest.raises(StoreCorruptError, match=r"'x'.*bytes 0-8192.*read CRC32C"):
            _read(s, "x")
        assert torch.equal(s.read_rows(s.get("x"), slice(40, 50)).result(), x[40:50])  # part
        assert torch.equal(_read(s, "other"), torch.ones(3))
        s.close()
    s = DiskStore(tmp_path / "s", verify=False)  # page cache: reads unchecked by default
    assert not s.verify_reads
    got = _read(s, "x")  # the flipped bit comes through
    assert not torch.equal(got, x) and torch.equal(got.view(-1)[251:], x.view(-1)[251:])
    s.close()


def test_split_and_row_reads_verify_their_segments(tmp_path):
    s = DiskStore(tmp_path / "s", threads=4, verify_reads=True)
    x = torch.randn(2100, 1024)  # 8.2 MiB: read as several pieces at once
    h = s.put("x", x)
    rows = torch.randn(100, 1024)
    s.write_rows(h, slice(1000, 1100), rows).result()
    x[1000:1100] = rows
    assert torch.equal(_read(s, "x"), x)
    assert torch.equal(s.read_rows(h, slice(900, 1200)).result(), x[900:1200])
    s.close()
    s = DiskStore(tmp_path / "s", threads=4)  # the flush filled in the cut-out checksums
    assert all(isinstance(c, int) for *_, c in s._ledger.segments("x"))
    f = s.file_of(h)
    s.close()
    _flip(f, 1050 * 4096 + 7)  # inside the rows written as a slice
    s = DiskStore(tmp_path / "s", threads=4, verify=False, verify_reads=True)
    h = s.get("x")
    with pytest.raises(StoreCorruptError, match=r"bytes 4096000-4505600"):
        s.read_rows(h, slice(990, 1110)).result()
    with pytest.raises(StoreCorruptError, match=r"bytes 4096000-4505600"):
        s.read(h).result()  # split across threads: the pieces' CRCs are combined
    assert torch.equal(s.read_rows(h, slice(0, 999)).result(), x[:999])
    s.close()


def test_sparse_row_writes_keep_segments_bounded_and_flush_fills_them(tmp_path):
    s = DiskStore(tmp_path / "s")
    x = torch.randn(4000, 8)
    h = s.put("x", x)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):  # lazy-Adam-like: scattered rows each step
        rows = torch.randperm(4000, generator=g)[:20].sort().values
        src = torch.randn(20, 8, generator=g)
        s.write_rows(h, rows, src).result()
        x[rows] = src
    segs = s._ledger.segments("x")
    assert len(segs) <= ledger_mod.seg_cap(h.nbytes) == 64
    assert any(c is None for *_, c in segs)
    many = torch.arange(0, 4000, 2)  # 2000 runs: more than a record lists, one unknown span
    s.write_rows(h, many, torch.zeros(2000, 8)).result()
    x[many] = 0
    assert s._ledger.segments("x")[0][2] is None
    s.flush()
    segs = s._ledger.segments("x")
    assert all(isinstance(c, int) for *_, c in segs) and segs[-1][1] == h.nbytes
    assert torch.equal(_read(s, "x"), x)
    f = s.file_of(h)
    s.close()
    _flip(f, 4 * 8 * 1001 + 3)  # a byte whose checksum only the flush computed
    with pytest.raises(StoreCorruptError, match="'x'"):
        DiskStore(tmp_path / "s")


def test_crc_combine_and_segments():
    a, b = os.urandom(1000), os.urandom(77777)
    assert seg.combine(seg.crc(a), seg.crc(b), len(b)) == seg.crc(a + b)
    assert seg.zeros_crc(12345) == seg.crc(bytes(12345)) and seg.zeros_crc(0) == 0
    data = os.urandom(1000)
    segs = [[0, 1000, seg.crc(data)]]
    seg.put(segs, 100, 300, seg.crc(data[100:300]), cap=64)
    assert segs == [[0, 100, None], [100, 300, seg.crc(data[100:300])], [300, 1000, None]]
    for lo in range(0, 1000, 100):  # sliced writes in order: all known again
        seg.put(segs, lo, lo + 100, seg.crc(data[lo:lo + 100]), cap=4)
    assert len(segs) <= 4 and seg.crc_of_range(segs, 0, 1000) == seg.crc(data)
    seg.put(segs, 0, 1000, seg.BAD, cap=4)
    seg.put(segs, 200, 300, 5, cap=4)
    assert segs == [[0, 200, seg.BAD], [200, 300, 5], [300, 1000, seg.BAD]]


# ---------------------------------------------------------------------- journal
def test_journal_replays_allocs_writes_and_frees_of_an_unclosed_store(tmp_path):
    s = DiskStore(tmp_path / "s", threads=2)
    x = torch.randn(10, 3)
    h = s.put("x", x)
    s.write_rows(h, torch.tensor([1, 2, 7]), torch.ones(3, 3)).result()
    x[[1, 2, 7]] = 1
    s.flush()
    gone = s.put("gone", torch.zeros(4))
    gone_file = s.file_of(gone)
    y = s.put("y", torch.arange(6).reshape(2, 3))
    s.write(h, x * 2).result()
    s.free(gone)
    snap = _snapshot(s, tmp_path / "snap")
    (snap / gone_file.name).write_bytes(bytes(16))  # as if killed between journal and unlink
    s.close()
    t, warned = _open(snap)
    assert sorted(t.keys()) == ["x", "y"] and not (snap / gone_file.name).exists()
    assert torch.equal(_read(t, "x"), x * 2)
    assert torch.equal(t.read(t.get("y")).result(), torch.arange(6).reshape(2, 3))
    assert any("was not closed" in m for m in warned)
    t.close()
    t, warned = _open(snap)  # closed cleanly this time
    assert not warned and torch.equal(t.read(t.get("y")).result(), torch.arange(6).reshape(2, 3))
    t.close()
    del y


def test_records_already_in_the_index_are_not_replayed_twice(tmp_path):
    """Stopped between the index's rename and the journal's truncation: records repeat."""
    s = DiskStore(tmp_path / "s")
    h = s.put("x", torch.zeros(4))
    s.free(s.put("tmp", torch.ones(2)))
    s.write_rows(h, slice(1, 2), torch.ones(1)).result()
    journal = (tmp_path / "s" / "journal.jsonl").read_bytes()
    s.flush()
    s.write_rows(h, slice(2, 3), torch.full((1,), 2.0)).result()
    snap = _snapshot(s, tmp_path / "snap")
    s.close()
    (snap / "journal.jsonl").write_bytes(journal + (snap / "journal.jsonl").read_bytes())
    t, _ = _open(snap)
    assert t.keys() == ["x"] and torch.equal(_read(t, "x"), torch.tensor([0.0, 1.0, 2.0, 0.0]))
    t.close()


@pytest.mark.parametrize("reached", ["all", "none", "half"])
def test_write_in_flight_at_a_kill_is_new_old_or_torn(tmp_path, monkeypatch, reached):
    s = DiskStore(tmp_path / "s", threads=2)
    old = torch.randn(1000)
    h = s.put("x", old)
    s.put("y", torch.ones(2))
    real = disk_mod._pwrite_from

    def partial(fd, buf, offset, written):
        if reached == "all":
            real(fd, buf, offset, written)
        elif reached == "half":
            real(fd, buf[:len(buf) // 2], offset, written)

    monkeypatch.setattr(disk_mod, "_pwrite_from", partial)
    monkeypatch.setattr(s._ledger, "end_write", lambda rid, result: None)  # "killed" before
    new = torch.randn(1000)
    s.write(h, new).result()
    snap = _snapshot(s, tmp_path / "snap")
    monkeypatch.undo()
    if reached == "half":
        with pytest.raises(StoreCorruptError, match=r"'x'.*bytes 0-4000.*in flight"):
            DiskStore(snap)
        return
    t, _ = _open(snap)
    assert torch.equal(_read(t, "x"), new if reached == "all" else old)
    t.close()


def test_compaction_threshold_bounds_the_journal(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_mod, "COMPACT_BYTES", 4096)
    s = DiskStore(tmp_path / "s")
    h = s.alloc("x", (8, 4), torch.float32)
    seq0 = json.loads((tmp_path / "s" / "index.json").read_text())["seq"]
    for i in range(200):
        s.write_rows(h, slice(i % 8, i % 8 + 1), torch.full((1, 4), float(i))).result()
        assert (tmp_path / "s" / "journal.jsonl").stat().st_size <= 4096 + 512
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    assert index["seq"] > seq0 + 300 and not index["clean"]  # compacted while open
    snap = _snapshot(s, tmp_path / "snap")
    expect = _read(s, "x")
    s.close()
    t, _ = _open(snap)
    assert torch.equal(_read(t, "x"), expect)
    assert torch.equal(expect[:, 0], torch.arange(192.0, 200.0))
    t.close()


# ---------------------------------------------------------------------- broken metadata
def test_truncated_or_garbled_index_is_a_clear_error(tmp_path):
    s = DiskStore(tmp_path / "s")
    s.put("x", torch.ones(3))
    s.close()
    index = tmp_path / "s" / "index.json"
    good = index.read_bytes()
    for bad in (good[: len(good) // 2], b"\x00" * 40, b"[1, 2]"):
        index.write_bytes(bad)
        with pytest.raises(StoreCorruptError, match=r"index\.json is unreadable.*overwrite=True"):
            DiskStore(tmp_path / "s")
    index.write_bytes(good)
    s = DiskStore(tmp_path / "s")
    assert torch.equal(_read(s, "x"), torch.ones(3))
    s.close()


def test_damaged_journal_record_is_a_clear_error_but_a_torn_tail_is_ignored(tmp_path):
    s = DiskStore(tmp_path / "s")
    s.put("x", torch.ones(3))
    s.put("y", torch.zeros(2))
    snap = _snapshot(s, tmp_path / "snap")
    s.close()
    journal = snap / "journal.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    torn = _snapshot_dir(snap, tmp_path / "torn")
    (torn / "journal.jsonl").write_bytes(b"".join(lines) + lines[0][:20])  # killed mid-append
    t, _ = _open(torn)
    assert sorted(t.keys()) == ["x", "y"]
    t.close()
    garbled = _snapshot_dir(snap, tmp_path / "garbled")
    mid = bytearray(lines[1])
    mid[15] ^= 1
    (garbled / "journal.jsonl").write_bytes(b"".join([lines[0], bytes(mid), *lines[2:]]))
    with pytest.raises(StoreCorruptError, match=r"journal\.jsonl record 2 is damaged"):
        DiskStore(garbled)
    gap = _snapshot_dir(snap, tmp_path / "gap")
    (gap / "journal.jsonl").write_bytes(b"".join([lines[0], *lines[2:]]))
    with pytest.raises(StoreCorruptError, match=r"journal\.jsonl record 2 has sequence"):
        DiskStore(gap)


def _snapshot_dir(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_missing_tensor_file(tmp_path):
    s = DiskStore(tmp_path / "s")
    s.put("x", torch.ones(3))
    h = s.alloc("z", (4,), torch.float32)  # never written: zeros
    fx, fz = s.file_of(s.get("x")), s.file_of(h)
    s.close()
    fz.unlink()
    s, _ = _open(tmp_path / "s")  # recreated: it only ever held zeros
    assert torch.equal(_read(s, "z"), torch.zeros(4))
    s.close()
    fx.unlink()
    with pytest.raises(StoreCorruptError, match=r"'x'.*file missing"):
        DiskStore(tmp_path / "s")
    s, _ = _open(tmp_path / "s", recover=True)
    with pytest.raises(StoreCorruptError, match="marked damaged"):
        _read(s, "x")
    s.write(s.get("x"), torch.full((3,), 2.0)).result()
    assert torch.equal(_read(s, "x"), torch.full((3,), 2.0))
    s.close()


def test_failed_write_marks_its_range_damaged(tmp_path, monkeypatch):
    s = DiskStore(tmp_path / "s")
    h = s.put("x", torch.zeros(1000))
    real = os.pwritev
    calls = []

    def part_then_full(fd, bufs, offset):
        if calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        calls.append(1)
        return real(fd, [bufs[0][:400]], offset)

    monkeypatch.setattr(disk_mod.os, "pwritev", part_then_full)
    with pytest.raises(StoreFullError, match="disk full while writing"):
        s.write(h, torch.ones(1000)).result()
    monkeypatch.undo()
    assert s.damaged() == {"x": [(0, 4000)]}
    with pytest.raises(StoreCorruptError, match="marked damaged"):
        _read(s, "x")
    s.write(h, torch.ones(1000)).result()
    assert torch.equal(_read(s, "x"), torch.ones(1000)) and s.damaged() == {}
    s.close()


# ---------------------------------------------------------------------- the folder
def test_foreign_folder_is_refused_and_overwrite_keeps_other_files(tmp_path):
    old = tmp_path / "old"  # a store killed before it wrote any index (the old format)
    old.mkdir()
    (old / "000001-w.bin").write_bytes(b"\1" * 16)
    (old / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"old'.*not empty.*overwrite=True"):
        DiskStore(old)
    assert (old / "000001-w.bin").read_bytes() == b"\1" * 16  # untouched
    assert sorted(os.listdir(old)) == ["000001-w.bin", "notes.txt"]
    s = DiskStore(old, overwrite=True)
    assert s.keys() == [] and (old / "notes.txt").read_text() == "mine"
    assert not (old / "000001-w.bin").exists()
    s.put("w", torch.ones(2))
    s.close()
    s = DiskStore(old, overwrite=True)
    assert s.keys() == [] and (old / "notes.txt").read_text() == "mine"
    s.close()
    other = tmp_path / "other"
    other.mkdir()
    (other / "index.json").write_text('{"some": "thing"}')
    with pytest.raises(FileExistsError, match="not a DiskStore's"):
        DiskStore(other)


def test_unaccounted_files_are_refused_and_existing_files_never_overwritten(tmp_path):
    s = DiskStore(tmp_path / "s")
    s.put("x", torch.ones(2))
    s.close()
    (tmp_path / "s" / "000007-stray.bin").write_bytes(b"x")
    (tmp_path / "s" / "keep.txt").write_text("keep")
    with pytest.raises(StoreCorruptError, match=r"000007-stray\.bin\..*recover=True"):
        DiskStore(tmp_path / "s")
    with pytest.warns(UserWarning, match=r"moved aside \(not deleted\): 000007-stray\.bin"
                      r"\.unaccounted"):
        s = DiskStore(tmp_path / "s", recover=True)
    assert (tmp_path / "s" / "000007-stray.bin.unaccounted").read_bytes() == b"x"
    assert not (tmp_path / "s" / "000007-stray.bin").exists()
    assert (tmp_path / "s" / "keep.txt").exists()
    nxt = tmp_path / "s" / "000002-y.bin"  # the name the next alloc will take
    nxt.write_bytes(b"not yours")
    with pytest.raises(FileExistsError, match="000002-y.bin appeared"):
        s.alloc("y", (4,), torch.float32)
    assert nxt.read_bytes() == b"not yours" and "y" not in s
    nxt.unlink()
    s.put("y2", torch.zeros(1))
    s.close()
    s = DiskStore(tmp_path / "s")
    assert sorted(s.keys()) == ["x", "y2"]
    s.close()


def test_one_store_per_folder(tmp_path):
    a = DiskStore(tmp_path / "s")
    with pytest.raises(RuntimeError, match=r"already open in this process.*close\(\) it first"):
        DiskStore(tmp_path / "s")
    a.put("x", torch.ones(2))
    a.close()
    b = DiskStore(tmp_path / "s")
    assert torch.equal(_read(b, "x"), torch.ones(2))
    del b  # dropped without close: the garbage collector's finalizer unlocks and snapshots
    gc.collect()
    c, warned = _open(tmp_path / "s")
    assert not warned and torch.equal(_read(c, "x"), torch.ones(2))
    c.close()


def test_reads_a_version_1_index(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    x = torch.randn(4, 2)
    (folder / "000001-x.bin").write_bytes(x.numpy().tobytes())
    (folder / "index.json").write_text(json.dumps({"version": 1, "counter": 1, "tensors": {
        "x": {"file": "000001-x.bin", "shape": [4, 2], "dtype": "float32"}}}))
    s = DiskStore(folder)
    assert torch.equal(_read(s, "x"), x)
    s.close()
    index = json.loads((folder / "index.json").read_text())
    assert index["version"] == 3 and isinstance(index["tensors"]["x"]["segments"][0][2], int)
