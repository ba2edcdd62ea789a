"""The memory tracker against analytic sizes, saved-tensor hooks and PyTorch's MemTracker."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import headroom as hr
from headroom.memory import CATEGORIES, annotate
from headroom.transfer import resize_storage

B, D_IN, D_HID, D_OUT = 32, 64, 128, 10


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(D_IN, D_HID),
        nn.ReLU(),
        nn.Linear(D_HID, D_HID),
        nn.ReLU(),
        nn.Linear(D_HID, D_OUT),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, D_OUT),
    )


MODELS = {"mlp": (mlp, (B, D_IN)), "cnn": (cnn, (B, 3, 16, 16))}


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def saved_bytes_by_hooks(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward, deduplicated by storage, without parameters/buffers."""
    own = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in own:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(seen.values())


@pytest.mark.parametrize("name", MODELS)
def test_activations_equal_saved_tensor_hooks(name):
    make, shape = MODELS[name]
    model = make()
    x = torch.randn(shape)
    expected = saved_bytes_by_hooks(model, x)
    assert expected > 0
    with hr.track_memory(model=model) as mem:
        out = model(x)
        during = mem.current_by_category["activations"]
        out.sum().backward()
        after = mem.current_by_category["activations"]
    assert during == expected
    assert after == 0  # the graph is freed by backward: nothing is saved any more


@pytest.mark.parametrize("name", MODELS)
def test_parameters_gradients_adam_state_are_analytic(name):
    make, shape = MODELS[name]
    model = make()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(shape)
    p_bytes = param_bytes(model)
    n_tensors = len(list(model.parameters()))
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    with hr.track_memory(model=model, optimizer=opt) as mem:
        at_entry = mem.current_by_category
        model(x).square().mean().backward()
        after_backward = mem.current_by_category
        opt.step()
        after_step = mem.current_by_category
    assert at_entry["parameters"] == p_bytes
    assert at_entry["buffers"] == buffer_bytes
    assert at_entry["gradients"] == 0
    assert after_backward["gradients"] == p_bytes
    # Adam: exp_avg and exp_avg_sq like each parameter, plus a float32 `step` scalar per tensor.
    assert after_step["optimizer_state"] == 2 * p_bytes + 4 * n_tensors
    assert after_step["parameters"] == p_bytes
    assert mem.max_by_category["optimizer_state"] == 2 * p_bytes + 4 * n_tensors


@pytest.mark.parametrize("name", MODELS)
def test_categories_at_peak_sum_to_peak(name):
    make, shape = MODELS[name]
    model = make()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(shape)
    with hr.track_memory() as mem:  # nothing given: everything is found while it runs
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert mem.peak > 0
    assert sum(mem.peak_by_category.values()) == mem.peak
    assert set(mem.peak_by_category) == set(CATEGORIES)
    cpu = mem.stats("cpu")
    assert cpu.peak == mem.peak and sum(cpu.peak_by_category.values()) == cpu.peak
    # found without being told: parameters and Adam state are classified
    assert mem.max_by_category["parameters"] == param_bytes(model)
    assert mem.max_by_category["optimizer_state"] >= 2 * param_bytes(model)
    assert max(s.total for s in mem.timeline) == mem.peak


