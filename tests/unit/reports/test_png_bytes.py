"""The PNGs of a run are the bytes ``Figure.savefig(format="png", pil_kwargs=PNG_KWARGS)`` writes
(issue 27 made them cheaper to draw: one draw instead of savefig's two, the timeline's rectangles as
one array per category and its device separators as one line collection; then the memory bars as
one collection per category, the timeline's row labels as plain texts, a faster zlib level): the
same pixels as savefig at its defaults, the same bytes for the same inputs, and the shapes are
those the result and trace say: one rectangle per bar segment and per slice (widened to the minimum
width), a separator between devices, a label and a tick per row."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from reports.figure_base import CATEGORY_STYLE, OOM_COLOUR, PNG_KWARGS, write_png
from reports.figures_run import memory_figure, timeline_figure, trace_lanes
from specs import DeviceResult, MemoryBreakdown, Result

GIB = 1 << 30


def result(peaks_gib: list[float], capacity_gib: float = 32.0) -> Result:
    devices = []
    for i, peak in enumerate(peaks_gib):
        peak_b, cap = int(peak * GIB), int(capacity_gib * GIB)
        bd = MemoryBreakdown(parameters_bytes=peak_b // 4, optimizer_bytes=peak_b // 4,
                             activations_bytes=peak_b - 2 * (peak_b // 4))
        devices.append(DeviceResult(device=i, stages=[i], layers=[(i, i + 1)], capacity_bytes=cap, peak_bytes=peak_b,
                                    breakdown=bd, oom=peak_b > cap, oom_over_bytes=max(0, peak_b - cap)))
    return Result(source="simulated", plan_id="abc123", model="toy", hardware="toyhw", devices=devices,
                  iteration_time_s=0.01, samples_per_s=3200.0, tflops_per_device=1.0)


def trace(devices: int = 3) -> dict:
    """Back-to-back passes, thin p2p sends (narrower than the minimum width) and swaps per device."""
    ev = []
    for pid in range(devices):
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                   "args": {"name": f"device {pid} (position {pid}, stages [{pid}], for 1 devices)"}})
        for k in range(6):
            ev.append({"ph": "X", "cat": "forward", "name": f"F{k}", "pid": pid, "tid": 0, "ts": 700.0 * k + 13 * pid,
                       "dur": 700.0})
            ev.append({"ph": "X", "cat": "backward", "name": f"B{k}", "pid": pid, "tid": 0,
                       "ts": 4200 + 1400.0 * k + 13 * pid, "dur": 1400.0})
            ev.append({"ph": "X", "cat": "p2p", "name": f"s{k}", "pid": pid, "tid": 1, "ts": 700.0 * k + 690, "dur": 0.3})
            ev.append({"ph": "X", "cat": "swap", "name": f"w{k}", "pid": pid, "tid": 5, "ts": 700.0 * k, "dur": 250.0})
    return {"traceEvents": ev}


def savefig_bytes(fig, **pil_kwargs) -> bytes:
    """savefig's PNG at write_png's settings (PNG_KWARGS), or at ``pil_kwargs`` when given."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", pil_kwargs=pil_kwargs or dict(PNG_KWARGS))
    return buf.getvalue()


def pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        im.load()
        assert im.format == "PNG"
        return np.asarray(im)


def write_png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    write_png(fig, buf)
    return buf.getvalue()


def savefig_bytes_with_face(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="#ffeedd", pil_kwargs=dict(PNG_KWARGS))
    return buf.getvalue()


@pytest.mark.parametrize("draw", [
    lambda: memory_figure(result([10, 40, 40, 12, 50])),  # OOM bars and their labels
    lambda: memory_figure(result([0.001, 0.002])),  # capacity off the scale
    lambda: timeline_figure(trace(), result([1, 1, 1])),
], ids=["memory_oom", "memory_tiny", "timeline"])
def test_write_png_writes_the_bytes_savefig_writes(draw):
    one, two = draw(), draw()  # a fresh figure each: savefig and write_png both run the layout themselves
    new = write_png_bytes(one)
    assert new[:8] == b"\x89PNG\r\n\x1a\n"
    assert new == savefig_bytes(two)


