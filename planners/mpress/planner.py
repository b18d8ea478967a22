"""policy=mpress: MPress's memory-compaction planner (Zhou et al., HPCA'23, §III-C/D).

Start from a compute-balanced pipeline, one stage per device (PipeDream/DAPPLE's partition,
§IV-A), simulate it, and give the layers of every stage that overflows its device a memory action:

1. *Live intervals* (§III-D, footnote 1): for every layer and microbatch, the time from the end of
   the layer's forward to the start of its backward, read off the simulated schedule; a layer's
   interval is its shortest over the microbatches (the one a transfer must hide in).
2. *Cost per technique* (Table III, footnote 2): recompute costs one more forward of the layer;
   a swap costs what its out-and-back transfer does not hide in the interval, CPU swap over the
   PCIe uplink shared by the GPUs behind one switch, D2D swap striped over the NVLinks to the
   peers with spare memory (planners/mpress/mapping.py, §III-C), plus the stall of the forwards
   when a stage's swap-outs take longer than its passes (a forward waits for the previous
   microbatch's swap-outs, in the simulator and the executor alike).
3. *Device mapping* (Fig. 6): the stage->GPU permutation that puts light stages next to heavy ones
   on fast links (exhaustive for 8 GPUs, local search beyond; mpress_mapping).
4. *Initial assignment* (§III-D): per overflowing stage, the cheapest of recompute / CPU swap per
   saved byte first (free swaps of long-lived tensors before anything that costs), until the
   closed-form peak (simulator/analytic.py) fits; a stage still over with every layer compacted
   streams its optimizer state through host memory (§II-D: GPU-CPU swap of model data). Spare
   peer memory smaller than a layer's in-flight bytes takes every n-th microbatch of it
   (``LayerMemory.microbatch_period``: MPress picks tensors, a layer's microbatches are ours).
5. *Emulator loop* (§III-B step 5, §III-D): simulate the candidate (simulator/, the same engine
   the user sees); a stage still over capacity gets more layers, a D2D target over capacity *at
   some moment of its timeline* (its own memory plus what peers hold there) loses its largest
   stripes; once it fits (and, if no stage had spare memory at first, after mapping again for the
   room compaction made), optimizer swaps are dropped where they are not needed, the costliest
   compacted layers are tried with the other techniques and as keep (a change is kept only if the
   simulated iteration is faster, or for less data moved no slower, and still fits), and hidden
   CPU swaps move to spare peer memory when that is no slower. It stops after
   ``policy.max_simulations`` runs.

Pure: no I/O, no clocks; the same inputs give the same plan. Returns :class:`MPressOutcome`
(plan, per-layer choices with their reason, fit, the log of the emulator loop). The per-layer
costs and the assignment being built live in planners/mpress/assign.py, the stage->GPU mapping
in planners/mpress/mapping.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from simulator.analytic import d2d_held_by_device
from planners.baselines.partition import plan_balanced, plan_even
from planners.layout import PlanningError
from planners.mpress.assign import (
    CPU as _CPU, D2D as _D2D, KEEP as _KEEP, RC as _RC, Assignment, layer_facts, size_text, with_actions,
)
from planners.mpress.mapping import Mapping, search_mapping
from planners.policy import BalancedPolicy, EvenPolicy, MPressPolicy
import costs.activations
import costs.layer_time
import costs.params
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleKind, ScheduleSpec
from specs.training import TrainingSpec

_NAMES = {"recompute": _RC, "cpu_swap": _CPU, "d2d_swap": _D2D}


@dataclass(frozen=True)
class LayerChoice:
    stage: int
    layer: int
    action: str
    saved_bytes: int
    live_s: float
    costs_s: dict           # technique -> its estimated extra seconds per microbatch
    why: str


@dataclass(frozen=True)
class MPressOutcome:
    plan: Plan
    fits: bool
    choices: tuple[LayerChoice, ...]
    mapping: Mapping
    simulations: int
    iteration_s: float
    base_iteration_s: float
    log: tuple[str, ...]
    optimizer_swap: tuple[tuple[int, str], ...] = ()  # (stage, why) for stages swapping optimizer state
    host_bytes_per_node: tuple[int, ...] = ()  # simulated host memory (swap space, offloaded state), per node
    host_capacity_bytes: int = 0


def plan_mpress(policy: MPressPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                schedule: ScheduleSpec, progress=None, profile=None) -> Plan:
    """``profile``: a CAPTURE profile (specs.profile.Profile), for ``policy.partition=capture``."""
    return mpress_search(policy, model, hardware, training, schedule, progress, profile).plan


def capture_partition(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, schedule: ScheduleSpec,
                      profile) -> Plan:
    """CAPTURE's memory-centric partition, pipeline only (degree 1 per stage, CAPTURE Fig. 6g-l),
    as MPress's starting point (``policy.partition=capture``)."""
    from planners.capture.planner import plan_capture

    if profile is None or profile.capture is None:
        raise PlanningError("policy.partition=capture needs a CAPTURE profile: python -m run profiles first "
                            "(mode=simulate does), or pass one to make_plan(..., profile=...)")
    return plan_capture(capture_policy(), model, hardware, training, schedule, profile)


