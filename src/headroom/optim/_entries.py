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

# NOTE: torch's CPU default is kept unless it costs over 5% of a training step; Adam, AdamW and
# Adagrad get the fused kernel (docs/host_optimizer.md, benchmarks/optimizer_impl.py).
FUSED_DEFAULT = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
LAZY = (torch.optim.Adam, torch.optim.AdamW)
ALIAS, HOSTED, BOUND = Kind.ALIAS, Kind.HOSTED, Kind.BOUND
MASTER_DTYPES = (torch.float32, torch.float64)


class Bucket:
    """Parameters whose gradients complete close together; stepped together when all are in
    (one hand-off to the worker each: trading the GIL per gradient costs more than it saves)."""

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
    master_handle: Handle | None = None  # a lowp parameter's fp32 master, beside its state
    ready: object | None = None  # an event at its gradient-ready point, reused
    hooked: bool = False  # its gradient-complete hook is registered
    stepped: bool = False  # it took the step in progress (during final_backward or step())
    undo: dict[str, tuple[Any, Handle]] = field(default_factory=dict)  # see _undo.py
    spare: dict[str, Handle] = field(default_factory=dict)  # state the next step writes
    # spares of the offloaded parameter's own tensors ("p", "lp"), exchanged in at the end
    xspare: dict[str, tuple[Any, Handle]] = field(default_factory=dict)
    # an FSDP2 shard bound to a store: master its local shard, gradient param.grad's local
    sharded: bool = False
    seen: tuple | None = None  # `grad_mark` as its step started inside a final backward
    # lowp (see _follow.py): whether its step compares value and master; the store's count
    # of writes to the value (`value_edits`) at its last step / at the one starting now
    follow: bool = False
    value_seen: int | None = None
    value_mark: int | None = None
    written: tuple[int, int] | None = None  # `written_mark` after its last step

    @property
    def kind(self) -> Kind:
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
        """What tells a later change of ``param.grad``: the tensor, its version counter and its
        binding's edit count (`StoreTensor` ops). A DTensor's shows only its replacement."""
        g = self.param.grad
        b = None if self.kind == ALIAS else self.binding
        return (g, None if g is None else g._version, 0 if b is None else b.grad_edits)

    def grad_changed(self) -> bool:
        """Whether ``param.grad`` changed since `seen` was taken (as `grad_mark` tells)."""
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
    """``cls``'s defaults, once `probe_step` steps it on the CPU; else why it cannot."""
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    try:
        opt, _ = probe_step(cls, kwargs)
    except ProbeError as e:
        raise ValueError(
            f"{cls.__name__}({args}) cannot step on CPU tensors ({e}), where HostOptimizer runs"
            " it: pick options that run on the CPU (e.g. fused=False, capturable=False) or an"
            " optimizer with a CPU implementation"
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
