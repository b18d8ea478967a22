"""The PNGs of a run are the bytes ``Figure.savefig(format="png")`` writes (issue 27 made them
cheaper to draw: one draw instead of savefig's two, the timeline's rectangles as one array per
category and its device separators as one line collection), and the timeline's shapes are those
its trace says: one rectangle per slice (widened to the minimum width), a separator between
devices."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from reports.figure_base import write_png
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


def savefig_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    write_png(fig, buf)
    return buf.getvalue()


def savefig_bytes_with_face(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="#ffeedd")
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
