"""Predicted vs measured: per-rank peak-memory error, iteration-time error, and per-action time
error from the two traces (compare.json)."""
from __future__ import annotations

import re
import statistics
from collections.abc import Iterable

from pydantic import Field

from specs._base import Spec
from specs.result import Result


class RankError(Spec):
    rank: int
    device: int
    simulated_peak_bytes: int
    measured_peak_bytes: int
    error_pct: float = Field(description="(simulated - measured) / measured x 100")


class ActionError(Spec):
    """Mean duration of one kind of action on one stage, simulated vs measured (all ranks of the
    stage, all microbatches; measured: every timed iteration)."""

    action: str = Field(description="forward | backward | send_act | send_grad | recv_wait | allreduce | optimizer "
                                    "| fetch | grad_copy | cpu_step (these three: a STRONGHOLD window's or a "
                                    "weight swap's host traffic, per layer of the stage) | conversion (a MAP "
                                    "layout conversion, forward or gradient)")
    stage: int
    simulated_mean_s: float | None = Field(description="None: the simulator books no slice for it")
    measured_mean_s: float | None
    simulated_count: int
    measured_count: int
    error_pct: float | None = Field(description="(simulated - measured) / measured x 100")


class Comparison(Spec):
    plan_id: str
    predicted_source: str
    ranks: list[RankError]
    memory_abs_error_pct_mean: float
    memory_abs_error_pct_max: float
    simulated_iteration_time_s: float
    measured_iteration_time_s: float
    time_error_pct: float
    actions: list[ActionError] = Field(default_factory=list)
    failure: str | None = None


def pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured if measured else float("nan")


#: trace slice name -> (action, stage): names as the simulator (walk, transfers, optimizer) and executor/timeline.py write them;
#: a multi-stream group pass (STRONGHOLD §IV-A, simulator.window.group_name) is ``g{g} (mb {a}-{b})`` in place of ``mb{k}``
_PATTERNS = (
    (re.compile(r"^F s(\d+) (?:mb\d+|g\d+ \(mb \d+-\d+\))$"), "forward"),
    (re.compile(r"^B s(\d+) (?:mb\d+|g\d+ \(mb \d+-\d+\))$"), "backward"),
    (re.compile(r"^W s(\d+) mb\d+$"), "backward_weight"),  # zero-bubble weight-gradient pass
    (re.compile(r"^act s(\d+)->s\d+ mb\d+$"), "send_act"),
    (re.compile(r"^grad s(\d+)->s\d+ mb\d+$"), "send_grad"),
    (re.compile(r"^wait (?:act|grad) s\d+->s(\d+) mb\d+$"), "recv_wait"),
    (re.compile(r"^allreduce_grads s(\d+)$"), "allreduce"),
    (re.compile(r"^optimizer_step s(\d+)$"), "optimizer"),
)
#: host traffic of a STRONGHOLD window (simulator/window.py) and of MPress's weight swap
#: (simulator/weightswap.py), as executor/timeline.py's HOST_KINDS names them too: (pattern with the
#: layer, action, the stream the slice must be on). The stream tells a copy from the compute-stream
#: slice of the same name that holds a CPU rank's compute thread for a memcpy; the layer's stage
#: comes from the plan
_HOST_PATTERNS = (
    (re.compile(r"^fetch L(\d+)(?: mb\d+)?(?: \(memcpy\))?$"), "fetch", "h2d"),
    (re.compile(r"^grads L(\d+) (?:mb\d+|g\d+ \(mb \d+-\d+\))(?: \(memcpy\))?$"), "grad_copy", "d2h"),
    (re.compile(r"^cpu step L(\d+)(?: mb\d+)?$"), "cpu_step", "cpu"),
)
#: a MAP layout conversion (issue 26 item 4), forward or its gradient's, named by its layer as
#: executor/timeline.py's conversion_name names it; its stage from the plan. The simulator books each
#: conversion as a slice of its own on the collective stream inside the pass that runs it
#: (simulator/sharded_layer.conversion_slices), its seconds still counted in u_fcomm / u_bcomm
_HOST_PATTERNS += ((re.compile(r"^convert(?: grad)? L(\d+) .+$"), "conversion", "collective"),)
ACTIONS = tuple(a for _, a in _PATTERNS) + tuple(a for _, a, _ in _HOST_PATTERNS)


def layer_stages(plan) -> dict[int, int]:
    """layer -> the index of the plan stage that holds it (for :func:`action_of`'s host traffic)."""
    return {layer: i for i, st in enumerate(plan.stages) for layer in range(st.layer_start, st.layer_stop)}


