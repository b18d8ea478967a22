"""MPress's emulator (§III-B step 5): one emulation simulates a candidate plan for one iteration
(simulator/, the same engine the user sees) and reads its per-device memory and iteration time.

:class:`Emulator` counts the simulations against ``policy.max_simulations`` (a safety cap),
reads back a candidate simulated before instead of simulating it again, reports progress and
keeps the planner's log; the functions below read one simulation.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import replace

from planners.layout import PlanningError
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan


class Emulator:
    """Runs the simulations of one search: at most ``budget`` (``policy.max_simulations``, a
    safety cap: the search stops when a round gains too little, planners/mpress/improve.py),
    each reported to ``progress``. A candidate plan simulated before is not simulated again: the
    simulator is deterministic, so its result is read back (``hits`` counts those; they are not
    simulations and do not count against the cap). A result read back carries no trace."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, budget: int, progress=None):
        self.model, self.hardware, self.budget, self.progress = model, hardware, budget, progress
        self.sims = 0
        self.hits = 0
        self.log: list[str] = []
        self._seen: dict[str, object] = {}

    def run(self, plan: Plan, trace: bool = False):
        """``plan``'s Simulation; with ``trace`` its Perfetto trace too (the search reads only the
        base plan's; the others' would be built and thrown away)."""
        from simulator import simulate

        key = plan.model_dump_json()
        if (sim := self._seen.get(key)) is not None:
            self.hits += 1
            return sim
        self.sims += 1
        if self.progress is not None:
            self.progress(self.sims, None)  # no total: the search runs until it converges
        sim = simulate(plan, self.model, self.hardware, trace=trace)
        self._seen[key] = replace(sim, trace={})  # the search reads the trace of the base only
        return sim

    def seen(self, plan: Plan) -> bool:
        """Whether ``plan`` was simulated before (running it again costs no simulation)."""
        return plan.model_dump_json() in self._seen

    @property
    def left(self) -> bool:
        """Whether the budget allows another simulation."""
        return self.sims < self.budget

    @property
    def capped(self) -> bool:
        """Whether the safety cap is spent."""
        return self.sims >= self.budget


def check_size(plan: Plan) -> None:
    """Raise if ``plan`` is too large for the emulator to simulate."""
    from simulator import size_problem

    if (problem := size_problem(plan)) is not None:
        raise PlanningError(problem)


def fits(sim) -> bool:
    return not any(d.oom for d in sim.result.devices)


#: relative difference of two iteration times below which they count as equal (float64 rounding
#: of sums of ~1e5 event times, far below any real difference between plans)
TIE = 1e-9


def better(sim, best_s: float) -> bool:
    """Fits and is faster than ``best_s``."""
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s < best_s * (1 - TIE)


def no_worse(sim, best_s: float) -> bool:
    """Fits and is no slower than ``best_s``."""
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s <= best_s * (1 + TIE)


def over_and_spare(sim, devices: list, capacity: int) -> tuple[list, list]:
    """Per stage (on ``devices``), the bytes its simulated peak is over ``capacity`` and under it."""
    peak = {d.device: d.peak_bytes for d in sim.result.devices}
    return [max(0, peak[d] - capacity) for d in devices], [max(0, capacity - peak[d]) for d in devices]


def ooms(sim) -> dict:
    """Device -> bytes it is over capacity by, for the devices that are."""
    return {d.device: d.oom_over_bytes for d in sim.result.devices if d.oom}


def peak_of(sim, device: int) -> int:
    return next(d.peak_bytes for d in sim.result.devices if d.device == device)


def host_bytes_per_node(sim, hardware: HardwareSpec) -> list:
    """Each node's host memory: the sum of its devices' host peaks (a bound; CPU-swap bytes)."""
    per_node = [0] * hardware.nodes
    for d in sim.result.devices:
        per_node[hardware.node_of(d.device)] += d.host_bytes
    return per_node
