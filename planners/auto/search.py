"""policy=auto: one search over every technique memwall has (issue 23).

"What is the fastest way to train this model on this cluster?" The product of the techniques is
not enumerated; the search decomposes as the papers' own solvers do:

1. **singles** (planners/auto/singles.py): balanced, throughput, CAPTURE, MPress, STRONGHOLD and
   MAP each plan the same inputs with their default knobs; each answer is simulated and is a
   candidate, so auto's answer is never slower than the best of them (and fits whenever one does).
   MPress and STRONGHOLD (singles.BOUNDED: their searches take minutes at 64-512 devices) run
   last, each only while a lower bound on its answer (singles.single_bound_s) can beat the
   fastest fitting plan found; else the report says "not searched" with both times, and the
   never-worse promise still holds.
2. **outer search over layouts** (planners/auto/layouts.py): pipeline depth, contiguous split,
   per-stage dp × tp, microbatch size and schedule, from the throughput planner's stage table,
   each priced in closed form with no memory action (a lower bound on its time) and at its floor
   (what no activation action goes below); layouts that cannot fit are pruned.
3. **inner per-stage compaction** (planners/auto/realise.py): in order of the lower bound, each
   layout is simulated as is, with full recompute, and compacted (STRONGHOLD windows where a
   stage's state does not fit, MPress's per-layer actions elsewhere; a dp x tp stage's window
   streams per replica / per shard, issue 25, and a one-stage windowed plan gets its streams,
   STRONGHOLD §IV-A). Layouts that need a dp / tp window are realised on a budget of their own
   (policy.max_layouts // 2).
4. **interleaved 1F1B** (planners/auto/interleave.py): the fastest fitting uniform layouts again
   with v = 2, 3, 4 chunks per device group (Megatron-LM's schedule), no action or full recompute.
   Then today's Megatron knobs (planners/auto/knobs.py, issue 27): sequence parallelism, selective
   recompute, the distributed optimizer, zb_h1 / zbv and (long sequences) context parallelism, one
   at a time on the fastest plans, each kept when the simulator says it helps.
5. **branch and bound**: the loop stops once a layout's lower bound reaches the fastest fitting
   simulated plan so far (exact for the closed-form bound; a heuristic against the simulator,
   which adds contention the bound omits), or after ``policy.max_layouts`` layouts.

The winner is the fastest simulated candidate that fits; if none fits, the one with the lowest
peak (the closest), which the shell reports as "does not fit" with its knobs. MAP's per-operator
sharding enters twice: as policy=map's whole plan (single 1), and per stage of the fastest plan at
the configured microbatch, or of the lowest-peak one when none fits (planners/auto/map_mix.py: a
stage replaced by MAP's sharding of its devices, kept when the simulator says faster, or fitting
where nothing did). Both for any model whose operator graphs were traced (issue 26).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from planners.auto.candidate import Candidate, pareto
from planners.auto.interleave import interleaved
from planners.auto.knobs import with_knobs
from planners.auto.layouts import needs_dp_tp_window, search_layouts
from planners.auto.map_mix import map_base, map_mixed
from planners.auto.realise import compacted, realise
from planners.auto.singles import BOUNDED, Single, run_single, single_bound_s
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from planners.layout import PlanningError
from planners.mpress.compact import budget_hardware
from specs.plan import Plan, PlanError, ScheduleSpec
from specs.training import TrainingSpec

GIB = 1 << 30

#: a layout's lower bound (layouts.compute_bound_s) against simulated times: the simulator's
#: per-layer timing sits ≥ 0.987 × the closed form on the test configs (tests/unit/auto), so a
#: layout is cut only once its bound exceeds the best by this much
BOUND_SLACK = 1.02


@dataclass
class AutoOutcome:
    plan: Plan
    fits: bool
    capacity_bytes: int
    winner: Candidate
    singles: list[Single]
    candidates: list[Candidate]          # auto's own simulated plans
    layouts_priced: int
    layouts_kept: int
    layouts_realised: int
    pruned: Counter
    left_out: list[str]
    stop: str
    notes: list[str] = field(default_factory=list)
    hardware: HardwareSpec | None = None   # what the plan is for (policy.find=fewest_nodes: other nodes)
    model: ModelSpec | None = None         # the model planned (policy.find=largest_model: a grown one)
    find_answer: str | None = None         # policy.find's answer in words

    @property
    def everything(self) -> list[Candidate]:
        return [s.candidate for s in self.singles if s.candidate is not None] + self.candidates

    @property
    def best_single(self) -> Single | None:
        fit = [s for s in self.singles if s.candidate is not None and s.candidate.fits]
        return min(fit, key=lambda s: (s.candidate.time_s, s.name)) if fit else None

    @property
    def frontier(self) -> list[Candidate]:
        return pareto(self.everything)


def capacity_bytes(policy, hardware: HardwareSpec) -> int:
    """What each device may hold: ``policy.memory_budget_gib``, or the device memory."""
    cap = hardware.device.memory_bytes
    if policy.memory_budget_gib is not None:
        cap = min(cap, int(policy.memory_budget_gib * GIB))
    return cap


def planning_hardware(hardware: HardwareSpec, capacity: int) -> HardwareSpec:
    """The hardware the planners see: device memory = the capacity (a budget below it binds them all)."""
    return budget_hardware(hardware, min(capacity, hardware.device.memory_bytes))


def _host_short(c: Candidate) -> bool:
    return any(d.host_oom for d in c.result.devices)


def _pick(cands: list[Candidate], singles: list[Single], pruned: Counter) -> Candidate:
    """The fastest fitting candidate; else the closest: within host RAM / NVMe first, then the
    lowest device peak. No candidate at all: PlanningError naming why."""
    if not cands:
        why = [f"policy={s.name}: {s.error}" for s in singles if s.error] + [f"{n} layout(s): {r}" for r, n in
                                                                            sorted(pruned.items())]
        raise PlanningError("policy=auto found no plan to simulate: " + ("; ".join(why) or "no layout in the space"))
    fit = [c for c in cands if c.fits]
    if fit:
        return min(fit, key=lambda c: (c.time_s, c.peak, c.source != "auto", c.source, c.how))
    return min(cands, key=lambda c: (_host_short(c), c.peak, c.time_s, c.source, c.how))


def _improve(policy, cands: list[Candidate], best: float, model: ModelSpec, hardware: HardwareSpec,
             capacity: int, progress=None) -> list[Candidate]:
    """MPress's improve rounds (§III-D) on the ``policy.improve_layouts`` layouts whose screening
    compaction (repair only) fit fastest, each only while its lower bound can still beat the best
    fitting plan (rounds only make a plan faster, never below its layout's bound)."""
    # by the screened time (heuristic): on GPT-15.4B / DGX-1 it picks the tp2 layout that improves
    # to 14.35 s, where ordering by the lower bound picks pp8 layouts (16.09 s); on GPT-20.4B
    # improving 3 screened layouts gives 2.768 samples/s, 6 (the default) and 12 give 3.139: the
    # winner ranks 4th-6th by screened time (docs/auto.md)
    screened = sorted((c for c in cands if c.fits and c.how.endswith("(screening: repair only)")),
                      key=lambda c: (c.time_s, c.how))
    out: list[Candidate] = []
    for c in screened[:policy.improve_layouts]:
        layout = c.layout
        if layout.time_lb_s >= best * BOUND_SLACK:
            continue
        try:
            got = compacted(layout, layout.plan("none"), model, hardware, capacity, policy.max_simulations, True,
                            progress)
        except (PlanningError, PlanError, ValueError):
            continue
        if got is not None:
            got.how, got.layout = f"{layout.text()}: {got.how}", layout
            out.append(got)
            if got.fits:
                best = min(best, got.time_s)
    return out


def _twin(layout) -> tuple:
    v = layout.variant
    return layout.stages, v.training.samples_per_microbatch, v.schedule.kind.value


def _zero_twins_pruned(layouts: list, capacity: int, pruned: Counter) -> list:
    """The layouts without the ZeRO > 0 ones that need compaction while their ZeRO-0 twin (same
    stages, microbatch, schedule) is kept too, or that fit as they are where the twin does: the
    distributed optimizer enters the compaction loop only where it changes what fits (a layout that
    fits as is only with the optimizer state sharded), so it does not halve policy.max_layouts; on
    the fastest plans the knobs pass (knobs.py) tries it wherever the simulator says it helps."""
    zero0 = {_twin(lay): lay for lay in layouts if not lay.variant.zero_stage}
    out = []
    for lay in layouts:
        twin = zero0.get(_twin(lay)) if lay.variant.zero_stage else None
        if twin is not None and (max(lay.peaks_none) > capacity or max(twin.peaks_none) <= capacity):
            pruned["ZeRO-1 twin of a kept ZeRO-0 layout (compacted as ZeRO-0; the knobs pass tries ZeRO-1 on the "
                   "fastest plans)"] += 1
            continue
        out.append(lay)
    return out


def auto_search(policy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, schedule: ScheduleSpec,
                profile=None, progress=None, phase=None) -> AutoOutcome:
    """The fastest plan that fits (module doc). ``progress(done, total)``: layouts realised;
    ``phase(name, seconds)``: called as each part ends (the shell prints it)."""
    say = phase or (lambda name, s: None)
    capacity = capacity_bytes(policy, hardware)
    plan_hw = planning_hardware(hardware, capacity)
    singles = []
    for name in policy.singles:
        if name in BOUNDED:
            continue
        single = run_single(name, model, hardware, plan_hw, training, schedule, capacity, profile, progress)
        singles.append(single)
        say(f"policy={name}", single.planning_s)
    start = time.perf_counter()
    layouts, pruned, left_out, priced = search_layouts(policy, model, plan_hw, training, schedule, capacity)
    say(f"layouts: {priced} priced, {len(layouts)} kept", time.perf_counter() - start)
    best = min((s.candidate.time_s for s in singles if s.candidate is not None and s.candidate.fits),
               default=float("inf"))
    cands: list[Candidate] = []
    start = time.perf_counter()
    # layouts that fit as they are in closed form first, one simulation each (a fast fitting plan
    # early tightens the bound for the compaction loop below: map_gpt2_alpha's fastest plan ranks
    # 14th by bound and fits as is)
    layouts = _zero_twins_pruned(layouts, capacity, pruned)
    as_is = [lay for lay in layouts if max(lay.peaks_none) <= capacity][:4 * policy.max_layouts]
    for layout in as_is:
        try:
            got = realise(layout, model, hardware, capacity, policy.max_simulations, improve=False)
        except (PlanningError, PlanError, ValueError):
            continue
        for c in got:
            c.how, c.layout = f"{layout.text()}: {c.how}", layout
        cands += got
        best = min([best] + [c.time_s for c in got if c.fits])
    say(f"layouts that fit as they are: {len(as_is)} simulated", time.perf_counter() - start)
    done = {id(lay) for lay in as_is}
    layouts_left = [lay for lay in layouts if id(lay) not in done]
    stop, realised, dp_tp = "every kept layout realised", 0, 0
    start = time.perf_counter()
    for n, layout in enumerate(layouts_left):
        if layout.time_lb_s >= best * BOUND_SLACK:
            stop = (f"bound: the next layout's lower bound {layout.time_lb_s:.3f} s ≥ the fastest fitting plan's "
                    f"{best:.3f} s ({len(layouts_left) - n} layouts left)")
            break
        # layouts that need a data- or tensor-parallel window (issue 25) have a budget of their own,
        # policy.max_layouts // 2: they add to the search without displacing the layouts it realised
        # before (GPT-3 175B on one Selene node: eight of them ranked first and left its pp8 plan out)
        windows = needs_dp_tp_window(layout, capacity)
        if windows and dp_tp >= max(1, policy.max_layouts // 2):
            continue
        if not windows and realised >= policy.max_layouts:
            stop = (f"policy.max_layouts={policy.max_layouts} reached ({len(layouts_left) - n} layouts left "
                    "unrealised)")
            break
        if progress is not None:
            progress(realised, min(len(layouts_left), policy.max_layouts))
        try:
            got = realise(layout, model, hardware, capacity, policy.max_simulations, improve=False)
        except (PlanningError, PlanError, ValueError) as exc:  # e.g. the simulator refuses its size
            pruned[f"could not be realised: {' '.join(str(exc).split())[:160]}"] += 1
            continue
        if windows:
            dp_tp += 1
        else:
            realised += 1
        for c in got:
            c.how = f"{layout.text()}: {c.how}"
            c.layout = layout
        cands += got
        best = min([best] + [c.time_s for c in got if c.fits])
    say(f"layouts realised: {realised}" + (f", and {dp_tp} with a dp/tp window" if dp_tp else ""),
        time.perf_counter() - start)
    start = time.perf_counter()
    improved = _improve(policy, cands, best, model, hardware, capacity, progress)
    cands += improved
    say(f"improve rounds on the {len(improved)} most promising layouts", time.perf_counter() - start)
    start = time.perf_counter()
    inter = interleaved(cands, model, hardware, plan_hw, capacity, schedule)
    cands += inter
    say(f"interleaved 1F1B on the fastest uniform layouts: {len(inter)} simulated", time.perf_counter() - start)
    start = time.perf_counter()
    tuned = with_knobs(cands, layouts, model, hardware, plan_hw, capacity, training)
    cands += tuned
    say(f"Megatron knobs (sp, p2p scatter/gather, selective, ZeRO-1, zb_h1/zbv, cp) on the fastest plans: {len(tuned)} simulated",
        time.perf_counter() - start)
    # MAP's strategies come from operator graphs traced at the configured microbatch
    # (specs/plan.py refuses a sharded stage at another): the fastest own plan at that size, or
    # when none fits its lowest-peak one (sharding a stage may make it fit: issue 26, map_mix.py)
    base = map_base(cands, training.samples_per_microbatch)
    if base is not None:
        start = time.perf_counter()
        mixed = map_mixed(base, model, hardware, capacity)
        cands += mixed
        say(f"MAP sharding on the fastest plan's stages: {len(mixed)} simulated", time.perf_counter() - start)
    best = min([best] + [c.time_s for c in cands if c.fits])
    for name in policy.singles:  # the bounded singles last, each only while its bound can win
        if name not in BOUNDED:
            continue
        start = time.perf_counter()
        bound = single_bound_s(name, model, plan_hw, training, schedule)
        if bound is not None and bound >= best * BOUND_SLACK:
            single = Single(name, None, time.perf_counter() - start,
                            f"not searched: its layout's lower bound {bound:.3f} s ≥ {best:.3f} s, the fastest "
                            "fitting plan found (it cannot win)", bound_s=bound)
        else:
            single = run_single(name, model, hardware, plan_hw, training, schedule, capacity, profile, progress)
        singles.append(single)
        say(f"policy={name}", single.planning_s)
    singles.sort(key=lambda s: policy.singles.index(s.name))
    winner = _pick([s.candidate for s in singles if s.candidate is not None] + cands, singles, pruned)
    return AutoOutcome(winner.plan.model_copy(update={"planner": "auto"}), winner.fits, capacity, winner, singles,
                       cands, priced, len(layouts), realised + dp_tp + len(as_is), pruned, left_out, stop,
                       hardware=hardware, model=model)
