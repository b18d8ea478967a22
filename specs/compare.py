"""Predicted vs measured: per-rank peak-memory error and iteration-time error (compare.json)."""
from __future__ import annotations

import statistics

from pydantic import Field

from specs._base import Spec
from specs.result import Result


class RankError(Spec):
    rank: int
    device: int
    simulated_peak_bytes: int
    measured_peak_bytes: int
    error_pct: float = Field(description="(simulated - measured) / measured x 100")


class Comparison(Spec):
    plan_id: str
    predicted_source: str
    ranks: list[RankError]
    memory_abs_error_pct_mean: float
    memory_abs_error_pct_max: float
    simulated_iteration_time_s: float
    measured_iteration_time_s: float
    time_error_pct: float
    failure: str | None = None


def pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured if measured else float("nan")


def compare(predicted: Result, measured: Result) -> Comparison:
    """Match devices of the two results (same plan) and compute the errors."""
    if predicted.plan_id != measured.plan_id:
        raise ValueError(f"results are for different plans: {predicted.plan_id} vs {measured.plan_id}")
    by_device = {d.device: d for d in predicted.devices}
    ranks = []
    for i, m in enumerate(measured.devices):
        p = by_device[m.device]
        ranks.append(RankError(rank=m.rank if m.rank is not None else i, device=m.device,
                               simulated_peak_bytes=p.peak_bytes, measured_peak_bytes=m.peak_bytes,
                               error_pct=pct(p.peak_bytes, m.peak_bytes)))
    errors = [abs(r.error_pct) for r in ranks] or [float("nan")]
    return Comparison(
        plan_id=measured.plan_id, predicted_source=predicted.source, ranks=ranks,
        memory_abs_error_pct_mean=statistics.fmean(errors), memory_abs_error_pct_max=max(errors),
        simulated_iteration_time_s=predicted.iteration_time_s, measured_iteration_time_s=measured.iteration_time_s,
        time_error_pct=pct(predicted.iteration_time_s, measured.iteration_time_s), failure=measured.failure,
    )


def comparison_table(c: Comparison) -> str:
    lines = [f"{'rank':>4} {'device':>6} {'simulated MiB':>14} {'measured MiB':>13} {'error %':>8}"]
    for r in c.ranks:
        lines.append(f"{r.rank:>4} {r.device:>6} {r.simulated_peak_bytes / 2**20:14.3f} "
                     f"{r.measured_peak_bytes / 2**20:13.3f} {r.error_pct:+8.1f}")
    lines.append(f"memory |error| mean {c.memory_abs_error_pct_mean:.1f} %, max {c.memory_abs_error_pct_max:.1f} %")
    lines.append(f"iteration time: simulated {c.simulated_iteration_time_s * 1e3:.1f} ms, measured "
                 f"{c.measured_iteration_time_s * 1e3:.1f} ms, error {c.time_error_pct:+.1f} %")
    return "\n".join(lines)
