"""The host optimizer's bookkeeping per parameter, and checks on the wrapped optimizer class."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from headroom.optim._plan import EntryPlan, Kind
from headroom.optim._sliced import ProbeError, probe_step
from headroom.store import Handle
from headroom.transfer import ParamBinding, sync_grad

__all__ = [
    "ALIAS", "BOUND", "FUSED_DEFAULT", "HOSTED", "LAZY", "MASTER_DTYPES", "Bucket",
    "Entry", "check_class", "probe_cpu", "same", "want_fp32_grad",
]

# NOTE: PyTorch's fused CPU kernels run at the memory-bandwidth limit (as fast as hand-written
# CPU Adam kernels), so there is no reason to write our own. ``cls(params)`` with neither
# ``fused`` nor ``foreach`` steps CPU tensors one tensor at a time (torch never picks fused by
# itself; foreach, its pick on accelerators, is bitwise the same on the CPU for these four).
# HostOptimizer takes that default unless it costs more than 5% of a training step: Adam,
# AdamW and Adagrad step several times slower that way, so they get the fused kernel (bitwise
# ``cls(..., fused=True)``); SGD's default costs about 1% of a CPU step
# (benchmarks/optimizer_impl.py).
FUSED_DEFAULT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
LAZY = (torch.optim.Adam, torch.optim.AdamW)
ALIAS, HOSTED, BOUND = Kind.ALIAS, Kind.HOSTED, Kind.BOUND
MASTER_DTYPES = (torch.float32, torch.float64)


class Bucket:
    """Parameters whose gradients complete close together; stepped together when all are in."""
    # One hand-off to the worker per bucket (not per parameter) keeps the two threads from trading
    # the GIL on every gradient, which costs more than it overlaps for small tensors.

    __slots__ = ("entries", "remaining")

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.remaining = len(entries)
        for e in entries:
            e.bucket = self


@dataclass(slots=True, eq=False, repr=False)
class Entry:
    """Book-keeping for one parameter."""

    param: torch.Tensor
    index: int
    group: int
    plan: EntryPlan  # where its tensors rest, see [Note: the entry plan]
    master: torch.Tensor | None = None  # in-memory fp32 master (None: in a store)
    own: ParamBinding | None = None  # HOSTED: our host master + gradient
    bound: ParamBinding | None = None  # BOUND: the store-resident parameter's binding
    sparse: bool = False
    state_handles: dict[str, Handle] = field(default_factory=dict)
    small: dict[str, Any] = field(default_factory=dict)
    initialized: bool = False
    count: int = 0  # gradients received since the last step
    launched: bool = False  # its step started during a final backward
    grad_scale: torch.Tensor | None = None
    bucket: Bucket | None = None
    fired: bool = False  # its gradient of the current final backward is complete
    # a store-resident bf16/fp16 parameter's fp32 master, beside its state (else None)
    master_handle: Handle | None = None
    # an event at its gradient-ready point (on the stream backward ran on), reused
    ready: object | None = None
    hooked: bool = False  # its gradient-complete hook is registered
    stepped: bool = False  # it took the step in progress (during final_backward or step())
    undo: dict[str, tuple[Any, Handle]] = field(default_factory=dict)  # see _undo.py
    spare: dict[str, Handle] = field(default_factory=dict)  # state the next step writes
    # spares of the offloaded parameter's own tensors in its store ("p", "lp"), exchanged
    # into place when a step ends
    xspare: dict[str, tuple[Any, Handle]] = field(default_factory=dict)
    # A DTensor (FSDP2 shard) bound to a store: its master is the local shard there, its
    # gradient the local tensor of the DTensor FSDP2 leaves in param.grad.
    sharded: bool = False
    # its gradient as its step started inside a final backward (`grad_mark`)
    seen: tuple | None = None
    # a store-resident bf16/fp16 parameter: whether its step compares the value with its
    # master (see _follow.py), and the store's count of writes to the value
    # (`headroom.transfer.value_edits`) at its last step / at the one starting now
    follow: bool = False
    value_seen: int | None = None
    value_mark: int | None = None
    # the parameter's (version counter, data pointer) after its last step: a write
    # PyTorch records (an in-place op on it, nn.init, load_state_dict, `.data = t`) since
    # changes it (see _follow.py); None before the first step
    written: tuple[int, int] | None = None

    @property
    def kind(self) -> Kind:
        """How the optimizer holds the parameter."""
        return self.plan.kind

    @property
    def streamed(self) -> bool:
        """Its state rests in handles (sliced step) rather than in the wrapped optimizer."""
        return self.plan.sliced

    @property
    def lowp(self) -> bool:
        """A store-resident parameter whose stored value is not its master (bf16, fp16)."""
        return self.plan.lowp

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of what is stepped (a sharded parameter's local shard)."""
        return self.bound.handle.shape if self.sharded else tuple(self.param.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def binding(self) -> ParamBinding | None:
        return self.own if self.kind == HOSTED else self.bound

    def grad_mark(self) -> tuple:
        """What tells a later change of ``param.grad``: the tensor there, its version counter
        (in-place ops on a plain tensor) and its binding's edit count (in-place ops through a
        `StoreTensor`, foreach ops included). In-place ops on a DTensor (an FSDP2 shard's
        gradient) bump neither: only its replacement shows."""
        g = self.param.grad
        b = None if self.kind == ALIAS else self.binding
        return (g, None if g is None else g._version, 0 if b is None else b.grad_edits)

    def grad_changed(self) -> bool:
        """Whether ``param.grad`` changed since `seen` was taken (assigned, set to ``None``,
        or changed in place where `grad_mark` can tell)."""
        if self.seen is None:
            return False
        now = self.grad_mark()
        return now[0] is not self.seen[0] or now[1:] != self.seen[1:]

    def has_grad(self) -> bool:
        if self.kind == ALIAS or self.sharded:
            return self.param.grad is not None
        b = self.binding
        return b is not None and b.grad_handle is not None and b.has_grad

    def grad_tensor(self) -> torch.Tensor | None:
        """The gradient as an in-memory host tensor, or ``None`` if it rests elsewhere."""
        if self.kind == ALIAS:
            return self.param.grad
        if self.sharded:
            g = self.param.grad
            return None if g is None else g.to_local()
        b = self.binding
        if b is None or not b.has_grad:
            return None
        if b.grad_sparse is not None:
            return b.grad_sparse  # a sparse gradient, in host memory
        if self.kind == HOSTED and self.param.grad is not None and self.param.grad.is_sparse:
            # left where autograd summed it (see HostOptimizer._on_grad), stepped in fp32
            return self.param.grad.to("cpu", self.master.dtype)
        if b.grad_handle is None:
            return None
        return b.store.host_tensor(b.grad_handle)


def check_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW,"
            f" got {cls!r}"
        )
    if cls is torch.optim.LBFGS:
        raise ValueError(
            "torch.optim.LBFGS cannot run as a HostOptimizer: it re-evaluates the model inside "
            "step() with a closure over all parameters at once; use it directly"
        )


