"""policy=mpress: MPress's memory-compaction planner (Zhou et al., HPCA'23, §III-C/D).

Start from a compute-balanced pipeline, one stage per device (PipeDream/DAPPLE's partition,
§IV-A), simulate it, and give the layers of every stage that overflows its device a memory action:

1. *Live intervals* (§III-D, footnote 1): for every layer and microbatch, the time from the end of
   the layer's forward to the start of its backward, read off the simulated schedule; a layer's
   interval is its shortest over the microbatches (the one a transfer must hide in).
2. *Cost per technique* (Table III, footnote 2): recompute costs one more forward of the layer;
   a swap costs what its out-and-back transfer does not hide in the interval, CPU swap over the
   PCIe uplink shared by the GPUs behind one switch, D2D swap striped over the NVLinks to the
   peers with spare memory (planners/mpress_mapping.py, §III-C), plus the queueing when one
   stage's swaps need more than a pipeline period of its channel.
3. *Device mapping* (Fig. 6): the stage->GPU permutation that puts light stages next to heavy ones
   on fast links (exhaustive for 8 GPUs, local search beyond; mpress_mapping).
4. *Initial assignment* (§III-D): per overflowing stage, the cheapest of recompute / CPU swap per
   saved byte first (free swaps of long-lived tensors before anything that costs), until the
   closed-form peak (planners/analytic.py) fits.
5. *Emulator loop* (§III-B step 5, §III-D): simulate the candidate (simulator/, the same engine
   the user sees); a stage still over capacity gets more layers, a D2D target over capacity *at
   some moment of its timeline* (its own memory plus what peers hold there) loses its largest
   stripes; once it fits, the costliest recomputed or CPU-swapped layers are tried as D2D swaps
   (and then as keep), accepting each change only if the simulated iteration is faster and still
   fits. It stops when a pass changes nothing or after ``policy.max_simulations`` runs.

Pure: no I/O, no clocks; the same inputs give the same plan. Returns :class:`MPressOutcome`
(plan, per-layer choices with their reason, fit, the log of the emulator loop).
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.analytic import device_memory
from planners.baselines import plan_balanced, plan_even
from planners.layout import PlanningError
from planners.mpress_mapping import Mapping, search_mapping
from planners.policy import BalancedPolicy, EvenPolicy, MPressPolicy
from specs import costs
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import ModelSpec
from specs.plan import D2DTarget, LayerMemory, MemoryAction, Plan, ScheduleKind, ScheduleSpec
from specs.training import TrainingSpec

_KEEP, _RC, _CPU, _D2D = MemoryAction.keep, MemoryAction.recompute, MemoryAction.cpu_swap, MemoryAction.d2d_swap
_NAMES = {"recompute": _RC, "cpu_swap": _CPU, "d2d_swap": _D2D}
GIB = float(1 << 30)


def _size(nbytes: float) -> str:
    """Bytes for the log: GiB for model-sized amounts, MiB/KiB for the tiny CPU models."""
    for unit, scale in (("GiB", GIB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class LayerFacts:
    stage: int
    layer: int
    saved_bytes: int        # activations the layer keeps for backward, one microbatch
    fwd_s: float            # one more forward: recompute's price
    live_s: float           # shortest forward-end -> backward-start over the microbatches
    cpu_s: float            # one direction of a CPU swap (PCIe shared by the switch's GPUs)
    d2d_s: float            # one direction of a D2D swap striped over the stage's targets (inf: none)

    def cost_s(self, action: MemoryAction) -> float:
        """Extra time per microbatch, before channel queueing (Table III; footnote 2: a swap
        costs its round trip less the live interval it hides in)."""
        if action is _RC:
            return self.fwd_s
        one_way = self.cpu_s if action is _CPU else self.d2d_s
        return max(0.0, 2 * one_way - self.live_s)


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
                schedule: ScheduleSpec, progress=None) -> Plan:
    return mpress_search(policy, model, hardware, training, schedule, progress).plan


# ---- inputs: the base pipeline and its simulated schedule ----------------------------------------

def _base_plan(policy: MPressPolicy, model, hardware, training, schedule) -> Plan:
    if schedule.kind is ScheduleKind.interleaved_1f1b:
        raise PlanningError("policy=mpress plans one stage per device (MPress §IV evaluates PipeDream async and "
                            "DAPPLE's 1F1B); use schedule=1f1b, pipedream_async or gpipe")
    pp = policy.pp or min(hardware.num_devices, model.num_layers)
    if pp > hardware.num_devices:
        raise PlanningError(f"policy.pp: {pp} stages need {pp} devices; hardware {hardware.name!r} has {hardware.num_devices}")
    base = (BalancedPolicy if policy.partition == "balanced" else EvenPolicy)(pp=pp, dp=1, tp=1)
    planner = plan_balanced if policy.partition == "balanced" else plan_even
    plan = planner(base, model, hardware, training, schedule)
    return plan.model_copy(update={"planner": "mpress"})


def _pass_times(trace: dict) -> dict[tuple[str, int, int], int]:
    """(F|B, stage, microbatch) -> start ns, from the simulator's compute slices."""
    from simulator.trace import x_slices

    out = {}
    for _, name, start, _, cat in x_slices(trace):
        if cat in ("forward", "backward"):
            kind, s, mb = name.split()
            out[(kind, int(s[1:]), int(mb[2:]))] = start
    return out