def action_of(name: str, stream: str | None = None, stages: dict[int, int] | None = None) -> tuple[str, int] | None:
    """(action, stage) of a trace slice name, None for other slices (activation swaps, recompute).
    A window's or weight swap's fetch, gradient copy or CPU step is named by its layer: it counts
    when ``stream`` is its copy engine's or the CPU's and ``stages`` (:func:`layer_stages`) places
    the layer."""
    for pattern, action in _PATTERNS:
        m = pattern.match(name)
        if m:
            return action, int(m.group(1))
    if stages is None:
        return None
    for pattern, action, on in _HOST_PATTERNS:
        m = pattern.match(name)
        if m and stream == on and int(m.group(1)) in stages:
            return action, stages[int(m.group(1))]
    return None


def action_means(slices: Iterable[tuple],
                 stages: dict[int, int] | None = None) -> dict[tuple[str, int], tuple[float, int]]:
    """``(name, dur_ns)`` or ``(name, dur_ns, stream)`` slices -> (action, stage) -> (mean
    seconds, count); ``stages``: see :func:`action_of`."""
    sums: dict[tuple[str, int], list[int]] = {}
    for name, dur_ns, *stream in slices:
        key = action_of(name, stream[0] if stream else None, stages)
        if key is not None:
            acc = sums.setdefault(key, [0, 0])
            acc[0] += dur_ns
            acc[1] += 1
    return {k: (total / n / 1e9, n) for k, (total, n) in sums.items()}


def action_errors(simulated: Iterable[tuple], measured: Iterable[tuple],
                  stages: dict[int, int] | None = None) -> list[ActionError]:
    """Per (action, stage): mean simulated vs mean measured duration (see :class:`ActionError`);
    slices as :func:`action_means` takes them."""
    sim, meas = action_means(simulated, stages), action_means(measured, stages)
    order = {a: i for i, a in enumerate(ACTIONS)}
    out = []
    for key in sorted(set(sim) | set(meas), key=lambda k: (k[1], order[k[0]])):
        s, m = sim.get(key), meas.get(key)
        out.append(ActionError(action=key[0], stage=key[1], simulated_mean_s=s[0] if s else None,
                               measured_mean_s=m[0] if m else None, simulated_count=s[1] if s else 0,
                               measured_count=m[1] if m else 0,
                               error_pct=pct(s[0], m[0]) if s and m and m[0] > 0 else None))
    return out


def slice_action_errors(simulated: Iterable[tuple], measured: Iterable[tuple], plan=None) -> list[ActionError]:
    """:func:`action_errors` of two sequences of trace slices ``(stream, name, start_ns, dur_ns,
    category)``: the simulator's (:func:`trace_slices` of its trace) and the executor's
    (executor.measure.measured_timeline). With ``plan``, host traffic (fetches, gradient copies,
    CPU steps) counts too, each slice on its layer's stage. A first field that is not a stream
    name (simulator.trace.x_slices' pid) matches passes, transfers and steps only."""
    stages = layer_stages(plan) if plan is not None else None
    row = lambda s: (s[1], s[3], s[0] if isinstance(s[0], str) else None)  # noqa: E731
    return action_errors((row(s) for s in simulated), (row(s) for s in measured), stages)


def trace_slices(trace: dict) -> list[tuple[str, str, int, int, str]]:
    """The "X" slices of a Chrome trace dict (simulator/trace.py's format) as ``(stream, name,
    start_ns, dur_ns, category)``, the stream read from the trace's thread names."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [(threads.get((e["pid"], e["tid"]), ""), e["name"], round(e["ts"] * 1000), round(e["dur"] * 1000),
             e.get("cat", "")) for e in trace["traceEvents"] if e.get("ph") == "X"]


def action_table(actions: list[ActionError]) -> str:
    """The per-action error table for a person (ms; '-' where one side has no such slice)."""
    ms = lambda v: f"{v * 1e3:10.3f}" if v is not None else f"{'-':>10}"  # noqa: E731
    lines = [f"{'stage':>5} {'action':<10} {'simulated ms':>12} {'measured ms':>12} {'error %':>8} {'n sim/meas':>11}"]
    for a in actions:
        err = f"{a.error_pct:+8.1f}" if a.error_pct is not None else f"{'-':>8}"
        lines.append(f"{a.stage:>5} {a.action:<10} {ms(a.simulated_mean_s):>12} {ms(a.measured_mean_s):>12} {err} "
                     f"{a.simulated_count:>5}/{a.measured_count:<5}")
    return "\n".join(lines)


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