def probe_cpu(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Build and step ``cls`` on a CPU tensor; returns its defaults or explains why it can't.

    The probe is a matrix (Muon steps matrices only) with a dense gradient, or a sparse one
    where the step takes sparse gradients only (SparseAdam): see `probe_step`.
    """
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    try:
        opt, _ = probe_step(cls, kwargs)
    except ProbeError as e:
        raise ValueError(
            f"{cls.__name__}({args}) cannot step on CPU tensors ({e}). HostOptimizer runs the "
            "step in host memory: pick options that run on the CPU (e.g. fused=False, "
            "capturable=False) or an optimizer with a CPU implementation"
        ) from e.dense
    except Exception as e:  # noqa: BLE001 - the constructor's own reason, passed on
        raise ValueError(
            f"{cls.__name__}({args}) refuses these options ({type(e).__name__}: {e}); "
            "HostOptimizer passes them to it unchanged"
        ) from e
    return dict(opt.defaults)


def want_fp32_grad(b: ParamBinding) -> None:
    """Ask the producer of a low-precision store-resident gradient to accumulate it in fp32."""
    b.grad_dtype = torch.float32
    gh = b.grad_handle
    if gh is None or gh.dtype == torch.float32:
        return
    sync_grad(b)
    old = b.store.read(gh).result() if b.has_grad else None
    b.store.free(gh)
    b.grad_handle = None
    if old is not None:  # a gradient already accumulated: keep it, in fp32 from now on
        b.grad_handle = b.store.alloc(gh.key, gh.shape, torch.float32, zero=False)
        b.store.write(b.grad_handle, old.float()).result()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu())))
    return a == b
