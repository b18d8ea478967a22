"""Today's Megatron-Core / torchtitan knobs on policy=auto's fastest plans (issue 27).

The layout table (layouts.py) prices dp × tp × pp, the microbatch, 1F1B / GPipe and ZeRO; the
compaction (realise.py) per-layer recompute, swaps and windows. The knobs Megatron runs set since
2022 change a plan without changing its layout, so they are tried here, on the plans the search
found, one knob at a time, each kept only when the simulator says the plan got better (it fits
where it did not, or it fits and is faster): nothing is assumed about what a knob saves, so a knob
whose cost model prices it as a no-op (or a loss) is simply not kept.

* **sequence parallelism** (Korthikanti et al. 2022 §4.2.2) on every stage with tp > 1;
* **pipeline scatter/gather** (Narayanan et al. SC'21 §4.1) where a boundary joins stages of
  equal tp > 1 without sequence parallelism;
* **selective recompute** (Korthikanti §5): the plan's recomputed blocks recompute only their
  attention core, all stages at once, then stage by stage (a per-layer choice where memory wants
  it); on a plan that does not fit, its kept blocks selective instead;
* **op-level selective checkpointing** (torchtitan's default ``selective_ac_option = "op"``,
  MemoryAction.op_sac): the fully recomputed blocks that price it (LLaMA with flash attention, a
  user model's profiled layers) on the stages at cp 1, where memwall models it;
* **distributed optimizer** (ZeRO-1 over each stage's dp group, Megatron's
  --use-distributed-optimizer) with overlap_grad_reduce, where some stage has dp > 1;
* **zero-bubble schedules** (Qi et al. 2024): zb_h1 on a 1F1B pipeline (1F1B's memory, §3.1), the
  searched ZB-1p and ZB-2p orders (zb_auto, §3.1 / §5.1: 1F1B's and twice its activation memory) and
  zbv (two chunks per device in a V, §6) on a uniform pipeline whose 2p chunks fit the layers;
* **context parallelism** (ring attention; Megatron-Core, torchtitan) for long sequences only
  (model seq_len ≥ CP_MIN_SEQ_LEN): half of a stage's dp group becomes a cp group of 2.

Which plans (:func:`bases`): the ``top`` fastest fitting ones, the ``top`` fastest that do not
fit but hold no window or swap (a knob may make such a plan fit without the actions that slowed
the others) and the ``top`` fastest such plain plans with tensor parallelism.
Heuristic, not exact: the greedy order and the bases; exact: each kept plan's time and peak are
the simulator's.
"""
from __future__ import annotations

from typing import Callable, Iterator

from costs.buffers import scatterable
from planners.auto.candidate import Candidate
from planners.auto.realise import simulated_candidate
from planners.layout import SELECTIVE_KINDS, PlanningError
from planners.zero_bubble.order import with_zb_order
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import (
    SPLIT_BACKWARD, WEIGHT_STORE_KINDS, LayerMemory, MemoryAction, Plan, PlanError, ScheduleKind, ScheduleSpec,
)

#: context parallelism is tried from this sequence length on (Megatron-Core enables CP for long
#: contexts; below it the ring's exchanges cost more than the activations they split save)
CP_MIN_SEQ_LEN = 16384

Move = Callable[[Plan], Plan | None]


def _plain(plan: Plan) -> bool:
    """No MAP sharding, window or swap: a Megatron-style (dp x cp x tp) plan."""
    return not any(st.sharding or st.offload.window_layers or st.offload.weight_swap_layers
                   or any(m.action in (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme)
                          for m in st.memory) for st in plan.stages)


def _stages(plan: Plan, stages: list) -> Plan:
    return plan.model_copy(update={"stages": stages})


def sequence_parallel(plan: Plan) -> Plan | None:
    """Sequence parallelism on every stage with tp > 1 (None: nothing to turn on)."""
    if not any(st.tp > 1 and not st.sequence_parallel and not st.sharding for st in plan.stages):
        return None
    return _stages(plan, [st.model_copy(update={"sequence_parallel": True}) if st.tp > 1 and not st.sharding
                          else st for st in plan.stages])


