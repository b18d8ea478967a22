"""MAP's per-operator sharding on single stages of policy=auto's winner (issues 23, 26; MAP §4-§5).

policy=map plans every stage as a MAP mesh; auto's layouts give each stage dp × tp. This step
mixes them: for each stage of the fastest fitting auto plan that spans several devices (no
window), MAP's stage problem on those same devices — its operator strategies and layout
conversions (planners/map/plan.py ``_StageModel``), eq. 1's ILP and rotor checkpointing under the
capacity (planners/map/stage.py ``solve_stage``) — replaces the stage (its per-layer actions and
optimizer swap with it), the other stages unchanged. The mixed plan is simulated; it is kept when
it fits and is faster, and the next stage is tried on top of it (greedy, in stage order). When the
simulator puts the sharded stage over the capacity, MAP's own refinement is applied once: the
budget shrinks by capacity / peak and the stage is solved again (as map_search does).

Any model with operator graphs (issue 26): MAP's strategies are per operator of the traced graph
(executor.op_graph: GPT, BERT, LLaMA, Wide-ResNet, MoE and a user's torch_module alike), so nothing
here asks the family. A torch_module layer has no closed-form tensor parallelism (max_tp 1), so for
such a model a MAP stage is auto's only way to shard a layer's parameters (MAP §1: automatic
parallelisation of any model).

When no plan of auto's fits (a layer's state alone over the capacity on one device), the base is
the own plan with the lowest peak instead: sharding a stage may be what makes it fit. A mixed plan
is kept when it is better than the last kept one: it fits and is faster, or the last one does not
fit and it fits or peaks lower.

Heuristic, not exact: one plan (the winner), stages one at a time, one refinement. Exact: each
mixed plan's time and peak are the simulator's. Needs the model's operator graphs (the shell
attaches them for policy=auto: model_costs.wants_op_graphs); without them nothing is tried.
"""
from __future__ import annotations

from planners.auto.candidate import Candidate, over_capacity
from planners.auto.realise import simulated_candidate
from planners.layout import PlanningError
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, PlanError, StagePlan

GIB = float(1 << 30)


def _sharded_stage(plan: Plan, s: int, model: ModelSpec, hardware: HardwareSpec, budget: int) -> StagePlan:
    """Stage ``s`` of ``plan`` as a MAP stage on the same devices, solved at ``budget`` bytes."""
    from planners.map.plan import StageChoice, _StageModel, choose_mesh
    from planners.map.stage import solve_stage
    from planners.policy import MapPolicy

    st = plan.stages[s]
    shape, order = choose_mesh(None, hardware, tuple(st.devices))
    sm = _StageModel(model, hardware, plan.training, range(st.layer_start, st.layer_stop), order, shape)
    sm.build()
    choice = StageChoice(stage=s, layers=(st.layer_start, st.layer_stop), devices=order, mesh=shape,
                         nodes=len(sm.nodes), strategies=sum(len(x) for x in sm._unary))
    groups: list = []     # filled when rotor's chain over node groups wins (MAP Algorithm 2), as in map_search
    shard, segs = solve_stage(sm, budget, MapPolicy(memory_budget_gib=budget / GIB), choice, None, [], None, groups)
    if choice.min_budget_bytes:
        raise PlanningError(f"stage {s}: MAP needs {choice.min_budget_bytes / GIB:.2f} GiB per device")
    # what the stage is, as map_search writes it: its mesh (StagePlan.mesh where specs carries it), and
    # its checkpoint tree's node groups when that tree cuts inside layers (the segments index them)
    mesh_field = {"mesh": list(shape)} if "mesh" in StagePlan.model_fields else {}
    return StagePlan(layer_start=st.layer_start, layer_stop=st.layer_stop, devices=list(order), dp=1,
                     tp=len(order), sharding=shard, checkpoint=segs, node_groups=groups or None, **mesh_field)


def _with_stage(plan: Plan, s: int, stage: StagePlan) -> Plan:
    stages = list(plan.stages)
    stages[s] = stage
    return plan.model_copy(update={"stages": stages})


def _better(got: Candidate, best: Candidate) -> bool:
    """Kept over ``best`` (module doc): fits and faster; or ``best`` does not fit, and it fits or peaks lower."""
    if best.fits:
        return got.fits and got.time_s < best.time_s
    return got.fits or got.peak < best.peak


def map_base(cands: list[Candidate], samples_per_microbatch: int) -> Candidate | None:
    """The plan MAP sharding is tried on: auto's own fastest fitting plan at the configured
    microbatch (the operator graphs' size, module doc); if none fits, its lowest-peak one."""
    own = [c for c in cands
           if c.layout is not None and c.plan.training.samples_per_microbatch == samples_per_microbatch]
    fit = [c for c in own if c.fits]
    if fit:
        return min(fit, key=lambda c: (c.time_s, c.how))
    return min(own, key=lambda c: (c.peak, c.time_s, c.how), default=None)


def map_mixed(winner: Candidate, model: ModelSpec, hardware: HardwareSpec, capacity: int) -> list[Candidate]:
    """The mixed plans tried on ``winner`` (module doc), each simulated; the last kept one is the best."""
    if not model.op_graphs or any(layer.op_graph is None for layer in model.layers):
        return []
    plan = winner.plan
    if plan.schedule.virtual_stages > 1 or plan.zero_stage:
        return []
    best, out = winner, []
    for s, st in enumerate(plan.stages):
        if len(st.devices) < 2 or st.offload.window_layers is not None or st.sharding:
            continue
        budget, last = capacity, None
        for _ in range(2):  # the solve, then MAP's one refinement if the simulator says it is over
            try:
                mixed = _with_stage(best.plan, s, _sharded_stage(best.plan, s, model, hardware, budget))
                got = simulated_candidate(f"stage {s} as MAP's sharding", mixed, model, hardware, capacity)
            except (PlanningError, PlanError, ValueError):
                break
            got.how = f"{winner.how} + MAP sharding on stage {s}"
            out.append(got)
            last = got
            peak = max(d.peak_bytes for d in got.result.devices if d.device in set(st.devices))
            if not over_capacity(got.result, capacity) or peak <= capacity:
                break
            budget = int(budget * capacity / peak * 0.995)
        if last is not None and _better(last, best):
            best = last
    return out
