"""How many concurrent streams (training workers) a STRONGHOLD window stage runs: §IV-A.

STRONGHOLD §IV-A: "The number of concurrent streams used is determined during the warm-up phase,
where STRONGHOLD computes the GPU memory consumption of the GPU working window size to determine
how many CUDA streams to use so that multi-streamed execution does not cause GPU OOM." The
workers share the window's one copy of the weights (Fig. 5); each holds its own microbatch's
activations. The contract (specs.plan_memory.OffloadPolicy.streams): S workers, the stage's m
microbatches in m / S groups of S, one fetch and one gradient copy per streamed layer per group
pass, the S computes of a layer priced as one kernel over S·b samples (costs.window.grouped_plan).
A tp > 1 stage is left at 1 (the executor does not run S workers' tp collectives; a plan may still
force it through ``policy.streams``).

:func:`choose_streams` keeps the paper's memory rule and takes the speed from the simulator's own
window walk (planners/stronghold/planner.py ``price``: the simpy engine's mechanism driven by
plain arithmetic, equal to it on a one-stage pipeline): every divisor S of m (at most
MAX_STREAMS) is priced with the stage's window; those whose device peak (the analytic memory
model, the simulator's) exceeds ``capacity_bytes`` are out (the paper's OOM bound: the window's
static bytes plus S workers' activations and each worker's own held gradients,
costs.window.group_workspace_bytes); of the rest, the smallest S within PLATEAU of the
fastest, and 1 unless that gains more than PLATEAU over one stream (STRONGHOLD §V-D: run-to-run
variance under 3 %, so a smaller gain is not measurable, the window plateau rule of Fig. 9).
Where the gain comes from: a window's transfers are amortised over the group (one fetch and one
gradient copy per S microbatches), and a kernel over S·b samples runs higher on the device's
GEMM efficiency curve (costs.gemm) than S kernels over b; on a flat curve with transfers hidden
there is no gain and S stays 1.

Pure and deterministic: no I/O, no clocks.
"""
from __future__ import annotations

from planners.layout import PlanningError
from planners.stronghold.pricing import PLATEAU, price
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan

#: the most workers considered (OffloadPolicy.streams' bound)
MAX_STREAMS = 64


def with_streams(plan: Plan, s: int, streams: int) -> Plan:
    """``plan`` with stage ``s``'s window run by ``streams`` workers (its offload otherwise as is)."""
    stages = list(plan.stages)
    stages[s] = stages[s].model_copy(update={"offload": stages[s].offload.model_copy(update={"streams": streams})})
    return plan.model_copy(update={"stages": stages})


def stream_candidates(plan: Plan) -> list[int]:
    """The S a stage may run: the divisors of the microbatch count, at most MAX_STREAMS."""
    m = plan.training.microbatches
    return [d for d in range(1, min(m, MAX_STREAMS) + 1) if m % d == 0]


def check_streams(plan: Plan, s: int, streams: int) -> None:
    """Refuse ``policy.streams`` where the contract does not allow it (PlanningError naming it)."""
    if streams == 1:
        return
    if len(plan.stages) != 1:
        raise PlanningError(f"policy.streams: {streams} workers share the window of a one-stage pipeline (§IV-A); "
                            f"this plan has {len(plan.stages)} stages (policy.pp 1, or policy.streams 1)")
    if plan.stages[s].offload.window_layers is None:
        raise PlanningError(f"policy.streams: {streams} workers share a window; stage {s} has none")
    if streams not in stream_candidates(plan):
        raise PlanningError(f"policy.streams: {streams} does not divide the {plan.training.microbatches} microbatches "
                            f"(groups of {streams}); allowed: {stream_candidates(plan)}")


def price_streams(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, capacity_bytes: int,
                  candidates: list[int] | None = None) -> list[tuple[int, object]]:
    """(S, its planner.WindowPrice) for each candidate S, stage ``s``'s window as in ``plan``."""
    out = []
    for S in candidates if candidates is not None else stream_candidates(plan):
        out.append((S, price(with_streams(plan, s, S), model, hardware, s, capacity_bytes=capacity_bytes)))
    return out


def choose_streams(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int,
                   capacity_bytes: int) -> tuple[Plan, str]:
    """``plan`` with stage ``s``'s streams chosen (the module docstring's rule) and one line saying
    why. A stage without a window, or a pipeline of more than one stage, keeps 1."""
    stage = plan.stages[s]
    if stage.offload.window_layers is None:
        return with_streams(plan, s, 1) if stage.offload.streams != 1 else plan, "streams 1: no window to share"
    if len(plan.stages) != 1:
        return with_streams(plan, s, 1), (f"streams 1: multi-stream (§IV-A) shares the window of a one-stage "
                                          f"pipeline; this one has {len(plan.stages)} stages")
    if stage.tp > 1:  # the executor (executor/window.py) refuses it: S threads' tp collectives unordered
        return with_streams(plan, s, 1), (f"streams 1: with tp = {stage.tp} the workers' tensor-parallel "
                                          "collectives would run from S threads in an order the tp peers do "
                                          "not share (the executor does not run it; policy.streams forces it)")
    priced = price_streams(plan, model, hardware, s, capacity_bytes)
    fits = [(S, p) for S, p in priced if p.fits]
    t1 = priced[0][1].time_s
    if len(priced) == 1:
        return with_streams(plan, s, 1), (f"streams 1: {plan.training.microbatches} microbatch per iteration "
                                          "(streams run microbatches in groups; raise training.global_batch "
                                          "or lower training.microbatch_size)")
    over = [S for S, p in priced if not p.fits]
    limit = (f"; S >= {over[0]} does not fit ({_gib(dict(priced)[over[0]].peak_bytes)} > {_gib(capacity_bytes)}: "
             "the window plus S workers' activations, §IV-A's bound)" if over else "")
    if len(fits) <= 1:
        return with_streams(plan, s, 1), f"streams 1: 2 workers' activations do not fit{limit}"
    best = min(p.time_s for _, p in fits)
    chosen, cp = next((S, p) for S, p in fits if p.time_s <= best * (1 + PLATEAU))
    times = ", ".join(f"S={S}: {p.time_s:.4g} s" for S, p in fits)
    if t1 <= best * (1 + PLATEAU) or chosen == 1:
        return with_streams(plan, s, 1), (f"streams 1: more workers gain at most {100 * (t1 / best - 1):.2g} % "
                                          f"(under the {PLATEAU:.0%} plateau) ({times}){limit}")
    return with_streams(plan, s, chosen), (
        f"streams {chosen}: {100 * (t1 / cp.time_s - 1):.3g} % faster than one stream "
        f"(one fetch and gradient copy per {chosen} microbatches, kernels over {chosen}x the samples) "
        f"({times}; the smallest within {PLATEAU:.0%} of the fastest){limit}")


def _gib(nbytes: int) -> str:
    from specs.units import size_text

    return size_text(nbytes)
