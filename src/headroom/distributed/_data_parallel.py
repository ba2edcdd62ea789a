"""`hr.data_parallel`: data-parallel training of a model that may have offloaded parts.

Device parameters go through PyTorch's ``DistributedDataParallel``; DDP ignores the offloaded
ones (autograd sees only their device copies), whose used gradients `StoreReducer` all-reduces
on a process group of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from headroom.distributed._reducer import StoreReducer
from headroom.residency import Offload, check_sharded, offload_states, tensor_outputs
from headroom.transfer import binding

__all__ = ["DataParallel", "data_parallel"]

_DEFAULT_TIMEOUT = timedelta(minutes=10)


def data_parallel(
    model: nn.Module,
    process_group: Any = None,
    *,
    bucket_bytes: int = 25 << 20,
    timeout: timedelta | float | None = None,
    **ddp_kwargs: Any,
) -> DataParallel:
    """Wrap ``model`` for data-parallel training on ``torch.distributed``.

    Like ``DistributedDataParallel(model)``, for a model whose parts may be offloaded with
    `hr.offload`. Call it on every rank after ``hr.offload`` and before building the optimizer;
    use the returned module for forward. Rank 0's parameters (and buffers) are copied to the
    others here. Of the offloaded parameters only those some rank's forward used travel; the
    others keep ``grad is None``. See docs/data_parallel.md, "What is communicated, and when".

    Args:
        model: the model (``hr.offload`` already applied to it or to its parts).
        process_group: the ranks taking part (default: the default group). The offloaded
            gradients use a group of their own with the same ranks, apart from DDP's.
        bucket_bytes: gradient bytes per all-reduce of offloaded parameters. Smaller buckets
            start earlier; each is one collective.
        timeout: seconds (or a ``timedelta``) headroom's collectives wait for the other ranks
            before raising `CollectiveError`; default: ``process_group``'s own.
        **ddp_kwargs: passed to ``DistributedDataParallel`` (``find_unused_parameters``,
            ``broadcast_buffers``, ``gradient_as_bucket_view``, ``device_ids``, ...).

    Returns:
        A `DataParallel` module: ``.module`` is ``model``, ``no_sync()`` skips the all-reduce
        for gradient accumulation, ``bytes_reduced`` counts headroom's own traffic.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized; a parameter rests in a store
            without being offloaded by ``hr.offload`` (a huge classifier head).

    Example:
        >>> dist.init_process_group("nccl")                          # doctest: +SKIP
        >>> hr.offload(model.heads, device="cuda", store="cpu", prefetch=0)
        >>> model = hr.data_parallel(model, device_ids=[rank])
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> loss_fn(model(x, task), y).backward(); opt.step(); opt.zero_grad()
    """
    return DataParallel(model, process_group, bucket_bytes=bucket_bytes, timeout=timeout,
                        **ddp_kwargs)


class DataParallel(nn.Module):
    """The module `data_parallel` returns; see there."""

    _headroom_data_parallel = True  # hr.offload refuses a model inside one (offload first)

    def __init__(self, model: nn.Module, process_group: Any = None, *, bucket_bytes: int,
                 timeout: timedelta | float | None, **ddp_kwargs: Any) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "hr.data_parallel needs torch.distributed: call"
                " torch.distributed.init_process_group(...) on every rank first"
            )
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if check_sharded(model, "hr.data_parallel"):
            raise RuntimeError(
                "hr.data_parallel cannot wrap a fully_shard'ed (FSDP2) model: its parameters are"
                " shards that FSDP2 reduce-scatters itself. Train it directly (hr.offload after"
                " fully_shard keeps each rank's shards off the device)"
            )
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            raise ValueError("the model is already wrapped for data parallel; pass the inner"
                             " model (wrapper.module)")
        pg = process_group if process_group is not None else dist.group.WORLD
        if timeout is None:
            timeout = _group_timeout(pg)
        elif not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        self.module = model
        self.timeout = timeout
        states = _offload_states(model)
        offloaded = {id(s.param) for st in states for s in st.slots}
        ignore = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if binding(p) is None:
                continue
            if id(p) not in offloaded:
                raise RuntimeError(
                    f"parameter {name!r} rests in a store but was not offloaded by hr.offload"
                    " (a HugeClassifier's weight?), so hr.data_parallel cannot all-reduce its"
                    " gradient. Keep such heads out of the data-parallel model"
                )
            ignore.append(name)
        ranks = dist.get_process_group_ranks(pg)
        # NOTE: new_group is collective (every rank, same order); gloo whatever DDP uses, as the
        # offloaded gradients rest on the host.
        self._group = dist.new_group(ranks=ranks, timeout=timeout,
                                     backend="gloo") if states else None
        for st in states:
            st.ddp_allowed = True
            st.init_pending()
        # Not a submodule: the state dict, parameters() and repr show `module` once.
        ddp = None
        if any(p.requires_grad and binding(p) is None for p in model.parameters()):
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
            ddp = DistributedDataParallel(model, process_group=process_group, **ddp_kwargs)
        else:
            for b in model.buffers():  # DDP would broadcast them: start from rank 0's
                dist.broadcast(b, src=ranks[0], group=pg)
        self.__dict__["ddp"] = ddp
        self.reducer: StoreReducer | None = None
        if states:
            self._broadcast_stored(states, ranks[0])
            self.reducer = StoreReducer(states, self._group, bucket_bytes=bucket_bytes,
                                        timeout=timeout)
        self._sync = True

    def _broadcast_stored(self, states: list[Offload], src: int) -> None:
        """Every rank starts from ``src``'s offloaded values (DDP does so for its own)."""
        for st in states:
            for s in st.slots:
                h = s.binding.handle
                host = st.store.host_tensor(h)
                value = host if host is not None else st.store.read(h).result()
                dist.broadcast(value, src=src, group=self._group)
                if host is None:
                    st.store.write(h, value).result()

    # ------------------------------------------------------------------ nn.Module
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._begin_forward()
        out = (self.ddp or self.module)(*args, **kwargs)
        self._end_forward(out)
        return out

    # NOTE: bookkeeping and collectives of the reducer: never traced by torch.compile.
    @torch.compiler.disable
    def _begin_forward(self) -> None:
        if self.reducer is not None:
            self.reducer.begin_forward(self._sync)

    @torch.compiler.disable
    def _end_forward(self, out: Any) -> None:
        if self.reducer is not None:
            self.reducer.end_forward(tensor_outputs(out) if torch.is_grad_enabled() else [])

    def train(self, mode: bool = True) -> DataParallel:
        super().train(mode)
        if self.ddp is not None:
            self.ddp.training = mode  # its module is ours, already switched
        return self

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally (as DDP's ``no_sync``); the next
        synchronized one all-reduces the sums."""
        old = self._sync
        self._sync = False
        try:
            with self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext():
                yield
        finally:
            self._sync = old

    @property
    def bytes_reduced(self) -> int:
        """Bytes headroom all-reduced for offloaded parameters so far (not DDP's)."""
        return self.reducer.bytes_reduced if self.reducer is not None else 0

    def close(self) -> None:
        """Stop reducing offloaded gradients (before `hr.unoffload` or a new wrapper)."""
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None
        for st in _offload_states(self.module):
            st.ddp_allowed = False


def _offload_states(model: nn.Module) -> list[Offload]:
    return [st for _, _, st in offload_states(model)]


def _group_timeout(pg: Any) -> timedelta:
    """The timeout ``pg`` was created with (``init_process_group(timeout=...)``)."""
    for dev in ("cpu", "cuda"):  # a private attribute: fall back if it moves
        with contextlib.suppress(Exception):
            return pg._get_backend(torch.device(dev)).options._timeout
    return _DEFAULT_TIMEOUT
