"""The figure half of the writer: matplotlib figures built from Results, traces and sweep rows.

Each ``*_figure`` function takes data and returns a matplotlib ``Figure`` (no file I/O, no global
pyplot state); ``reports.outputs`` saves them. matplotlib is imported lazily inside the functions,
with the Agg canvas attached explicitly, so ``import specs`` never needs matplotlib and no GUI
backend is ever chosen. The small helpers that shape the data (folding identical devices, lanes
of a trace, error statistics) are plain Python and tested on their own.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from specs.result import CATEGORIES, DeviceResult, Result

GIB = float(1 << 30)
#: binary byte units, largest first (the shown unit is picked from the magnitude: byte_unit)
BYTE_UNITS = (("GiB", GIB), ("MiB", float(1 << 20)), ("KiB", float(1 << 10)))


def byte_unit(largest_bytes: float) -> tuple[str, float]:
    """(name, bytes per unit) to show byte counts whose largest is ``largest_bytes``: GiB from
    1 GiB up, MiB from 1 MiB, else KiB — so a CPU run's 5 MiB peak reads 5.00 MiB, not 0.00 GiB."""
    for name, size in BYTE_UNITS:
        if largest_bytes >= size:
            return name, size
    return BYTE_UNITS[-1]


def human_bytes(n: float, digits: int | None = 1) -> str:
    """One byte count in its own unit: 38_755_041_280 -> '36.1 GiB', 3_145_728 -> '3.0 MiB';
    ``digits=None``: three significant digits (25_232_932_864 -> '23.5 GiB', 2**35 -> '32 GiB');
    under 1 KiB, whole bytes ('4 B')."""
    if abs(n) < BYTE_UNITS[-1][1]:
        return f"{n:.0f} B"
    name, size = byte_unit(abs(n))
    return f"{n / size:.3g} {name}" if digits is None else f"{n / size:.{digits}f} {name}"

#: colour and legend label per memory category (Result.devices[*].breakdown)
CATEGORY_STYLE = {
    "parameters_bytes": ("#4c72b0", "parameters"),
    "gradients_bytes": ("#55a868", "gradients"),
    "optimizer_bytes": ("#8172b3", "optimizer state"),
    "activations_bytes": ("#dd8452", "activations"),
    "buffers_bytes": ("#937860", "buffers"),
    "swapped_in_bytes": ("#da8bc3", "swapped in / peer copies"),
    "stashed_weights_bytes": ("#ccb974", "stashed weights"),
}
OTHER_STYLE = ("#bbbbbb", "unattributed")
OOM_COLOUR = "#c0392b"

#: colour per trace slice category ("cat" of the simulator's X events); unknown ones cycle GREYS
SLICE_STYLE = {
    "forward": ("#4c72b0", "forward"),
    "backward": ("#dd8452", "backward"),
    "recompute": ("#8172b3", "recompute"),
    "optimizer_step": ("#7f7f7f", "optimizer step"),
    "p2p": ("#55a868", "p2p send (activations / grads)"),
    "allreduce_grads": ("#17becf", "gradient all-reduce"),
    "swap": ("#c44e52", "swap (d2h / h2d / peer)"),
}
GREYS = ("#aaaaaa", "#666666", "#cccccc")
LANES = ("compute", "comm", "swap")