def test_tracking_never_changes_results():
    torch.manual_seed(1)
    ref = cnn()
    tracked = cnn()
    tracked.load_state_dict(ref.state_dict())
    x = torch.randn(B, 3, 16, 16)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, tracked)]
    for _ in range(3):
        ref(x).square().mean().backward()
        opts[0].step()
        opts[0].zero_grad()
    with hr.track_memory():
        for _ in range(3):
            tracked(x).square().mean().backward()
            opts[1].step()
            opts[1].zero_grad()
    for a, b in zip(ref.state_dict().values(), tracked.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_views_count_once_and_frees_are_seen():
    with hr.track_memory() as mem:
        x = torch.zeros(1000)
        views = [x[::2], x.view(10, 100), x[3:]]
        assert mem.current == 4000
        del x, views
        assert mem.current == 0
        y = torch.ones(256)  # noqa: F841 - alive at exit
    assert mem.peak == 4000
    assert mem.current == 1024


def test_storage_resize_is_tracked():
    p = nn.Parameter(torch.randn(1024))
    with hr.track_memory(model=nn.ParameterList([p])) as mem:
        assert mem.current_by_category["parameters"] == 4096
        p.data.untyped_storage().resize_(0)
        assert mem.current_by_category["parameters"] == 0
        p.data.untyped_storage().resize_(4096)
        assert mem.current_by_category["parameters"] == 4096
        resize_storage(p.data, 0)
        assert mem.current_by_category["parameters"] == 0
        resize_storage(p.data, 4096)
        p.data.copy_(torch.ones(1024))
    assert mem.max_by_category["parameters"] == 4096
    assert mem.current_by_category["parameters"] == 4096


def test_annotate_moves_bytes_between_categories():
    t = torch.zeros(100)
    with hr.track_memory() as mem:
        annotate(t, "optimizer_state")
        assert mem.current_by_category["optimizer_state"] == 400
        annotate(t, "other")
        assert mem.current_by_category == {**dict.fromkeys(CATEGORIES, 0), "other": 400}
    annotate(t, "gradients")  # no tracker active: a no-op
    with pytest.raises(ValueError, match="unknown memory category"):
        annotate(t, "weights")


def test_by_module_names_who_saves_what():
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))
    x = torch.randn(B, D_IN)
    with hr.track_memory(model=model) as mem:
        out = model(x)
    del out
    # Linear 0 saves its input, ReLU its output (which Linear 2 also saves: counted once).
    assert mem.by_module == {"0": B * D_IN * 4, "1": B * D_HID * 4}
    assert mem.max_by_category["activations"] == B * (D_IN + D_HID) * 4


def test_timeline_labels_phases_and_modules():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        model(torch.randn(B, D_IN)).sum().backward()
        opt.step()
    phases = {s.phase for s in mem.timeline}
    assert {"forward", "backward", "optimizer"} <= phases
    modules = {s.module for s in mem.timeline if s.phase == "forward"}
    assert {"0", "2", "4"} <= modules
    assert any(s.module for s in mem.timeline if s.phase == "backward")


def test_nested_use_fails_clearly_and_repeated_use_works():
    with hr.track_memory(), pytest.raises(RuntimeError, match="nested tracking is not supported"):
        with hr.track_memory():
            pass
    for _ in range(2):
        with hr.track_memory() as mem:
            torch.ones(10)
        assert mem.peak == 40
    with pytest.raises(RuntimeError, match="already used"):
        with mem:
            pass
    with pytest.raises(RuntimeError, match="has not run yet"):
        _ = hr.track_memory().peak


def test_bad_arguments_name_the_fix():
    with pytest.raises(TypeError, match="nn.Module"):
        hr.track_memory(model="resnet")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hr.track_memory(optimizer=[1])
    with hr.track_memory() as mem:
        torch.ones(3)
    with pytest.raises(ValueError, match="no tensors were tracked on 'cuda:0'"):
        mem.stats("cuda:0")


def test_timeline_is_bounded_and_keeps_the_peak():
    with hr.track_memory(max_samples=64) as mem:
        keep = []
        for i in range(300):
            keep.append(torch.ones(10 + (i == 150) * 10_000))
            if i % 3 == 0:
                keep.pop(0)
    assert len(mem.timeline) <= 64
    assert max(s.total for s in mem.timeline) == mem.peak


