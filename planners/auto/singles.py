"""Each single-technique policy's own answer on policy=auto's inputs (issue 23): planned with its
default knobs on the same model, hardware (device memory replaced by the capacity auto plans for),
training and schedule, then simulated. They are candidates of the search too, so auto is never
worse than the best of them; the report shows them beside auto's answer."""
from __future__ import annotations

import time
from dataclasses import dataclass

from planners.auto.candidate import Candidate, over_capacity
from planners.layout import PlanningError
from planners.policy import (BalancedPolicy, CapturePolicy, MapPolicy, MPressPolicy, StrongholdPolicy,
                             ThroughputPolicy)
from simulator import simulate
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, PlanError, ScheduleSpec, validate_plan
from specs.training import TrainingSpec

GIB = float(1 << 30)


@dataclass
class Single:
    """A single policy's answer: its candidate (None when it could not plan), why not, its time."""

    name: str
    candidate: Candidate | None
    planning_s: float
    error: str | None = None

    def row(self) -> dict:
        row = {"policy": self.name, "planning_s": round(self.planning_s, 3), "error": self.error}
        if self.candidate is not None:
            row.update(self.candidate.row())
        return row


def _plan(name: str, model: ModelSpec, plan_hw: HardwareSpec, training: TrainingSpec, schedule: ScheduleSpec,
          capacity: int, profile, progress) -> Plan:
    """Run one single policy's planner with its default knobs (MAP gets the capacity as its budget)."""
    if name == "balanced":
        from planners.baselines.partition import plan_balanced

        return plan_balanced(BalancedPolicy(), model, plan_hw, training, schedule)
    if name == "throughput":
        from planners.baselines.throughput import plan_throughput

        return plan_throughput(ThroughputPolicy(), model, plan_hw, training, schedule, progress)
    if name == "capture":
        if profile is None:
            raise PlanningError("no CAPTURE profile (the shell profiles first; policy.singles without capture skips it)")
        from planners.capture.planner import plan_capture

        return plan_capture(CapturePolicy(compare_throughput=False, backend="simulator"), model, plan_hw, training,
                            schedule, profile)
    if name == "mpress":
        from planners.mpress.planner import mpress_search

        return mpress_search(MPressPolicy(), model, plan_hw, training, schedule, progress).plan
    if name == "stronghold":
        from planners.stronghold.planner import stronghold_search

        return stronghold_search(StrongholdPolicy(), model, plan_hw, training, schedule).plan
    if name == "map":
        if schedule.virtual_stages > 1:  # as planning._plan_map: its stages are whole meshes
            raise PlanningError("MAP plans non-interleaved schedules (one stage per device group)")
        if not model.op_graphs:
            raise PlanningError("the model carries no operator graphs (MAP profiles gpt/bert families)")
        from planners.map.plan import map_search

        return map_search(MapPolicy(memory_budget_gib=capacity / GIB), model, plan_hw, training, schedule,
                          progress).plan
    raise PlanningError(f"unknown single policy {name!r}")


def run_single(name: str, model: ModelSpec, hardware: HardwareSpec, plan_hw: HardwareSpec, training: TrainingSpec,
               schedule: ScheduleSpec, capacity: int, profile=None, progress=None) -> Single:
    """Plan and simulate policy ``name``; a planner that refuses these inputs is reported, not raised."""
    start = time.perf_counter()
    try:
        plan = validate_plan(_plan(name, model, plan_hw, training, schedule, capacity, profile, progress),
                             model, hardware)
        result = simulate(plan, model, hardware, trace=False).result
    except (PlanningError, PlanError, ValueError) as exc:
        return Single(name, None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}".splitlines()[0])
    cand = Candidate(name, f"policy={name}", plan, result, not over_capacity(result, capacity))
    return Single(name, cand, time.perf_counter() - start)