def capture_policy():
    """The CAPTURE policy whose profile and plan ``partition=capture`` uses: pipeline only."""
    from planners.policy import CapturePolicy

    return CapturePolicy(pipeline_only=True, compare_throughput=False)


# ---- the base pipeline --------------------------------------------------------------------------

def _base_plan(policy: MPressPolicy, model, hardware, training, schedule, profile=None) -> Plan:
    if schedule.kind is ScheduleKind.interleaved_1f1b:
        raise PlanningError("policy=mpress plans one stage per device (MPress §IV evaluates PipeDream async and "
                            "DAPPLE's 1F1B); use schedule=1f1b, pipedream_async or gpipe")
    if policy.partition == "capture":
        plan = capture_partition(model, hardware, training, schedule, profile)
        if any(st.dp != 1 or st.tp != 1 for st in plan.stages) or len({st.devices[0] for st in plan.stages}) != len(plan.stages):
            raise PlanningError("policy.partition=capture: CAPTURE's plan is not one stage per device")
        return plan.model_copy(update={"planner": "mpress"})
    pp = policy.pp or min(hardware.num_devices, model.num_layers)
    if pp != hardware.num_devices:
        why = (f"got {pp}" if policy.pp else
               f"but model {model.name!r} has only {model.num_layers} layers (a stage needs one); use a smaller hardware")
        raise PlanningError(f"policy.pp: MPress runs one pipeline stage per device (no data or tensor parallelism, "
                            f"§IV-A), so pp must be null or {hardware.num_devices} (the devices of hardware "
                            f"{hardware.name!r}), {why}")
    base = (BalancedPolicy if policy.partition == "balanced" else EvenPolicy)(pp=pp, dp=1, tp=1)
    planner = plan_balanced if policy.partition == "balanced" else plan_even
    plan = planner(base, model, hardware, training, schedule)
    return plan.model_copy(update={"planner": "mpress"})


# ---- the search ------------------------------------------------------------------------------------

def _better(sim, best_s: float) -> bool:
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s < best_s * (1 - 1e-9)


def _no_worse(sim, best_s: float) -> bool:
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s <= best_s * (1 + 1e-9)


