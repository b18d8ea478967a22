"""Discrete-event simulator of one training iteration of a plan (simpy).

``simulate(plan, model, hardware) -> Simulation``: ``.result`` is a Result (source "simulated")
listing every device the plan uses, ``.trace`` a Chrome/Perfetto trace dict, ``.events`` the
number of simpy events processed. Pure: no I/O, no clocks; same inputs give byte-identical
``result.model_dump_json()`` and ``json.dumps(trace, sort_keys=True)``. The only state kept between
calls is a bounded cache of stage costs (simulator.stagecost, keyed on everything a stage's costs
read) and of GEMM times (costs.gemm): values, never results, so no output depends on call order.

Modules: stagecost (ns/bytes from costs), links (FIFO-booked links and copy engines),
memory (step functions, peak, OOM), engine (the simpy processes: walk — the schedule's passes,
transfers — sends, swaps and D2D stripes, optimizer — all-reduce and optimizer steps, stash —
PipeDream's stashed weight versions and their swap to the host), window (STRONGHOLD's window walk),
sharded + sharded_layer (MAP stages), trace, report (Result), and analytic (the closed-form
estimator; stash_peak its walk of a PipeDream position whose memory moves every backward).
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

from simulator.engine import Engine
from simulator.report import build_result
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan
from specs.result import Result

#: simulated passes one simulation may walk, a (stage, microbatch) pair each: the simulator is
#: linear in them (~3 simpy events per forward or backward, ~190 K events/s on one core: Megatron's
#: 1T on 512 GPUs, 36,864 passes, takes ~1 s; 1,000,000 passes ~30 s and ~2 GB, with a progress
#: callback, and a trace cut to simulator.trace.MAX_TRACE_EVENTS). A layer with a memory action
#: (recompute, swap) adds a step per microbatch in backward, ~1/16 of a pass. Beyond it the
#: closed-form estimator answers in ms, at any microbatch count.
MAX_SIMULATED_PASSES = 1_000_000


def simulated_passes(plan: Plan) -> float:
    """Pass-equivalents a simulation of ``plan`` walks: m · (stages + layers with actions / 16)."""
    actions = sum(len(stage.memory) for stage in plan.stages)
    return plan.training.microbatches * (len(plan.stages) + actions / 16)


def size_problem(plan: Plan) -> str | None:
    """Why ``plan`` is too large to simulate (a message naming the fields to change), or None."""
    t = plan.training
    work = simulated_passes(plan)
    if work <= MAX_SIMULATED_PASSES:
        return None
    given = (f"training.global_batch ({t.global_batch}) / training.microbatch_size ({t.microbatch_size})"
             if t.microbatch_size is not None else f"training.num_microbatches ({t.num_microbatches})")
    actions = sum(len(stage.memory) for stage in plan.stages)
    return (f"{given} = {t.microbatches:,} microbatches per iteration x {len(plan.stages)} pipeline stages"
            + (f" (+ {actions:,} layers with recompute/swap actions)" if actions else "")
            + f" = {work:,.0f} simulated passes; the discrete-event simulator takes at most "
            f"{MAX_SIMULATED_PASSES:,} (about 30 s). Lower training.global_batch, raise training.microbatch_size, "
            "or use estimator=analytic (closed form, any size)")


@dataclass(frozen=True)
class Simulation:
    result: Result
    trace: dict
    events: int


def simulate(plan: Plan, model: ModelSpec, hardware: HardwareSpec,
             progress: Callable[[int, int], None] | None = None, trace: bool = True) -> Simulation:
    """Simulate one iteration of ``plan`` (validated against ``model`` and ``hardware`` by the
    caller) and return its Result, Perfetto trace and event count. Raises ValueError when the
    plan is too large to simulate (see :func:`size_problem`).

    ``progress(done, total)``, if given, is called every few thousand passes (forwards and
    backwards walked, of ``2 · microbatches · stages``) and once at the end; the simulator keeps
    no clock, so the caller decides when a bar is worth drawing (reports.progress.after).

    ``trace=False`` records no Perfetto trace (``Simulation.trace`` is empty); the Result is the
    same. A planner's emulator that reads only Results asks for that (about a third less time)."""
    problem = size_problem(plan)
    if problem is not None:
        raise ValueError(problem)
    engine = Engine(plan, model, hardware, progress=progress, trace=trace)
    # the walk allocates millions of small objects and frees them by reference counting; the cyclic
    # collector would only rescan them (~20 % of the time), so it is paused while the engine runs
    # and its state is restored after: no output depends on it
    collecting = gc.isenabled()
    gc.disable()
    try:
        engine.run()
        result, trace = build_result(engine, model)
    finally:
        if collecting:
            gc.enable()
    return Simulation(result=result, trace=trace, events=engine.events)


__all__ = ["MAX_SIMULATED_PASSES", "Simulation", "simulate", "simulated_passes", "size_problem"]