def p2p_scatter_gather(plan: Plan) -> Plan | None:
    """Megatron-LM's scatter/gather of pipeline boundaries (Narayanan et al. SC'21 §4.1): each tp
    rank sends 1/t, the receivers all-gather (None: no boundary it applies to)."""
    if plan.p2p_scatter_gather or not any(scatterable(a, b) for a, b in zip(plan.stages, plan.stages[1:])):
        return None
    return plan.model_copy(update={"p2p_scatter_gather": True})


def _selective_stage(st, model: ModelSpec, from_action: MemoryAction):
    """Stage ``st`` with its ``from_action`` blocks (attention-core layers) selective instead."""
    if from_action is MemoryAction.keep:
        acted = {m.layer for m in st.memory}
        new = [LayerMemory(layer=i, action=MemoryAction.selective) for i in range(st.layer_start, st.layer_stop)
               if i not in acted and model.layers[i].kind in SELECTIVE_KINDS]
        if not new:
            return None
        return st.model_copy(update={"memory": sorted(list(st.memory) + new, key=lambda m: m.layer)})
    mem = [m.model_copy(update={"action": MemoryAction.selective})
           if m.action is from_action and model.layers[m.layer].kind in SELECTIVE_KINDS else m for m in st.memory]
    if mem == list(st.memory):
        return None
    return st.model_copy(update={"memory": mem})


def selective(model: ModelSpec, which: list[int] | None, from_action: MemoryAction) -> Move:
    """The move: the stages ``which`` (None: all) with their ``from_action`` blocks selective."""
    def move(plan: Plan) -> Plan | None:
        stages, changed = list(plan.stages), False
        for s, st in enumerate(plan.stages):
            if (which is None or s in which) and not st.sharding and not st.offload.window_layers:
                got = _selective_stage(st, model, from_action)
                if got is not None:
                    stages[s], changed = got, True
        return _stages(plan, stages) if changed else None
    return move


def distributed_optimizer(plan: Plan) -> Plan | None:
    """ZeRO-1 over each stage's dp group with overlap_grad_reduce (Megatron-Core's default with the
    distributed optimizer); None where no stage has dp > 1 or the plan shards already."""
    if plan.zero_stage or not any(st.dp > 1 for st in plan.stages):
        return None
    return plan.model_copy(update={"zero_stage": 1, "overlap_grad_reduce": True})


def zb_h1(plan: Plan) -> Plan | None:
    """ZB-H1 (Qi et al. 2024 §3.1) in place of a non-interleaved 1F1B pipeline of p > 1 stages."""
    if plan.pipeline_depth < 2 or plan.schedule.kind is not ScheduleKind.one_f_one_b or _has_op_sac(plan):
        return None
    return plan.model_copy(update={"schedule": ScheduleSpec(kind="zb_h1")})


def zb_auto(model: ModelSpec, plan_hw: HardwareSpec, limit: float) -> Move:
    """ZB-1p / ZB-2p (Qi et al. 2024 §3.1, §5.1; ``limit`` 1 or 2) in place of a 1F1B or ZB-H1
    pipeline of p > 1 stages: the pass order searched from the plan's stage costs under limit x p x
    M_B (planners.zero_bubble), the weight store kept as the plan had it. Sends overlap the next
    pass, as the paper's runtime runs them (a blocking plan is left alone)."""
    def move(plan: Plan) -> Plan | None:
        if (plan.pipeline_depth < 2 or plan.schedule.kind not in (ScheduleKind.one_f_one_b, ScheduleKind.zb_h1)
                or _has_op_sac(plan) or plan.p2p_blocking or len(plan.stages) != plan.pipeline_depth):
            return None
        schedule = ScheduleSpec(kind="zb_auto", zb_memory_limit=limit, weight_store=plan.schedule.weight_store)
        return with_zb_order(plan.model_copy(update={"schedule": schedule}), model, plan_hw)
    return move