def _facts(plan: Plan, model: ModelSpec, hardware: HardwareSpec, trace: dict, mapping: Mapping) -> dict:
    """LayerFacts per (stage, layer) from the base plan's simulated schedule."""
    starts = _pass_times(trace)
    m = plan.training.microbatches
    p = len(plan.stages)
    share = min(hardware.host.gpus_per_pcie_switch, p)  # every stage may swap at once
    pcie = LinkSpec(kind="pcie", bw_gbps=hardware.host.pcie_gbps / share, latency_s=hardware.host.pcie_latency_s)
    out = {}
    for s, stage in enumerate(plan.stages):
        b = costs.samples_per_replica(plan, stage)
        times = [costs.layer_pass_times_s(model, plan, hardware, stage, l)[:2] for l in stage.layers]
        links = [hardware.link(mapping.device_of_stage[s], mapping.device_of_stage[t]) for t, _ in mapping.targets[s]]
        lat = max((link.latency_s for link in links), default=0.0)
        for j, l in enumerate(stage.layers):
            nbytes = costs.layer_saved_bytes(model.layers[l], b, stage.tp)
            fwd_done = sum(f for f, _ in times[: j + 1])
            bwd_after = sum(bb for _, bb in times[j + 1:])
            live = min(((starts[("B", s, k)] - starts[("F", s, k)]) / 1e9 - fwd_done + bwd_after
                        for k in range(m) if ("B", s, k) in starts and ("F", s, k) in starts), default=0.0)
            d2d = _striped_s(nbytes, links, [w for _, w in mapping.targets[s]], lat) if links else float("inf")
            out[(s, l)] = LayerFacts(stage=s, layer=l, saved_bytes=nbytes, fwd_s=times[j][0], live_s=max(live, 0.0),
                                     cpu_s=costs.transfer_s(nbytes, pcie), d2d_s=d2d)
    return out


def _striped_s(nbytes: int, links: list, weights: list[float], latency_s: float) -> float:
    """One direction of a tensor striped by ``weights`` over ``links`` (MPress §III-C): the
    slowest stripe decides."""
    total = sum(weights)
    return latency_s + max(nbytes * w / total / (link.total_bw_gbps * 1e9) for link, w in zip(links, weights))


# ---- plan edits --------------------------------------------------------------------------------

