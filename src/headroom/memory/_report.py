"""Reports of a memory tracker: a readable table, JSON, and a PNG timeline."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headroom.memory._categories import CATEGORIES, format_bytes

if TYPE_CHECKING:
    from headroom.memory._tracker import MemoryTracker

# One color per category, the same in every plot headroom makes.
COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
    "buffers": "#8172B3",
    "other": "#937860",
}


def format_report(mem: MemoryTracker, *, top_modules: int = 10,
                  heading: str = "headroom memory report", rss: bool = True,
                  advice: bool = False, devices: list[str] | None = None) -> str:
    """A table: per device, each category at the peak, its own maximum, and at the end."""
    lines = []
    devices = devices or mem.devices or ["cpu"]
    for dev in devices:
        s = mem.stats(dev) if mem.devices else mem.stats()
        lines.append(f"{heading} - {dev}")
        lines.append(f"{'category':<17}{'at peak':>12}{'max':>12}")
        lines += [_row(c, s.peak_by_category[c], s.max_by_category[c]) for c in CATEGORIES]
        lines += [_row("total (peak)", s.peak), _row("live at end", s.current)]
        alloc = {k.split("/", 1)[1]: v for k, v in s.allocator.items() if k.startswith(dev + "/")}
        if alloc:
            lines.append(
                "allocator        "
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(alloc.items()))
            )
            if "reserved" in alloc and s.peak:
                outside = _row("reserved - peak", alloc["reserved"] - s.peak)
                lines.append(f"{outside}  (fragmentation, cached blocks, or memory outside tracked"
                             " tensors)")
        lines.append("")
    by_module = mem.by_module
    if by_module:
        lines.append("activations saved for backward at their peak, by module")
        for name, nbytes in list(by_module.items())[:top_modules]:
            lines.append(_row(_module_row(mem, name), nbytes, width=40, indent=2))
        rest = list(by_module.values())[top_modules:]
        if rest:
            lines.append(_row(f"({len(rest)} more)", sum(rest), width=40, indent=2))
        lines.append("")
    resting = mem.resting_at_peak
    most = mem.resting_max
    if most:
        lines.append("resting in stores, off the device (not counted above)")
        lines.append(f"  {'where/category':<25}{'at peak':>12}{'max':>12}")
        for where, cats in most.items():
            for cat, mx in cats.items():
                at = resting.get(where, {}).get(cat, 0)
                lines.append(_row(f"{where}/{cat}", at, mx, width=25, indent=2))
        lines.append("")
    peak_sample = max(mem.timeline, key=lambda s: s.total, default=None)  # the first at the peak
    if peak_sample is not None:
        lines.append(f"peak reached during {_moment(mem, peak_sample)}")
    rss = mem.rss if rss else {"peak": None}
    if rss["peak"] is not None:
        lines.append(
            f"process RSS: start {format_bytes(rss['start'] or 0)}, peak"
            f" {format_bytes(rss['peak'])}, end {format_bytes(rss['end'] or 0)} (the tracked"
            " tensors plus the interpreter, libraries, memory the C allocator keeps, and"
            " anything outside PyTorch)"
        )
    if advice:
        more = tracker_advice(mem)
        if more:
            lines.append("")
            lines.extend(more)
    return "\n".join(lines).rstrip() + "\n"


def _row(label: str, *values: int, width: int = 17, indent: int = 0) -> str:
    return " " * indent + f"{label:<{width}}" + "".join(f"{format_bytes(v):>12}" for v in values)


def _module_row(mem: MemoryTracker, name: str) -> str:
    """``"layers.1 (BatchNorm2d)"`` (a root's name is its class already)."""
    if not name:
        return "(outside any module)"
    cls = mem.module_class(name)
    return f"{name} ({cls})" if cls and cls != name else name


def format_estimate(est: Any, *, top_modules: int = 10, advice: bool = True) -> str:
    """The tracker's table for a dry run (``est``, a `headroom.fit.Estimate`), the allocator
    model's figures, then the advice."""
    text = format_report(est.tracker, top_modules=top_modules,
                         heading="headroom memory estimate (dry run)", rss=False,
                         devices=[est.device] if est.device in est.tracker.devices else None)
    lines = [text.rstrip("\n")]
    alloc = est.allocator
    if alloc:
        lines.append(
            f"caching allocator model ({est.device}): allocated"
            f" {format_bytes(alloc['peak_allocated'])} at most, reserved"
            f" {format_bytes(alloc['peak_reserved'])} in {alloc['segments']} segments (the CUDA"
            " context and library workspaces come on top)"
        )
    if advice and est.advice:
        lines.append("")
        lines.extend(est.advice)
    return "\n".join(lines) + "\n"


# Advice at the end of reports, from dry runs of the step: the figures come from `headroom.fit`
# through `headroom._providers`, which memory/ never imports.
def tracker_advice(mem: MemoryTracker) -> list[str]:
    ctx = mem._context
    if not ctx:
        return []
    if "advice" in ctx:  # computed once: a report printed and written costs one set of dry runs
        return ctx["advice"]
    model = ctx["model"]()
    if model is None:
        return ["(no advice: the model that ran is no longer alive; report before it is freed)"]
    if _fsdp_sharded(model):
        ctx["advice"] = ["(no advice: the model is sharded with FSDP2 (fully_shard), whose"
                         " collectives the dry runs do not model; the figures above are this"
                         " rank's)"]
        return ctx["advice"]
    p = next(iter([*model.parameters(), *model.buffers()]), None)
    device = str(p.device) if p is not None and p.device.type != "meta" else "cpu"
    resting = max((by.get("activations", 0) for by in mem.resting_max.values()), default=0)
    ctx["advice"] = advise(model, ctx, device=device, base=None, measured=mem.peak,
                           resting_activations=resting)
    return ctx["advice"]


def advise(model: Any, ctx: dict[str, Any], **more: Any) -> list[str]:
    """The advice for the step ``ctx`` holds (the tracker's or an estimate's), through the
    provider; a failed dry run is one line of it, never an error."""
    from headroom._providers import advice_provider

    try:
        return advice_provider()(
            model, ctx["args"], kwargs=ctx.get("kwargs"), loss_fn=ctx.get("loss_fn"),
            optimizer=ctx.get("optimizer"), optimizer_kwargs=ctx.get("optimizer_kwargs"),
            autocast=ctx.get("autocast"), **more)
    except Exception as e:  # advice never breaks a report
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return [f"(no advice: a dry run of the step failed: {type(e).__name__}: {first})"]


def _fsdp_sharded(model: Any) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def _moment(mem: MemoryTracker, sample: Any) -> str:
    """When a timeline sample was taken, in words: ``"the backward of layers.1 (BatchNorm2d)"``."""
    if sample.phase == "optimizer":
        return "the optimizer step"
    if sample.phase == "other":
        return "no forward, backward or optimizer step (between them)"
    if sample.module:
        return f"the {sample.phase} of {_module_row(mem, sample.module)}"
    return f"the {sample.phase}"


def to_dict(mem: MemoryTracker) -> dict[str, Any]:
    """Everything measured, as JSON-ready data (bytes as ints, times in seconds)."""
    timeline = mem.timeline
    return {
        "format": "headroom.memory/1",
        "categories": list(CATEGORIES),
        "peak": mem.peak,
        "peak_by_category": mem.peak_by_category,
        "max_by_category": mem.max_by_category,
        "current": mem.current,
        "by_module": mem.by_module,
        "rss": mem.rss,
        "resting": {"at_peak": mem.resting_at_peak, "max": mem.resting_max,
                    "current": mem.resting},
        "devices": {
            d: {
                "peak": (s := mem.stats(d)).peak,
                "peak_by_category": s.peak_by_category,
                "max_by_category": s.max_by_category,
                "current": s.current,
                "allocator": s.allocator,
            }
            for d in mem.devices
        },
        "timeline": {
            "time_s": [round(s.time_s, 6) for s in timeline],
            "label": [s.label for s in timeline],
            "bytes": {c: [s.by_category[c] for s in timeline] for c in CATEGORIES},
        },
        "rss_timeline": _series(mem.rss_timeline),
        "resting_timeline": _series(mem.resting_timeline),
    }


def _series(samples: list[tuple[float, int]]) -> dict[str, list]:
    return {"time_s": [round(t, 6) for t, _ in samples], "bytes": [b for _, b in samples]}


def _atomic_write(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# A run with more steps than this is drawn as its peak step plus a per-step envelope: hundreds
# of steps on one time axis are a comb no one can read.
_MANY_STEPS = 4


def plot(mem: MemoryTracker, path: str | os.PathLike, *, title: str | None = None,
         x_axis: str = "time", rss: bool = True) -> None:
    """Write `figure` as a PNG to ``path``; a failed write leaves the previous file, no partial."""
    fig = figure(mem, title=title, x_axis=x_axis, rss=rss)
    import matplotlib.pyplot as plt  # with the backend `figure` chose

    tmp = Path(path).with_name(Path(path).name + ".tmp.png")
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)  # a write that failed leaves no partial file


def figure(mem: MemoryTracker, *, title: str | None = None, x_axis: str = "time",
           rss: bool = True) -> Any:
    """A stacked timeline by category, the peak marked, the phases in a strip above it; the
    legend right of the axes. Returns the matplotlib figure (the caller closes it).

    Many steps are drawn as two panels: each step's peak, and the step with the overall peak.
    ``x_axis="ops"`` numbers the samples instead of timing them, and ``rss=False`` leaves out
    the process's RSS: both for a dry run, whose wall time and RSS are not the step's.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    timeline = mem.timeline
    # from the first tracked allocation: a profiled script may spend long importing first
    first = next((i for i, s in enumerate(timeline) if s.total > 0), 0)
    timeline = timeline[first:]
    steps = _steps(timeline)
    many = len(steps) > _MANY_STEPS
    if many:
        fig = plt.figure(figsize=(12, 8), dpi=110, layout="constrained")
        top, strip, ax = fig.subplots(3, 1, gridspec_kw={"height_ratios": [2, 0.12, 3]})
        _plot_envelope(top, timeline, steps)
        k = max(range(len(timeline)), key=lambda i: timeline[i].total)
        lo, hi = next((a, b) for a, b in steps if a <= k < b)
        shown = timeline[lo:hi]
        peak_steps = sum(1 for a, b in steps
                         if max(s.total for s in timeline[a:b]) == timeline[k].total)
        where = f"step {steps.index((lo, hi)) + 1} of {len(steps)}, " + (
            "the one with the peak" if peak_steps == 1
            else f"the first of the {peak_steps} that reach the peak")
    else:
        fig = plt.figure(figsize=(12, 5.5), dpi=110, layout="constrained")
        strip, ax = fig.subplots(2, 1, gridspec_kw={"height_ratios": [0.12, 3]})
        shown, where = timeline, ""
    handles, labels = _plot_timeline(ax, strip, mem, shown, x_axis=x_axis, rss=rss,
                                     where=where)
    heading = title or f"headroom: memory by category ({', '.join(mem.devices) or 'cpu'})"
    (top if many else strip).set_title(heading)
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
    return fig


def _steps(timeline: list) -> list[tuple[int, int]]:
    """``[start, end)`` sample ranges of the training steps: a step ends where a forward starts
    after a backward or an optimizer step (or, for a run without either, after a pause), less
    what ran just before that forward outside the three phases."""
    trains = any(s.phase in ("backward", "optimizer") for s in timeline)
    bounds, seen = [0], set()
    for i in range(1, len(timeline)):
        phase, prev = timeline[i].phase, timeline[i - 1].phase
        if phase == "forward" and prev != "forward" and (
                seen & {"backward", "optimizer"} or not trains):
            j = i  # what ran between the steps (making the next inputs) belongs to the next
            while j - 1 > bounds[-1] and timeline[j - 1].phase == "other":
                j -= 1
            bounds.append(j)
            seen = set()
        seen.add(phase)
    bounds.append(len(timeline))
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _plot_envelope(ax: Any, timeline: list, steps: list[tuple[int, int]]) -> None:
    import numpy as np

    peaks = [max(range(a, b), key=lambda i: timeline[i].total) for a, b in steps]
    scale, unit = _unit(max(timeline[i].total for i in peaks))
    x = np.arange(1, len(steps) + 1)
    bottom = np.zeros(len(steps))
    for c in CATEGORIES:
        h = np.array([timeline[i].by_category[c] for i in peaks]) / scale
        if h.any():
            ax.bar(x, h, bottom=bottom, width=0.8 if len(steps) <= 60 else 1.0,
                   color=COLORS[c], lw=0)
        bottom += h
    ax.set_xlim(0.5, len(steps) + 0.5)
    ax.set_ylim(0, bottom.max() * 1.15 if bottom.max() > 0 else 1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"peak of the step ({unit})")
    ax.grid(alpha=0.3, axis="y")


# The phases, in a strip above the timeline: shades of grey, apart from the categories' colors.
PHASES = {"forward": ("#d0d0d0", "forward"), "backward": ("#8c8c8c", "backward"),
          "optimizer": ("#3a3a3a", "optimizer step")}


def _plot_timeline(ax: Any, strip: Any, mem: MemoryTracker, timeline: list, *, x_axis: str,
                   rss: bool, where: str) -> tuple[list, list[str]]:
    """Draw the step on ``ax`` and its phases on ``strip``; the legend's handles and labels."""
    import numpy as np
    from matplotlib.patches import Patch

    strip.set_yticks([])
    strip.tick_params(axis="x", labelbottom=False, length=0)
    if not timeline:
        return [], []
    times = np.array([s.time_s for s in timeline])
    t_start, t_end = times[0], times[-1]
    if x_axis == "ops":
        x = np.arange(len(timeline), dtype=float)
        xlabel = "samples of the step, in order (one after each op that changed memory)"
    else:
        t_unit = "s" if t_end - t_start > 10 else "ms"
        x = (times - t_start) * (1.0 if t_unit == "s" else 1e3)
        xlabel = (f"time since the {'step' if where else 'first tracked allocation'} began"
                  f" ({t_unit})")

    def within(series: list[tuple[float, int]]) -> tuple[np.ndarray, np.ndarray]:
        """A series sampled at other times, in the step: its x on this axis, and its bytes."""
        kept = np.array([(t, b) for t, b in series if t_start <= t <= t_end]).reshape(-1, 2)
        return np.interp(kept[:, 0], times, x), kept[:, 1]
    x_end = x[-1] if x[-1] > x[0] else x[0] + 1
    scale, unit = _unit(max(max(s.total for s in timeline), mem.peak))
    ys = [np.array([s.by_category[c] for s in timeline]) / scale for c in CATEGORIES]
    shown = [c for c, y in zip(CATEGORIES, ys, strict=True) if y.any()]
    ax.stackplot(x, *ys, colors=[COLORS[c] for c in CATEGORIES], step="post", alpha=0.9,
                 zorder=1)
    handles: list = [Patch(facecolor=COLORS[c], alpha=0.9) for c in shown]
    labels = list(shown)
    phases = _phase_spans(timeline, x, x_end)
    for x0, x1, phase in phases:
        strip.axvspan(x0, x1, color=PHASES[phase][0], lw=0)
    strip.set_xlim(x[0], x_end)
    strip.set_ylabel("phase", rotation=0, ha="right", va="center", fontsize=8)
    for phase, (color, name) in PHASES.items():
        if any(p == phase for _, _, p in phases):
            handles.append(Patch(facecolor=color))
            labels.append(f"phase: {name}")
    totals = np.sum(ys, axis=0)
    rest_x, rest = within(mem.resting_timeline)
    if len(rest):
        (line,) = ax.step(rest_x, rest / scale, where="post", color="#C44E52", ls="--", lw=1.2,
                          zorder=2)
        handles.append(line)
        labels.append("resting in stores (off the device)")
    k = int(np.argmax(totals))
    peak_y = max(totals[k], mem.peak / scale)
    # a peak held for one op may be narrower than a pixel: draw its stack 0.6% of the axis wide
    width = (x[k + 1] if k + 1 < len(x) else x_end) - x[k]
    least = 0.006 * (x_end - x[0])
    if width < least:
        bottom = 0.0
        for y, c in zip(ys, CATEGORIES, strict=True):
            if y[k]:
                ax.bar(x[k], y[k], width=least, bottom=bottom, align="edge", color=COLORS[c],
                       alpha=0.9, lw=0, zorder=1)
            bottom += y[k]
        width = least
    at = x[k] + min(width, least) / 2  # the mark on the middle of the peak's stack
    top = max(peak_y, rest.max(initial=0) / scale)
    ax.set_ylim(0, top * 1.3 if top > 0 else 1)
    ax.set_xlim(x[0], x_end)
    _mark_peak(ax, mem, timeline[k], at, peak_y, (at - x[0]) / (x_end - x[0]))
    ax.set_ylabel(f"live tensor memory ({unit})")
    ax.set_xlabel(xlabel + (f"; {where}" if where else ""))
    rss_x, samples = within(mem.rss_timeline if rss else [])
    if len(samples):
        ax2 = ax.twinx()
        rscale, runit = _unit(samples.max())
        (line,) = ax2.plot(rss_x, samples / rscale, color="black", lw=1, alpha=0.6)
        ax2.set_ylim(0, samples.max() / rscale * 1.3)
        ax2.set_ylabel(f"process RSS ({runit})")
        handles.append(line)
        labels.append("process RSS (right axis)")
        # the categories and the peak's mark over the RSS line
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
    ax.grid(alpha=0.3, zorder=0)
    return handles, labels


def _phase_spans(timeline: list, x: Any, x_end: float) -> list[tuple[float, float, str]]:
    """``(x0, x1, phase)`` of each run of samples in one phase (``"other"`` left out)."""
    spans = []
    start = 0
    for i in range(1, len(timeline) + 1):
        if i == len(timeline) or timeline[i].phase != timeline[start].phase:
            phase = timeline[start].phase
            if phase in PHASES:
                spans.append((x[start], x[i] if i < len(timeline) else x_end, phase))
            start = i
    return spans


def _mark_peak(ax: Any, mem: MemoryTracker, sample: Any, x: float, y: float,
               frac: float) -> None:
    """A line up to the peak, a marker on it and its label above (``gid="peak"``): visible
    even where the peak lasts a single op, and never under the legend (outside the axes)."""
    ax.vlines(x, 0, y, color="black", ls="--", lw=1, zorder=3)
    ax.plot([x], [y], marker="v", color="black", ms=7, zorder=4, clip_on=False)
    ha = "left" if frac < 0.2 else ("right" if frac > 0.8 else "center")
    ax.annotate(f"peak {format_bytes(mem.peak)}\nduring {_moment(mem, sample)}", xy=(x, y),
                xytext=(0, 10), textcoords="offset points", ha=ha, va="bottom", fontsize=8,
                zorder=5, gid="peak",
                bbox={"facecolor": "white", "alpha": 0.85, "lw": 0, "pad": 1.5})


def _unit(n: float) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return float(scale), unit
    return 1.0, "bytes"
