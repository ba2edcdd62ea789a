"""How long a step takes under a plan: the dry run's ops priced at measured speeds, plus transfers.

Each op costs ``max(FLOPs / rate, bytes / memory) + op``; bytes moved to and from stores are
added at their bandwidths with no overlap credited (headroom overlaps them, so real steps are
at most this long). ``cpu`` speeds are measured once per machine (`measure_speeds`);
accelerators get declared figures (``speeds=`` of `hr.plan` overrides them).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

_CACHE: dict[str, Speeds] = {}


@dataclass(frozen=True)
class Speeds:
    """Speeds the time model uses (per second, or seconds per op).

    Attributes:
        matmul: FLOP/s of matmuls and attention on the device.
        conv: FLOP/s of convolutions on the device.
        memory: bytes/s element-wise ops read and write on the device.
        op: seconds one op costs beyond its work (dispatch, autograd, Python).
        disk_read: bytes/s a `DiskStore` reads.
        disk_write: bytes/s a `DiskStore` writes.
        link: host <-> device bytes/s (``inf`` on ``cpu``: host memory is the device's).
        host_memory: bytes/s of element-wise ops on the host (an optimizer step there).
        host_op: seconds per op on the host.
    """

    matmul: float
    conv: float
    memory: float
    op: float
    disk_read: float
    disk_write: float
    link: float = float("inf")
    host_memory: float = 10e9
    host_op: float = 5e-6

    def describe(self) -> str:
        def g(x: float) -> str:
            return f"{x / 1e9:.1f}"

        return (f"matmul {g(self.matmul)} GFLOP/s, conv {g(self.conv)} GFLOP/s, memory"
                f" {g(self.memory)} GB/s, {self.op * 1e6:.1f} us per op, disk read"
                f" {g(self.disk_read)} GB/s, write {g(self.disk_write)} GB/s")


def default_speeds(device: str, disk: str | os.PathLike | None = None) -> Speeds:
    """``cpu``: `measure_speeds`; accelerators: a data-center GPU over PCIe, declared."""
    if device.split(":")[0] == "cpu":
        return measure_speeds(disk)
    return Speeds(matmul=50e12, conv=30e12, memory=1.5e12, op=10e-6, disk_read=2e9,
                  disk_write=1e9, link=12e9, host_memory=10e9, host_op=5e-6)


def measure_speeds(disk: str | os.PathLike | None = None, *, refresh: bool = False) -> Speeds:
    """This CPU's speeds, measured once and kept in this process and in
    ``$XDG_CACHE_HOME/headroom/speeds.json`` (``~/.cache`` without it).

    ``matmul``: a 512 x 512 fp32 matmul; ``conv``: a 3 x 3 convolution, 64 channels, 56 x 56;
    ``memory``: an in-place add of two 64 MiB tensors; ``op``: a tiny MLP's training step per
    op; ``disk_*``: a 64 MiB tensor written to and read back from a `DiskStore` in ``disk`` (a
    temporary folder when ``None``; reads may come from the page cache, as in training). Each
    the fastest of several runs at the current thread count.
    """
    key = _key(disk)
    if not refresh and key in _CACHE:
        return _CACHE[key]
    path = _cache_file()
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if not refresh and isinstance(stored.get(key), dict):
        try:
            _CACHE[key] = Speeds(**{f.name: float(stored[key][f.name]) for f in fields(Speeds)})
            return _CACHE[key]
        except (KeyError, TypeError, ValueError):
            pass
    n, m = 512, 16 << 20
    memory = 3 * 4 * m / _best("a.add_(b)", {"a": torch.zeros(m), "b": torch.ones(m)})
    op = _op()
    read, write = _disk(disk)
    matmul = 2 * n**3 / _best("a @ b", {"a": torch.randn(n, n), "b": torch.randn(n, n)})
    conv = 2 * 64 * 64 * 9 * 56 * 56 / _best("f(x, w, padding=1)", {
        "f": torch.nn.functional.conv2d, "x": torch.randn(1, 64, 56, 56),
        "w": torch.randn(64, 64, 3, 3)})
    sp = Speeds(matmul=matmul, conv=conv, memory=memory, op=op, disk_read=read,
                disk_write=write, host_memory=memory, host_op=op)
    _CACHE[key] = sp
    stored[key] = {k: (v if v != float("inf") else 1e30) for k, v in asdict(sp).items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only home: measured again in the next process
        pass
    return sp


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "headroom" / "speeds.json"


def _key(disk) -> str:
    where = "tmp"
    if disk is not None:
        p = Path(disk)
        while not p.exists() and p != p.parent:
            p = p.parent
        try:
            where = f"dev{os.stat(p).st_dev}"
        except OSError:
            where = str(disk)
    return (f"{platform.node()}|{platform.machine()}|torch {torch.__version__}|"
            f"threads {torch.get_num_threads()}|{where}")


def _best(stmt: str, globals_: dict) -> float:
    """Seconds per run of ``stmt``: the fastest block (other load only slows one down)."""
    from torch.utils.benchmark import Timer

    m = Timer(stmt, globals=globals_, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=0.2)
    return min(m.times)


def _op() -> float:
    from headroom.fit._dryrun import OpCounter

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1, 8)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    counter = OpCounter(lambda: False)
    with counter:
        step()
    return _best("step()", {"step": step}) / max(len(counter.ops), 1)


def _disk(folder) -> tuple[float, float]:
    from headroom.store import DiskStore

    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=None if folder is None else str(folder)) as tmp:
        store = DiskStore(Path(tmp) / "speeds")
        try:
            t = torch.ones(16 << 20)
            h = store.put("probe", t)
            writes, reads = [], []
            for _ in range(3):
                start = time.perf_counter()
                store.write(h, t).result()
                store.flush()
                writes.append(time.perf_counter() - start)
                start = time.perf_counter()
                store.read(h, out=t).result()
                reads.append(time.perf_counter() - start)
        finally:
            store.close()
    return t.numel() * 4 / min(reads), t.numel() * 4 / min(writes)


def step_time(ops: list[tuple[int, int, str, bool]], sp: Speeds, *, host_step: bool,
              moved: dict[str, int]) -> float:
    """Seconds of one step: its ops (the optimizer step's on the host when ``host_step``) and
    ``moved`` bytes by way (``"disk_read"``, ``"disk_write"``, ``"link"``)."""
    t = 0.0
    for flops, nbytes, kind, in_step in ops:
        if host_step and in_step:
            t += nbytes / sp.host_memory + sp.host_op
            continue
        rate = sp.conv if kind == "conv" else sp.matmul
        t += max(flops / rate, nbytes / sp.memory) + sp.op
    for way, nbytes in moved.items():
        t += nbytes / getattr(sp, way)
    return t


def activation_ways(where: str, on_cpu: bool) -> tuple[str, ...]:
    """The ways saved activations sent to ``where`` (``"host"``, ``"disk"``) move, once each."""
    if where == "disk":
        return "disk_read", "disk_write"
    return ("link", "link") if where == "host" and not on_cpu else ()


def dry_run_time(est: Any, sp: Speeds, *, activations: str, on_cpu: bool,
                 host_step: bool) -> float:
    """Seconds per step of an `Estimate`, its activations offloaded to ``activations``."""
    moved = {k: v for k, v in est.transfers.items() if not (on_cpu and k == "link")}
    a = est.activation_bytes_moved
    for way in activation_ways(activations, on_cpu) if a else ():
        moved[way] = moved.get(way, 0) + a
    return step_time(est.ops, sp, host_step=host_step, moved=moved)
