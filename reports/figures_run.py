"""Figures of one run: memory.png (bytes per category at each device's peak, identical devices
folded into one bar) and timeline.png (the simulated iteration as a Gantt chart of device lanes).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from reports.figure_base import (
    CAPACITY_OFF_SCALE, CATEGORY_STYLE, GIB, GREYS, LANES, OOM_COLOUR, OTHER_STYLE, SLICE_STYLE, byte_unit,
    device_ranges, human_bytes, new_figure,
)
from specs.result import CATEGORIES, DeviceResult, Result


# ---------------------------------------------------------------- memory.png

@dataclass
class DeviceGroup:
    """Devices with identical stages, breakdown, capacity and OOM: drawn as one bar."""

    devices: list[int]
    first: DeviceResult

    @property
    def label(self) -> str:
        text = device_ranges(self.devices)
        return text if len(text) <= 12 else f"{len(self.devices)} devices"


def fold_devices(result: Result) -> list[DeviceGroup]:
    """Fold identical devices (same stages, peak, breakdown, capacity, OOM) into one group each,
    in order of first appearance, so a 1,024-device run draws a bar per distinct device."""
    groups: dict[tuple, DeviceGroup] = {}
    for d in result.devices:
        key = (tuple(d.stages), d.peak_bytes, d.capacity_bytes, d.oom,
               tuple(getattr(d.breakdown, c) for c in CATEGORIES))
        if key in groups:
            groups[key].devices.append(d.device)
        else:
            groups[key] = DeviceGroup([d.device], d)
    return list(groups.values())


def _segments(d: DeviceResult, scale: float = GIB) -> list[tuple[str, float]]:
    """(category, bytes / scale) stacked bottom-up; peak bytes not covered by the breakdown (a
    measured result that only knows its peak) become an 'unattributed' segment."""
    segs = [(c, getattr(d.breakdown, c) / scale) for c in CATEGORIES]
    rest = d.peak_bytes - d.breakdown.total_bytes
    if rest > 0:
        segs.append(("other", rest / scale))
    return segs


def _rectangles(xs, bottoms, heights, width: float = 0.8):
    """(n, 4, 2) vertices of bars ``width`` wide centred on ``xs`` from ``bottoms`` up by ``heights``:
    the rectangles ax.bar draws, as one array (PolyCollection's fast path)."""
    import numpy as np

    x0 = np.asarray(xs, dtype=float) - width / 2
    x1 = x0 + width
    y0 = np.asarray(bottoms, dtype=float)
    y1 = y0 + np.asarray(heights, dtype=float)
    return np.stack([np.stack(c, axis=-1) for c in ((x0, y0), (x0, y1), (x1, y1), (x1, y0))], axis=1)


def memory_figure(result: Result):
    """Stacked bars of bytes per category at each device's peak, the capacity line, OOM marked.
    The unit (GiB/MiB/KiB) follows the largest value drawn; when every peak is under 5 % of the
    capacity (a tiny CPU model) the axis follows the peaks and the capacity is named, not drawn."""
    groups = fold_devices(result)
    n = len(groups)
    peak_bytes = max((g.first.peak_bytes for g in groups), default=0)
    cap_bytes = max((g.first.capacity_bytes for g in groups), default=0)
    cap_shown = not cap_bytes or peak_bytes >= CAPACITY_OFF_SCALE * cap_bytes
    unit, scale = byte_unit(max(peak_bytes, cap_bytes) if cap_shown else peak_bytes)
    fig = new_figure(min(16.0, max(7.0, 2.5 + 0.5 * n)), 5.0)
    ax = fig.add_subplot()
    import numpy as np
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    xs = list(range(n))
    # one PolyCollection of rectangles per category, added without autoscaling (the limits are set
    # below): ax.bar made a Rectangle per bar and updated the data limits for each, ~1 s for 7
    # categories x 64 bars (llama3_70b on 8 H100 nodes); the legend gets a Patch per category as bar's
    # did. Capacity first, then the categories bottom-up, then OOM: the legend's order under ax.bar
    bars: list[tuple[object, str]] = []
    bottoms = np.zeros(n)
    segments = [dict(_segments(g.first, scale)) for g in groups]
    for cat in list(CATEGORIES) + ["other"]:
        heights = np.array([seg.get(cat, 0.0) for seg in segments])
        if not (heights > 0).any():
            continue
        colour, label = CATEGORY_STYLE.get(cat, OTHER_STYLE)
        shown = heights > 0
        ax.add_collection(PolyCollection(_rectangles(np.flatnonzero(shown), bottoms[shown], heights[shown]),
                                         facecolors=colour, edgecolors="white", linewidths=0.3), autolim=False)
        bars.append((Patch(facecolor=colour, edgecolor="white", linewidth=0.3), label))
        bottoms = bottoms + heights
    caps = [g.first.capacity_bytes / scale for g in groups]
    if not cap_shown:
        ax.plot([], [], " ", label=f"capacity {human_bytes(cap_bytes, None)}\n(off the scale: peaks use "
                                   f"{100 * peak_bytes / cap_bytes:.2g} % of it)")
        caps = []
    elif len(set(caps)) == 1:
        ax.axhline(caps[0], color="black", linestyle="--", linewidth=1.2,
                   label=f"capacity {human_bytes(cap_bytes, None)}")
    else:
        ax.hlines(caps, [x - 0.45 for x in xs], [x + 0.45 for x in xs], colors="black", linestyles="--",
                  linewidth=1.2, label="capacity")
    peaks = [g.first.peak_bytes / scale for g in groups]
    top = max(peaks + caps + [1e-9])
    digits = 1 if top >= 10 else 2
    oom_x = [x for x, g in zip(xs, groups) if g.first.oom]
    dense = n > 24  # the OOM label on one line, turned upright ("+98.5"), as wide as a bar ~20 px wide
    if oom_x:  # one hatched outline per OOM bar; hatch.color: the hatches in red on every matplotlib
        import matplotlib as mpl  # (a collection's hatches follow its edges only from matplotlib 3.10)

        with mpl.rc_context({"hatch.color": OOM_COLOUR}):
            ax.add_collection(PolyCollection(_rectangles(oom_x, [0.0] * len(oom_x), [peaks[x] for x in oom_x]),
                                             facecolors="none", edgecolors=OOM_COLOUR, linewidths=2.0, hatch="//"),
                              autolim=False)
    # the labels above the bars stay inside the axes (its top is 1.2 x the tallest): out of the
    # layout, which would measure each of them twice more (60 at 64 devices)
    for x, g, peak in zip(xs, groups, peaks):
        if g.first.oom:
            over = g.first.oom_over_bytes  # in the axis unit when it reads well there, else its own
            over_text = f"{over / scale:.1f}" if byte_unit(over)[0] == unit else human_bytes(over)
            if dense:
                ax.text(x, peak + 0.01 * top, f"+{over_text}", ha="center", va="bottom", rotation=90,
                        color=OOM_COLOUR, fontsize=6, fontweight="bold", in_layout=False)
            else:
                ax.text(x, peak + 0.02 * top, f"OOM\n+{over_text}", ha="center",
                        va="bottom", color=OOM_COLOUR, fontsize=8, fontweight="bold", in_layout=False)
        elif not dense:
            ax.text(x, peak + 0.01 * top, f"{peak:.{digits}f}", ha="center", va="bottom", fontsize=7, in_layout=False)
    ax.set_ylim(0, top * 1.2)
    ax.set_xlim(-0.6, n - 0.4)
    step = max(1, math.ceil(n / 40))
    ax.set_xticks(xs[::step])
    many = n > 16
    labels = [f"{g.label}" + ("" if many else "\nstage " + ",".join(map(str, g.first.stages)))
              for g in groups[::step]]
    ax.set_xticklabels(labels, rotation=90 if many else 0, fontsize=7 if many else 8)
    for tick, g in zip(ax.get_xticklabels(), groups[::step]):
        if g.first.oom:
            tick.set_color(OOM_COLOUR)
    folded = sum(len(g.devices) for g in groups) > n
    ax.set_xlabel("device" + (" (identical devices folded into one bar)" if folded else ""))
    ax.set_ylabel(f"{unit} at the device's peak")
    ooms = len(result.oom_devices)
    ax.set_title(f"{result.model} on {result.hardware} ({len(result.devices)} devices, {result.source}): "
                 f"peak {human_bytes(peak_bytes, digits)}, "
                 + (f"OOM on {ooms} device(s)" if ooms else "fits"), fontsize=10)
    handles, labels_ = ax.get_legend_handles_labels()
    handles += [h for h, _ in bars]
    labels_ += [label for _, label in bars]
    if ooms:
        handles.append(Patch(fill=False, edgecolor=OOM_COLOUR, hatch="//", linewidth=2.0))
        labels_.append(f"out of memory\n(+N {unit} over capacity)" if dense and oom_x else "out of memory")
    ax.legend(handles, labels_, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return fig


# ---------------------------------------------------------------- timeline.png

@dataclass
class Lane:
    """One row of the Gantt chart: one device's compute, communication or swap work."""

    pid: int
    lane: str
    slices: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # cat -> [(start_s, dur_s)]


_PROC = re.compile(r"device (\d+) \(position (\d+), stages \[([^\]]*)\], for (\d+) devices\)")


def device_label(process_name: str, pid: int) -> str:
    """'device 64 (position 1, stages [1], for 64 devices)' -> 'dev 64 · stage 1 · ×64'."""
    m = _PROC.fullmatch(process_name)
    if not m:
        return process_name[:28] if process_name else f"pid {pid}"
    dev, _, stages, n = m.groups()
    return f"dev {dev} · stage {stages.replace(' ', '')}" + (f" · ×{n}" if int(n) > 1 else "")


def lane_of(cat: str, tid: int) -> str:
    if cat == "swap":
        return "swap"
    return "compute" if tid == 0 else "comm"


def trace_lanes(trace: dict) -> tuple[list[Lane], dict[int, str]]:
    """Chrome trace -> lanes (sorted by pid, then compute/comm/swap) and pid -> process name.
    Timestamps in the trace are microseconds; lanes hold seconds."""
    names: dict[int, str] = {}
    lanes: dict[tuple[int, str], Lane] = {}
    for e in trace.get("traceEvents", []):
        ph = e.get("ph")
        if ph == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e.get("args", {}).get("name", "")
        elif ph == "X":
            key = (e["pid"], lane_of(e.get("cat", ""), e.get("tid", 0)))
            lane = lanes.get(key) or lanes.setdefault(key, Lane(*key))
            lane.slices.setdefault(e.get("cat", "other"), []).append((e["ts"] / 1e6, e["dur"] / 1e6))
    ordered = sorted(lanes.values(), key=lambda ln: (ln.pid, LANES.index(ln.lane)))
    return ordered, names


def _row_labels(ax, labels: list[str], fontsize: float) -> None:
    """A label and a tick mark left of each row ``y`` = 0, 1, ... where the y axis's ticks would
    put them (the same font, pad, tick length and width), drawn as plain texts and one line of tick
    markers: 128 y ticks at 64 devices cost a Tick each (two lines, two texts) and measuring their
    labels again for the layout and the axis, ~0.15 s of the timeline's CPU."""
    import matplotlib as mpl
    from matplotlib.lines import TICKLEFT, Line2D
    from matplotlib.transforms import ScaledTranslation

    ax.set_yticks([])
    rc = mpl.rcParams
    size, pad = rc["ytick.major.size"], rc["ytick.major.pad"]
    rows = ax.get_yaxis_transform(which="tick1")
    ax.add_artist(Line2D([0] * len(labels), range(len(labels)), linestyle="none", marker=TICKLEFT,
                         markersize=size, markeredgewidth=rc["ytick.major.width"], color=rc["ytick.color"],
                         transform=rows, clip_on=False, zorder=2.5))
    to_left = rows + ScaledTranslation(-(size + pad) / 72, 0, ax.figure.dpi_scale_trans)
    colour = rc["ytick.color"] if rc["ytick.labelcolor"] == "inherit" else rc["ytick.labelcolor"]
    for y, text in enumerate(labels):
        ax.text(0, y, text, transform=to_left, ha="right", va="center_baseline", fontsize=fontsize, color=colour,
                clip_on=False)


def timeline_figure(trace: dict, result: Result | None = None):
    """Gantt chart: one row per (device, lane), one colour per slice category, legend on top."""
    lanes, names = trace_lanes(trace)
    rows = max(1, len(lanes))
    fig = new_figure(13.0, min(16.0, max(3.2, 1.4 + 0.32 * rows)))
    ax = fig.add_subplot()
    cats: dict[str, tuple[str, str]] = {}
    end = max((s + d for ln in lanes for spans in ln.slices.values() for s, d in spans), default=0.0)
    # a p2p send or swap can last 1e-4 of the iteration: widen every slice to ~1 pixel so it shows
    min_w = end / 1200
    # one PolyCollection per (category, seams) for the whole chart, added without autoscaling (the
    # limits are set below): a broken_barh per lane and category cost ~4 ms each, 256 of them at
    # 64 devices (llama3_70b on 8 H100 nodes)
    # (category, seams) -> (starts_s, durations_s, rows), turned below into one (n, 4, 2) array of
    # rectangles each: PolyCollection's fast path, the same vertices as a list of 4-tuples per slice
    # (half the figure's build time at 64 devices, issue 27)
    rects: dict[tuple[str, bool], tuple[list[float], list[float], list[int]]] = {}
    for y, lane in enumerate(lanes):
        # white seams between back-to-back passes; not on thin transfers or dense rows (they wash out)
        seams = lane.lane == "compute" and sum(map(len, lane.slices.values())) <= 1200
        for cat, spans in lane.slices.items():
            if cat not in cats:
                colour, label = SLICE_STYLE.get(cat, (GREYS[len(cats) % len(GREYS)], cat))
                cats[cat] = (colour, label)
            starts, durations, rows_ = rects.setdefault((cat, seams), ([], [], []))
            starts += [s for s, _ in spans]
            durations += [d for _, d in spans]
            rows_ += [y] * len(spans)
    import numpy as np
    from matplotlib.collections import PolyCollection

    for (cat, seams), (starts, durations, rows_) in rects.items():
        x0 = np.asarray(starts, dtype=float)
        x1 = x0 + np.maximum(np.asarray(durations, dtype=float), min_w)
        y = np.asarray(rows_, dtype=float)
        y0, y1 = y - 0.4, y + 0.4
        verts = np.stack([np.stack(c, axis=-1) for c in ((x0, y0), (x0, y1), (x1, y1), (x1, y0))], axis=1)
        ax.add_collection(PolyCollection(verts, facecolors=cats[cat][0], edgecolors="white" if seams else "none",
                                         linewidths=0.8 if seams else 0), autolim=False)
    labels, prev, seps = [], None, []
    for y, lane in enumerate(lanes):
        if lane.pid != prev:
            labels.append(f"{device_label(names.get(lane.pid, ''), lane.pid)}  {lane.lane}")
            if y:
                seps.append([(0, y - 0.5), (1, y - 0.5)])
        else:
            labels.append(lane.lane)
        prev = lane.pid
    if seps:  # one line collection for every separator: the pixels of an axhline each, without 63 Line2D
        from matplotlib.collections import LineCollection

        ax.add_collection(LineCollection(seps, colors="black", linewidths=0.5, capstyle="projecting", zorder=2,
                                         transform=ax.get_yaxis_transform(which="grid")), autolim=False)
    _row_labels(ax, labels, fontsize=7 if rows > 24 else 8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.01 if end else 1.0)
    ax.set_xlabel("time in the iteration (s)")
    ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    order = [c for c in SLICE_STYLE if c in cats] + [c for c in cats if c not in SLICE_STYLE]
    ax.legend([Patch(color=cats[c][0]) for c in order], [cats[c][1] for c in order], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=min(4, max(1, len(order))), fontsize=8, frameon=False)
    head = "simulated timeline of one iteration"
    if result is not None:
        head = (f"{result.model} on {result.hardware}: {head}, {result.iteration_time_s:.3g} s "
                f"({len({ln.pid for ln in lanes})} representative devices; identical peers not drawn)")
    fig.suptitle(head, fontsize=10)
    return fig
