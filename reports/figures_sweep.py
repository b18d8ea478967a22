"""Figures over many jobs or plans: summary.png (a sweep's peaks and throughput per job) and MAP's
budget curve (iteration time and peak against the per-device memory budget, benchmarks/map_eval.py).
"""
from __future__ import annotations

import math
import re

from reports.figure_base import CAPACITY_OFF_SCALE, GIB, GREYS, OOM_COLOUR, byte_unit, human_bytes, new_figure


# ---------------------------------------------------------------- summary.png

def summary_figure(rows: list[dict], swept: list[str]):
    """Sweep overview: max peak GiB per job (whisker down to the min device, capacity tick, OOM
    hatched) and samples/s. Two swept keys give grouped bars (first key on x, second as colour);
    otherwise one bar per job labelled by its swept values."""
    fig = new_figure(min(16.0, max(7.0, 3.0 + 0.7 * len(rows))), 6.5)
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
    fig.suptitle(f"sweep over {', '.join(swept) if swept else 'jobs'}: {len(rows)} jobs", fontsize=10)
    fit_tick_labels(fig, ax2, ticklabels)
    return fig


# ---------------------------------------------------------------- legible x labels

#: where a label line may break: after '=' first (key / value), then after these
_BREAKS = re.compile(r"[^._,/\-]*[._,/\-]?")
_GAP_PX = 3.0  # the least space between two labels


def _greedy(pieces: list[str], width: int) -> list[str]:
    out, cur = [], ""
    for piece in pieces:
        if cur and len(cur) + len(piece) > width:
            out.append(cur)
            cur = piece
        else:
            cur += piece
    return out + [cur]


def wrap_label(label: str, width: int) -> str:
    """Each line of ``label`` longer than ``width`` characters broken after its '=' (key, value),
    and a part still too long after '.', '_', ',', '/' or '-' where the pieces allow
    ('model=stronghold_gpt_l500', 12 -> 'model=\nstronghold_\ngpt_l500'; 'model=gpt3_2b6', 12 ->
    'model=\ngpt3_2b6')."""
    out = []
    for line in label.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        key, eq, value = line.partition("=")
        lines = []
        for part in ([key + eq, value] if eq and value else [line]):
            more = _greedy([p for p in _BREAKS.findall(part) if p], width)
            if lines and len(lines[-1]) + len(more[0]) <= width:  # 'size=4' stays on one line
                lines[-1] += more.pop(0)
            lines += more
        out += lines
    return "\n".join(out)


def _label_boxes(fig, ax) -> list:
    """Window extents (pixels) of ``ax``'s visible, non-empty x tick labels after layout, left to right."""
    fig.draw_without_rendering()  # runs the constrained layout, so the extents are the saved ones
    renderer = fig.canvas.get_renderer()
    texts = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    return sorted((t.get_window_extent(renderer) for t in texts), key=lambda b: b.x0)


def _crowded(fig, ax) -> bool:
    boxes = _label_boxes(fig, ax)
    return any(a.x1 + _GAP_PX > b.x0 for a, b in zip(boxes, boxes[1:]))


def fit_tick_labels(fig, ax, labels: list[str], fontsize: float = 8.0) -> None:
    """Set ``ax``'s x tick labels (ticks one unit apart) so that no two overlap, trying in turn:
    as they are; each line wrapped to the width of a tick's slot; upright (90 degrees); upright at
    a smaller font; upright with only every k-th label (the rest blank, positions kept). Each
    step is measured after layout (a few draws without rendering, whatever the job count)."""
    ax.set_xticklabels(labels, fontsize=fontsize, rotation=0)
    if len(labels) < 2:
        return
    boxes = _label_boxes(fig, ax)
    if not any(a.x1 + _GAP_PX > b.x0 for a, b in zip(boxes, boxes[1:])):
        return
    lo, hi = ax.get_xlim()
    slot_px = ax.get_window_extent().width / max(hi - lo, 1e-9)
    longest = max(len(line) for lab in labels for line in lab.split("\n"))
    width = int((slot_px - _GAP_PX) / (max(b.width for b in boxes) / max(longest, 1)))
    if width >= 6:  # characters per slot from the widest label's measured width per character
        ax.set_xticklabels([wrap_label(lab, width) for lab in labels], fontsize=fontsize, rotation=0)
        if not _crowded(fig, ax):
            return
    upright = max(b.height for b in boxes)  # an upright label is as wide as it was tall
    small = max(5.0, fontsize - 2)
    for size in (fontsize, small):
        if upright * size / fontsize + _GAP_PX <= slot_px:
            ax.set_xticklabels(labels, fontsize=size, rotation=90)
            if not _crowded(fig, ax):
                return
    step = max(2, math.ceil((upright * small / fontsize + _GAP_PX) / slot_px))
    while True:  # ends: with a step past the job count one label is left
        ax.set_xticklabels([lab if i % step == 0 else "" for i, lab in enumerate(labels)], fontsize=small, rotation=90)
        if not _crowded(fig, ax):
            return
        step += 1


def budget_curve_figure(rows: list[dict]):
    """MAP's trade-off (benchmarks/map_eval.py): iteration time against the per-device memory budget
    (left), and each plan's simulated peak against its budget (right, the diagonal is the budget),
    for policy=map and for the same ILP bounding parameter state only (autoparallel / ColossalAI's
    constraint). Rows: {"budget_gib", "map": {...}, "params_only": {...}} with iteration_s,
    peak_gib, fits."""
    fig = new_figure(11.0, 4.2)
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
