"""policy=auto's inner step: one layout made to fit, per stage (issue 23).

For a layout (planners/auto/layouts.py) this builds, simulates and returns the plans worth
comparing:

1. the layout as it is (no memory action): it may already fit;
2. every layer recomputed (Megatron's full activation checkpointing), when that fits in closed form;
3. compacted: under PipeDream, the over-full stages' stashed weight versions to host memory first
   (planners/mpress/stash.py, as policy=mpress does); then MPress's per-layer compaction
   (planners/mpress/compact.py: recompute / CPU swap /
   D2D swap and optimizer swap, cheapest seconds per saved byte, emulator-verified, MPress
   §III-C/D), then a STRONGHOLD window (planners/stronghold/stage_window.py: the smallest window
   that hides its transfers, STRONGHOLD §III-D) on each stage whose parameter state and working
   set alone exceed the capacity (its floor) and, after a simulation, on each stage still over
   that can take one. A window stage keeps its recomputes and drops its swaps (specs/plan.py
   allows no swap beside a window); compaction does not run again once a window is in the plan
   (compact() takes no windowed plan), so the other stages keep what the first pass gave them.
   When every stage is over its floor, compaction is skipped: windows go on the layout with
   every layer recomputed and with none (:func:`_all_windowed`);
4. windowed instead of compacted: the stages whose state is over the capacity even with every
   layer recomputed, windowed on the layout (:func:`windowed_instead`), a candidate beside the
   compacted one. A stage of dp x tp devices takes a window as policy=stronghold's layouts do
   (issue 25, STRONGHOLD §III-F): each replica streams its own window and all-reduces its host
   gradients before the CPU steps, a tp rank streams its shard.

Heuristic, not exact: the order (compact, then window) and the single retry. Exact: each plan's
time and peak are the simulator's.
"""
from __future__ import annotations

from planners.auto.candidate import Candidate, over_capacity
from planners.auto.layouts import Layout, window_possible
from planners.mpress.compact import compact
from planners.stronghold.stage_window import window_stage
from simulator import simulate
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan, validate_plan


def simulated_candidate(how: str, plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity: int,
               notes: list[str] | None = None) -> Candidate:
    """``plan`` validated and simulated; a one-stage windowed plan first gets its streams
    (:func:`with_streams`)."""
    notes = list(notes or [])
    plan, why = with_streams(plan, model, hardware, capacity)
    if why is not None:
        how = f"{how}, streams {plan.stages[0].offload.streams}"
        notes.append(why)
    plan = validate_plan(plan, model, hardware)
    result = simulate(plan, model, hardware, trace=False).result
    return Candidate("auto", how, plan, result, not over_capacity(result, capacity), notes)


def with_streams(plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity: int) -> tuple[Plan, str | None]:
    """STRONGHOLD §IV-A's multi-streamed execution on a one-stage windowed plan (the contract:
    specs.plan_memory.OffloadPolicy.streams, a one-stage pipeline only): its streams chosen as
    policy=stronghold chooses them (planners/stronghold/streams.choose_streams: the fastest
    simulated S within the plateau whose S workers' activations fit ``capacity``, 1 otherwise),
    and the one line why; a plan of several stages or without a window: as is, None."""
    if len(plan.stages) != 1 or plan.stages[0].offload.window_layers is None:
        return plan, None
    from planners.stronghold.streams import choose_streams

    return choose_streams(plan, model, hardware, 0, capacity)


def _over_stages(plan: Plan, cand: Candidate, capacity: int) -> list[int]:
    over = {d.device for d in cand.result.devices if d.peak_bytes > capacity}
    return [s for s, st in enumerate(plan.stages) if over.intersection(st.devices)]


def _drop_swaps(plan: Plan, s: int) -> Plan:
    """Stage ``s`` keeping only its recompute actions (a window stage swaps nothing: specs/plan.py)."""
    stage = plan.stages[s]
    kept = [m for m in stage.memory if m.action is MemoryAction.recompute]
    stages = list(plan.stages)
    stages[s] = stage.model_copy(update={"memory": kept})
    return plan.model_copy(update={"stages": stages})