def _new_figure(width_in: float, height_in: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: specs imports without matplotlib
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def device_ranges(devices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], devices[0]
    for prev, cur in zip(devices, devices[1:] + [None]):
        if cur is None or cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(parts)


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


#: below this share of the capacity the bars would be a few pixels: scale to the peaks instead
CAPACITY_OFF_SCALE = 0.05


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
    fig = _new_figure(min(16.0, max(7.0, 2.5 + 0.5 * n)), 5.0)
    ax = fig.add_subplot()
    xs = list(range(n))
    bottoms = [0.0] * n
    used: dict[str, None] = {}
    for cat in list(CATEGORIES) + ["other"]:
        heights = [dict(_segments(g.first, scale)).get(cat, 0.0) for g in groups]
        if not any(h > 0 for h in heights):
            continue
        colour, label = CATEGORY_STYLE.get(cat, OTHER_STYLE)
        ax.bar(xs, heights, 0.8, bottom=bottoms, color=colour, label=label, edgecolor="white", linewidth=0.3)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
        used[cat] = None
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
    for x, g, peak in zip(xs, groups, peaks):
        if g.first.oom:
            ax.bar([x], [peak], 0.8, fill=False, edgecolor=OOM_COLOUR, linewidth=2.0, hatch="//")
            over = g.first.oom_over_bytes  # in the axis unit when it reads well there, else its own
            over_text = f"{over / scale:.1f}" if byte_unit(over)[0] == unit else human_bytes(over)
            ax.text(x, peak + 0.02 * top, f"OOM\n+{over_text}", ha="center",
                    va="bottom", color=OOM_COLOUR, fontsize=8 if n <= 24 else 6, fontweight="bold")
        elif n <= 24:
            ax.text(x, peak + 0.01 * top, f"{peak:.{digits}f}", ha="center", va="bottom", fontsize=7)
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
    if ooms:
        from matplotlib.patches import Patch

        handles.append(Patch(fill=False, edgecolor=OOM_COLOUR, hatch="//", linewidth=2.0))
        labels_.append("out of memory")
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


def timeline_figure(trace: dict, result: Result | None = None):
    """Gantt chart: one row per (device, lane), one colour per slice category, legend on top."""
    lanes, names = trace_lanes(trace)
    rows = max(1, len(lanes))
    fig = _new_figure(13.0, min(16.0, max(3.2, 1.4 + 0.32 * rows)))
    ax = fig.add_subplot()
    cats: dict[str, tuple[str, str]] = {}
    end = max((s + d for ln in lanes for spans in ln.slices.values() for s, d in spans), default=0.0)
    # a p2p send or swap can last 1e-4 of the iteration: widen every slice to ~1 pixel so it shows
    min_w = end / 1200
    for y, lane in enumerate(lanes):
        # white seams between back-to-back passes; not on thin transfers or dense rows (they wash out)
        seams = lane.lane == "compute" and sum(map(len, lane.slices.values())) <= 1200
        for cat, spans in lane.slices.items():
            if cat not in cats:
                colour, label = SLICE_STYLE.get(cat, (GREYS[len(cats) % len(GREYS)], cat))
                cats[cat] = (colour, label)
            ax.broken_barh([(s, max(d, min_w)) for s, d in spans], (y - 0.4, 0.8), facecolors=cats[cat][0],
                           edgecolor="white" if seams else "none", linewidth=0.8 if seams else 0)
    labels, prev = [], None
    for y, lane in enumerate(lanes):
        if lane.pid != prev:
            labels.append(f"{device_label(names.get(lane.pid, ''), lane.pid)}  {lane.lane}")
            if y:
                ax.axhline(y - 0.5, color="black", linewidth=0.5)
        else:
            labels.append(lane.lane)
        prev = lane.pid
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(labels, fontsize=7 if rows > 24 else 8)
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


# ---------------------------------------------------------------- compare.png

@dataclass(frozen=True)
class PeakPair:
    device: int
    rank: int | None
    predicted_bytes: int
    measured_bytes: int

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes if self.measured_bytes else 0.0


def peak_pairs(predicted: Result, measured: Result) -> list[PeakPair]:
    """Devices present in both results, matched by device id, in device order."""
    pred = {d.device: d for d in predicted.devices}
    return [PeakPair(m.device, m.rank, pred[m.device].peak_bytes, m.peak_bytes)
            for m in sorted(measured.devices, key=lambda d: d.device) if m.device in pred]


def error_stats(pairs: list[PeakPair]) -> dict[str, float]:
    """Mean absolute % error, max |%| error, mean signed % error (bias; + = over-predicted),
    RMSE in GiB, over the matched devices."""
    if not pairs:
        return {"n": 0, "mape_pct": 0.0, "max_abs_pct": 0.0, "bias_pct": 0.0, "rmse_gib": 0.0}
    errs = [p.error_pct for p in pairs]
    sq = [((p.predicted_bytes - p.measured_bytes) / GIB) ** 2 for p in pairs]
    return {"n": len(pairs), "mape_pct": sum(map(abs, errs)) / len(errs), "max_abs_pct": max(map(abs, errs)),
            "bias_pct": sum(errs) / len(errs), "rmse_gib": math.sqrt(sum(sq) / len(sq))}


def compare_figure(predicted: Result, measured: Result):
    """Three panels: predicted vs measured peak per rank (y = x, ±10 % band), error per rank
    (a histogram past 64 ranks), iteration time side by side."""
    pairs = peak_pairs(predicted, measured)
    st = error_stats(pairs)
    fig = _new_figure(15.0, 4.8)
    ax1, ax2, ax3 = fig.subplots(1, 3, width_ratios=[1.1, 1.3, 0.7])
    biggest = max([p.measured_bytes for p in pairs] + [p.predicted_bytes for p in pairs] + [0])
    unit, scale = byte_unit(biggest)  # CPU runs are MiB-sized
    xs = [p.measured_bytes / scale for p in pairs]
    ys = [p.predicted_bytes / scale for p in pairs]
    hi = max(xs + ys + [1e-9]) * 1.1
    ax1.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="#dddddd", label="±10 %")
    ax1.plot([0, hi], [0, hi], color="black", linestyle="--", linewidth=1, label="y = x")
    oom = {d.device for d in measured.devices if d.oom}
    ax1.scatter(xs, ys, s=28, zorder=3, c=[OOM_COLOUR if p.device in oom else "#4c72b0" for p in pairs],
                label="rank")
    if len(pairs) <= 16:
        for p, x, y in zip(pairs, xs, ys):
            ax1.annotate(str(p.rank if p.rank is not None else p.device), (x, y), textcoords="offset points",
                         xytext=(4, -10), fontsize=7)
    ax1.set_xlim(0, hi)
    ax1.set_ylim(0, hi)
    ax1.set_xlabel(f"{measured.source} peak ({unit})")
    ax1.set_ylabel(f"{predicted.source} peak ({unit})")
    ax1.set_title(f"peak per rank: mean |err| {st['mape_pct']:.1f} %, max {st['max_abs_pct']:.1f} %\n"
                  f"bias {st['bias_pct']:+.1f} %, RMSE {st['rmse_gib'] * GIB / scale:.3g} {unit}, {st['n']} ranks", fontsize=9)
    ax1.legend(fontsize=7, loc="upper left")
    errs = [p.error_pct for p in pairs]
    if len(pairs) <= 64:
        ax2.bar(range(len(pairs)), errs, color=["#4c72b0" if e >= 0 else "#dd8452" for e in errs])
        ax2.set_xticks(range(len(pairs)))
        ax2.set_xticklabels([str(p.rank if p.rank is not None else p.device) for p in pairs],
                            fontsize=7, rotation=90 if len(pairs) > 16 else 0)
        ax2.set_xlabel("rank" if any(p.rank is not None for p in pairs) else "device")
        ax2.set_ylabel(f"peak error (%), + = {predicted.source} higher")
    else:
        ax2.hist(errs, bins=30, color="#4c72b0")
        ax2.set_xlabel(f"peak error (%), + = {predicted.source} higher")
        ax2.set_ylabel("ranks")
    ax2.axhline(0, color="black", linewidth=0.8)
    ax2.set_title("prediction error per rank", fontsize=9)
    ax2.grid(axis="y", alpha=0.3)
    t_pred, t_meas = predicted.iteration_time_s, measured.iteration_time_s
    t_err = 100.0 * (t_pred - t_meas) / t_meas if t_meas else 0.0
    bars = ax3.bar([0, 1], [t_pred, t_meas], color=["#4c72b0", "#55a868"])
    for b, t in zip(bars, (t_pred, t_meas)):
        ax3.text(b.get_x() + b.get_width() / 2, t, f"{t:.3g} s", ha="center", va="bottom", fontsize=8)
    ax3.set_xticks([0, 1])
    ax3.set_xticklabels([predicted.source, measured.source], fontsize=8)
    ax3.set_ylabel("iteration time (s)")
    ax3.set_ylim(0, max(t_pred, t_meas, 1e-9) * 1.2)
    ax3.set_title(f"iteration time: error {t_err:+.1f} %", fontsize=9)
    fig.suptitle(f"{predicted.model} on {predicted.hardware}: {predicted.source} vs {measured.source} "
                 f"(plan {predicted.plan_id})", fontsize=10)
    return fig


