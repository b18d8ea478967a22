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
    bound_s: float | None = None   # not searched: its layout's lower bound beat by auto (search.py)

    def row(self) -> dict:
        row = {"policy": self.name, "planning_s": round(self.planning_s, 3), "error": self.error}
        if self.bound_s is not None:
            row["lower_bound_s"] = self.bound_s
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
            raise PlanningError("no CAPTURE profile (the shell builds it first, or says why it left CAPTURE out)")
        from planners.capture.planner import plan_capture

        return plan_capture(CapturePolicy(compare_throughput=False, backend="simulator"), model, plan_hw, training,
                            schedule, profile)
    if name == "mpress":
        from planners.mpress.planner import mpress_search

        return mpress_search(MPressPolicy(), model, plan_hw, training, schedule, progress).plan
    if name == "stronghold":
        from planners.stronghold.planner import stronghold_search

        # policy=stronghold's own plan: its null dp / tp search the data- and tensor-parallel
        # windows too (planners/stronghold/layouts.py, issue 25), as _stronghold_bound_s bounds it
        return stronghold_search(StrongholdPolicy(), model, plan_hw, training, schedule).plan
    if name == "map":
        if schedule.virtual_stages > 1:  # as planning._plan_map: its stages are whole meshes
            raise PlanningError("MAP plans non-interleaved schedules (one stage per device group)")
        if not model.op_graphs:
            # the shell traces them for any model when "map" is in policy.singles (issue 26:
            # model_costs.wants_op_graphs); it prints why when a model cannot be traced
            raise PlanningError("the model carries no operator graphs (traced when 'map' is in policy.singles; "
                                "a model torch.export cannot trace has none)")
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


#: singles whose own search is long at scale and whose layout gives a cheap lower bound: searched
#: after auto's own candidates, and only while that bound can still beat them (search.py)
BOUNDED = ("mpress", "stronghold")


def single_bound_s(name: str, model: ModelSpec, plan_hw: HardwareSpec, training: TrainingSpec,
                   schedule: ScheduleSpec) -> float | None:
    """A lower bound on policy ``name``'s simulated iteration time, or None when there is none.

    MPress (exact up to the simulator's BOUND_SLACK): its plan is its base partition (one stage per
    device, planners/mpress/base.py) with per-layer actions and a stage→device mapping; actions
    only add time (recompute, swap traffic) and the mapping moves only transfers, so the base's
    compute alone, Σ work + (m − 1) · max work (layouts.compute_bound_s), bounds it from below.
    GPT-3 175B on 64 A100s: its search took 128 s of auto's 179 s for an answer at half auto's speed."""
    if name == "stronghold":
        return _stronghold_bound_s(model, plan_hw, training, schedule)
    if name != "mpress":
        return None
    from planners.auto.layouts import compute_bound_s
    from planners.baselines.stage_place import Placed
    from planners.baselines.stagetable import StageTable
    from planners.mpress.base import base_plan

    try:
        base = base_plan(MPressPolicy(), model, plan_hw, training, schedule)
    except (PlanningError, PlanError, ValueError):
        return None
    table = StageTable(model, plan_hw, training, schedule, 0, "none")
    stages = [Placed(st.layer_start, st.layer_stop, "pp", 1, st.devices[0]) for st in base.stages]
    if any(table.cost(p) is None for p in stages):
        return None
    return compute_bound_s(table, stages)


def _stronghold_bound_s(model: ModelSpec, plan_hw: HardwareSpec, training: TrainingSpec,
                        schedule: ScheduleSpec) -> float | None:
    """STRONGHOLD's plan (planners/stronghold/planner.py, layouts.py) is one of its layouts: a
    pipeline of pp ≤ min(devices, layers) one-device stages, or pp stages of dp x tp devices over
    every device (planners.stronghold.layouts._layouts), every layer recomputed (its default),
    windows adding only stalls (and, with dp > 1, the host all-reduce). A stage's work per
    microbatch is at least its one-device work / (dp · tp) (dp splits the microbatch, tp each
    layer's GEMMs; the GEMM efficiency curve does not rise as a kernel shrinks, costs.gemm), so the
    layout's compute, Σ work + (m − 1) · max work, is at least W / (dp · tp) · (1 + (m − 1) / pp) for
    W the whole model's recomputed work on one device (max ≥ Σ / pp); the bound is the least over
    its layouts. GPT 1T on 512 A100s: its search took 125 s of auto's 350 s, for a plan that does
    not fit."""
    from planners.baselines.stage_place import Placed
    from planners.baselines.stagetable import StageTable
    from planners.stronghold.layouts import _layouts

    if schedule.kind.value not in ("1f1b", "gpipe") or schedule.virtual_stages != 1:
        return None  # it refuses these; run it to say so
    cost = StageTable(model, plan_hw, training, schedule, 0, "full").cost(Placed(0, model.num_layers, "pp", 1, 0))
    if cost is None:
        return None
    m = training.microbatches
    layouts = [(min(plan_hw.num_devices, model.num_layers), 1, 1)]  # the fewest-stage search's deepest pipeline
    layouts += _layouts(StrongholdPolicy(), model, plan_hw, training)
    return min(cost.work_s / (dp * tp) * (1 + (m - 1) / pp) for pp, dp, tp in layouts)