def _tracked_steps(n):
    """An MLP trained ``n`` AdamW steps under one tracker; returns the model and tracker."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with hr.track_memory(model=model, optimizer=opt) as mem:
        for _ in range(n):
            F.cross_entropy(model(torch.randn(B, D_IN)), torch.randint(0, D_OUT, (B,))).backward()
            opt.step()
            opt.zero_grad()
    return model, mem


def test_report_json_and_plot(tmp_path):
    from PIL import Image

    model, mem = _tracked_steps(2)
    text = mem.report(file=open(tmp_path / "r.txt", "w"))  # noqa: SIM115
    for cat in CATEGORIES:
        assert cat in text
    assert "activations saved for backward at their peak, by module" in text
    mem.to_json(tmp_path / "m.json")
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["peak"] == mem.peak
    assert data["peak_by_category"] == mem.peak_by_category
    assert len(data["timeline"]["time_s"]) == len(mem.timeline)
    assert data["devices"]["cpu"]["peak"] == mem.peak
    mem.plot(tmp_path / "m.png")
    img = Image.open(tmp_path / "m.png").convert("RGB")
    assert img.size[0] >= 800 and img.size[1] >= 400
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20  # a real plot, not a blank canvas


def test_a_long_run_plots_its_peak_step_and_every_step_peak(tmp_path):
    from PIL import Image

    from headroom.memory._report import _steps

    model, mem = _tracked_steps(6)
    steps = _steps(mem.timeline)
    assert len(steps) == 6
    for a, b in steps:
        phases = [s.phase for s in mem.timeline[a:b] if s.phase != "other"]
        assert phases[0] == "forward" and phases[-1] == "optimizer"
        assert phases.count("forward") and "forward" not in phases[phases.index("backward"):]
    mem.plot(tmp_path / "long.png")
    with hr.track_memory(model=model) as one:
        model(torch.randn(B, D_IN)).sum().backward()
    one.plot(tmp_path / "one.png")
    # two panels (the envelope above the peak step) against one
    tall, short = (Image.open(tmp_path / f).size[1] for f in ("long.png", "one.png"))
    assert tall > 1.4 * short


def _legend_and_peak(fig):
    """The figure's legend, the axes holding the peak's label, and the label."""
    (legend,) = fig.legends
    marked = [(ax, t) for ax in fig.axes for t in ax.texts if t.get_gid() == "peak"]
    assert len(marked) == 1
    return legend, *marked[0]


@pytest.mark.parametrize("steps", [2, 6])
def test_plot_legend_outside_the_axes_and_the_peak_labelled(steps):
    """The legend sits right of every axes (it covers no data), the peak has a label at or
    above its bytes, inside the axes and clear of the legend; each phase has its entry (no
    "not shaded" one) and the stack is drawn up to the peak even where it lasts one op."""
    import matplotlib.pyplot as plt

    from headroom.memory._report import _unit, figure

    _, mem = _tracked_steps(steps)
    fig = figure(mem)
    try:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        legend, ax, label = _legend_and_peak(fig)
        box = legend.get_window_extent(r)
        for a in fig.axes:
            assert box.x0 >= a.get_window_extent(r).x1, "the legend overlaps the axes"
        scale, _ = _unit(mem.peak)
        assert label.xy[1] * scale >= mem.peak
        assert f"peak {hr.memory.format_bytes(mem.peak)}" in label.get_text()
        assert "\nduring the optimizer step" in label.get_text()  # AdamW's temporaries
        where = label.get_window_extent(r)
        inside = ax.get_window_extent(r)
        assert inside.y0 <= where.y0 and where.y1 <= inside.y1
        assert not where.overlaps(box)
        texts = [t.get_text() for t in legend.get_texts()]
        assert not any("not shaded" in t for t in texts)
        assert {"phase: forward", "phase: backward", "phase: optimizer step"} <= set(texts)
        assert len(texts) <= 10
        # the stack (bands or the peak's own bars) is drawn up to just below the mark
        from matplotlib.collections import PolyCollection

        shapes = [p.get_path().transformed(p.get_patch_transform()) for p in ax.patches]
        shapes += [path for c in ax.collections if isinstance(c, PolyCollection)
                   for path in c.get_paths()]
        lo, hi = ax.get_xlim()
        # 0.5% of the axis wide at least: visible where the peak lasts a single op
        for dx in (-0.0025, 0.0025):
            point = (label.xy[0] + dx * (hi - lo), 0.999 * mem.peak / scale)
            assert any(path.contains_point(point) for path in shapes)
    finally:
        plt.close(fig)


def test_report_names_modules_with_their_class_and_the_moment_of_the_peak():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    with hr.track_memory(model=model) as mem:
        model(torch.randn(4, 3, 16, 16)).sum().backward()
    text = mem.report(advice=False)
    assert "  1 (BatchNorm2d) " in text and "  2 (ReLU) " in text, text
    assert "peak reached during the backward of " in text or \
        "peak reached during the forward of " in text, text


def test_agrees_with_pytorch_memtracker():
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
        # NOTE: SGD with momentum and foreach=False makes no temporaries in its step, so both
        # trackers' notion of "optimizer state" is the same (MemTracker counts a step's
        # temporaries as optimizer state).
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
        return model, opt

    x, y = torch.randn(128, 256), torch.randn(128, 256)

    def step(model, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    model, opt = make()
    theirs = mem_tracker.MemTracker()
    theirs.track_external(model, opt, x, y)
    with theirs:
        step(model, opt)
    snap = theirs.get_tracker_snapshot("peak")[torch.device("cpu")]
    t = {k.name if hasattr(k, "name") else k: v for k, v in snap.items()}

    model, opt = make()
    with hr.track_memory(model=model, optimizer=opt) as mem:
        step(model, opt)
    ours = mem.peak_by_category
    assert mem.peak == pytest.approx(t["Total"], rel=0.05)
    assert ours["parameters"] == pytest.approx(t["PARAM"], rel=0.05)
    assert ours["optimizer_state"] == pytest.approx(t["OPT"], rel=0.05)
    assert ours["activations"] == pytest.approx(t["ACT"], rel=0.05, abs=0.05 * mem.peak)
    # MemTracker leaves gradients created in backward as "temp" until its own hook sees them;
    # ours classifies them as gradients when AccumulateGrad hands them over.
    assert t["GRAD"] <= ours["gradients"] <= t["GRAD"] + t["TEMP"]
    assert ours["gradients"] == param_bytes(model)


@pytest.mark.gpu
def test_accelerator_device_stats_and_allocator():
    from tests.conftest import accelerator_type

    dev = accelerator_type()
    model = mlp().to(dev)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(B, D_IN, device=dev)
    with hr.track_memory(model=model, optimizer=opt) as mem:
        model(x).square().mean().backward()
        opt.step()
    s = mem.stats(dev)
    assert s.max_by_category["parameters"] == param_bytes(model)
    assert s.max_by_category["gradients"] == param_bytes(model)
    assert sum(s.peak_by_category.values()) == s.peak
    name = f"{dev}:{torch.device(dev, 0).index}"
    assert s.allocator[f"{name}/reserved"] >= s.allocator[f"{name}/allocated"] > 0
    assert s.allocator[f"{name}/max_reserved"] >= s.peak
    assert "allocator" in mem.report(file=open("/dev/null", "w"))  # noqa: SIM115


def test_rss_is_reported_beside_tracked_bytes():
    """Memory outside PyTorch (a NumPy array) is not a tracked tensor, but RSS sees it."""
    import numpy as np

    with hr.track_memory() as mem:
        a = np.ones(64 << 17)  # 64 MiB
        t = torch.ones(1 << 20)
        # the array lives until the sampling thread has seen it (a loaded machine may not run
        # that thread for a while; the process's high-water mark may predate the region)
        seen = len(mem.rss_timeline)
        deadline = time.monotonic() + 30
        while len(mem.rss_timeline) < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        del a
    rss = mem.rss
    assert rss["peak"] - rss["start"] >= 48 << 20  # measured independently of the tracker
    assert mem.peak == t.numel() * 4
    assert mem.rss_timeline and all(b > 0 for _, b in mem.rss_timeline)
    assert "process RSS" in mem.report()


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_a_compiled_model_is_said_once_to_run_eagerly(how):
    # PyTorch runs compiled frames eagerly under a dispatch mode: the tracker says so, once
    # per region, and what it measured is the eager model's
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    if how == "torch.compile":
        run = torch.compile(model, backend="eager")
    else:
        run = model
        model.compile(backend="eager")
    x = torch.randn(4, 8)
    run(x).sum().backward()  # compiled before tracking
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="runs compiled code eagerly") as rec:
        with hr.track_memory() as compiled:
            for _ in range(2):
                run(x).sum().backward()
                model.zero_grad(set_to_none=True)
    assert sum("track_memory" in str(w.message) for w in rec) == 1
    torch._dynamo.reset()
    eager = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    eager.load_state_dict(model.state_dict())
    with hr.track_memory() as plain:
        for _ in range(2):
            eager(x).sum().backward()
            eager.zero_grad(set_to_none=True)
    assert compiled.peak == plain.peak
    assert compiled.peak_by_category == plain.peak_by_category


def test_a_plot_that_fails_mid_write_leaves_the_previous_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    _, mem = _tracked_steps(1)
    path = tmp_path / "m.png"
    path.write_bytes(b"the previous plot")

    def broken(self, fname, *args, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        mem.plot(path)
    assert path.read_bytes() == b"the previous plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png"]