def mpress_search(policy: MPressPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                  schedule: ScheduleSpec, progress=None, profile=None) -> MPressOutcome:
    """The MPress static planner (§III-B steps 3-5); see the module docstring. ``profile``: the
    CAPTURE profile ``policy.partition=capture`` starts from."""
    from simulator import simulate

    budget = policy.max_simulations
    sims = 0
    log: list[str] = []

    def run(plan: Plan):
        nonlocal sims
        sims += 1
        if progress is not None:
            progress(min(sims, budget), budget)
        return simulate(plan, model, hardware)

    base = _base_plan(policy, model, hardware, training, schedule, profile)
    from simulator import size_problem

    if (problem := size_problem(base)) is not None:  # the emulator simulates (§III-B step 5)
        raise PlanningError(problem)
    capacity = hardware.device.memory_bytes
    first = run(base)
    peak = {d.device: d.peak_bytes for d in first.result.devices}
    devices = [stage.devices[0] for stage in base.stages]
    p = len(devices)
    demand = [max(0, peak[d] - capacity) for d in devices]
    spare = [max(0, capacity - peak[d]) for d in devices]
    boundary = [costs.params.samples_per_replica(base, st) * model.layers[st.layer_stop - 1].output_bytes_per_sample
                for st in base.stages[:-1]]  # per microbatch, stage i -> i + 1
    allowed = [_NAMES[t] for t in policy.techniques]
    use_d2d = _D2D in allowed
    # a plan swaps whole layers (all their in-flight microbatches): ask the mapping for room in
    # whole layers, the overflow rounded up to the stage's largest layer x its in-flight count
    want = []
    for s, stage in enumerate(base.stages):
        unit = costs.activations.in_flight_microbatches(base, s) * max(
            costs.activations.layer_saved_bytes(model.layers[l], costs.params.samples_per_replica(base, stage), 1) for l in stage.layers)
        want.append(-(-demand[s] // unit) * unit if demand[s] and unit else demand[s])
    mapping = search_mapping(hardware, devices, want if use_d2d else [0] * p, spare, boundary,
                             striping=policy.striping, mode=policy.mapping if use_d2d else "identity")
    log.append(f"base: {p} stages, iteration {first.result.iteration_time_s:.3f} s; over capacity: "
               + (", ".join(f"stage {s} +{size_text(demand[s])}" for s in range(p) if demand[s]) or "none"))
    if use_d2d:
        log.append(f"device mapping ({'exact' if mapping.exact else 'local search'}, {mapping.candidates} candidates): "
                   + " ".join(f"s{s}->d{d}" for s, d in enumerate(mapping.device_of_stage)))
    if not any(demand):
        plan = with_actions(base, {}, mapping)
        sim = run(plan) if plan != base else first
        log.append("every stage fits: no memory action needed (MPress §IV-B, small models)")
        return MPressOutcome(plan, not any(d.oom for d in sim.result.devices), (), mapping, sims,
                             sim.result.iteration_time_s, first.result.iteration_time_s, tuple(log))

    facts = layer_facts(base, model, hardware, first.trace, mapping)
    st = Assignment(base, model, facts, mapping, allowed, capacity)
    st.spare_left = {t: int(spare[t]) for t in range(p)}
    passes = [costs.layer_time.stage_pass_times_s(model, base, hardware, stage) for stage in base.stages]
    st.fwd_s = {s: f for s, (f, _) in enumerate(passes)}
    st.bwd_s = {s: b for s, (_, b) in enumerate(passes)}
    # §III-D: initial assignment with recompute and CPU swap; D2D replaces the costliest later.
    # A D2D-only policy (the paper's "D2D swap" baseline) places D2D from the start.
    initial = [a for a in allowed if a is not _D2D] or allowed
    st.fill(st.over(), initial)

    # ---- emulator: repair what does not fit --------------------------------------------------
    sim = run(st.plan_now())
    while sims < budget:
        ooms = {d.device: d.oom_over_bytes for d in sim.result.devices if d.oom}
        if not ooms:
            break
        changed = False
        stage_of = {d: s for s, d in enumerate(mapping.device_of_stage)}
        plan_now = st.plan_now()
        for device, over_b in sorted(ooms.items()):
            held = d2d_held_by_device(plan_now, model).get(device, 0)
            if held:  # a target over capacity at some moment: take back its largest stripes
                mine = sorted(((st.held_bytes(k), k) for k, a in st.actions.items()
                               if a is _D2D and device in [mapping.device_of_stage[t] for t, _ in st.stripes[k]]),
                              reverse=True)
                freed = 0
                for nbytes, key in mine:
                    if freed >= over_b:
                        break
                    st.no_d2d.add(key)
                    fallback = st.options(key, [a for a in allowed if a is not _D2D])
                    if fallback:
                        st.set(key, fallback[0][1], st.reason(key, fallback[0][1], fallback[0][0])
                               + f" (D2D stripes overfilled device {device})")
                    else:
                        st.set(key, _KEEP, f"keep: D2D stripes overfilled device {device}, no other technique allowed")
                    freed += nbytes
                    changed = True
                log.append(f"emulator {sims}: target device {device} over by {size_text(over_b)} at its peak; "
                           f"took back {size_text(freed)} of stripes")
            if device in stage_of:  # a stage over on its own: learn the gap, assign more layers
                s = stage_of[device]
                # what the simulated timeline holds beyond the closed form (e.g. an output still
                # in flight): learn it, so the closed form steers the next assignment
                simulated = next(d.peak_bytes for d in sim.result.devices if d.device == device)
                st.margin[s] = max(st.margin[s] + 1, simulated - st.own_peak(s))
                grew = st.fill(st.over(), [a for a in allowed])
                if not grew and _RC in allowed:  # every layer has an action: recompute, which
                    # frees deterministically, replaces the swap with the busiest channel
                    swaps = sorted((st.facts[k].cpu_s if a is _CPU else st.facts[k].d2d_s, k)
                                   for k, a in st.actions.items() if k[0] == s and a in (_CPU, _D2D))
                    if swaps:
                        key = swaps[-1][1]
                        st.set(key, _RC, st.reason(key, _RC, st.facts[key].fwd_s) + " (its swap left bytes on the device)")
                        grew = True
                changed |= grew
                log.append(f"emulator {sims}: stage {s} over by {size_text(over_b)}; more layers compacted")
        if not changed:
            log.append(f"emulator {sims}: nothing left to compact: the closest plan does not fit")
            break
        sim = run(st.plan_now())

    fits = not any(d.oom for d in sim.result.devices)
    best_t = sim.result.iteration_time_s
    if fits and use_d2d and not any(a is _D2D for a in st.actions.values()) and sims < budget:
        # Every stage overflowed the base plan, so there was no spare memory to map for; now that
        # recompute, CPU swaps and optimizer swaps made room, map again (Fig. 6) for the costly
        # compactions: their bytes are the demand, what the devices have left the spare
        peak_now = {d.device: d.peak_bytes for d in sim.result.devices}
        dev_now = mapping.device_of_stage
        demand2 = [sum(st.held_bytes(k) for k, a in st.actions.items() if k[0] == s and st.facts[k].cost_s(a) > 0)
                   for s in range(p)]
        spare2 = [max(0, capacity - peak_now[dev_now[s]]) if not demand2[s] else 0 for s in range(p)]
        if any(demand2) and any(spare2):
            remap = search_mapping(hardware, devices, demand2, spare2, boundary,
                                   striping=policy.striping, mode=policy.mapping)
            saved, old_map, old_facts = st.snapshot(), st.mapping, st.facts
            st.mapping, st.spare_left = remap, dict(enumerate(spare2))
            st.facts = facts = layer_facts(base, model, hardware, first.trace, remap)
            t = run(st.plan_now())
            if _no_worse(t, best_t):
                mapping, sim, best_t = remap, t, t.result.iteration_time_s
                log.append(f"emulator {sims}: mapped again for the room compaction made "
                           f"({'exact' if remap.exact else 'local search'}, {remap.candidates} candidates): "
                           + " ".join(f"s{s}->d{d}" for s, d in enumerate(remap.device_of_stage)))
            else:
                st.restore(saved)
                st.mapping, st.facts = old_map, old_facts
                facts = old_facts
    # ---- emulator: improve (costliest first: D2D instead, then keep) -----------------------------
    if fits:
        # the optimizer swap is the costliest (its whole state crosses PCIe twice an iteration):
        # first see which stages fit without it now that their activations are compacted (and
        # again at the end, after the layers' actions changed)
        def keep_optimizers() -> None:
            nonlocal best_t, sim
            for s in sorted(st.opt_swap):
                if sims >= budget:
                    break
                saved = st.snapshot()
                st.opt_swap.discard(s)
                t = run(st.plan_now())
                if _no_worse(t, best_t):  # as fast and less PCIe traffic: keep it resident
                    log.append(f"emulator {sims}: stage {s} keeps its optimizer state: {best_t:.3f} -> "
                               f"{t.result.iteration_time_s:.3f} s")
                    st.opt_why.pop(s, None)
                    best_t, sim = t.result.iteration_time_s, t
                else:
                    st.restore(saved)

        keep_optimizers()
        order = sorted(st.actions, key=lambda k: (-st.facts[k].cost_s(st.actions[k]), k))
        for key in order:
            if sims >= budget:
                break
            current = st.actions.get(key)
            if current is None:
                continue
            # every other technique, cheapest estimate first, then keep: the estimate misses link
            # contention (a D2D stripe delays a pipeline send on the same NVLink), the emulator not
            tries = [a for _, a in st.options(key, allowed) if a is not current]
            tries.append(_KEEP)
            for a in tries:
                if sims >= budget:
                    break
                saved = st.snapshot()
                cost = st.marginal_cost_s(key, a) if a is not _KEEP else 0.0
                st.set(key, a, "")
                if a is _KEEP and st.over()[key[0]]:
                    st.restore(saved)  # the closed form already says it would not fit
                    continue
                t = run(st.plan_now())
                # faster; or, for keep, no slower (nothing to move is better than a hidden move)
                if _no_worse(t, best_t) if a is _KEEP else _better(t, best_t):
                    log.append(f"emulator {sims}: stage {key[0]} layer {key[1]} {current.value} -> {a.value}: "
                               f"{best_t:.3f} -> {t.result.iteration_time_s:.3f} s")
                    st.why[key] = ((st.reason(key, a, cost) if a is not _KEEP else "keep: fits without compaction")
                                   + f" (emulator: {best_t:.3f} -> {t.result.iteration_time_s:.3f} s per iteration)")
                    best_t, sim = t.result.iteration_time_s, t
                    break
                st.restore(saved)
        # Spare peer memory left over: a CPU swap that hides is moved to it if that is no slower.
        # A departure from §III-D, which keeps D2D for the tensors that need it: by now every
        # tensor has had its chance, and a D2D stripe leaves the host link (shared by the GPUs of
        # a PCIe switch, and by optimizer swaps) and host memory alone
        for key in sorted((k for k, a in st.actions.items() if a is _CPU), key=lambda k: (-st.held_bytes(k), k)):
            if sims >= budget or st.stripes_for(key) is None:
                continue
            saved = st.snapshot()
            st.set(key, _D2D, "")
            t = run(st.plan_now())
            if _no_worse(t, best_t):
                log.append(f"emulator {sims}: stage {key[0]} layer {key[1]} cpu_swap -> d2d_swap (spare peer memory "
                           f"left): {best_t:.3f} -> {t.result.iteration_time_s:.3f} s")
                st.why[key] = st.reason(key, _D2D, st.facts[key].cost_s(_D2D)) + " (spare peer memory left over)"
                best_t, sim = t.result.iteration_time_s, t
            else:
                st.restore(saved)
        keep_optimizers()
    plan = st.plan_now()
    choices = tuple(
        LayerChoice(stage=s, layer=l, action=st.actions.get((s, l), _KEEP).value, saved_bytes=facts[(s, l)].saved_bytes,
                    live_s=facts[(s, l)].live_s,
                    costs_s={a.value: facts[(s, l)].cost_s(a) for a in allowed
                             if a is not _D2D or mapping.targets[s]},
                    why=st.why[(s, l)])
        for s, l in sorted(st.why))
    log.append(f"result: {'fits' if fits else 'does NOT fit'}, iteration {sim.result.iteration_time_s:.3f} s "
               f"after {sims} simulations")
    per_node = [0] * hardware.nodes
    for d in sim.result.devices:  # each device's host peak; their sum bounds the node's (CPU-swap bytes)
        per_node[hardware.node_of(d.device)] += d.host_bytes
    if any(n > hardware.host.memory_bytes for n in per_node):
        fits = False
        log.append(f"host memory: {size_text(max(per_node))} on one node is over its {size_text(hardware.host.memory_bytes)}")
    return MPressOutcome(plan, fits, choices, mapping, sims, sim.result.iteration_time_s,
                         first.result.iteration_time_s, tuple(log),
                         tuple((s, st.opt_why[s]) for s in sorted(st.opt_swap)), tuple(per_node),
                         hardware.host.memory_bytes)


def report(outcome: MPressOutcome) -> dict:
    """The planner's decisions as plain JSON (mpress.json): per stage which layers got which
    technique and why, the device mapping, the emulator's log."""
    stages: dict[str, list] = {}
    for c in outcome.choices:
        stages.setdefault(str(c.stage), []).append({
            "layer": c.layer, "action": c.action, "saved_bytes_per_microbatch": c.saved_bytes,
            "live_interval_s": c.live_s, "extra_s_per_microbatch": c.costs_s, "why": c.why})
    m = outcome.mapping
    return {
        "fits": outcome.fits, "iteration_time_s": outcome.iteration_s, "base_iteration_time_s": outcome.base_iteration_s,
        "simulations": outcome.simulations,
        "mapping": {"device_of_stage": list(m.device_of_stage), "exact": m.exact, "candidates": m.candidates,
                    "targets": {str(s): [{"stage": t, "device": m.device_of_stage[t], "weight": w} for t, w in ts]
                                for s, ts in enumerate(m.targets) if ts},
                    "placed_bytes": list(m.placed_bytes), "swap_time_s": list(m.swap_time_s)},
        "stages": stages, "log": list(outcome.log),
        "optimizer_swap": {str(s): why for s, why in outcome.optimizer_swap},
        "host_bytes_per_node": list(outcome.host_bytes_per_node),
    }


def summary_lines(outcome: MPressOutcome) -> list[str]:
    """A few lines for the terminal: per stage the techniques' layer counts and bytes."""
    per: dict[int, dict[str, list[int]]] = {}
    for c in outcome.choices:
        if c.action != "keep":
            per.setdefault(c.stage, {}).setdefault(c.action, []).append(c.layer)
    lines = [f"mpress: {outcome.log[-1]}"]
    for n, nbytes in enumerate(outcome.host_bytes_per_node):
        if nbytes:
            over = " -- OVER host memory" if nbytes > outcome.host_capacity_bytes else ""
            lines.append(f"  host memory of node {n} (CPU swaps, offloaded optimizer state): {size_text(nbytes)} of "
                         f"{size_text(outcome.host_capacity_bytes)}{over}")
    for s, _ in outcome.optimizer_swap:
        per.setdefault(s, {})["optimizer state to host"] = []
    for s in sorted(per):
        parts = [f"{a} L{','.join(map(str, ls))}" if ls else a for a, ls in sorted(per[s].items())]
        lines.append(f"  stage {s} (device {outcome.mapping.device_of_stage[s]}): " + "; ".join(parts))
    return lines
