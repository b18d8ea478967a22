"""The three baseline planners: even, balanced and manual (uniform degrees across stages)."""
from __future__ import annotations

import itertools

from planners.layout import (
    PlanningError, assemble, check_chunks, device_groups, megatron_split, resolve_degrees,
)
from costs.context_parallel import sequence_split_error
from planners.policy import BalancedPolicy, EvenPolicy, ManualPolicy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import blocking_refusal, Plan, ScheduleSpec
from specs.training import TrainingSpec


def balanced_split(costs: list[float], parts: int) -> list[int]:
    """Contiguous partition of ``costs`` (≥ 0) into ``parts`` non-empty runs minimising the largest
    run (the linear-partition problem PipeDream's planner solves per stage, §3.1).

    Small inputs: the O(parts · L²) DP. Large ones (1,000 layers into hundreds of stages would be
    10⁹ steps): bisection on the bottleneck B with a greedy feasibility test (take the longest
    runs ≤ B; feasible iff it needs ≤ parts runs), O(L · 100); the answer is the largest run of the
    plan at the smallest feasible B, which equals the DP's optimum up to float rounding."""
    n = len(costs)
    if parts * n * n <= 2_000_000:
        return _balanced_split_dp(costs, parts)
    return _balanced_split_bisect(costs, parts)


def _balanced_split_dp(costs: list[float], parts: int) -> list[int]:
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


def _greedy_runs(costs: list[float], cap: float) -> list[int] | None:
    """Run lengths taking, from the last layer backwards, the longest runs whose cost ≤ cap (later
    stages, which hold fewer 1F1B microbatches, get the longer runs, as the DP's tie-break does)."""
    runs, total, length = [], 0.0, 0
    for c in reversed(costs):
        if c > cap:
            return None
        if total + c > cap:
            runs.append(length)
            total, length = 0.0, 0
        total += c
        length += 1
    runs.append(length)
    return runs[::-1]


def _balanced_split_bisect(costs: list[float], parts: int) -> list[int]:
    lo, hi = max(costs), sum(costs) * (1 + 1e-9)  # hi: one run, feasible despite float rounding
    first = _greedy_runs(costs, lo)
    if first is not None and len(first) <= parts:
        hi = lo
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        runs = _greedy_runs(costs, mid)
        if runs is not None and len(runs) <= parts:
            hi = mid
        else:
            lo = mid
    runs = _greedy_runs(costs, hi)
    while len(runs) < parts:  # split the longest run: sub-runs never cost more
        i = max(range(len(runs)), key=lambda r: runs[r])
        runs[i:i + 1] = [runs[i] // 2, runs[i] - runs[i] // 2]
    return runs


def _uniform(planner: str, policy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
             schedule: ScheduleSpec, split) -> Plan:
    if policy.recompute is None:
        # null is resolved by planners.make_plan (planners.recompute_choice); called directly, a planner
        # plans no recompute, or full where recompute_num_layers / recompute_every say which blocks
        full = policy.recompute_num_layers is not None or policy.recompute_every is not None
        policy = policy.model_copy(update={"recompute": "full" if full else "none"})
    pp, dp = resolve_degrees(policy.pp, policy.dp, policy.tp * policy.cp, hardware, model, training,
                             schedule.virtual_stages)
    groups = device_groups(hardware, pp, dp, policy.tp, policy.cp)
    chunks = pp * schedule.virtual_stages
    check_chunks(model, chunks, f"policy.pp ({pp}) x schedule.virtual_stages ({schedule.virtual_stages})")
    if policy.sequence_parallel and policy.tp == 1:
        raise PlanningError("policy.sequence_parallel: splits the sequence over the tensor-parallel group; needs "
                            "policy.tp > 1, got 1")
    if (err := sequence_split_error(model, policy.cp)) is not None:
        raise PlanningError(f"policy.{err}")
    if policy.recompute_num_layers is not None and policy.recompute != "full":
        raise PlanningError(f"policy.recompute_num_layers: recomputes the first N blocks of each stage in full "
                            f"(Megatron's --recompute-method block); needs policy.recompute=full, got "
                            f"{policy.recompute!r}")
    if policy.recompute == "op_sac" and not any(layer.has_op_sac for layer in model.layers):
        raise PlanningError(f"policy.recompute: op_sac (torchtitan's op-level selective AC) is priced for LLaMA "
                            f"blocks with flash attention and bias-free q, k, v (not model.qkv_bias) and a user "
                            f"model's (family torch_module) profiled layers; model {model.name!r} has none: use "
                            f"full or selective")
    if policy.recompute == "op_sac" and policy.cp > 1:
        raise PlanningError(f"policy.recompute: op_sac is modelled at cp 1 (what the ring attention's blocks leave "
                            f"saved under it is not); got cp {policy.cp}")
    if policy.recompute_every is not None and policy.recompute != "full":
        raise PlanningError(f"policy.recompute_every: recomputes every k-th block in full (torchtitan's "
                            f"selective_ac_option = k); needs policy.recompute=full, got {policy.recompute!r}")
    if policy.recompute_every is not None and policy.recompute_num_layers is not None:
        raise PlanningError("policy.recompute_every: picks the recomputed blocks model-wide; "
                            "policy.recompute_num_layers picks them per stage: set one of the two")
    why = blocking_refusal(schedule, pp) if policy.p2p_blocking else None
    if why:
        raise PlanningError(f"policy.p2p_blocking: {why}")
    zero_stage = policy.zero_stage or (1 if policy.distributed_optimizer else 0)
    if policy.overlap_param_gather and zero_stage < 1:
        raise PlanningError("policy.overlap_param_gather: gathers a distributed optimizer's parameter shards; set "
                            "policy.distributed_optimizer=true (or zero_stage >= 1)")
    return assemble(planner, model, hardware, training, schedule, split(chunks), groups,
                    dp, policy.tp, policy.recompute, zero_stage, cp=policy.cp,
                    sequence_parallel=policy.sequence_parallel, overlap_grad_reduce=policy.overlap_grad_reduce,
                    overlap_param_gather=policy.overlap_param_gather, p2p_scatter_gather=policy.p2p_scatter_gather,
                    p2p_blocking=policy.p2p_blocking,
                    recompute_num_layers=policy.recompute_num_layers, recompute_every=policy.recompute_every)


def plan_even(policy: EvenPolicy, model, hardware, training, schedule) -> Plan:
    return _uniform("even", policy, model, hardware, training, schedule,
                    lambda k: megatron_split(model, k))


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
                    lambda k: list(given) if given is not None else megatron_split(model, k))


__all__ = ["PlanningError", "balanced_split", "plan_balanced", "plan_even", "plan_manual"]