# ---------------------------------------------------------------- summary.png

def summary_figure(rows: list[dict], swept: list[str]):
    """Sweep overview: max peak GiB per job (whisker down to the min device, capacity tick, OOM
    hatched) and samples/s. Two swept keys give grouped bars (first key on x, second as colour);
    otherwise one bar per job labelled by its swept values."""
    fig = _new_figure(min(16.0, max(7.0, 3.0 + 0.7 * len(rows))), 6.5)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    if len(swept) == 2:
        xkey, hkey = swept
        xvals = list(dict.fromkeys(r.get(xkey, "") for r in rows))
        hvals = list(dict.fromkeys(r.get(hkey, "") for r in rows))
        width = 0.8 / len(hvals)
        pos = [xvals.index(r.get(xkey, "")) - 0.4 + width * (hvals.index(r.get(hkey, "")) + 0.5) for r in rows]
        colours = [f"C{hvals.index(r.get(hkey, ''))}" for r in rows]
        ticks, ticklabels = list(range(len(xvals))), [f"{xkey}={v}" for v in xvals]
        from matplotlib.patches import Patch

        handles = [Patch(color=f"C{i}", label=f"{hkey}={v}") for i, v in enumerate(hvals)]
    else:
        width = 0.8
        pos = list(range(len(rows)))
        colours = ["C0"] * len(rows)
        ticks = pos
        ticklabels = ["\n".join(f"{k}={r.get(k, '')}" for k in swept) if swept else str(r.get("job", i))
                      for i, r in enumerate(rows)]
        handles = []

    def num(r: dict, key: str) -> float:
        v = r.get(key)
        return float(v) if v not in (None, "") else math.nan

    # rows carry GiB (summary.csv); draw in the unit the largest peak reads best in, and leave the
    # capacity out when every peak is under 5 % of it (tiny CPU models), as memory_figure does
    biggest = max([x for x in (num(r, k) for r in rows for k in ("max_peak_gib", "measured_max_peak_gib"))
                   if not math.isnan(x)] + [0.0])
    cap_max = max([x for x in (num(r, "capacity_gib") for r in rows) if not math.isnan(x)] + [0.0])
    cap_shown = not cap_max or biggest >= CAPACITY_OFF_SCALE * cap_max
    unit, scale = byte_unit((max(biggest, cap_max) if cap_shown else biggest) * GIB)
    to_unit = GIB / scale
    peak = [num(r, "max_peak_gib") * to_unit for r in rows]
    low = [num(r, "min_peak_gib") * to_unit for r in rows]
    ax1.bar(pos, [0 if math.isnan(p) else p for p in peak], width * 0.95, color=colours)
    ax1.vlines(pos, low, peak, colors="black", linewidth=1)
    ax1.scatter(pos, low, marker="_", color="black", s=60, zorder=3, label="min over devices")
    caps = [num(r, "capacity_gib") * to_unit for r in rows] if cap_shown else []
    if cap_shown:
        ax1.hlines(caps, [p - width / 2 for p in pos], [p + width / 2 for p in pos], colors="black",
                   linestyles="--", linewidth=1.2, label="capacity")
    else:
        ax1.plot([], [], " ", label=f"capacity {human_bytes(cap_max * GIB, None)} (off the scale)")
    measured = [num(r, "measured_max_peak_gib") * to_unit for r in rows]
    if any(not math.isnan(m) for m in measured):
        ax1.scatter(pos, measured, marker="D", color="black", zorder=4, label="measured max peak")
    top = max([x for x in peak + caps + measured if not math.isnan(x)] + [1e-9])
    for p, r, pk in zip(pos, rows, peak):
        if r.get("status") != "ok":
            ax1.text(p, 0.02 * top, "failed", rotation=90, ha="center", va="bottom", fontsize=8, color=OOM_COLOUR)
        elif int(r.get("oom_devices") or 0):
            ax1.bar([p], [pk], width * 0.95, fill=False, edgecolor=OOM_COLOUR, hatch="//", linewidth=1.5)
            ax1.text(p, pk + 0.02 * top, f"OOM×{r['oom_devices']}", ha="center", va="bottom", fontsize=7,
                     color=OOM_COLOUR, fontweight="bold")
        elif len(rows) <= 24:
            ax1.text(p, pk + 0.01 * top, f"{pk:.3g}", ha="center", va="bottom", fontsize=7)
    ax1.set_ylim(0, top * 1.2)
    ax1.set_ylabel(f"max peak per device ({unit})")
    ax1.legend(handles=handles + ax1.get_legend_handles_labels()[0], fontsize=7, loc="upper left",
               bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax1.grid(axis="y", alpha=0.3)
    ax2.bar(pos, [0 if math.isnan(x) else x for x in (num(r, "samples_per_s") for r in rows)], width * 0.95,
            color=colours)
    ax2.set_ylabel("samples/s (predicted)")
    ax2.grid(axis="y", alpha=0.3)
    ax2.set_xticks(ticks)
    ax2.set_xticklabels(ticklabels, fontsize=8, rotation=90 if len(ticks) > 12 else 0)
    fig.suptitle(f"sweep over {', '.join(swept) if swept else 'jobs'}: {len(rows)} jobs", fontsize=10)
    return fig


# ---------------------------------------------------------------- prediction_error.png

def prediction_error_figure(errors: dict[str, tuple[list[float], list[float]]],
                            margins: tuple[float, ...] = (0.02, 0.05, 0.11), title: str = ""):
    """CAPTURE Fig. 7 analogue: histograms of relative peak-memory error per device (left) and
    per plan (right), one colour per predictor. ``errors``: predictor -> (per-device errors,
    per-plan errors), each ``(predicted − measured) / measured``. Dashed lines at ± each margin;
    the legend gives each predictor's share within the margins."""
    fig = _new_figure(12.0, 4.2)
    axes = fig.subplots(1, 2)
    colours = ("#4c72b0", "#55a868", "#dd8452", "#8172b3")
    every = [100 * e for pair in errors.values() for level in pair for e in level]
    lo, hi = math.floor(min(every + [-12.0])) - 0.5, math.ceil(max(every + [12.0])) + 0.5
    step = 1.0 if hi - lo <= 60 else (hi - lo) / 60  # 1 % bins centred on whole percents
    bins = [lo + i * step for i in range(int((hi - lo) / step) + 2)]
    for ax, level, name in zip(axes, (0, 1), ("per device", "per plan (peak across devices)")):
        for colour, (pred, pair) in zip(colours * 4, errors.items()):
            errs = [100 * e for e in pair[level]]
            within = " / ".join(f"{100 * sum(abs(e) <= 100 * m + 1e-9 for e in errs) / max(len(errs), 1):.0f}"
                                for m in margins)
            ax.hist(errs, bins=bins, color=colour, alpha=0.55, label=f"{pred} (n={len(errs)}): {within} %")
        for m in margins:
            for sign in (-1, 1):
                ax.axvline(sign * 100 * m, color="black", linestyle="--", linewidth=0.7, alpha=0.5)
        ax.set_xlabel("prediction error (predicted − measured) / measured, %")
        ax.set_ylabel("count")
        ax.set_title(f"{name}; legend: share within " + " / ".join(f"{100 * m:g}" for m in margins) + " %",
                     fontsize=9)
        ax.legend(fontsize=8, frameon=False)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def budget_curve_figure(rows: list[dict]):
    """MAP's trade-off (benchmarks/map_eval.py): iteration time against the per-device memory budget
    (left), and each plan's simulated peak against its budget (right, the diagonal is the budget),
    for policy=map and for the same ILP bounding parameter state only (autoparallel / ColossalAI's
    constraint). Rows: {"budget_gib", "map": {...}, "params_only": {...}} with iteration_s,
    peak_gib, fits."""
    fig = _new_figure(11.0, 4.2)
    ax1, ax2 = fig.subplots(1, 2)
    for key, label, colour in (("map", "MAP: params + activations", "C0"),
                               ("params_only", "bound on parameters only", "C3")):
        pts = sorted((r["budget_gib"], r[key]) for r in rows)
        ok = [(b, v) for b, v in pts if v["fits"]]
        bad = [(b, v) for b, v in pts if not v["fits"]]
        if key == "map":
            ax1.plot([b for b, _ in ok], [v["iteration_s"] for _, v in ok], "o-", color=colour, label=label)
            if bad:
                ax1.plot([b for b, _ in bad], [v["iteration_s"] for _, v in bad], "x", color=colour,
                         label="MAP: does not fit (closest plan)")
        ax2.plot([b for b, _ in pts], [v["peak_gib"] for _, v in pts], "o-" if key == "map" else "s--",
                 color=colour, label=label)
    top = max(r["budget_gib"] for r in rows)
    ax2.plot([0, top], [0, top], ":", color=GREYS[1], label="peak = budget")
    ax1.set_xlabel("memory budget per device (GiB)")
    ax1.set_ylabel("simulated iteration time (s)")
    ax1.set_title("time vs budget (policy=map)")
    ax2.set_xlabel("memory budget per device (GiB)")
    ax2.set_ylabel("simulated peak per device (GiB)")
    ax2.set_title("peak vs budget")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig
