"""Planners: pure functions (policy, model, hardware, training, schedule) -> Plan.

The registry maps a policy's ``kind`` to its planner; configs never name code.
"""
from __future__ import annotations

from planners.baselines import plan_balanced, plan_even, plan_manual
from planners.capture import plan_capture
from planners.throughput import plan_throughput
from planners.layout import PlanningError
from planners.policy import PolicyConfig, parse_policy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec, validate_plan
from specs.training import TrainingSpec



#: planners that need only the specs; "capture" also takes the profile (make_plan passes it)
PLANNERS = {"even": plan_even, "balanced": plan_balanced, "manual": plan_manual, "throughput": plan_throughput}


def make_plan(policy: PolicyConfig, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
              schedule: ScheduleSpec, profile=None) -> Plan:
    """Run the planner ``policy.kind`` and validate its plan against the model and hardware.
    ``profile`` (a specs.profile.Profile) feeds profile-driven planners (CAPTURE)."""
    if policy.kind == "capture":
        plan = plan_capture(policy, model, hardware, training, schedule, profile)
    else:
        plan = PLANNERS[policy.kind](policy, model, hardware, training, schedule)
    return validate_plan(plan, model, hardware)


__all__ = ["PLANNERS", "PlanningError", "PolicyConfig", "make_plan", "parse_policy"]
