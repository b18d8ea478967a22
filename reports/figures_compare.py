"""Figures that set predictions against measurements: compare.png (predicted vs measured peak
per rank, error per rank, iteration time) and prediction_error.png (CAPTURE Fig. 7-style error
histograms per device and per plan), with the pairing and error statistics they draw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from reports.figure_base import GIB, OOM_COLOUR, byte_unit, new_figure
from specs.result import Result


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
    fig = new_figure(15.0, 4.8)
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


# ---------------------------------------------------------------- prediction_error.png

def prediction_error_figure(errors: dict[str, tuple[list[float], list[float]]],
                            margins: tuple[float, ...] = (0.02, 0.05, 0.11), title: str = ""):
    """CAPTURE Fig. 7 analogue: histograms of relative peak-memory error per device (left) and
    per plan (right), one colour per predictor. ``errors``: predictor -> (per-device errors,
    per-plan errors), each ``(predicted − measured) / measured``. Dashed lines at ± each margin;
    the legend gives each predictor's share within the margins."""
    fig = new_figure(12.0, 4.2)
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