def _windowed(plan: Plan, stages: list[int], model: ModelSpec, hardware: HardwareSpec, capacity: int,
              notes: list[str]) -> Plan | None:
    """``stages`` each given a window, in order; None if one is blocked or host RAM / NVMe cannot hold
    the streamed state. The host tier is chosen per stage (nvme=auto: RAM until it runs short), a
    greedy that fills the node's RAM with the first stages' optimizer state and then leaves a late
    stage too little even for its weights (GPT-3 175B, pp8 on one Selene node: stage 6); when it
    fails so and the node has a drive, every window's optimizer state goes to NVMe (nvme=on)."""
    for nvme in ("auto", "on") if hardware.host.nvme_bytes else ("auto",):
        got_plan, got_notes = plan, []
        for s in stages:
            got = window_stage(_drop_swaps(got_plan, s), model, hardware, s, capacity, nvme=nvme)
            if got is None:
                return None  # blocked (not a host-tier question)
            if not got.host_fits:
                got_plan = None
                break
            got_notes.append(f"stage {s}: {got.reason}")
            got_plan = got.plan
        if got_plan is not None:
            notes.extend(got_notes)
            return got_plan
    return None


def _stash_swapped(plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity: int, notes: list[str]) -> Plan:
    """A PipeDream layout: the over-full stages' stashed weight versions to host memory first, as
    policy=mpress does (planners/mpress/stash.py, MPress §II-D: the longest-lived tensors), so the
    compaction that follows starts from that."""
    from planners.mpress.stash import choose_stash_swap, stash_line, with_stash_swap
    from specs.plan import ScheduleKind

    if plan.schedule.kind is not ScheduleKind.pipedream_async:
        return plan
    sim = simulate(validate_plan(plan, model, hardware), model, hardware)
    peak = {d.device: d.peak_bytes for d in sim.result.devices}
    demand = [max(0, peak[st.devices[0]] - capacity) for st in plan.stages]
    chosen, windows = choose_stash_swap(plan, model, hardware, sim.trace, demand, True)
    if not chosen:
        return plan
    swapped = with_stash_swap(plan, chosen)
    traced = simulate(validate_plan(swapped, model, hardware), model, hardware).trace
    notes.append(stash_line(swapped, model, hardware, chosen, windows, traced, demand))
    return swapped


def _compacted(plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity: int, max_simulations: int,
               notes: list[str], improve: bool = True, progress=None) -> Plan:
    got = compact(plan, model, hardware, capacity, max_simulations=max_simulations, progress=progress,
                  improve_rounds=improve)
    if got is None:
        return plan
    notes.append(f"compaction: {got.stop} ({got.simulations} simulations)")
    return got.plan


def realise(layout: Layout, model: ModelSpec, hardware: HardwareSpec, capacity: int,
            max_simulations: int, improve: bool = True) -> list[Candidate]:
    """The simulated plans of one layout (module doc). ``improve=False``: the compaction stops once
    its repair fits (a screening pass; search.py improves the most promising layouts after)."""
    base = simulated_candidate("layout as is", layout.plan("none"), model, hardware, capacity)
    if base.fits:
        return [base]
    out = [base]
    if max(layout.peaks_full) <= capacity:
        out.append(simulated_candidate("every layer recomputed", layout.plan("full"), model, hardware, capacity))
    got = compacted(layout, base.plan, model, hardware, capacity, max_simulations, improve)
    alt = windowed_instead(layout, model, hardware, capacity)
    return out + [c for c in (got, alt) if c is not None]


def compacted(layout: Layout, plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity: int,
              max_simulations: int, improve: bool = True, progress=None) -> Candidate | None:
    """``plan`` (the layout with no action) compacted and windowed (module doc, step 3);
    ``progress(simulations, None)`` after each of the compaction's simulations. Under PipeDream
    also with the stashed versions swapped first, the faster fitting of the two kept (the swap
    moves weights every microbatch: where activations alone fit cheaper it loses)."""
    got = _compacted_layout(layout, plan, model, hardware, capacity, max_simulations, improve, progress, False)
    if plan.schedule.kind.value != "pipedream_async":
        return got
    stashed = _compacted_layout(layout, plan, model, hardware, capacity, max_simulations, improve, progress, True)
    cands = [c for c in (got, stashed) if c is not None]
    if not cands:
        return None
    return min(cands, key=lambda c: (not c.fits, c.result.iteration_time_s))


