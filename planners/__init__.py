"""Planners: pure functions (policy, model, hardware, training, schedule) -> Plan.

The registry maps a policy's ``kind`` to its planner; configs never name code.
"""
from __future__ import annotations

from planners.baselines import plan_balanced, plan_even, plan_manual
from planners.layout import PlanningError
from planners.policy import PolicyConfig, parse_policy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec, validate_plan
from specs.training import TrainingSpec



def plan_capture_not_yet(policy, model, hardware, training, schedule) -> Plan:
    raise PlanningError("the CAPTURE planner is not available yet (issue #6); policy=capture only "
                        "drives its profiler: python -m run mode=profile policy=capture ...")


PLANNERS = {"even": plan_even, "balanced": plan_balanced, "manual": plan_manual,
            "capture": plan_capture_not_yet}


def make_plan(policy: PolicyConfig, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
              schedule: ScheduleSpec) -> Plan:
    """Run the planner ``policy.kind`` and validate its plan against the model and hardware."""
    plan = PLANNERS[policy.kind](policy, model, hardware, training, schedule)
    return validate_plan(plan, model, hardware)


__all__ = ["PLANNERS", "PlanningError", "PolicyConfig", "make_plan", "parse_policy"]