def weight_store(model: ModelSpec, plan_hw: HardwareSpec) -> Move:
    """A split backward's W from stored Linear inputs (the Zero Bubble paper's own implementation,
    ``schedule.weight_store``): B frees the graph, so the microbatches between B and W hold only
    what W reads. None unless the schedule splits and every layer is a Linear layer
    (specs.plan.WEIGHT_STORE_KINDS; tensor-parallel Linears store their local shards). A zb_auto order is searched again: what B's end
    holds until W is what its memory limit counts."""
    def move(plan: Plan) -> Plan | None:
        if (plan.schedule.kind not in SPLIT_BACKWARD or plan.schedule.weight_store
                or any(layer.kind.value not in WEIGHT_STORE_KINDS for layer in model.layers)):
            return None
        stored = plan.model_copy(update={"schedule": plan.schedule.model_copy(update={"weight_store": True,
                                                                                     "order": None})})
        return with_zb_order(stored, model, plan_hw)
    return move


def zbv(model: ModelSpec, plan_hw: HardwareSpec) -> Move:
    """ZBV (Qi et al. 2024 §6): the same p x dp x cp x tp, 2p chunks in a V, split by compute balance
    (policy=balanced's partition), the plan's knobs kept (its recompute made uniform: selective if
    any layer is, else full if any is)."""
    def move(plan: Plan) -> Plan | None:
        from planners.baselines.partition import plan_balanced
        from planners.policy import BalancedPolicy

        p = plan.pipeline_depth
        meshes = {(st.dp, st.tp, st.cp, st.sequence_parallel) for st in plan.stages}
        if (p < 2 or len(meshes) != 1 or plan.schedule.kind not in (ScheduleKind.one_f_one_b, ScheduleKind.zb_h1)
                or 2 * p > model.num_layers or not _plain(plan) or len(plan.stages) != p or _has_op_sac(plan)):
            return None
        (dp, tp, cp, sp), = meshes
        acts = {m.action for st in plan.stages for m in st.memory}
        recompute = ("selective" if MemoryAction.selective in acts else
                     "full" if MemoryAction.recompute in acts else "none")
        knobs = BalancedPolicy(pp=p, dp=dp, tp=tp, cp=cp, recompute=recompute, sequence_parallel=sp,
                               zero_stage=plan.zero_stage, overlap_grad_reduce=plan.overlap_grad_reduce,
                               overlap_param_gather=plan.overlap_param_gather)
        got = plan_balanced(knobs, model, plan_hw, plan.training, ScheduleSpec(kind="zbv"))
        return got.model_copy(update={"planner": plan.planner})
    return move