def _compacted_layout(layout: Layout, plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity: int,
                      max_simulations: int, improve: bool, progress, stash: bool) -> Candidate | None:
    notes: list[str] = []
    must = [i for i, f in enumerate(layout.floors) if f > capacity]
    if len(must) == len(layout.stages):
        return _all_windowed(layout, model, hardware, capacity)
    return _compacted_then_windowed(layout, plan, model, hardware, capacity, max_simulations, improve, progress,
                                    stash, must, notes)


def windowed_instead(layout: Layout, model: ModelSpec, hardware: HardwareSpec, capacity: int) -> Candidate | None:
    """The stages whose parameter state keeps them over the capacity even with every layer
    recomputed windowed instead of compacted (:func:`_all_windowed` on those stages), when each
    can take a window and some stage is under its floor (else :func:`compacted` windows them
    already). MPress's swaps move activations, a window the state itself: for a tp slice or dp
    replica of a model whose state is the problem (STRONGHOLD §III-F) the window is the faster
    (GPT-3 13B on two V100s: tp2 compacted 20.0 s, tp2 windowed 16.3 s, policy=stronghold's own
    layout). None when no stage qualifies."""
    heavy = [i for i, f in enumerate(layout.peaks_full) if f > capacity]
    must = [i for i, f in enumerate(layout.floors) if f > capacity]
    if not heavy or len(must) == len(layout.stages):
        return None
    if not all(window_possible(layout.stages[i], layout.variant) for i in heavy):
        return None
    return _all_windowed(layout, model, hardware, capacity, heavy)


def _compacted_then_windowed(layout: Layout, plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity: int,
                             max_simulations: int, improve: bool, progress, stash: bool, must: list[int],
                             notes: list[str]) -> Candidate | None:
    base_plan = plan
    # compaction first (planners/mpress/compact.py takes no windowed plan), then the windows: a
    # window stage keeps its recomputes and drops its swaps (_drop_swaps)
    if stash:
        base_plan = _stash_swapped(base_plan, model, hardware, capacity, notes)
        if not any(st.offload.stash_swap_layers for st in base_plan.stages):
            return None  # nothing to swap: the plain compaction is the same plan
    plan = _compacted(base_plan, model, hardware, capacity, max_simulations, notes, improve, progress)
    how = "compacted" if improve else "compacted (screening: repair only)"
    if must:
        plan = _windowed(plan, must, model, hardware, capacity, notes)
        if plan is None:
            return None
    cand = simulated_candidate(how, plan, model, hardware, capacity, notes)
    if not cand.fits:  # a stage still over: a window where one is possible, then compact again
        more = [s for s in _over_stages(plan, cand, capacity)
                if not plan.stages[s].offload.window_layers and window_possible(layout.stages[s], layout.variant)]
        if more:
            again = _windowed(plan, more, model, hardware, capacity, notes)
            if again is not None:
                cand = simulated_candidate(how, again, model, hardware, capacity, notes)
    return cand


def _all_windowed(layout: Layout, model: ModelSpec, hardware: HardwareSpec, capacity: int,
                  stages: list[int] | None = None) -> Candidate | None:
    """Every stage's parameter state and working set exceed the capacity: each stage takes a
    window, and a window stage keeps only its recomputes, so MPress's compaction (whose swaps
    the window drops) is skipped: the windows go on the layout with every layer recomputed
    (STRONGHOLD §V-D's setting) and with none, and the faster fitting one is kept. On GPT-39.4B
    / one V100 the compaction this replaces spent 25 s per layout to choose recomputes.
    ``stages``: only those windowed (default: all); the others keep the layout's recompute or none."""
    got = []
    for recompute in ("full", "none"):
        notes: list[str] = []
        which = list(range(len(layout.stages))) if stages is None else stages
        plan = _windowed(layout.plan(recompute), which, model, hardware, capacity, notes)
        if plan is not None:
            how = "windowed" + (", every layer recomputed" if recompute == "full" else "")
            got.append(simulated_candidate(how, plan, model, hardware, capacity, notes))
    if not got:
        return None
    return min(got, key=lambda c: (not c.fits, c.time_s if c.fits else c.peak))
