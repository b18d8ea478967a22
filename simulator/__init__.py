"""Discrete-event simulator of one training iteration of a plan (simpy).

``simulate(plan, model, hardware) -> Simulation``: ``.result`` is a Result (source "simulated")
listing every device the plan uses, ``.trace`` a Chrome/Perfetto trace dict, ``.events`` the
number of simpy events processed. Pure: no I/O, no clocks, no global state; same inputs give
byte-identical ``result.model_dump_json()`` and ``json.dumps(trace, sort_keys=True)``.

Modules: stagecost (ns/bytes from specs.costs), links (FIFO-booked links and copy engines),
memory (step functions, peak, OOM), engine (the simpy processes), trace, report (Result).
"""
from __future__ import annotations

from dataclasses import dataclass

from simulator.engine import Engine
from simulator.report import build_result
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan
from specs.result import Result


@dataclass(frozen=True)
class Simulation:
    result: Result
    trace: dict
    events: int


def simulate(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> Simulation:
    """Simulate one iteration of ``plan`` (validated against ``model`` and ``hardware`` by the
    caller) and return its Result, Perfetto trace and event count."""
    engine = Engine(plan, model, hardware)
    engine.run()
    result, trace = build_result(engine, model)
    return Simulation(result=result, trace=trace, events=engine.events)


__all__ = ["Simulation", "simulate"]
