"""zb_auto's pass order: the Zero Bubble paper's automatic schedule for one plan (Qi et al. 2024 §3).

The paper profiles T_F, T_B, T_W and T_comm, then searches the order (§3.1, :mod:`.heuristic`) under
an activation memory limit of k·p·M_B (§5.1: ZB-1p k = 1, ZB-2p k = 2; its runtime takes
``--zero-bubble-max-pending-backward`` = k·p times the larger of the first two stages' forward
memory). memwall prices the same quantities before any run: per stage the simulator's F, B and W
seconds (simulator.analytic.split_pass_costs, the numbers its pipeline walk uses), the longest
boundary hop as T_comm, and the bytes a microbatch's F adds, its B's end adds and its W frees
(simulator.analytic.split_pass_bytes, as the memory walk books them). The order is written into
``schedule.order``, so the simulator and the executor walk the same list and the plan file shows it.
"""
from __future__ import annotations

from planners.layout import PlanningError
from planners.zero_bubble.heuristic import zb_orders
from simulator.analytic import split_pass_bytes, split_pass_costs
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleKind, ScheduleSpec

#: policies that partition without simulating their candidates, so the order can be searched after
ZB_AUTO_POLICIES = ("even", "balanced", "manual", "throughput")


def search_inputs(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> dict:
    """The heuristic's inputs for ``plan`` (a zb_auto plan, with or without its order): per stage
    ``cost_f``, ``cost_b``, ``cost_w`` (s), ``cost_comm`` (s), ``mem_f``, ``mem_b``, ``mem_w``
    (bytes; they sum to 0) and ``max_mem`` (bytes, zb_memory_limit x p x M_B, M_B the larger of the
    first two stages' per-microbatch bytes at B, as the paper's runtime sets it)."""
    passes, hops = split_pass_costs(plan, model, hardware)
    mem = split_pass_bytes(plan, model)
    n = len(plan.stages)
    # The paper's B frees part of a microbatch's activations (Table 1: M_W < M_B; its runtime's
    # mem_b <= 0). torch's B (no weight store) keeps the graph and adds the output gradients until W
    # (mem_b > 0); the search places a stage's first B without a memory check and would then find no
    # room for the next (no order at ZB-1p), so B's bytes are reserved at F: a microbatch counts
    # mem_f + mem_b from its F to its W (over-counting by mem_b between its F and its B).
    mem_f = [float(mem[i][0] + max(mem[i][1], 0)) for i in range(n)]
    mem_b = [float(min(mem[i][1], 0)) for i in range(n)]
    limit = plan.schedule.zb_memory_limit * plan.pipeline_depth * max(mem_f[:2])
    return {"cost_f": [passes[i][0] for i in range(n)], "cost_b": [passes[i][1] for i in range(n)],
            "cost_w": [passes[i][2] for i in range(n)], "cost_comm": max(hops.values(), default=0.0),
            "mem_f": mem_f, "mem_b": mem_b, "mem_w": [-(f + b) for f, b in zip(mem_f, mem_b)],
            "max_mem": [limit] * n}


def refuse_zb_auto(policy_kind: str, schedule: ScheduleSpec) -> None:
    """schedule=zb_auto with a policy other than :data:`ZB_AUTO_POLICIES` (those that simulate
    candidates while they plan would need each candidate's order before the partition it depends
    on; ZeRO-Offload plans no pipeline): PlanningError naming the policies that take it."""
    if schedule.kind is ScheduleKind.zb_auto and policy_kind not in ZB_AUTO_POLICIES:
        raise PlanningError(f"schedule=zb_auto: its pass order is searched from a partitioned pipeline's stage costs, "
                            f"after policy {', '.join(ZB_AUTO_POLICIES)} partition it; policy={policy_kind} does "
                            f"not take it (it simulates candidates while it plans, or plans no pipeline): use one "
                            "of those (policy=auto tries ZB-1p and ZB-2p itself), or schedule=zb_h1")


def with_zb_order(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> Plan:
    """``plan`` with its zb_auto order searched (Qi et al. 2024 §3.1); other plans, and a zb_auto
    plan that lists its order already, unchanged. Raises PlanningError when no order keeps the
    memory limit (a limit below one microbatch's activations)."""
    if plan.schedule.kind is not ScheduleKind.zb_auto or plan.schedule.order is not None:
        return plan
    if plan.schedule.virtual_stages != 1 or len(plan.stages) != plan.pipeline_depth:
        raise PlanningError("schedule=zb_auto places one chunk per device (virtual_stages 1)")
    try:
        orders, _ = zb_orders(m=plan.training.microbatches, **search_inputs(plan, model, hardware))
    except ValueError as e:
        raise PlanningError(f"schedule.zb_memory_limit {plan.schedule.zb_memory_limit:g}: {e}; raise it "
                            "(1 = ZB-1p, 1F1B's memory; 2 = ZB-2p) or use schedule=zb_h1") from None
    return plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"order": orders})})