def _with_actions(plan: Plan, actions: dict[tuple[int, int], MemoryAction], mapping: Mapping,
                  stripes: dict | None = None, opt_swap: frozenset | set = frozenset(),
                  period: dict | None = None) -> Plan:
    """``plan`` with stage devices from ``mapping`` and the given per-layer actions (others keep);
    a D2D swap stripes over ``stripes[(stage, layer)]`` ((target stage, weight), ...)."""
    stages = []
    for s, stage in enumerate(plan.stages):
        items = []
        for l in stage.layers:
            action = actions.get((s, l), _KEEP)
            if action is _KEEP:
                continue
            targets = ([D2DTarget(device=mapping.device_of_stage[t], weight=w) for t, w in stripes[(s, l)]]
                       if action is _D2D else [])
            items.append(LayerMemory(layer=l, action=action, targets=targets,
                                     microbatch_period=(period or {}).get((s, l), 1)))
        offload = stage.offload.model_copy(update={"optimizer_swap": s in opt_swap})
        stages.append(stage.model_copy(update={"devices": [mapping.device_of_stage[s]], "memory": items,
                                               "offload": offload}))
    return plan.model_copy(update={"stages": stages})


def _analytic_over(plan: Plan, model: ModelSpec, capacity: int, margin: dict[int, int] | None = None) -> dict[int, int]:
    """Stage -> bytes its device is over ``capacity`` by, closed form, own memory only (what a
    stage's own actions can fix; targets are checked on the simulated timeline)."""
    out = {}
    held = {}
    for s, stage in enumerate(plan.stages):
        in_flight = costs.in_flight_microbatches(plan, s)
        b = costs.samples_per_replica(plan, stage)
        for item in stage.memory:
            if item.action is _D2D:
                nbytes = in_flight * costs.layer_saved_bytes(model.layers[item.layer], b, stage.tp)
                total = sum(t.weight for t in item.targets)
                for t in item.targets:
                    held[t.device] = held.get(t.device, 0) + round(nbytes * t.weight / total)
    mem = device_memory(plan, model)
    for s, stage in enumerate(plan.stages):
        d = stage.devices[0]
        own = mem[d][0].total_bytes - held.get(d, 0)
        out[s] = max(0, own + (margin or {}).get(s, 0) - capacity)
    return out


# ---- the search ------------------------------------------------------------------------------------

def _better(sim, best_s: float) -> bool:
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s < best_s * (1 - 1e-9)


def _no_worse(sim, best_s: float) -> bool:
    return not any(d.oom for d in sim.result.devices) and sim.result.iteration_time_s <= best_s * (1 + 1e-9)


