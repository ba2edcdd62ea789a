"""Masters that follow values written into their parameters between steps: where the
parameter no longer holds its master rounded to its dtype (bit for bit), the master takes its
value. Compared only where PyTorch or the store recorded a write (`written_mark`,
`headroom.transfer.value_edits`); see docs/host_optimizer.md, "Writes into parameters".
"""

from __future__ import annotations

import numpy as np
import torch

from headroom.store import Handle, Store

__all__ = ["follow_", "follow_stored", "init_stored", "written_mark"]


def written_mark(p: torch.Tensor) -> tuple[int, int]:
    """``p``'s version counter and data pointer (0 without storage of its own)."""
    try:
        ptr = p.data_ptr()
    except RuntimeError:
        ptr = 0
    return p._version, ptr

_CHUNK = 1 << 22  # elements compared at once: a bounded temporary
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_CHUNK = 1 << 18  # elements per numpy pass: temporaries that stay in cache


def _unchanged(master: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``value`` holds ``master`` rounded to its dtype, bit for bit, the fast way
    (numpy; fp32 to bf16 rounding as bit arithmetic). ``False`` may also mean "not known"
    (a NaN in the master): the caller then compares exactly."""
    bits = _BITS[value.element_size()]
    if not (master.is_contiguous() and value.is_contiguous()):
        return False
    if master.dtype == value.dtype:
        return bool(np.array_equal(master.view(bits).numpy(), value.view(bits).numpy()))
    if not (master.dtype == torch.float32 and value.dtype == torch.bfloat16):
        return torch.equal(master.to(value.dtype).view(bits), value.view(bits))
    m = master.view(torch.int32).numpy().reshape(-1).view(np.uint32)
    v = value.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    lsb = np.empty(min(_NP_CHUNK, m.size), dtype=np.uint32)
    out = np.empty_like(lsb)
    for a in range(0, m.size, _NP_CHUNK):
        x = m[a:a + _NP_CHUNK]
        t, r = lsb[:x.size], out[:x.size]
        # round to nearest even, as torch rounds float32 to bfloat16 (NaN aside)
        np.right_shift(x, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(x, t, out=r)
        np.right_shift(r, 16, out=r)
        if not np.array_equal(r.astype(np.uint16), v[a:a + _NP_CHUNK]):
            return False
    return True


def _follow_part(master: torch.Tensor, value: torch.Tensor) -> bool:
    if _unchanged(master, value):
        return False
    bits = _BITS[value.element_size()]
    rounded = master if master.dtype == value.dtype else master.to(value.dtype)
    diff = rounded.view(bits) != value.view(bits)
    if not bool(diff.any()):
        return False
    master[diff] = value[diff].to(master.dtype)
    return True


def follow_(master: torch.Tensor, value: torch.Tensor) -> bool:
    """``master`` takes ``value`` (host tensors of one shape) where ``master`` rounded to its
    dtype differs from it bit for bit (NaNs, signed zeros too); returns whether any did."""
    if not master.is_contiguous() or master.numel() <= _CHUNK:
        return _follow_part(master, value)
    m, v = master.view(-1), value.reshape(-1)
    changed = False
    for a in range(0, m.numel(), _CHUNK):
        changed |= _follow_part(m[a:a + _CHUNK], v[a:a + _CHUNK])
    return changed


def _row_slices(handle: Handle) -> list[slice]:
    rows = handle.shape[0]
    per = max(1, _CHUNK // max(1, handle.numel // max(1, rows)))
    return [slice(a, min(a + per, rows)) for a in range(0, rows, per)]


def follow_stored(master_store: Store, master: Handle, value_store: Store,
                  value: Handle) -> None:
    """`follow_` for a master and a value resting in stores, rows at a time."""
    if not master.shape:
        m = master_store.read(master).result()
        if follow_(m, value_store.read(value).result()):
            master_store.write(master, m).result()
        return
    in_memory = master_store.host_tensor(master) is not None
    for rows in _row_slices(master):
        m = _rows(master_store, master, rows)
        if follow_(m, _rows(value_store, value, rows)) and not in_memory:
            master_store.write_rows(master, rows, m).result()


def init_stored(master_store: Store, master: Handle, value_store: Store, value: Handle) -> None:
    """The whole master made from the value (for rows a row-sparse first step skips)."""
    if not master.shape:
        master_store.write(master, value_store.read(value).result().to(master.dtype)).result()
        return
    for rows in _row_slices(master):
        v = _rows(value_store, value, rows)
        master_store.write_rows(master, rows, v.to(master.dtype).contiguous()).result()


def _rows(store: Store, h: Handle, rows: slice) -> torch.Tensor:
    """Rows of ``h``: a view of its host tensor, or a copy read from the store."""
    host = store.host_tensor(h)
    return host[rows] if host is not None else store.read_rows(h, rows).result()
