"""Steps that start during the final backward pass (`HostOptimizer.final_backward`).

Only there is a gradient complete once signalled, whatever the number of micro-batches.
Parameters are bucketed in last time's gradient order (as DDP rebuilds its buckets); a
complete bucket is stepped on one worker thread while backward goes on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from headroom.memory import track_this_thread
from headroom.optim._entries import Bucket, Entry, same
from headroom.optim._undo import wait_all
from headroom.store import owned_pool

__all__ = ["Overlap"]


class Overlap:
    """The worker thread, the buckets and the hyperparameters steps started with.

    ``step_entries`` steps a batch (on the worker, ``early=True``); ``hparams(gi)`` is a
    group's current hyperparameters; ``failed_backward(exc)`` is called when a final backward
    fails after some steps started (and ended); ``bucket_bytes``: fp32 bytes per bucket.
    """

    def __init__(self, step_entries: Callable[..., None], hparams: Callable[[int], dict],
                 *, enabled: bool, bucket_bytes: int,
                 failed_backward: Callable[[BaseException], None]) -> None:
        self.enabled = enabled
        self._failed_backward = failed_backward
        self.bucket_bytes = bucket_bytes
        self._step_entries = step_entries
        self._hparams = hparams
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._ready: list[Entry] = []
        self.final = False  # inside final_backward()
        self.clips = False  # clip_grad_norm_ has been called: gradients are not final
        self.launched_hparams: dict[int, dict[str, Any]] = {}
        self.last_arrival: list[Entry] = []  # first-gradient order of the last iteration
        self.failed: BaseException | None = None  # the worker could not be started this time

    # ------------------------------------------------------------------ the worker
    def submit(self, fn: Callable[[], None]) -> None:
        if self._pool is None:
            self._pool = owned_pool(self, 1, "hr-host-step")  # ends with its optimizer
        self._futures.append(self._pool.submit(fn))

    def wait(self) -> None:
        """Wait for everything submitted; re-raise the first error."""
        err = None
        while self._futures:
            f = self._futures[0]
            try:
                f.result()
            except BaseException as ex:  # noqa: BLE001 - re-raised below, first one wins
                if not f.done():
                    raise  # interrupted while waiting (Ctrl-C): still there for `settle`
                err = err or ex
            self._futures.pop(0)
        if err is not None:
            raise err

    def settle(self) -> None:
        """Wait for everything submitted, dropping errors (the step is being undone)."""
        futures, self._futures = self._futures, []
        wait_all(futures)

    @property
    def busy(self) -> bool:
        """Whether work was submitted and not waited for."""
        return bool(self._futures)

    def _drain(self) -> None:
        with self._lock:
            batch, self._ready = self._ready, []
        if batch:
            with track_this_thread():  # an active hr.track_memory sees the step's tensors
                self._step_entries(batch, early=True)

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    # ------------------------------------------------------------------ final backward
    @contextlib.contextmanager
    def final_backward(self, entries: list[Entry], enabled: bool) -> Iterator[None]:
        """The body of `HostOptimizer.final_backward` (see there)."""
        if not enabled or not self.enabled:
            yield
            return
        if self.clips:
            raise RuntimeError(
                "final_backward() steps parameters before every gradient is known, but this "
                "optimizer clips gradients (clip_grad_norm_). Drop the `with "
                "opt.final_backward():` (the step then runs in step()), or stop clipping"
            )
        if self.final or any(e.launched for e in entries):
            raise RuntimeError(
                "final_backward() was already used since the last step(); only the last "
                "backward pass before step() is final"
            )
        self._arm(entries)
        self.final = True
        try:
            yield
        except BaseException as exc:
            if any(e.launched for e in entries):
                with contextlib.suppress(BaseException):
                    self.wait()
                self._failed_backward(exc)
            raise
        finally:
            self.final = False

    def _arm(self, entries: list[Entry]) -> None:
        """Buckets for this final backward, in last time's gradient order (at first, reverse
        registration order)."""
        order = self.last_arrival or list(reversed(entries))
        for e in entries:
            e.bucket = None
            e.fired = False
        cur: list[Entry] = []
        size = 0
        for e in order:
            cur.append(e)
            size += e.numel * 4
            if size >= self.bucket_bytes:
                Bucket(cur)
                cur, size = [], 0
        if cur:
            Bucket(cur)

    def gradient_complete(self, e: Entry) -> None:
        """``e``'s gradient of this backward is complete: start its bucket once all are in."""
        if not self.final or e.bucket is None or e.fired:
            return
        e.fired = True
        bucket = e.bucket
        bucket.remaining -= 1
        if bucket.remaining:
            return
        if self.failed is not None:
            return  # no worker: step() steps these
        for x in bucket.entries:
            x.launched = True
            x.seen = x.grad_mark()  # step() checks it is unchanged
        with self._lock:
            # taken now, on this thread: a change before the worker runs is caught at step()
            for x in bucket.entries:
                self.launched_hparams.setdefault(x.group, self._hparams(x.group))
            self._ready.extend(bucket.entries)
        try:
            self.submit(self._drain)
        except BaseException as ex:  # noqa: BLE001 - e.g. no thread: step() steps these
            self.failed = ex
            with self._lock:
                left = [x for x in self._ready if x in bucket.entries]
                self._ready = [x for x in self._ready if x not in bucket.entries]
            for x in left:
                x.launched = False
                x.seen = None

    def check_hparams(self) -> None:
        """Raise if a hyperparameter changed since a step started with it."""
        for gi, snap in self.launched_hparams.items():
            now = self._hparams(gi)
            for k, v in snap.items():
                if not same(v, now.get(k)):
                    raise RuntimeError(
                        f"param_groups[{gi}][{k!r}] changed from {v!r} to {now.get(k)!r} after "
                        "parameters had started stepping with the old value in "
                        "final_backward(). Set hyperparameters before backward (call "
                        "scheduler.step() after opt.step())"
                    )

    def abort(self, entries: list[Entry]) -> None:
        """Forget buckets and launches (the step ended, or was undone)."""
        with self._lock:
            self._ready = []
        for e in entries:
            e.launched = False
            e.fired = False
            e.bucket = None
            e.seen = None
        self.launched_hparams = {}
        self.failed = None