class _State:
    """The assignment being built: per-layer actions, why each was chosen, layers banned from D2D
    (their stripes overfilled a target), per-stage capacity corrections learnt from simulation."""

    def __init__(self, plan: Plan, model: ModelSpec, facts: dict, mapping: Mapping, allowed: list, capacity: int):
        self.plan, self.model, self.facts, self.mapping = plan, model, facts, mapping
        self.allowed, self.capacity = allowed, capacity
        self.actions: dict[tuple[int, int], MemoryAction] = {}
        self.why: dict[tuple[int, int], str] = {}
        self.no_d2d: set[tuple[int, int]] = set()
        self.stripes: dict[tuple[int, int], tuple] = {}
        self.period: dict[tuple[int, int], int] = {}  # layers swapping every n-th microbatch only
        self.opt_swap: set[int] = set()  # stages whose optimizer state lives on the host between steps
        self.opt_why: dict[int, str] = {}
        self.spare_left: dict[int, int] = {}  # target stage -> bytes it can still hold (set by the search)
        self.margin = {s: 0 for s in range(len(plan.stages))}  # simulated peak above the closed form
        self.in_flight = {s: costs.in_flight_microbatches(plan, s) for s in range(len(plan.stages))}
        self.fwd_s: dict[int, float] = {}  # stage -> one forward pass (set by the search)
        self.bwd_s: dict[int, float] = {}

    def plan_now(self, actions=None) -> Plan:
        return _with_actions(self.plan, self.actions if actions is None else actions, self.mapping, self.stripes,
                             self.opt_swap, self.period)

    def channel_s(self, s: int, action: MemoryAction, actions=None) -> float:
        """One direction of stage ``s``'s ``action`` channel per microbatch, in seconds."""
        acts = self.actions if actions is None else actions
        f = self.facts
        return sum((f[k].cpu_s if action is _CPU else f[k].d2d_s) for k, a in acts.items() if k[0] == s and a is action)

    def marginal_cost_s(self, key: tuple[int, int], action: MemoryAction) -> float:
        """Extra seconds per microbatch of giving ``key`` ``action`` now: its own unhidden time
        plus the stall it adds to its stage's forwards (:meth:`stall_s`)."""
        fact = self.facts[key]
        cost = fact.cost_s(action)
        if action in (_CPU, _D2D):
            used = self.channel_s(key[0], action)
            one = fact.cpu_s if action is _CPU else fact.d2d_s
            cost += self.stall_s(key[0], used + one) - self.stall_s(key[0], used)
        return cost

    def stall_s(self, s: int, channel_s: float) -> float:
        """Mean wait per microbatch of stage ``s`` whose swap-outs take ``channel_s`` per
        microbatch: a forward waits for the previous microbatch's swap-outs (simulator, executor),
        so the warm-up forwards (back to back, one per in-flight microbatch) wait for what exceeds
        a forward, the steady-state ones for what exceeds a forward and a backward."""
        m, n = self.plan.training.microbatches, min(self.in_flight[s], self.plan.training.microbatches)
        f, fb = self.fwd_s[s], self.fwd_s[s] + self.bwd_s[s]
        return (n * max(0.0, channel_s - f) + (m - n) * max(0.0, channel_s - fb)) / m

    def held_bytes(self, key: tuple[int, int], period: int | None = None) -> int:
        """What a D2D-swapped layer parks on its targets at the source's peak: its saved
        activations for the in-flight microbatches it swaps (every ``period``-th; the closed
        form's bound, the emulator checks timelines)."""
        period = self.period.get(key, 1) if period is None else period
        return -(-self.in_flight[key[0]] // period) * self.facts[key].saved_bytes

    def stripes_for(self, key: tuple[int, int]) -> tuple | None:
        """((target stage, weight), ...), period: the peers ``key`` can stripe over with the spare
        memory left, and how many of its microbatches (every period-th) fit there: the mapping's
        peers of its stage, dropping the one shortest of room until every stripe fits (§III-C
        spare-memory assignment, greedy per layer), all in-flight microbatches first, then every
        second, third... (MPress picks tensors; a layer's microbatches are ours)."""
        if key in self.no_d2d:
            return None
        mine = self.stripes.get(key, ()) if self.actions.get(key) is _D2D else ()
        left = dict(self.spare_left)
        total = sum(w for _, w in mine)
        for t, w in mine:  # what this layer holds now is free for it
            left[t] += round(self.held_bytes(key) * w / total)
        for period in range(1, self.in_flight[key[0]] + 1):
            held = self.held_bytes(key, period)
            cands = list(self.mapping.targets[key[0]])
            while cands:
                total = sum(w for _, w in cands)
                worst = min((left[t] - held * w / total, t, w) for t, w in cands)
                if worst[0] >= 0:
                    return tuple(cands), period
                cands.remove((worst[1], worst[2]))
        return None

    def options(self, key: tuple[int, int], techniques) -> list[tuple[float, MemoryAction]]:
        s, _ = key
        out = []
        for a in techniques:
            if a is _D2D and self.stripes_for(key) is None:
                continue
            out.append((self.marginal_cost_s(key, a), a))
        return sorted(out, key=lambda x: (x[0], [_D2D, _CPU, _RC].index(x[1])))

    def set(self, key: tuple[int, int], action: MemoryAction, why: str) -> None:
        stripes, period = self.stripes_for(key) if action is _D2D else (None, 1)
        if self.actions.get(key) is _D2D:  # give its spare memory back
            old = self.stripes.pop(key)
            total = sum(w for _, w in old)
            for t, w in old:
                self.spare_left[t] += round(self.held_bytes(key) * w / total)
        if action is _KEEP:
            self.actions.pop(key, None)
        else:
            self.actions[key] = action
        self.period.pop(key, None)
        if period > 1:
            self.period[key] = period
        if action is _D2D:
            self.stripes[key] = stripes
            total = sum(w for _, w in stripes)
            for t, w in stripes:
                self.spare_left[t] -= round(self.held_bytes(key) * w / total)
        self.why[key] = why

    def reason(self, key, action: MemoryAction, cost_s: float) -> str:
        f = self.facts[key]
        live = f"live {f.live_s * 1e3:.1f} ms"
        if action is _RC:
            return f"recompute: one more forward, {f.fwd_s * 1e3:.2f} ms, is the cheapest ({live})"
        one = f.cpu_s if action is _CPU else f.d2d_s
        where = "PCIe" if action is _CPU else "NVLink stripes"
        hid = "hides in" if 2 * one <= f.live_s else "does not hide in"
        every = self.period.get(key, 1)
        which = f"; every {every}th microbatch (the peers' spare memory holds no more)" if every > 1 else ""
        return (f"{action.value}: round trip 2 x {one * 1e3:.2f} ms over {where} {hid} its {live}; "
                f"extra {cost_s * 1e3:.2f} ms/microbatch{which}")

    def fill(self, over: dict[int, int], techniques) -> bool:
        """Assign layers of over-full stages, cheapest per saved byte first (§III-D initial
        assignment), until the closed form fits each stage's capacity less its margin. Returns
        whether anything changed."""
        changed = False
        stuck: set[int] = set()
        while True:
            need = {s: o for s, o in over.items() if o > 0 and s not in stuck}
            if not need:
                return changed
            for s in sorted(need):
                best = None
                for l in self.plan.stages[s].layers:
                    key = (s, l)
                    if key in self.actions:
                        continue
                    opts = self.options(key, techniques)
                    if not opts:
                        continue
                    cost, a = opts[0]
                    f = self.facts[key]
                    rank = (cost / max(f.saved_bytes, 1), -f.live_s, l)
                    if best is None or rank < best[0]:
                        best = (rank, key, a, cost)
                if best is None:
                    if _CPU in techniques and s not in self.opt_swap:
                        # every layer's activations are compacted and the stage is still over:
                        # GPU-CPU swap of model data (§II-D), the optimizer state first (used by
                        # the step alone, so it can be away for the whole forward and backward)
                        self.opt_swap.add(s)
                        self.opt_why[s] = ("optimizer state swapped to host between steps: the "
                                                "stage is over capacity with every layer compacted")
                        changed = True
                    else:
                        stuck.add(s)
                    continue
                _, key, a, cost = best
                self.set(key, a, "")
                self.why[key] = self.reason(key, a, cost)
                changed = True
            over = self.over()

    def over(self) -> dict[int, int]:
        """Stage -> bytes its device's own memory (closed form, plus what simulation showed the
        closed form misses) is over capacity."""
        return _analytic_over(self.plan_now(), self.model, self.capacity, self.margin)

    def snapshot(self) -> tuple:
        return (dict(self.actions), dict(self.stripes), dict(self.spare_left), dict(self.why), set(self.opt_swap),
                dict(self.period))

    def restore(self, saved: tuple) -> None:
        self.actions, self.stripes, self.spare_left, self.why = (dict(x) for x in saved[:4])
        self.opt_swap, self.period = set(saved[4]), dict(saved[5])

    def own_peak(self, s: int) -> int:
        """Closed-form peak of stage ``s``'s device without the stripes peers hold there."""
        plan = self.plan_now()
        d = plan.stages[s].devices[0]
        return device_memory(plan, self.model)[d][0].total_bytes - self._held_at(plan, d)

    def _held_at(self, plan: Plan, device: int) -> int:
        held = 0
        for s, stage in enumerate(plan.stages):
            b = costs.samples_per_replica(plan, stage)
            for item in stage.memory:
                if item.action is _D2D:
                    total = sum(t.weight for t in item.targets)
                    nbytes = self.in_flight[s] * costs.layer_saved_bytes(self.model.layers[item.layer], b, 1)
                    held += sum(round(nbytes * t.weight / total) for t in item.targets if t.device == device)
        return held


def mpress_search(policy: MPressPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                  schedule: ScheduleSpec, progress=None) -> MPressOutcome:
    """The MPress static planner (§III-B steps 3-5); see the module docstring."""
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

    base = _base_plan(policy, model, hardware, training, schedule)
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
    boundary = [costs.samples_per_replica(base, st) * model.layers[st.layer_stop - 1].output_bytes_per_sample
                for st in base.stages[:-1]]  # per microbatch, stage i -> i + 1
    allowed = [_NAMES[t] for t in policy.techniques]
    use_d2d = _D2D in allowed
    # a plan swaps whole layers (all their in-flight microbatches): ask the mapping for room in
    # whole layers, the overflow rounded up to the stage's largest layer x its in-flight count
    want = []
    for s, stage in enumerate(base.stages):
        unit = costs.in_flight_microbatches(base, s) * max(
            costs.layer_saved_bytes(model.layers[l], costs.samples_per_replica(base, stage), 1) for l in stage.layers)
        want.append(-(-demand[s] // unit) * unit if demand[s] and unit else demand[s])
    mapping = search_mapping(hardware, devices, want if use_d2d else [0] * p, spare, boundary,
                             striping=policy.striping, mode=policy.mapping if use_d2d else "identity")
    log.append(f"base: {p} stages, iteration {first.result.iteration_time_s:.3f} s; over capacity: "
               + (", ".join(f"stage {s} +{_size(demand[s])}" for s in range(p) if demand[s]) or "none"))
    if use_d2d:
        log.append(f"device mapping ({'exact' if mapping.exact else 'local search'}, {mapping.candidates} candidates): "
                   + " ".join(f"s{s}->d{d}" for s, d in enumerate(mapping.device_of_stage)))
    if not any(demand):
        plan = _with_actions(base, {}, mapping)
        sim = run(plan) if plan != base else first
        log.append("every stage fits: no memory action needed (MPress §IV-B, small models)")
        return MPressOutcome(plan, not any(d.oom for d in sim.result.devices), (), mapping, sims,
                             sim.result.iteration_time_s, first.result.iteration_time_s, tuple(log))

    facts = _facts(base, model, hardware, first.trace, mapping)
    st = _State(base, model, facts, mapping, allowed, capacity)
    st.spare_left = {t: int(spare[t]) for t in range(p)}
    passes = [costs.stage_pass_times_s(model, base, hardware, stage) for stage in base.stages]
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
            held = st._held_at(plan_now, device)
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
                log.append(f"emulator {sims}: target device {device} over by {_size(over_b)} at its peak; "
                           f"took back {_size(freed)} of stripes")
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
                log.append(f"emulator {sims}: stage {s} over by {_size(over_b)}; more layers compacted")
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
            st.facts = facts = _facts(base, model, hardware, first.trace, remap)
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
        log.append(f"host memory: {_size(max(per_node))} on one node is over its {_size(hardware.host.memory_bytes)}")
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
            lines.append(f"  host memory of node {n} (CPU swaps, offloaded optimizer state): {_size(nbytes)} of "
                         f"{_size(outcome.host_capacity_bytes)}{over}")
    for s, _ in outcome.optimizer_swap:
        per.setdefault(s, {})["optimizer state to host"] = []
    for s in sorted(per):
        parts = [f"{a} L{','.join(map(str, ls))}" if ls else a for a, ls in sorted(per[s].items())]
        lines.append(f"  stage {s} (device {outcome.mapping.device_of_stage[s]}): " + "; ".join(parts))
    return lines