def context_parallel(plan: Plan) -> Plan | None:
    """Half of each stage's dp group as a cp group of 2 (same devices: replica r, CP rank c, TP rank
    t is devices[(r*cp + c)*tp + t]); None where a stage's dp is odd."""
    if not all(st.dp % 2 == 0 and not st.sharding for st in plan.stages):
        return None
    return _stages(plan, [st.model_copy(update={"dp": st.dp // 2, "cp": st.cp * 2}) for st in plan.stages])


def op_sac(model: ModelSpec) -> Move:
    """The move: every stage at cp 1 (where specs.plan allows op_sac) with its fully
    recomputed blocks under torchtitan's op-level policy instead (``LayerSpec.has_op_sac``);
    None where no block changes."""
    def move(plan: Plan) -> Plan | None:
        stages, changed = list(plan.stages), False
        for s, st in enumerate(plan.stages):
            if st.cp > 1 or st.sharding or st.offload.window_layers:
                continue
            mem = [m.model_copy(update={"action": MemoryAction.op_sac})
                   if m.action is MemoryAction.recompute and model.layers[m.layer].has_op_sac else m for m in st.memory]
            if mem != list(st.memory):
                stages[s], changed = st.model_copy(update={"memory": mem}), True
        return _stages(plan, stages) if changed else None
    return move


def _has_op_sac(plan: Plan) -> bool:
    """Whether a layer runs op_sac: the split backward of zb_h1 / zbv does not run it (executor.split_backward)."""
    return any(m.action is MemoryAction.op_sac for st in plan.stages for m in st.memory)


def recompute_all(model: ModelSpec, to: MemoryAction) -> Move:
    """Every selective (or recomputed) block recomputed in full (or every recomputed, selective or
    op_sac block kept): the way back when a knob's memory is not needed (``to`` keep) or not enough
    (``to`` recompute)."""
    src = MemoryAction.selective if to is MemoryAction.recompute else None

    def move(plan: Plan) -> Plan | None:
        stages, changed = [], False
        for st in plan.stages:
            if to is MemoryAction.keep:
                mem = [m for m in st.memory
                       if m.action not in (MemoryAction.selective, MemoryAction.recompute, MemoryAction.op_sac)]
            else:
                mem = [m.model_copy(update={"action": to}) if m.action is src else m for m in st.memory]
            changed |= mem != list(st.memory)
            stages.append(st.model_copy(update={"memory": mem}))
        return _stages(plan, stages) if changed else None
    return move


def megatron_grid(model: ModelSpec, hardware: HardwareSpec, plan_hw: HardwareSpec, training, capacity: int,
                  limit: int = 12) -> list[Candidate]:
    """Megatron's own recipe on uniform layouts (Korthikanti et al. 2022 §6: tensor parallelism
    inside a node with sequence parallelism and selective recompute, pipelining across, the
    distributed optimizer over dp): p x dp x tp for tp > 1 a divisor of the node's devices and p a
    power of two, balanced split, simulated as is. The layout table (layouts.py) knows neither
    knob, so its bound may rank these layouts past policy.max_layouts. At most ``limit``, fewest
    stages first (the least bubble)."""
    from planners.baselines.partition import plan_balanced
    from planners.policy import BalancedPolicy

    if not model.seq_len or not any(layer.kind in SELECTIVE_KINDS for layer in model.layers):
        return []  # no attention core, no sequence: the recipe is a transformer's
    n, node = hardware.num_devices, hardware.devices_per_node
    max_tp = min((layer.max_tp for layer in model.layers if layer.max_tp), default=node)
    out: list[Candidate] = []
    grid = [(p, tp) for p in (1 << k for k in range(n.bit_length())) for tp in range(2, min(node, max_tp) + 1)
            if node % tp == 0 and n % (p * tp) == 0 and p <= model.num_layers]
    for p, tp in sorted(grid)[:limit]:
        dp = n // (p * tp)
        if training.samples_per_microbatch % dp:
            continue
        try:
            knobs = BalancedPolicy(pp=p, dp=dp, tp=tp, recompute="selective", sequence_parallel=True,
                                   zero_stage=1 if dp > 1 else 0, overlap_grad_reduce=dp > 1)
            plan = plan_balanced(knobs, model, plan_hw, training, ScheduleSpec(kind="1f1b"))
            out.append(simulated_candidate(f"Megatron recipe pp{p} dp{dp} tp{tp}: sequence parallel, selective "
                                           "recompute" + (", distributed optimizer" if dp > 1 else ""),
                                           plan.model_copy(update={"planner": "auto"}), model, hardware, capacity))
        except (PlanningError, PlanError, ValueError, NotImplementedError):
            continue
    return out


def moves(plan: Plan, model: ModelSpec, plan_hw: HardwareSpec) -> Iterator[tuple[str, Move]]:
    """The knobs in the order tried (module doc); per-stage selective only on pipelines of ≤ 8 stages."""
    if model.seq_len:  # a sequence to split: transformer families only
        yield "sequence parallel", sequence_parallel
    yield "pipeline scatter/gather", p2p_scatter_gather
    yield "selective recompute instead of full", selective(model, None, MemoryAction.recompute)
    if 1 < len(plan.stages) <= 8:
        for s in range(len(plan.stages)):
            yield f"selective recompute instead of full on stage {s}", selective(model, [s], MemoryAction.recompute)
    yield "selective recompute on the kept blocks", selective(model, None, MemoryAction.keep)
    yield "no recompute", recompute_all(model, MemoryAction.keep)
    yield "full recompute instead of selective", recompute_all(model, MemoryAction.recompute)
    if any(layer.has_op_sac for layer in model.layers):
        yield "op-level selective checkpointing instead of full (torchtitan)", op_sac(model)
    yield "distributed optimizer (ZeRO-1), overlap_grad_reduce", distributed_optimizer
    yield "zb_h1", zb_h1
    yield "ZB-1p (searched zero-bubble order, 1F1B's memory)", zb_auto(model, plan_hw, 1.0)
    yield "ZB-2p (searched zero-bubble order, twice 1F1B's memory)", zb_auto(model, plan_hw, 2.0)
    yield "zbv", zbv(model, plan_hw)
    yield "zero-bubble weight store (W from stored Linear inputs)", weight_store(model, plan_hw)
    if (model.seq_len or 0) >= CP_MIN_SEQ_LEN:
        yield "context parallel 2", context_parallel


def better(a: Candidate, b: Candidate) -> bool:
    """``a`` fits where ``b`` does not, or both fit and ``a`` is faster, or neither fits and ``a``
    peaks lower."""
    if a.fits != b.fits:
        return a.fits
    return a.time_s < b.time_s if a.fits else a.peak < b.peak


def tune(base: Candidate, model: ModelSpec, hardware: HardwareSpec, plan_hw: HardwareSpec,
         capacity: int) -> list[Candidate]:
    """Greedy over the knobs from ``base``: each move applied to the best plan so far, simulated,
    kept when :func:`better`. Returns every plan simulated (the best among them)."""
    cur, out, names = base, [], []
    for name, move in moves(base.plan, model, plan_hw):
        try:
            plan = move(cur.plan)
            if plan is None:
                continue
            got = simulated_candidate(f"{base.how} + {', '.join(names + [name])}", plan, model, hardware, capacity,
                                      list(base.notes))
        except (PlanningError, PlanError, ValueError, NotImplementedError):
            continue  # the knob is refused on this plan (or not yet priced by the simulator)
        # no layout: a knob changes what the layout table priced (a zero-bubble schedule beats its
        # 1F1B bound, layouts.compute_bound_s), as interleave.py's plans have none
        got.layout = None
        out.append(got)
        if better(got, cur):
            cur = got
            names.append(name)
    return out


def bases(cands: list[Candidate], top: int) -> list[Candidate]:
    """The ``top`` fastest fitting plans, the ``top`` fastest plain ones (no window, no swap) that
    do not fit, and the ``top`` fastest plain ones with tensor parallelism (where sequence
    parallelism and selective recompute save the most, Korthikanti §4-5, so that a tp layout that
    fits only with every layer recomputed, or not at all, gets them); distinct plans only."""
    order = lambda c: (c.time_s, c.how)  # noqa: E731
    fit = sorted((c for c in cands if c.fits), key=order)
    plain = sorted((c for c in cands if _plain(c.plan)), key=order)
    over = [c for c in plain if not c.fits]
    tp = [c for c in plain if any(st.tp > 1 for st in c.plan.stages)]
    out, seen = [], set()
    for c in fit[:top] + over[:top] + tp[:top]:
        if c.plan.id not in seen:
            seen.add(c.plan.id)
            out.append(c)
    return out


def tp_layouts(layouts: list, cands: list[Candidate], model: ModelSpec, hardware: HardwareSpec, capacity: int,
               top: int) -> list[Candidate]:
    """The ``top`` best-bound layouts with a tp > 1 stage that the search did not simulate, each
    simulated as it is (no action): their tp groups are where sequence parallelism and selective
    recompute save the most, and the compaction loop, ordered by a bound that knows neither, may
    not have reached them."""
    done = {id(c.layout) for c in cands if c.layout is not None}
    out: list[Candidate] = []
    for lay in layouts:
        if len(out) == top:
            break
        if id(lay) in done or not any(p.degrees[1] > 1 for p in lay.stages) or lay.variant.zero_stage:
            continue
        try:
            got = simulated_candidate("layout as is", lay.plan("none"), model, hardware, capacity)
        except (PlanningError, PlanError, ValueError):
            continue
        got.how, got.layout = f"{lay.text()}: {got.how}", lay
        out.append(got)
    return out


def with_knobs(cands: list[Candidate], layouts: list, model: ModelSpec, hardware: HardwareSpec,
               plan_hw: HardwareSpec, capacity: int, training=None, top: int = 2) -> list[Candidate]:
    """The knobs tried on the :func:`bases` of ``cands``, of :func:`tp_layouts` and of
    :func:`megatron_grid` (at ``training``'s microbatch); every plan simulated."""
    out = tp_layouts(layouts, cands, model, hardware, capacity, top)
    if training is not None:
        out += megatron_grid(model, hardware, plan_hw, training, capacity)
    for base in bases(cands + out, top):
        out += tune(base, model, hardware, plan_hw, capacity)
    return out
