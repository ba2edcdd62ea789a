"""`HugeClassifier`: a linear head with an exact loss whose weight rests in a store, read (and
its gradient written) slice by slice."""

from __future__ import annotations

import gc
import itertools
import math
import numbers
import warnings
import weakref
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from headroom.heads._entry import linear_cross_entropy
from headroom.heads._linear_ce import (
    CrossEntropyOptions,
    LinearCrossEntropyOutput,
    _LinearCrossEntropy,
    check_labels,
    compute_dtype,
    pick_slice_size,
    plan,
)
from headroom.heads._linear_loss import SliceLoss, multilabel_loss
from headroom.heads._slices import GradSink, TensorParams, slice_bounds
from headroom.heads._store_io import StoreSlices, store_grad_sink
from headroom.heads._targets import Positives
from headroom.store import Handle, Store, claimed_keys, is_accelerator, resolve_store
from headroom.transfer import (
    GradSource,
    HandleSource,
    ParamBinding,
    StoreTensor,
    bind,
    binding,
    check_device,
    stream_module,
)

__all__ = ["HugeClassifier"]

_ids = itertools.count()
_DENSE = ("HugeClassifier's loss",
          "F.cross_entropy(features @ head.read_weight().T, labels) on dense logits")


class _StoreParams:
    """A head's store-resident weight for the sliced passes (see ``ParamSlices``)."""

    one_pass = False
    versioned = ()

    def __init__(self, head: HugeClassifier, dtype: torch.dtype) -> None:
        self.head = head
        self.dtype = dtype

    def source(self, slice_size: int) -> StoreSlices:
        h = self.head
        return StoreSlices(h.store, h._wh, h._bh, device=h.device, dtype=self.dtype,
                           max_rows=min(slice_size, h.num_classes), prefetch=h.prefetch)

    def sink(self, slice_size: int, *, weight: bool, bias: bool) -> GradSink:
        h = self.head
        acc = h._accumulating()  # before _grad_handle, which may reset has_grad
        wb, bb = binding(h.weight), None if h.bias is None else binding(h.bias)
        return store_grad_sink(
            h.store, h._grad_handle(wb) if (weight and wb is not None) else None,
            h._grad_handle(bb) if (bias and bb is not None) else None,
            accumulate=acc, device=h.device, dtype=self.dtype,
            max_rows=min(slice_size, h.num_classes), prefetch=h.prefetch)

    def landed(self, sink, *, weight: bool, bias: bool) -> tuple[None, None]:
        self.head._grads_landed(weight=weight, bias=bias, rows=None)
        return None, None


