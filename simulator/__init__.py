"""Discrete-event simulator of one training iteration of a plan (simpy).

``simulate(plan, model, hardware) -> Simulation``: ``.result`` is a Result (source "simulated")
listing every device the plan uses, ``.trace`` a Chrome/Perfetto trace dict, ``.events`` the
number of simpy events processed. Pure: no I/O, no clocks, no global state; same inputs give
byte-identical ``result.model_dump_json()`` and ``json.dumps(trace, sort_keys=True)``.

Modules: stagecost (ns/bytes from costs), links (FIFO-booked links and copy engines),
memory (step functions, peak, OOM), engine (the simpy processes: walk — the schedule's passes,
transfers — sends, swaps and D2D stripes, optimizer — all-reduce and optimizer steps), window
(STRONGHOLD's window walk), sharded + sharded_layer (MAP stages), trace, report (Result), and
analytic (the closed-form estimator).
"""
from __future__ import annotations

from dataclasses import dataclass

from simulator.engine import Engine
from simulator.report import build_result
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan
from specs.result import Result

#: simulated passes one simulation may walk, a (stage, microbatch) pair each: the simulator is
#: linear in them (~37 simpy events per microbatch on 8 positions, ~12 K events/s: 16,384 passes
#: is ~5 s and a ~10 MB trace). A layer with a memory action (recompute, swap) adds a step per
#: microbatch in backward, ~1/16 of a pass. Beyond it the closed-form estimator answers in ms.
MAX_SIMULATED_PASSES = 16_384


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
            f"{MAX_SIMULATED_PASSES:,} (about 5 s). Lower training.global_batch, raise training.microbatch_size, "
            "or use estimator=analytic (closed form, any size)")


@dataclass(frozen=True)
class Simulation:
    result: Result
    trace: dict
    events: int


def simulate(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> Simulation:
    """Simulate one iteration of ``plan`` (validated against ``model`` and ``hardware`` by the
    caller) and return its Result, Perfetto trace and event count. Raises ValueError when the
    plan is too large to simulate (see :func:`size_problem`)."""
    problem = size_problem(plan)
    if problem is not None:
        raise ValueError(problem)
    engine = Engine(plan, model, hardware)
    engine.run()
    result, trace = build_result(engine, model)
    return Simulation(result=result, trace=trace, events=engine.events)


__all__ = ["MAX_SIMULATED_PASSES", "Simulation", "simulate", "simulated_passes", "size_problem"]
