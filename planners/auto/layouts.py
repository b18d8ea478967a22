"""policy=auto's outer search: the layouts (issue 23).

A layout is a contiguous split of the layers into pipeline stages, each on a sub-mesh with its
dp × tp, for one (microbatch size, schedule, ZeRO stage). It is generated with the throughput
planner's stage table (planners/baselines: Alpa's stage space, CAPTURE's power-of-two degrees,
tensor parallelism inside a node) and priced in closed form twice:

* ``time_lb_s``: the iteration time of the stages' compute alone, no memory action (Σ work +
  (m − 1) · max work), or, where a stage must take a window (over its floor), the CPU steps of
  what it must stream when they take longer (:func:`host_step_bound_s`; a plan of that layout
  that fits streams it). Every action adds time (a recompute its forward, a swap whatever its
  copy does not hide, a window its stalls), and transfers and all-reduces only add to compute, so
  this bounds any compaction of the layout from below — exact for the closed-form stage times; the
  simulator's per-layer timing can differ slightly (measured ≥ 0.987 × over the test configs),
  so against simulated times it is a heuristic bound (search.py keeps 2 % slack).
* ``peaks_full``: per stage, the peak with every layer recomputed (Megatron's full activation
  checkpointing), and ``floors``: the peak with every in-flight activation gone (swapped out to
  the host or to peers, MPress §III-C) and the optimizer state swapped to the host between steps
  (MPress's optimizer swap): weights and gradients, one layer's working set, the boundary
  buffers. No per-layer action goes below the floor, so a layout with a stage over capacity at
  its floor is pruned unless that stage can take a STRONGHOLD window (no ZeRO, not PipeDream; a
  dp x tp stage too: each replica streams its own window, a tp rank its shard, STRONGHOLD §III-F),
  which streams the parameter state itself. Exact for the closed-form bytes; the
  simulator's timeline can differ by what the table omits (a heuristic prune against it).

Which layouts: for each variant, the exact DP's Pareto fronts (small inputs) or every uniform
config's best cut (at scale), with no memory limit (the fastest layouts, to compact), under the
capacity with no action (they fit as they are) and under it with full recompute (they fit once
compacted). Duplicates (same stages, variant) are priced once.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from planners.baselines.stage_place import Placed
from planners.baselines.stagetable import StageTable
from planners.layout import PlanningError
from planners.baselines.throughput import EXACT_TRANSITIONS, candidates, exact_transitions, uniform_plans
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec
from specs.training import TrainingSpec

INF = float("inf")


@dataclass(frozen=True)
class Variant:
    """What one stage table is built for: the training (its microbatch size), the schedule, ZeRO."""

    training: TrainingSpec
    schedule: ScheduleSpec
    zero_stage: int

    def text(self) -> str:
        return (f"microbatch {self.training.samples_per_microbatch}, {self.schedule.kind.value}"
                + (f", ZeRO-{self.zero_stage}" if self.zero_stage else ""))


@dataclass
class Layout:
    stages: tuple[Placed, ...]
    variant: Variant
    time_lb_s: float                 # no action: a lower bound on any compaction's time (see module doc)
    time_full_s: float               # every layer recomputed
    peaks_none: tuple[int, ...]      # per stage, bytes per device, no action
    peaks_full: tuple[int, ...]      # per stage, every layer recomputed
    floors: tuple[int, ...]          # per stage, no activation kept (every one swapped out)
    tables: tuple[StageTable, StageTable] = field(repr=False, compare=False)  # (none, full)

    def plan(self, recompute: str = "none") -> Plan:
        """The layout as a plan: no memory action (``none``), or every layer recomputed (``full``)."""
        table = self.tables[0] if recompute == "none" else self.tables[1]
        plan = table.to_plan(list(self.stages), "auto")
        if self.variant.zero_stage >= 1 and any(st.dp > 1 for st in plan.stages):
            # the distributed optimizer with its gradient reduce-scatter overlapped with the backward,
            # as Megatron-Core configures it (DistributedDataParallelConfig.overlap_grad_reduce)
            plan = plan.model_copy(update={"overlap_grad_reduce": True})
        return plan

    def text(self) -> str:
        parts = []
        for p in self.stages:
            dp, tp = p.degrees
            parts.append(f"{p.stop - p.start}L" + (f" dp{dp}" if dp > 1 else "") + (f" tp{tp}" if tp > 1 else ""))
        return f"pp{len(self.stages)} [{', '.join(parts)}] ({self.variant.text()})"


def variants(policy, training: TrainingSpec, schedule: ScheduleSpec) -> tuple[list[Variant], list[str]]:
    """The (microbatch size, schedule, ZeRO) tables the search builds, and what it leaves out and why."""
    left_out = []
    gb = training.global_batch
    mine = training.samples_per_microbatch
    sizes = policy.microbatch_sizes or [mine, mine // 2, mine * 2]
    sizes = sorted({s for s in sizes if s >= 1 and gb % s == 0})
    if not sizes:
        raise PlanningError(f"policy.microbatch_sizes: none of {policy.microbatch_sizes} divides "
                            f"training.global_batch={gb}; give sizes that divide it")
    async_ok = policy.allow_async if policy.allow_async is not None else schedule.kind.value == "pipedream_async"
    kinds = list(policy.schedules or ["1f1b", "gpipe"])
    if "zbv" in kinds:  # two chunks per device: the table prices one chunk per device (knobs.py tries it)
        kinds.remove("zbv")
    if schedule.virtual_stages == 1 and schedule.kind.value not in kinds:
        kinds.append(schedule.kind.value)
    if async_ok and "pipedream_async" not in kinds:
        kinds.append("pipedream_async")
    if not async_ok and "pipedream_async" in kinds:
        kinds.remove("pipedream_async")
        left_out.append("pipedream_async: it changes the optimisation (stale weights); policy.allow_async=true adds it")
    left_out.append("interleaved 1F1B: not in the layout table (it prices non-interleaved pipelines); tried after "
                    "the search on the fastest uniform layouts (v = 2, 3, 4, balanced chunks, no action or full "
                    "recompute: per-layer actions and windows take no interleaved plan; Megatron-Core's smallest "
                    "microbatch group where the depth does not divide the microbatches)")
    if any(z > 1 for z in policy.zero_stages):
        left_out.append("ZeRO > 1 is searched for simulation (the executor runs ZeRO-2 and ZeRO-3 on stages "
                        "without tp/cp or offload, ZeRO-3 with no weight tied over stages: executor.zero2, "
                        "executor.fsdp)")
    if 1 not in policy.zero_stages:
        left_out.append("distributed optimizer (ZeRO-1): not searched; policy.zero_stages=[0,1] (the default) adds it")
    left_out.append("sequence parallelism, pipeline scatter/gather, selective recompute, op-level SAC (LLaMA "
                    "blocks, a user model's profiled layers; cp 1), ZeRO-1, zb_h1 / zbv and "
                    "(seq_len >= 16384) context parallelism on the fastest plans: tried one knob at a time, each kept "
                    "when the simulator says it is faster or fits where the plan did not (planners/auto/knobs.py)")
    left_out.append("D2D swap from stages with dp·tp > 1: the executor sends every replica's stripes, the simulator "
                    "counts one share (planners/mpress/compact.py); such stages recompute or swap to the host")
    left_out.append("MAP's per-operator sharding beside dp × tp stages: tried on the fastest plan at the configured "
                    "microbatch only (its operator graphs are traced at that size; the lowest-peak one when none "
                    "fits), one stage at a time (planners/auto/map_mix.py)")
    out = []
    for size in sizes:
        tr = training.model_copy(update={"microbatch_size": size, "num_microbatches": None})
        tr = TrainingSpec.model_validate(tr.model_dump())
        for kind in kinds:
            sc = ScheduleSpec(kind=kind)
            for z in sorted(set(policy.zero_stages)):
                out.append(Variant(tr, sc, z))
    return out, left_out


def compute_bound_s(table: StageTable, stages) -> float:
    """The layout's iteration time from its stages' compute alone, no memory action: Σ work + (m − 1)
    · max work (1F1B, GPipe) or m · max work (PipeDream). The table's own estimate adds the p2p
    transfers and the slowest gradient all-reduce after the drain, which the simulator overlaps
    with other stages' backward (a late dp stage finishes first): measured up to 12 % above the
    simulated time (bert_tiny, gpt_5b3 on dgx1), so it is no bound. Compute alone is."""
    work = [table.cost(p).work_s for p in stages]
    m = table.training.microbatches
    if table.schedule.kind.value == "pipedream_async":
        return m * max(work)
    return sum(work) + (m - 1) * max(work)


def host_step_bound_s(table: StageTable, stages, floors, capacity: int) -> float:
    """A lower bound on the iteration of a layout whose stages over their floor must take a
    STRONGHOLD window (s): the CPU optimizer steps of what they stream. A window stage's device
    holds its resident layers' full state, so at most capacity / (w_b + g_b + o_b) of its P
    parameters stay; the rest, at least (static bytes − capacity) / (w_b + g_b + o_b), is stepped
    on the host each iteration, by every rank on a node on the node's shared cores
    (costs.window.cpu_step_s: a dp replica steps its own copy, a tp rank its shard), before the
    next forward needs it (eq. 3). The busiest node bounds the steady-state iteration. It
    keeps dp replicas of a model that must be streamed behind the layouts that stream it once
    (GPT-3 175B on one Selene node: pp1 dp4 tp2 steps 4 copies, ≥ 328 s; pp8 or tp8: ≥ 66 s)."""
    w_b, g_b, o_b = table.training.bytes_per_param()
    rate = table.hardware.host.cpu_adam_params_per_s
    per_node: dict[int, float] = {}   # the node's cores are one resource (simulator.window.resources)
    for p, floor in zip(stages, floors):
        c = table.cost(p)
        if floor <= capacity or c is None:
            continue
        streamed = max(0, c.static_bytes - capacity) / (w_b + g_b + o_b)   # parameters per rank
        for d in range(p.gpu, p.gpu + p.degree):
            node = table.hardware.node_of(d)
            per_node[node] = per_node.get(node, 0.0) + streamed / rate
    return max(per_node.values(), default=0.0)


def needs_dp_tp_window(layout: Layout, capacity: int) -> bool:
    """A stage of dp x tp > 1 devices over its floor: the layout needs a data- or tensor-parallel
    window (issue 25; search.py realises these on a budget of their own)."""
    return any(f > capacity and p.degree > 1 for p, f in zip(layout.stages, layout.floors))


def window_possible(p: Placed, variant: Variant) -> bool:
    """A STRONGHOLD window needs no ZeRO and 1F1B or GPipe (specs/plan.py, executor); a stage of dp
    x tp devices takes one as policy=stronghold's layouts do (issue 25: each dp replica streams its
    own window, all-reducing its host gradients before the CPU steps, §III-F; a tp rank streams its
    shard). ``p`` is any stage of the table (no MAP sharding: map_mix adds that after)."""
    del p  # every stage the table places can be windowed
    return variant.zero_stage == 0 and variant.schedule.kind.value in ("1f1b", "gpipe")


def floor_bytes(table: StageTable, p: Placed, stages_after: int) -> int:
    """What no activation action gets stage ``p`` below (module doc): its peak with no microbatch's
    activations held — static state, one layer's working set and the sent gradient (or the flat
    all-reduce copy), the received-gradient buffer, PipeDream's stashed weight versions (at most two
    on the device once the others are swapped to the host)."""
    c = table.cost(p)
    if c is None:
        return 0
    # PipeDream: the stash swap (planners/mpress/stash.py, MPress §II-D) sends every stashed version
    # to the host but the two a backward may hold (its own and the next one's, simulator/stash.py)
    stash = min(stages_after, 2) if table.schedule.kind.value == "pipedream_async" else 0
    w_b, g_b, o_b = table.training.bytes_per_param()
    # MPress's optimizer swap (§III-C) keeps the Adam state in host memory between steps, with
    # ZeRO too (planners/mpress/choice.py swaps a ZeRO stage's shard): off the floor. Under ZeRO the
    # state is sharded at least as finely as the weights and gradients, so its share of the static
    # bytes is at most o_b / (w_b + g_b + o_b): taking that share keeps the floor a lower bound
    optimizer = c.static_bytes * o_b // (w_b + g_b + o_b)
    return (c.static_bytes - optimizer + max(c.transient_bytes, c.allreduce_bytes) + c.grad_bytes + c.buffer_bytes
            + stash * c.weights_bytes)


def generate(model: ModelSpec, hardware: HardwareSpec, variant: Variant, capacity: int,
             progress=None, unlimited: dict | None = None) -> list[list[Placed]]:
    """The layouts of one variant (module doc): fastest with no limit, fitting as they are, fitting
    once every layer is recomputed. ``unlimited``: the exact DP's no-limit fronts by (microbatch
    size, ZeRO stage), shared between schedules: with no memory limit the DP reads only stage work,
    sync and p2p times, which do not depend on the schedule (StageTable.cost)."""
    none = StageTable(model, hardware, variant.training, variant.schedule, variant.zero_stage, "none")
    full = StageTable(model, hardware, variant.training, variant.schedule, variant.zero_stage, "full")
    out: list[list[Placed]] = []
    if exact_transitions(none) <= EXACT_TRANSITIONS:
        key = (variant.training.samples_per_microbatch, variant.zero_stage)
        free = None if unlimited is None else unlimited.get(key)
        if free is None:
            free = candidates(none, INF)
            if unlimited is not None:
                unlimited[key] = free
        out += free
        for table in (none, full):
            out += candidates(table, capacity)
    else:
        for table, cap in ((none, INF), (none, capacity), (full, capacity)):
            out += uniform_plans(table, cap, None, progress, prune=False)
    return out, (none, full)


def search_layouts(policy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                   schedule: ScheduleSpec, capacity: int, progress=None
                   ) -> tuple[list[Layout], Counter, list[str], int]:
    """Every admissible layout, best lower bound first; the pruned ones counted by reason; what the
    space leaves out; how many layouts were priced."""
    vs, left_out = variants(policy, training, schedule)
    seen: set = set()
    kept: list[Layout] = []
    pruned: Counter = Counter()
    unlimited: dict = {}
    for n, v in enumerate(vs):
        if progress is not None:
            progress(n, len(vs))
        try:
            stage_lists, tables = generate(model, hardware, v, capacity, unlimited=unlimited)
        except ValueError as exc:
            pruned[f"{v.text()}: {exc}"] += 1
            continue
        for stages in stage_lists:
            if v.zero_stage and all(st.degrees[0] == 1 for st in stages):
                continue  # no data parallelism to shard over: the zero_stage 0 layout, priced there
            key = (tuple(stages), v)
            if key in seen:
                continue
            seen.add(key)
            _, peaks_none = tables[0].evaluate(stages)
            t_full, peaks_full = tables[1].evaluate(stages)
            t_none = compute_bound_s(tables[0], stages)
            p = len(stages)
            floors = tuple(min(floor_bytes(t, st, p - 1 - i) for t in tables) for i, st in enumerate(stages))
            if any(f > capacity and not window_possible(st, v) for st, f in zip(stages, floors)):
                pruned["a stage's parameter state and working set alone exceed the capacity, and it cannot take "
                       "a window (ZeRO or PipeDream)"] += 1
                continue
            t_none = max(t_none, host_step_bound_s(tables[0], stages, floors, capacity))
            kept.append(Layout(tuple(stages), v, t_none, t_full, tuple(peaks_none), tuple(peaks_full), floors, tables))
    if progress is not None:
        progress(len(vs), len(vs))
    kept.sort(key=lambda lay: (lay.time_lb_s, max(lay.peaks_full), lay.text()))
    return kept, pruned, left_out, len(seen)
