"""The three baseline planners: even, balanced and manual (uniform degrees across stages)."""
from __future__ import annotations

import itertools

from planners.layout import (
    PlanningError, assemble, check_chunks, device_groups, even_split, resolve_degrees,
)
from planners.policy import BalancedPolicy, EvenPolicy, ManualPolicy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec
from specs.training import TrainingSpec


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """Contiguous partition of ``costs`` into ``parts`` non-empty runs minimising the largest run
    (the linear-partition DP, as PipeDream's planner does per stage, §3.1). O(parts · L²)."""
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]
    inf = float("inf")
    # best[k][i]: minimal max-run cost splitting the first i layers into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def _uniform(planner: str, policy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
             schedule: ScheduleSpec, split) -> Plan:
    pp, dp = resolve_degrees(policy.pp, policy.dp, policy.tp, hardware, model, training,
                             schedule.virtual_stages)
    groups = device_groups(hardware, pp, dp, policy.tp)
    chunks = pp * schedule.virtual_stages
    check_chunks(model, chunks, f"policy.pp ({pp}) x schedule.virtual_stages ({schedule.virtual_stages})")
    return assemble(planner, model, hardware, training, schedule, split(chunks), groups,
                    dp, policy.tp, policy.recompute, policy.zero_stage)


def plan_even(policy: EvenPolicy, model, hardware, training, schedule) -> Plan:
    return _uniform("even", policy, model, hardware, training, schedule,
                    lambda k: even_split(model.num_layers, k))


def plan_balanced(policy: BalancedPolicy, model, hardware, training, schedule) -> Plan:
    costs = [layer.fwd_flops_per_sample for layer in model.layers]
    return _uniform("balanced", policy, model, hardware, training, schedule,
                    lambda k: balanced_split(costs, k))


def plan_manual(policy: ManualPolicy, model, hardware, training, schedule) -> Plan:
    chunks = policy.pp * schedule.virtual_stages
    given = policy.layers_per_stage
    if given is not None and len(given) != chunks:
        raise PlanningError(
            f"policy.layers_per_stage has {len(given)} entries; it needs one per pipeline chunk "
            f"(policy.pp x schedule.virtual_stages = {chunks})"
        )
    if given is not None and sum(given) != model.num_layers:
        raise PlanningError(
            f"policy.layers_per_stage sums to {sum(given)}; model {model.name!r} has {model.num_layers} layers"
        )
    return _uniform("manual", policy, model, hardware, training, schedule,
                    lambda k: list(given) if given is not None else even_split(model.num_layers, k))


__all__ = ["PlanningError", "balanced_split", "plan_balanced", "plan_even", "plan_manual"]