@pytest.mark.parametrize("draw", [
    lambda: memory_figure(result([10, 40, 40, 12, 50])),
    lambda: memory_figure(result([10 + i for i in range(40)])),  # many bars: upright one-line OOM labels
    lambda: timeline_figure(trace(), result([1, 1, 1])),
], ids=["memory_oom", "memory_dense", "timeline"])
def test_the_faster_zlib_level_keeps_savefigs_pixels_and_the_bytes_are_deterministic(draw):
    """PNG_KWARGS only changes how the pixels are compressed: decoded, they are savefig's at PIL's
    defaults; and the same figure drawn twice writes the same bytes."""
    new = write_png_bytes(draw())
    assert new == write_png_bytes(draw())
    default = savefig_bytes(draw(), compress_level=6)  # PIL's default level
    assert np.array_equal(pixels(new), pixels(default))
    assert pixels(new).shape[2] == 4 and len(new) < 1.5 * len(default)


def test_write_png_falls_back_to_savefig_under_a_non_default_rc():
    import matplotlib as mpl

    with mpl.rc_context({"savefig.facecolor": "#ffeedd"}):
        assert write_png_bytes(memory_figure(result([10, 40]))) == savefig_bytes(memory_figure(result([10, 40])))
    assert write_png_bytes(memory_figure(result([10, 40]))) != savefig_bytes_with_face(memory_figure(result([10, 40])))