def _refuse_other(p: torch.Tensor, value: Any, what: str) -> None:
    """Refuse a value whose shape or dtype the store cannot take for ``p``'s values."""
    if not isinstance(value, torch.Tensor) or value.shape != p.shape or value.dtype != p.dtype:
        got = (f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise RuntimeError(
            f"cannot {what} a HugeClassifier parameter ({p.dtype} {tuple(p.shape)}) to {got}: "
            "its store keeps shape and dtype. Pass a tensor of that shape and dtype "
            "(head.load_weight(weight, bias) converts the dtype), or build the head with "
            "another dtype=")


class _HostParameter(nn.Parameter):
    """A parameter whose data is a host store's tensor, and stays it: ``.data = t`` copies
    ``t`` into the store's tensor (swapping the memory would train values the loss never
    reads)."""

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        b = binding(self)
        host = None if b is None else b.store.host_tensor(b.handle)
        if host is None:  # not (or no longer) a store's: an ordinary parameter
            torch._C.TensorBase.data.__set__(self, value)
            return
        _refuse_other(self, value, "rebind .data of")
        if isinstance(value, torch.Tensor) and value.data_ptr() == host.data_ptr() \
                and value.stride() == host.stride():
            return  # the store's own tensor (or its .data) given back
        with torch.no_grad():
            host.copy_(value.detach().clone() if _overlaps(value, host) else value)


def _union(rows: torch.Tensor | None, more: torch.Tensor | None) -> torch.Tensor | None:
    """Row ids in either (``None``: all rows)."""
    return None if rows is None or more is None else torch.unique(torch.cat([rows, more]))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class HugeClassifier(nn.Module):
    """Linear classifier + exact loss over a huge number of classes.

    Softmax cross-entropy with one class id per row, or multi-label targets (the positives of
    each row) with any loss of `headroom.linear_loss`. The weight rests in ``store`` and is read
    one slice of classes at a time in forward and again in backward; device memory is one
    ``batch x slice_size`` logits buffer plus ``prefetch + 1`` weight slices (and as many
    gradient slices), whatever ``num_classes``. Gradients accumulate in the store until
    ``zero_grad``; ``module.to(...)`` / ``.half()`` leave ``weight`` and ``bias`` where and as they
    rest. What the parameters are, how writes to them land and how to checkpoint: see
    docs/huge_classifier.md, "Writing the weight", "How it works" and "Limits".

    Args:
        num_classes: number of classes ``C``.
        in_features: feature size ``D``.
        bias: whether to learn a per-class bias (rests in the store too).
        device: the compute device, kept with an index (``"cuda"`` becomes the current
            ``cuda:N``).
        store: ``"cpu"`` (host memory, pinned when ``device`` is an accelerator) or a store such
            as ``headroom.DiskStore(path)`` (for weights bigger than RAM: reads the whole weight
            twice per training step and writes its gradient once).
        slice_size: classes per slice; ``None`` picks one per batch from a logits budget. Bigger
            slices cost device memory and do not speed up the products.
        sample_rate: ``1.0`` (default) is the exact loss; ``< 1`` an opt-in *approximation* over
            ``ceil(sample_rate * C)`` classes per forward (docs/huge_classifier.md, "How it works").
        dtype: dtype of the weight in the store. Logits and gradients accumulate in the widest of
            fp32, ``dtype`` and the features' dtype.
        key: name prefix of the tensors in the store (default: a fresh unique name); a reopened
            `DiskStore`'s values under ``key`` are kept. One live head per key and store.
        prefetch: with ``store="cpu"`` on an accelerator, slices copied ahead of the one
            computing, as in `headroom.linear_cross_entropy` (a `DiskStore` reads one ahead).
        generator: a CPU ``torch.Generator`` for the sampled mode's negatives (``None``: the
            global generator).

    Raises:
        ValueError: bad sizes, ``sample_rate`` or ``prefetch``; a generator not on the CPU; a
            store that cannot hold the weight, or holds ``key``'s tensors with another shape or
            dtype; a ``device`` that is not a torch device, or ``"meta"``.
        TypeError: ``num_classes`` or ``in_features`` is not an int.
        RuntimeError: ``device`` is not available here; ``key`` is in use by another live head
            (or offloaded model) in ``store``. From backward: a double backward
            (``create_graph=True``).

    Example:
        >>> head = HugeClassifier(100_000, 64, device="cpu")
        >>> feats = torch.randn(32, 64, requires_grad=True)
        >>> loss = head(feats, torch.randint(0, 100_000, (32,)))
        >>> loss.backward()
        >>> offsets = torch.arange(0, 97, 3)               # three positives per row
        >>> head(feats, (offsets, torch.arange(96) * 1000), loss="bce").backward()
        >>> values, classes = head.topk(feats.detach(), 5)
    """

    def __init__(
        self,
        num_classes: int,
        in_features: int,
        *,
        bias: bool = False,
        device: str | torch.device,
        store: str | Store = "cpu",
        slice_size: int | None = None,
        sample_rate: float = 1.0,
        dtype: torch.dtype = torch.float32,
        key: str | None = None,
        prefetch: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("num_classes", num_classes), ("in_features", in_features)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {v!r}; pass e.g. {name}=1000")
        if num_classes < 1 or in_features < 1:
            raise ValueError(
                f"num_classes and in_features must be >= 1, got {num_classes}, {in_features}"
            )
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if slice_size is not None and slice_size < 1:
            raise ValueError(f"slice_size must be a positive int or None, got {slice_size}")
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
        ):
            raise ValueError(
                "generator must be a CPU torch.Generator (negatives are drawn on the host), "
                f"got {generator!r}; use torch.Generator().manual_seed(seed)"
            )
        self.num_classes = int(num_classes)
        self.in_features = int(in_features)
        self.device = check_device(device)
        if is_accelerator(self.device):
            stream_module(self.device)  # an accelerator without streams is refused now
        self.slice_size = slice_size
        self.sample_rate = float(sample_rate)
        self.dtype = dtype
        self.accum_dtype = compute_dtype(dtype)
        self.prefetch = prefetch
        self.generator = generator
        self.store = resolve_store(store, self.device)
        if self.device.type == "cpu" and isinstance(store, str):
            warnings.warn(
                "HugeClassifier(device='cpu', store='cpu') keeps the weight in ordinary memory: "
                "this exercises the streaming mechanics but saves no memory; use "
                "store=headroom.DiskStore(path) for weights bigger than RAM",
                stacklevel=2,
            )
        prefix = key if key is not None else f"huge_classifier.{next(_ids)}"
        reopened = f"{prefix}.weight" in self.store
        shape = (self.num_classes, self.in_features)
        shapes = {f"{prefix}.weight": shape}
        if bias:
            shapes[f"{prefix}.bias"] = (self.num_classes,)
        for k, sh in shapes.items():
            self._check_stored(k, sh)
        keys = [k for n in shapes for k in (n, f"{n}.grad")]
        before = {k for k in keys if k in self.store}
        release = self._claim(prefix, keys)
        try:
            # weight, bias and their gradients from one slab of a pinned host store
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            self.store.reserve([math.prod(shapes[n]) * itemsize for n in shapes
                                for k in (n, f"{n}.grad") if k not in self.store])
            self._wh = self._alloc(f"{prefix}.weight", shape)
            self._bh = self._alloc(f"{prefix}.bias", (self.num_classes,)) if bias else None
            self.weight = self._param(self._wh)
            self.bias = self._param(self._bh) if self._bh is not None else None
        except BaseException:
            # NOTE: free what it allocated (a later head with this key would take uninitialized
            # tensors for trained ones) and the key now: a kept traceback would hold the head
            for k in keys:
                if k not in before and k in self.store:
                    self.store.free(self.store.get(k))
            release()
            raise
        # rows of the gradients holding values since the last overwrite; None: maybe all rows
        self._dirty: torch.Tensor | None = torch.empty(0, dtype=torch.int64)
        self.last_sampled_classes: torch.Tensor | None = None
        if not reopened:  # a reopened DiskStore's key keeps its trained values
            self.reset_parameters()

    # ------------------------------------------------------------------ storage
    def _claim(self, prefix: str, keys: list[str]) -> weakref.finalize:
        """Reserve ``keys`` of the store for this head until it is garbage-collected; returns
        the finalizer that releases them. See [Note: one writer per key] in
        headroom.store._claims."""
        claimed = claimed_keys(self.store)
        taken = [k for k in keys if k in claimed]
        if taken:
            gc.collect()  # an unreachable head in a reference cycle holds its keys until then
            taken = [k for k in keys if k in claimed]
        if taken:
            raise RuntimeError(
                f"key={prefix!r}: {taken[0]!r} in {self.store!r} is in use by another live "
                "HugeClassifier (or offloaded model); both would train one weight. Pass another "
                "key= (or none), or drop every reference to the other head first (del head: "
                "its keys free when it is collected, and a new head resumes their values)")
        claimed.update(keys)
        # the finalizer holds the set and keys, not the head: the claim ends with the head,
        # the values stay in the store
        return weakref.finalize(self, claimed.difference_update, keys)

    def _check_stored(self, key: str, shape: tuple[int, ...]) -> None:
        if key in self.store:
            h = self.store.get(key)
            if h.shape != shape or h.dtype != self.dtype:
                raise ValueError(
                    f"store already holds {key!r} with shape {h.shape} and dtype {h.dtype}, "
                    f"not {shape} {self.dtype}; pass another key="
                )

    def _alloc(self, key: str, shape: tuple[int, ...], *, zero: bool = False) -> Handle:
        if key in self.store:
            return self.store.get(key)
        return self.store.alloc(key, shape, self.dtype, zero=zero)

    def _param(self, h: Handle) -> nn.Parameter:
        # NOTE: every write to the parameter reaches the store: in host memory its data *is*
        # the store's tensor (`_HostParameter`); on disk it is a `StoreTensor`, whose in-place
        # ops and ``.data = t`` write the stored values.
        host = self.store.host_tensor(h)
        if host is not None:
            p = _HostParameter(host, requires_grad=True)
        else:
            p = nn.Parameter(StoreTensor(HandleSource(self.store, h), h.shape, dtype=h.dtype),
                             requires_grad=True)
        gh = self._alloc(f"{h.key}.grad", h.shape, zero=True)
        bind(p, h, grad_handle=gh, store=self.store)
        return p

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize like ``nn.Linear``: uniform in ``+-1/sqrt(in_features)``, slice by slice
        (a weight bigger than RAM never sits whole in memory; other random numbers than an
        ``nn.Linear``'s)."""
        bound = 1.0 / math.sqrt(self.in_features)
        rows = max(1, (64 << 20) // (self.in_features * 4))
        for start, stop in slice_bounds(self.num_classes, rows):
            w = torch.empty(stop - start, self.in_features, dtype=self.dtype)
            w.uniform_(-bound, bound)
            self.store.write_rows(self._wh, slice(start, stop), w).result()
            if self._bh is not None:
                b = torch.empty(stop - start, dtype=self.dtype).uniform_(-bound, bound)
                self.store.write_rows(self._bh, slice(start, stop), b).result()

    @torch.no_grad()
    def read_weight(self) -> torch.Tensor:
        """The whole weight as a host tensor (a copy; needs ``C x D`` host memory)."""
        return self.store.read(self._wh).result()

    @torch.no_grad()
    def read_bias(self) -> torch.Tensor | None:
        """The whole bias as a host tensor (a copy), or ``None``."""
        return None if self._bh is None else self.store.read(self._bh).result()

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Write ``weight`` (and ``bias``) into the store.

        Raises:
            ValueError: wrong shape, or a bias given to a head without one.
        """
        if tuple(weight.shape) != self._wh.shape:
            raise ValueError(f"weight must have shape {self._wh.shape}, got {tuple(weight.shape)}")
        self.store.write(self._wh, weight.detach().to("cpu", self.dtype).contiguous()).result()
        if bias is not None:
            if self._bh is None:
                raise ValueError("this HugeClassifier has no bias (bias=False)")
            self.store.write(self._bh, bias.detach().to("cpu", self.dtype).contiguous()).result()

    def _dtype_for(self, features: torch.Tensor) -> torch.dtype:
        return compute_dtype(self.dtype, features.dtype)

    def _accumulating(self) -> bool:
        b = binding(self.weight)
        return b is not None and b.has_grad and self.weight.grad is not None

    def _grad_handle(self, b: ParamBinding) -> Handle:
        """``b``'s gradient tensor in the store, made anew (zeroed, in ``b.grad_dtype``) where
        `headroom.HostOptimizer` freed it to ask for fp32."""
        if b.grad_handle is None:
            key = f"{b.handle.key}.grad"
            dtype = b.grad_dtype or b.handle.dtype
            if key in self.store:
                old = self.store.get(key)
                if old.dtype == dtype:
                    b.grad_handle = old
                    return old
                self.store.free(old)
            b.grad_handle = self.store.alloc(key, b.handle.shape, dtype, zero=True)
            b.has_grad = False
        return b.grad_handle

    def _grads_landed(self, *, weight: bool, bias: bool, rows: torch.Tensor | None) -> None:
        for p, flag in ((self.weight, weight), (self.bias, bias)):
            if p is None or not flag:
                continue
            b = binding(p)
            assert b is not None and b.grad_handle is not None
            was = b.has_grad and p.grad is not None
            b.grad_rows = _union(b.grad_rows, rows) if was else rows
            b.has_grad = True
            host = self.store.host_tensor(b.grad_handle)
            # as offloaded parameters: the store's gradient tensor, or one whose ops reach it;
            # zero_grad() sets it to None, so the next backward overwrites
            if host is not None and host.dtype == p.dtype:
                p.grad = host
            elif not isinstance(p.grad, StoreTensor):
                p.grad = StoreTensor(GradSource(b), tuple(p.shape), dtype=p.dtype)
        if weight:
            self._dirty = _union(self._dirty, rows)

    def _zero_rows_for_sparse_overwrite(self) -> None:
        """Before a row-sparse overwrite, zero every gradient row that may hold old values."""
        for p in (self.weight, self.bias):
            if p is None:
                continue
            b = binding(p)
            assert b is not None
            h = self._grad_handle(b)
            host = self.store.host_tensor(h)
            if self._dirty is None:
                if host is not None:
                    host.zero_()
                else:
                    self.store.write(h, torch.zeros(h.shape, dtype=h.dtype)).result()
            elif self._dirty.numel():
                zeros = torch.zeros((self._dirty.numel(), *h.shape[1:]), dtype=h.dtype)
                self.store.write_rows(h, self._dirty, zeros).result()
        self._dirty = torch.empty(0, dtype=torch.int64)

    def __setattr__(self, name: str, value: Any) -> None:
        # the loss reads the store: a tensor put in a bound parameter's place would be stepped
        # while the loss kept the stored values
        params = self.__dict__.get("_parameters")
        cur = None if params is None else params.get(name)
        if cur is not None and value is not cur and binding(cur) is not None:
            raise RuntimeError(
                f"HugeClassifier.{name} rests in the head's store ({self.store!r}), which the "
                "loss reads: a tensor assigned in its place would never be used. Write its "
                f"values: head.{name}.copy_(t) under torch.no_grad(), head.load_weight(weight, "
                "bias), or load_state_dict(sd) without assign=True")
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # model.to("cuda") leaves the store-resident parameters where they rest, bound
        params = self._parameters
        self._parameters = {k: v for k, v in params.items() if v is None or binding(v) is None}
        try:
            return super()._apply(fn, recurse)
        finally:
            kept = self._parameters
            self._parameters = {k: kept.get(k, v) for k, v in params.items()}

    # ------------------------------------------------------------------ compute
    def _check(self, features: torch.Tensor) -> None:
        if features.dim() < 1 or features.shape[-1] != self.in_features:
            raise ValueError(f"features must end in in_features={self.in_features}, got shape "
                             f"{tuple(features.shape)}")
        if not features.is_floating_point():
            raise TypeError(f"features must be floating point, got {features.dtype}")
        if features.device != self.device:
            raise ValueError(
                f"features are on {features.device} but this head computes on {self.device}; "
                "move them with .to(device)")

    def _slice_for(self, batch: int, dtype: torch.dtype) -> int:
        if self.slice_size is not None:
            return max(1, min(self.slice_size, self.num_classes))
        return pick_slice_size(batch, self.num_classes, accum_dtype=dtype)

    def forward(
        self,
        features: torch.Tensor,
        labels: torch.Tensor | tuple | list,
        *,
        loss: str | SliceLoss | None = None,
        pos_weight: float | torch.Tensor | None = None,
        ignore_rows: torch.Tensor | None = None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        shift: bool | int = False,
        z_loss: float = 0.0,
        class_weight: torch.Tensor | None = None,
        return_lse: bool = False,
        return_accuracy: bool = False,
        return_predictions: bool = False,
        loss_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | LinearCrossEntropyOutput:
        """The loss of ``features @ weight.T + bias`` against ``labels``.

        Args:
            features: ``(..., in_features)`` on ``device``.
            labels: ``features.shape[:-1]`` integer classes or ``ignore_index`` (softmax
                cross-entropy); or the positives of each row in a form `headroom.linear_loss` takes
                (trains ``loss``).
            loss: with multi-label targets, ``"bce"`` (default) or another loss of
                `headroom.linear_loss` (in the sampled mode a function's ``classes`` is the slice's
                int64 tensor of class ids).
            pos_weight: with ``"bce"``/``"squared_hinge"``, as in `headroom.linear_loss`.
            ignore_rows: with multi-label targets, as in `headroom.linear_loss`.
            ignore_index: with class ids, as in ``F.cross_entropy``.
            label_smoothing: with class ids, as in ``F.cross_entropy``.
            reduction: ``"mean"``, ``"sum"`` or ``"none"``, as in `headroom.linear_loss` and
                `headroom.linear_cross_entropy`.
            softcap, shift, z_loss, class_weight, return_lse, return_accuracy,
                return_predictions, loss_dtype: with class ids (and ``sample_rate == 1``), as
                in `headroom.linear_cross_entropy`.

        Returns:
            The loss (exact unless ``sample_rate < 1``), or with a ``return_*`` flag a
            `headroom.heads.LinearCrossEntropyOutput`.

        Raises:
            TypeError / ValueError: bad labels (dtype, range, duplicates), shapes, devices or
                options, before any compute.
        """
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        opts = CrossEntropyOptions(
            ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
            softcap=softcap, shift=shift, z_loss=z_loss, class_weight=class_weight,
            return_lse=return_lse, return_accuracy=return_accuracy,
            return_predictions=return_predictions, loss_dtype=loss_dtype,
            accum_dtype=self._dtype_for(features), prefetch=self.prefetch)
        given = opts.given()
        if not (isinstance(labels, torch.Tensor) and labels.layout == torch.strided):
            if ignore_index != -100 or label_smoothing != 0.0 or given:
                raise ValueError(
                    "ignore_index and label_smoothing apply to a tensor of class ids (as do "
                    "softcap, shift, z_loss, class_weight, return_* and loss_dtype"
                    + (f"; given: {', '.join(given)}" if given else "")
                    + "); with multi-label targets, drop rows with ignore_rows="
                )
            return self._multilabel(features, labels, loss="bce" if loss is None else loss,
                                    pos_weight=pos_weight, ignore_rows=ignore_rows,
                                    reduction=reduction)
        if loss is not None or pos_weight is not None or ignore_rows is not None:
            raise ValueError(
                "a tensor of class ids trains softmax cross-entropy, one label per row; loss=, "
                "pos_weight= and ignore_rows= take multi-label targets: pass the positives as "
                "(offsets, indices), e.g. (torch.arange(len(labels) + 1), labels) for one each"
            )
        # the head's slice_size was checked when it was built
        opts = replace(opts.checked(num_classes=self.num_classes, dtype=features.dtype),
                       slice_size=self.slice_size)
        self._check(features)
        labels = check_labels(features, labels, opts, num_classes=self.num_classes,
                              names=("labels", "features"))
        if self.sample_rate < 1.0:
            if given:
                raise ValueError(
                    f"{', '.join(given)} need the exact loss over all classes; with "
                    f"sample_rate={self.sample_rate} only ignore_index, label_smoothing and "
                    "reduction apply")
            return self._sampled_forward(features, labels, ignore_index, label_smoothing,
                                         reduction)
        # ignored rows are not read against the weight slices, as in linear_cross_entropy
        p = plan(features, labels, opts, num_classes=self.num_classes, one_pass=False)
        params = _StoreParams(self, p.opts.accum_dtype)
        out = _LinearCrossEntropy.apply(p.x, self.weight, self.bias, p.target, params, p.opts,
                                       _DENSE)
        return opts.returned(p.all_rows(out))

    def _multilabel(self, features, targets, *, loss, pos_weight, ignore_rows, reduction):
        self._check(features)
        dtype = self._dtype_for(features)
        kw = dict(num_classes=self.num_classes, loss=loss, pos_weight=pos_weight,
                  reduction=reduction, slice_size=self.slice_size, ignore_rows=ignore_rows,
                  accum_dtype=dtype)
        if self.sample_rate == 1.0:
            return multilabel_loss(features, self.weight, self.bias, targets,
                                   _StoreParams(self, dtype), **kw)
        picked: list = []

        def sample(pos: Positives):
            rows, w, b = self._sampled_rows(torch.unique_consecutive(pos.cols))
            picked.extend((w, b, rows))
            params = TensorParams(w, b, device=self.device, dtype=dtype,
                                  prefetch=self.prefetch)
            return rows, params, w, b

        out = multilabel_loss(features, self.weight, self.bias, targets, None, sample=sample,
                              **kw)
        w, b, rows = picked
        if w.requires_grad:
            self._hook_sparse_grads(w, b, rows)
        return out

    def _sample(self, positives: torch.Tensor) -> torch.Tensor:
        """Sorted class ids: the classes ``positives`` plus uniform negatives."""
        pos = torch.unique(positives).to("cpu", torch.int64)
        want = max(pos.numel(), math.ceil(self.sample_rate * self.num_classes))
        n_neg = min(want - pos.numel(), self.num_classes - pos.numel())
        if n_neg <= 0:
            return pos
        # the n_pos + n_neg smallest random keys, the positives' forced lowest: uniform
        # negatives without replacement in O(C)
        keys = torch.rand(self.num_classes, generator=self.generator)
        keys[pos] = -1.0
        chosen = torch.topk(keys, pos.numel() + n_neg, largest=False, sorted=False).indices
        return torch.sort(chosen).values

    def _sampled_rows(
        self, positives: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sample the classes and read their rows: ``(classes, weight rows, bias rows)``,
        leaves whose gradients `_hook_sparse_grads` lands in the store."""
        rows = self._sample(positives)
        self.last_sampled_classes = rows
        w = self.store.read_rows(self._wh, rows).result().to(self.device)
        b = None
        if self._bh is not None:
            b = self.store.read_rows(self._bh, rows).result().to(self.device)
        if torch.is_grad_enabled() and self.weight.requires_grad:
            w.requires_grad_(True)
            if b is not None:
                b.requires_grad_(True)
        return rows, w, b

    def _sampled_forward(self, features, labels, ignore_index, eps, reduction):
        flat = labels.reshape(-1)
        rows, w, b = self._sampled_rows(flat[flat != ignore_index])
        local = torch.searchsorted(rows.to(labels.device), labels.long())
        local = torch.where(labels == ignore_index, torch.full_like(local, ignore_index), local)
        dtype = self._dtype_for(features)
        # float64 features meet the rows in float64; others take the stored dtype
        wx, bx = w, b
        if features.dtype == torch.float64:
            wx, bx = w.double(), None if b is None else b.double()
        loss = linear_cross_entropy(
            features.to(wx.dtype), wx, local, bx,
            slice_size=self._slice_for(labels.numel(), dtype), ignore_index=ignore_index,
            label_smoothing=eps, reduction=reduction, accum_dtype=dtype,
        )
        if w.requires_grad:
            self._hook_sparse_grads(w, b, rows)
        return loss

    def _hook_sparse_grads(self, w: torch.Tensor, b: torch.Tensor | None, rows: torch.Tensor):
        pending = {k: t for k, t in (("w", w), ("b", b)) if t is not None}
        arrived: dict[str, torch.Tensor] = {}

        def landed(name: str, t: torch.Tensor) -> None:
            arrived[name] = t.grad.detach().to("cpu", self.dtype)
            t.grad = None
            if set(arrived) != set(pending):
                return
            acc = self._accumulating()
            if not acc:
                self._zero_rows_for_sparse_overwrite()
            for key, p in (("w", self.weight), ("b", self.bias)):
                if key not in arrived or p is None:
                    continue
                gh = self._grad_handle(binding(p))
                g = arrived[key].to(gh.dtype)  # fp32 where an optimizer with masters asks
                if acc:
                    g = g + self.store.read_rows(gh, rows).result()
                self.store.write_rows(gh, rows, g.contiguous()).result()
            self._grads_landed(weight=True, bias=b is not None, rows=rows)

        for name, t in pending.items():
            t.register_post_accumulate_grad_hook(lambda t, n=name: landed(n, t))

    @torch.no_grad()
    def topk(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` highest logits per row and their classes, streaming all classes.

        Holds one ``batch x slice`` block of logits plus ``2k`` candidates per row at most.

        Args:
            features: ``(..., in_features)`` on ``device``.
            k: how many classes per row, ``1 <= k <= num_classes``.

        Returns:
            ``(values, indices)``, each ``features.shape[:-1] + (k,)``, sorted descending
            (``indices`` are int64 class ids).

        Raises:
            ValueError: ``k`` out of range; bad feature shape or device.
        """
        self._check(features)
        if not 1 <= k <= self.num_classes:
            raise ValueError(f"k must be in [1, {self.num_classes}], got {k}")
        lead = features.shape[:-1]
        dtype = self._dtype_for(features)
        x = features.reshape(-1, self.in_features).to(dtype)
        batch = x.shape[0]
        # NOTE: a first slice of at least k classes: then every topk below has k candidates
        s = max(self._slice_for(batch, dtype), k)
        best_v = torch.full((batch, 0), -math.inf, dtype=dtype, device=self.device)
        best_i = torch.empty((batch, 0), dtype=torch.int64, device=self.device)
        for start, stop, w, b in _StoreParams(self, dtype).source(s).slices(
                slice_bounds(self.num_classes, s)):
            z = torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())
            v, i = torch.topk(z, min(k, stop - start), dim=1)
            cand_v = torch.cat([best_v, v], dim=1)
            cand_i = torch.cat([best_i, i + start], dim=1)
            best_v, pos = torch.topk(cand_v, k, dim=1)
            best_i = torch.gather(cand_i, 1, pos)
        return best_v.reshape(*lead, k), best_i.reshape(*lead, k)

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, in_features={self.in_features}, "
            f"bias={self.bias is not None}, device={self.device}, store={self.store!r}, "
            f"sample_rate={self.sample_rate}"
        )
