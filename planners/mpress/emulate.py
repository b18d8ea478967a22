"""MPress's emulator (§III-B step 5): one emulation simulates a candidate plan for one iteration
(simulator/, the same engine the user sees) and reads its per-device memory and iteration time.

:class:`Emulator` counts the simulations against ``policy.max_simulations``, reports progress
and keeps the planner's log; the functions below read one simulation.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from planners.layout import PlanningError
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan


class Emulator:
    """Runs the simulations of one search: at most ``budget``, each reported to ``progress``."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, budget: int, progress=None):
        self.model, self.hardware, self.budget, self.progress = model, hardware, budget, progress
        self.sims = 0
        self.log: list[str] = []

    def run(self, plan: Plan):
        from simulator import simulate

        self.sims += 1
        if self.progress is not None:
            self.progress(min(self.sims, self.budget), self.budget)
        return simulate(plan, self.model, self.hardware)

    @property
    def left(self) -> bool:
        """Whether the budget allows another simulation."""
        return self.sims < self.budget


def check_size(plan: Plan) -> None:
    """Raise if ``plan`` is too large for the emulator to simulate."""
    from simulator import size_problem

    if (problem := size_problem(plan)) is not None:
        raise PlanningError(problem)


def fits(sim) -> bool:
    return not any(d.oom for d in sim.result.devices)


def better(sim, best_s: float) -> bool:
    """Fits and is faster than ``best_s``."""
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s < best_s * (1 - 1e-9)


def no_worse(sim, best_s: float) -> bool:
    """Fits and is no slower than ``best_s``."""
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s <= best_s * (1 + 1e-9)


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
