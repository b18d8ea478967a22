"""Planners: pure functions (policy, model, hardware, training, schedule) -> Plan.

The registry maps a policy's ``kind`` to its planner; configs never name code.
"""
from __future__ import annotations

from planners.baselines.partition import plan_balanced, plan_even, plan_manual
from planners.capture.planner import plan_capture
from planners.baselines.throughput import plan_throughput
from planners.baselines.zero_offload import plan_zero_offload
from planners.verdict import Verdict, fit_verdict
from planners.layout import PlanningError
from planners.policy import PolicyConfig, parse_policy
from planners.recompute_choice import Choice, choose_recompute, needs_choice
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec, validate_plan
from specs.training import TrainingSpec



#: planners that need only the specs; "capture" also takes the profile (make_plan passes it)
PLANNERS = {"even": plan_even, "balanced": plan_balanced, "manual": plan_manual, "throughput": plan_throughput,
            "zero_offload": plan_zero_offload}


def make_plan(policy: PolicyConfig, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
              schedule: ScheduleSpec, profile=None, progress=None) -> Plan:
    """:func:`choose_plan`'s plan: the planner's, with ``policy.recompute=null`` resolved."""
    return choose_plan(policy, model, hardware, training, schedule, profile, progress).plan


def choose_plan(policy: PolicyConfig, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                schedule: ScheduleSpec, profile=None, progress=None) -> Choice:
    """The plan and the policy it was made with: for even/balanced/manual with ``policy.recompute``
    null (conf/policy's default), the fastest recompute setting that fits
    (planners.recompute_choice, whose ``note`` says what was chosen); otherwise the policy as given."""
    if needs_choice(policy):
        return choose_recompute(policy, model, hardware,
                                lambda pol: _plan_once(pol, model, hardware, training, schedule, profile, progress))
    return Choice(policy, _plan_once(policy, model, hardware, training, schedule, profile, progress), (), "")


def _plan_once(policy: PolicyConfig, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
               schedule: ScheduleSpec, profile=None, progress=None) -> Plan:
    """Run the planner ``policy.kind`` and validate its plan against the model and hardware.
    ``profile`` (a specs.profile.Profile) feeds profile-driven planners (CAPTURE). ``progress``
    (done, total) is called by searches that can take seconds (the shell may draw a bar).
    When no plan fits, the planner returns its closest one; :func:`verdict` says so.
    schedule=zb_auto: the planner partitions, then the pass order is searched for its plan
    (planners.zero_bubble.with_zb_order, Qi et al. 2024 §3.1)."""
    from planners.zero_bubble.order import refuse_zb_auto, with_zb_order  # imports the simulator's pricing

    refuse_zb_auto(policy.kind, schedule)
    if policy.kind == "capture":
        plan = plan_capture(policy, model, hardware, training, schedule, profile)
    elif policy.kind == "throughput":
        plan = plan_throughput(policy, model, hardware, training, schedule, progress)
    elif policy.kind == "mpress":
        from planners.mpress.planner import plan_mpress  # imports the simulator (its emulator, MPress §III-B)

        plan = plan_mpress(policy, model, hardware, training, schedule, progress, profile)
    elif policy.kind == "stronghold":
        from planners.stronghold.planner import plan_stronghold  # prices windows with the simulator's mechanism

        plan = plan_stronghold(policy, model, hardware, training, schedule)
    elif policy.kind == "auto":
        from planners.auto.search import auto_search  # runs every planner and the simulator (issue 23)

        plan = auto_search(policy, model, hardware, training, schedule, profile, progress).plan
    elif policy.kind == "map":
        from planners.map.plan import plan_map  # simulates its plan (MAP §5.3 refinement against the simulator)

        plan = plan_map(policy, model, hardware, training, schedule)
    else:
        plan = PLANNERS[policy.kind](policy, model, hardware, training, schedule)
    return validate_plan(with_zb_order(plan, model, hardware), model, hardware)


def verdict(policy: PolicyConfig, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
            schedule: ScheduleSpec, plan: Plan) -> Verdict:
    """Whether ``plan`` fits device memory and, if not, the knobs that would help (priced by
    re-evaluating the plan, and by re-planning on more nodes for planners that pick their degrees)."""
    chooses = policy.kind == "throughput" or (policy.kind in ("even", "balanced") and policy.pp is None)
    replan = (lambda pol, hw: make_plan(pol, model, hw, training, schedule)) if chooses else None
    return fit_verdict(policy, model, hardware, training, schedule, plan, replan,
                       searched=policy.kind in ("throughput", "capture", "auto"))


__all__ = ["PLANNERS", "Choice", "PlanningError", "PolicyConfig", "Verdict", "choose_plan", "make_plan", "parse_policy",
           "verdict"]