def test_timeline_rectangles_and_separators_follow_the_trace():
    tr = trace()
    lanes, _ = trace_lanes(tr)
    fig = timeline_figure(tr, result([1, 1, 1]))
    ax = fig.axes[0]
    from matplotlib.collections import LineCollection, PolyCollection

    polys = [c for c in ax.collections if isinstance(c, PolyCollection)]
    end = max(s + d for ln in lanes for spans in ln.slices.values() for s, d in spans)
    min_w = end / 1200
    want = sorted((round(s, 12), round(s + max(d, min_w), 12), y) for y, ln in enumerate(lanes)
                  for spans in ln.slices.values() for s, d in spans)
    got = []
    for c in polys:
        for path in c.get_paths():
            v = path.vertices
            assert v.shape == (5, 2) and np.array_equal(v[0], v[-1])  # closed rectangle
            x0, x1, y0, y1 = v[:, 0].min(), v[:, 0].max(), v[:, 1].min(), v[:, 1].max()
            assert y1 - y0 == pytest.approx(0.8) and (y0 + y1) / 2 == pytest.approx(round((y0 + y1) / 2))
            got.append((round(float(x0), 12), round(float(x1), 12), round((y0 + y1) / 2)))
    assert sorted(got) == want
    assert any(d < min_w for ln in lanes for spans in ln.slices.values() for _, d in spans)  # some were widened
    (seps,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    firsts = [y for y, ln in enumerate(lanes) if y and ln.pid != lanes[y - 1].pid]
    assert firsts == [3, 6]
    assert [seg[0][1] for seg in seps.get_segments()] == [y - 0.5 for y in firsts]


def test_a_run_writes_the_figures_savefig_would(tmp_path):
    """write_figures (reports.outputs) through write_png: memory.png and timeline.png are savefig's bytes."""
    from reports.outputs import write_figures

    r, tr = result([10, 40, 12]), trace()
    paths = write_figures(tmp_path, r, tr)
    assert [p.name for p in paths] == ["memory.png", "timeline.png"]
    assert Path(paths[0]).read_bytes() == savefig_bytes(memory_figure(r))
    assert Path(paths[1]).read_bytes() == savefig_bytes(timeline_figure(json.loads(json.dumps(tr)), r))


def rectangles(collection) -> list[tuple[float, float, float, float]]:
    """(x0, x1, y0, y1) of each closed rectangle of a PolyCollection."""
    out = []
    for path in collection.get_paths():
        v = path.vertices
        assert v.shape == (5, 2) and np.array_equal(v[0], v[-1])
        out.append((float(v[:, 0].min()), float(v[:, 0].max()), float(v[:, 1].min()), float(v[:, 1].max())))
    return out


def test_memory_bars_are_one_collection_per_category_stacked_as_the_breakdown_says():
    r = result([10, 40, 12, 50])  # devices 1 and 3 over 32 GiB
    ax = memory_figure(r).axes[0]
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_hex

    assert not ax.patches  # no Rectangle per bar (ax.bar's): the bars are collections
    polys = [c for c in ax.collections if isinstance(c, PolyCollection)]
    filled = [c for c in polys if c.get_facecolor().size]
    cats = ["parameters_bytes", "optimizer_bytes", "activations_bytes"]  # gradients are 0: no collection
    assert [to_hex(c.get_facecolor()[0]) for c in filled] == [CATEGORY_STYLE[c][0] for c in cats]
    bottoms = [0.0] * 4
    for cat, coll in zip(cats, filled):
        got = rectangles(coll)
        assert len(got) == 4
        for x, (x0, x1, y0, y1) in enumerate(got):
            d = r.devices[x]
            assert (x0, x1) == pytest.approx((x - 0.4, x + 0.4))
            assert y0 == pytest.approx(bottoms[x]) and y1 - y0 == pytest.approx(getattr(d.breakdown, cat) / GIB)
            bottoms[x] = y1
    assert bottoms == pytest.approx([d.peak_bytes / GIB for d in r.devices])
    (oom,) = [c for c in polys if not c.get_facecolor().size]  # the hatched outlines, one per OOM bar
    assert oom.get_hatch() == "//" and to_hex(oom.get_edgecolor()[0]) == OOM_COLOUR
    assert [(x0 + x1) / 2 for x0, x1, _, _ in rectangles(oom)] == pytest.approx([1, 3])
    assert [y1 for *_, y1 in rectangles(oom)] == pytest.approx([40, 50], rel=1e-6)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["capacity 32 GiB", "parameters", "optimizer state", "activations", "out of memory"]
    assert [t.get_text() for t in ax.texts] == ["10.0", "OOM\n+8.0", "12.0", "OOM\n+18.0"]
    assert ax.get_xlim() == (-0.6, 3.6) and ax.get_ylim() == pytest.approx((0, 60))


def test_many_bars_keep_the_amount_over_capacity_on_one_upright_line():
    r = result([30 + i for i in range(40)])  # 40 bars, 37 of them over 32 GiB
    ax = memory_figure(r).axes[0]
    texts = ax.texts
    assert [t.get_text() for t in texts] == [f"+{i - 2:.1f}" for i in range(3, 40)]
    assert all(t.get_rotation() == 90 and t.get_color() == OOM_COLOUR for t in texts)
    assert "out of memory\n(+N GiB over capacity)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_timeline_rows_have_a_label_and_a_tick_where_the_y_axis_would_put_them():
    tr = trace()
    lanes, _ = trace_lanes(tr)
    ax = timeline_figure(tr, result([1, 1, 1])).axes[0]
    from matplotlib.lines import TICKLEFT

    assert [t.get_text() for t in ax.texts] == ["dev 0 · stage 0  compute", "comm", "swap", "dev 1 · stage 1  compute",
                                                "comm", "swap", "dev 2 · stage 2  compute", "comm", "swap"]
    assert [t.get_position()[1] for t in ax.texts] == list(range(len(lanes)))
    assert all(t.get_horizontalalignment() == "right" for t in ax.texts)
    (ticks,) = [ln for ln in ax.lines if ln.get_marker() == TICKLEFT]
    assert list(ticks.get_ydata()) == list(range(len(lanes))) and set(ticks.get_xdata()) == {0}
    assert not ax.get_yticks().size  # the y axis's own ticks are off: the texts are the labels


@pytest.mark.parametrize("draw", [
    lambda: memory_figure(result([10, 40, 40, 12, 50])),
    lambda: memory_figure(result([30 + 3 * i for i in range(64)], capacity_gib=80)),
    lambda: memory_figure(result([0.001, 0.002])),
    lambda: timeline_figure(trace(), result([1, 1, 1])),
    lambda: timeline_figure(trace(64), result([1] * 64)),
], ids=["memory_oom", "memory_64", "memory_tiny", "timeline", "timeline_64"])
def test_no_text_is_clipped_by_the_figure_edges(draw):
    """Everything drawn around and in the axes (titles, axis labels, the ticks in view and their
    labels, row labels, legend, OOM amounts) lies inside the figure: the layout still makes room
    for what the figures write."""
    fig = draw()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [(ax, ax.get_tightbbox(renderer)) for ax in fig.axes]  # tick labels in view, labels, title, legend
    boxes += [(t.get_text(), t.get_window_extent(renderer)) for ax in fig.axes for t in ax.texts]  # in_layout or not
    boxes += [(t.get_text(), t.get_window_extent(renderer)) for t in fig.texts]  # the suptitle
    assert len(boxes) > 2
    for what, bb in boxes:
        assert bb.x0 >= 0 and bb.y0 >= 0 and bb.x1 <= fig.bbox.width and bb.y1 <= fig.bbox.height, what
