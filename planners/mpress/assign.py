"""The MPress planner's working assignment (MPress §III-D: which layers have which memory action):
the per-layer actions, the spare peer memory the D2D stripes use (§III-C spare-memory assignment)
and the closed-form check of a candidate.

- :func:`with_actions`: a plan with a stage->device mapping and per-layer actions applied;
- :func:`analytic_over`: the closed-form overflow of each stage's own memory;
- :class:`Assignment`: the actions being built, why each was chosen, the spare-memory ledger of
  the D2D targets; what a choice costs and the greedy fill live in planners/mpress/choice.py, the
  layers' facts in planners/mpress/facts.py.

Per tensor (MPress §III-D decides per tensor): a swap of a layer whose model spec lists its saved
tensors may move some of them only (``Assignment.tensors``, emitted as ``LayerMemory.tensors``;
the layer otherwise keeps). Such a layer never takes a ``microbatch_period``: where spare peer
memory is short of its in-flight bytes, its D2D swap moves the longest-lived tensors that fit
(:meth:`Assignment.d2d_fit`) instead of every n-th microbatch. The two grains are not combined:
a tensor subset already sizes the swap to what the peers hold, and one grain per layer keeps the
reason text, the closed form's held bytes and the emulated timeline saying the same thing.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from simulator.analytic import d2d_held_by_device, device_memory
from planners.mpress.facts import CPU, D2D, KEEP
from planners.mpress.mapping import Mapping
import costs.activations
from specs.model import ModelSpec
from specs.plan import D2DTarget, LayerMemory, MemoryAction, Plan
from specs.units import size_text  # noqa: F401  (re-exported: the MPress modules import it from here)

GIB = float(1 << 30)
#: "as assigned now" for the per-tensor helpers of :class:`Assignment` (None means the whole layer)
NOW = object()


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def period_text(n: int) -> str:
    """LayerMemory.microbatch_period in words: 'every microbatch', 'every 2nd microbatch'."""
    return "every microbatch" if n == 1 else f"every {ordinal(n)} microbatch"


def stage_devices(stage, device: int) -> list[int]:
    """The devices of ``stage`` once a mapping puts it on ``device``: its own when the mapping
    leaves its first device in place (the identity over a fixed layout, any dp x tp:
    planners/mpress/compact.py), else ``[device]``: only MPress's one-device stages move (Fig. 6)."""
    if stage.devices[0] == device:
        return stage.devices
    if len(stage.devices) > 1:
        raise ValueError(f"a stage of {len(stage.devices)} devices {stage.devices} cannot move to device {device}: "
                         "the stage->device mapping permutes one-device stages only")
    return [device]


def with_actions(plan: Plan, actions: dict[tuple[int, int], MemoryAction], mapping: Mapping,
                  stripes: dict | None = None, opt_swap: frozenset | set = frozenset(),
                  period: dict | None = None, tensors: dict | None = None, model: ModelSpec | None = None) -> Plan:
    """``plan`` with stage devices from ``mapping`` (:func:`stage_devices`) and the given per-layer
    actions (others keep); a D2D swap stripes over ``stripes[(stage, layer)]`` ((target stage,
    weight), ...), each target stage's stripe on its mapped device; a swap in ``tensors`` moves
    those saved tensors of its layer only (LayerMemory.tensors; with ``model``, ``tensors_of`` says how
    many the model lists, which the executor checks)."""
    stages = []
    for s, stage in enumerate(plan.stages):
        items = []
        for l in stage.layers:
            action = actions.get((s, l), KEEP)
            if action is KEEP:
                continue
            targets = ([D2DTarget(device=mapping.device_of_stage[t], weight=w) for t, w in stripes[(s, l)]]
                       if action is D2D else [])
            subset = (tensors or {}).get((s, l))
            items.append(LayerMemory(layer=l, action=action, targets=targets,
                                     microbatch_period=(period or {}).get((s, l), 1),
                                     tensors=list(subset) if subset is not None else None,
                                     tensors_of=len(model.layers[l].saved_tensors) if subset is not None and model else None))
        offload = stage.offload.model_copy(update={"optimizer_swap": s in opt_swap})
        stages.append(stage.model_copy(update={"devices": stage_devices(stage, mapping.device_of_stage[s]), "memory": items,
                                               "offload": offload}))
    return plan.model_copy(update={"stages": stages})


def analytic_own(plan: Plan, model: ModelSpec, held: dict[int, int] | None = None) -> dict[int, int]:
    """Stage -> closed-form peak of its device's own memory (without the stripes peers D2D-swap
    there). ``held``: the plan's d2d_held_by_device when the caller has it."""
    held = d2d_held_by_device(plan, model) if held is None else held
    mem = device_memory(plan, model)
    return {s: mem[stage.devices[0]][0].total_bytes - held.get(stage.devices[0], 0) for s, stage in enumerate(plan.stages)}


def analytic_over(plan: Plan, model: ModelSpec, capacity: int, margin: dict[int, int] | None = None,
                  held: dict[int, int] | None = None) -> dict[int, int]:
    """Stage -> bytes its device is over ``capacity`` by, closed form, own memory only (what a
    stage's own actions can fix; targets are checked on the simulated timeline). ``held``: the
    plan's d2d_held_by_device when the caller has it."""
    own = analytic_own(plan, model, held)
    return {s: max(0, b + (margin or {}).get(s, 0) - capacity) for s, b in own.items()}


class Assignment:
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
        self.tensors: dict[tuple[int, int], tuple[int, ...]] = {}  # swaps moving these saved tensors only
        self.opt_swap: set[int] = set()  # stages whose optimizer state lives on the host between steps
        self.opt_why: dict[int, str] = {}
        self.spare_left: dict[int, int] = {}  # target stage -> bytes it can still hold (set by the search)
        self.margin = {s: 0 for s in range(len(plan.stages))}  # simulated peak above the closed form
        # (stage, bytes of peers' stripes its device holds, closed form) -> simulated peak above the
        # closed form of its own memory, learnt from rejected candidates (:meth:`learn_from`)
        self.learnt: dict[tuple[int, int], int] = {}
        # (stage, bytes of peers' stripes its device holds) -> simulated peak above the closed form
        # of its own memory plus those stripes, learnt where a candidate overfilled a D2D target
        self.target_gap: dict[tuple[int, int], int] = {}
        self.in_flight = {s: costs.activations.in_flight_microbatches(plan, s) for s in range(len(plan.stages))}
        self.fwd_s: dict[int, float] = {}  # stage -> one forward pass (set by the search)
        self.bwd_s: dict[int, float] = {}

    def adopt(self) -> None:
        """Start from the actions the plan already carries: its layers' recompute and CPU swaps
        (each with its microbatch period) and its stages' optimizer swaps (a fixed layout's own
        choices, planners/mpress/compact.py; MPress's base carries none). D2D stripes and NVMe
        spills name devices, not the mapping's stages: ValueError."""
        for s, stage in enumerate(self.plan.stages):
            for item in stage.memory:
                if item.action in (D2D, MemoryAction.nvme):
                    raise ValueError(f"stage {s} layer {item.layer}: a given {item.action.value} cannot be adopted")
                if item.action is KEEP:
                    continue
                self.actions[(s, item.layer)] = item.action
                self.why[(s, item.layer)] = f"{item.action.value}: given by the plan"
                if item.microbatch_period > 1:
                    self.period[(s, item.layer)] = item.microbatch_period
                if item.tensors is not None:
                    self.tensors[(s, item.layer)] = tuple(item.tensors)
            if stage.offload.optimizer_swap:
                self.opt_swap.add(s)
                self.opt_why[s] = "optimizer state swapped to host between steps: given by the plan"

    def plan_now(self, actions=None) -> Plan:
        return with_actions(self.plan, self.actions if actions is None else actions, self.mapping, self.stripes,
                             self.opt_swap, self.period, self.tensors, self.model)

    # ---- what a swap of a layer, or of some of its saved tensors, moves and costs (MPress §III-D) ----

    def subset(self, key: tuple[int, int], tensors=NOW) -> tuple[int, ...] | None:
        """The saved tensors ``key``'s swap moves (None: the whole layer); NOW: as assigned."""
        return self.tensors.get(key) if tensors is NOW else tensors

    def moved_bytes(self, key: tuple[int, int], tensors=NOW) -> int:
        """One microbatch of what the swap of ``key`` (or of ``tensors`` of it) moves."""
        sub = self.subset(key, tensors)
        f = self.facts[key]
        return f.saved_bytes if sub is None else sum(t.nbytes for t in f.subset(sub))

    def one_way_s(self, key: tuple[int, int], action: MemoryAction, tensors=NOW) -> float:
        """One direction of ``key``'s ``action`` swap (of ``tensors``: their transfers in a row)."""
        sub = self.subset(key, tensors)
        f = self.facts[key]
        if sub is None:
            return f.cpu_s if action is CPU else f.d2d_s
        return sum(t.one_way_s(action) for t in f.subset(sub))

    def cost_s(self, key: tuple[int, int], action: MemoryAction, tensors=NOW) -> float:
        """Table III's extra time of ``action`` on ``key`` (LayerFacts.cost_s); a swap of some
        tensors costs what each one's round trip does not hide in its own live interval."""
        sub = self.subset(key, tensors) if action in (CPU, D2D) else None
        f = self.facts[key]
        return f.cost_s(action) if sub is None else sum(t.cost_s(action) for t in f.subset(sub))

    def held_bytes(self, key: tuple[int, int], period: int | None = None, tensors=NOW) -> int:
        """What a D2D-swapped layer parks on its targets at the source's peak: its saved
        activations (or the ``tensors`` it moves) for the in-flight microbatches it swaps (every
        ``period``-th; the closed form's bound, the emulator checks timelines)."""
        period = self.period.get(key, 1) if period is None else period
        return -(-self.in_flight[key[0]] // period) * self.moved_bytes(key, tensors)

    def _targets_for(self, key: tuple[int, int], held: int, left: dict) -> tuple | None:
        """The mapping's peers of ``key``'s stage that hold ``held`` bytes striped by weight,
        dropping the one shortest of room until every stripe fits (§III-C), or None."""
        cands = list(self.mapping.targets[key[0]])
        while cands:
            total = sum(w for _, w in cands)
            worst = min((left[t] - held * w / total, t, w) for t, w in cands)
            if worst[0] >= 0:
                return tuple(cands)
            cands.remove((worst[1], worst[2]))
        return None

    def _left_for(self, key: tuple[int, int]) -> dict:
        """The spare memory left, with what ``key`` holds now as D2D given back to it."""
        left = dict(self.spare_left)
        mine = self.stripes.get(key, ()) if self.actions.get(key) is D2D else ()
        total = sum(w for _, w in mine)
        for t, w in mine:
            left[t] += round(self.held_bytes(key) * w / total)
        return left

    def d2d_fit(self, key: tuple[int, int], tensors=None) -> tuple | None:
        """(targets, period, tensors) of a D2D swap of ``key`` in the spare memory left, or None.
        A layer without saved tensors: :meth:`stripes_for` (whole, every n-th microbatch). A layer
        with them: ``tensors`` (None: the whole layer) if they fit, else the longest-lived of them
        that fit (MPress §III-D decides per tensor; never a microbatch period, see the module
        docstring)."""
        f = self.facts[key]
        if not f.tensors:
            got = self.stripes_for(key)
            return None if got is None else (got[0], got[1], None)
        if key in self.no_d2d:
            return None
        left = self._left_for(key)
        targets = self._targets_for(key, self.held_bytes(key, 1, tensors), left)
        if targets is not None:
            return targets, 1, tensors
        pool = [t.index for t in f.by_live() if tensors is None or t.index in tensors]
        for n in range(len(pool) - 1, 0, -1):  # the most bytes first
            sub = tuple(sorted(pool[:n]))
            targets = self._targets_for(key, self.held_bytes(key, 1, sub), left)
            if targets is not None:
                return targets, 1, sub
        return None

    def stripes_for(self, key: tuple[int, int]) -> tuple | None:
        """((target stage, weight), ...), period: the peers ``key`` can stripe over with the spare
        memory left, and how many of its microbatches (every period-th) fit there: the mapping's
        peers of its stage, dropping the one shortest of room until every stripe fits (§III-C
        spare-memory assignment, greedy per layer), all in-flight microbatches first, then every
        second, third... (MPress picks tensors; a layer's microbatches are ours)."""
        if key in self.no_d2d:
            return None
        left = self._left_for(key)  # what this layer holds now is free for it
        for period in range(1, self.in_flight[key[0]] + 1):
            cands = self._targets_for(key, self.held_bytes(key, period, None), left)
            if cands is not None:
                return cands, period
        return None

    def set(self, key: tuple[int, int], action: MemoryAction, why: str, tensors: tuple | None = None) -> None:
        """Give ``key`` ``action`` (a swap of ``tensors`` of it only, when given: LayerMemory.tensors;
        recompute and keep are whole-layer). A D2D swap takes the spare peer memory it fits in
        (:meth:`d2d_fit`: a layer with saved tensors may end up moving fewer of them)."""
        tensors = tuple(sorted(tensors)) if tensors is not None and action in (CPU, D2D) else None
        if action is D2D:
            stripes, period, tensors = self.d2d_fit(key, tensors)
        else:
            stripes, period = None, 1
        if self.actions.get(key) is D2D:  # give its spare memory back
            old = self.stripes.pop(key)
            total = sum(w for _, w in old)
            for t, w in old:
                self.spare_left[t] += round(self.held_bytes(key) * w / total)
        if action is KEEP:
            self.actions.pop(key, None)
        else:
            self.actions[key] = action
        self.period.pop(key, None)
        if period > 1:
            self.period[key] = period
        self.tensors.pop(key, None)
        if tensors is not None:
            self.tensors[key] = tensors
        if action is D2D:
            self.stripes[key] = stripes
            total = sum(w for _, w in stripes)
            for t, w in stripes:
                self.spare_left[t] -= round(self.held_bytes(key) * w / total)
        self.why[key] = why

    def own(self, plan: Plan | None = None) -> tuple[dict[int, int], dict[int, int]]:
        """(stage -> closed-form peak of its device's own memory, stage -> bytes of the peers'
        D2D stripes its device holds) for ``plan`` (default :meth:`plan_now`)."""
        plan = self.plan_now() if plan is None else plan
        by_device = d2d_held_by_device(plan, self.model)
        held = {s: by_device.get(stage.devices[0], 0) for s, stage in enumerate(plan.stages)}
        return analytic_own(plan, self.model, by_device), held

    def over(self, plan: Plan | None = None, own: tuple | None = None, targets=()) -> dict[int, int]:
        """Stage -> bytes its device's own memory (closed form, plus what simulation showed the
        closed form misses: the repair's margin, or what :meth:`learn_from` learnt while the
        device held the peers' stripes it holds now) is over capacity. ``plan``: :meth:`plan_now`
        when the caller has built it; ``own``: its :meth:`own` when the caller has it. The stages
        in ``targets`` (a candidate's D2D targets) also count the stripes they hold, where a
        candidate that overfilled one of them holding the same bytes taught what the simulated
        timeline holds beyond that (:meth:`learn_from`)."""
        mine, held = self.own(plan) if own is None else own
        out = {s: max(0, b + max(self.margin[s], self.learnt.get((s, held[s]), 0)) - self.capacity)
               for s, b in mine.items()}
        for t in targets:
            if (gap := self.target_gap.get((t, held[t]))) is not None:
                out[t] = max(out[t], mine[t] + held[t] + gap - self.capacity)
        return out

    def targets_of(self, key: tuple[int, int]) -> list[int]:
        """The stages ``key``'s D2D swap stripes over, as assigned now (none if not D2D)."""
        return [t for t, _ in self.stripes.get(key, ())] if self.actions.get(key) is D2D else []

    def learn_from(self, plan: Plan, sim, s: int, own: tuple | None = None) -> bool:
        """A rejected candidate ``plan`` that changed stage ``s``, simulated as ``sim``: where
        its device was over capacity, learn what the simulated timeline holds beyond the closed
        form of its own memory so that :meth:`over` screens the next candidates of ``s`` that
        the emulator would find over too (MPress §III-B step 5: the emulator's feedback steers
        the assignment). Learnt per (stage, bytes of the peers' D2D stripes its device holds):
        the simulated peak counts the stripes parked there at that moment, the own closed form
        does not, so a gap learnt while the device held stripes holds only while it holds the
        same ones (a peer's later move to CPU swap or keep frees them; a gap learnt with them
        screened out keep and D2D candidates that fit, GPT-15.4B on DGX-1, 2026-11-27).
        Every stage whose device was over holding peers' stripes also learns what the timeline
        held beyond its own closed form plus those stripes (the D2D targets a candidate
        overfilled: GPT-25.5B on DGX-1 retried the same stripes of like layers on one full peer).
        ``own``: ``plan``'s :meth:`own` when the caller has it. Whether ``s``'s device was over."""
        peaks = {d.device: d.peak_bytes for d in sim.result.devices if d.oom}
        if not peaks:
            return False
        mine, held = self.own(plan) if own is None else own
        for t, stage in enumerate(plan.stages):
            if held[t] and (peak := peaks.get(stage.devices[0])) is not None:
                key = (t, held[t])
                self.target_gap[key] = max(self.target_gap.get(key, peak - mine[t] - held[t]), peak - mine[t] - held[t])
        peak = peaks.get(plan.stages[s].devices[0])
        if peak is None:
            return False
        key = (s, held[s])
        self.learnt[key] = max(self.learnt.get(key, 0), peak - mine[s])
        return True

    def snapshot(self) -> tuple:
        return (dict(self.actions), dict(self.stripes), dict(self.spare_left), dict(self.why), set(self.opt_swap),
                dict(self.period), dict(self.tensors))

    def restore(self, saved: tuple) -> None:
        self.actions, self.stripes, self.spare_left, self.why = (dict(x) for x in saved[:4])
        self.opt_swap, self.period, self.tensors = set(saved[4]), dict(saved[5]), dict(saved[6])

    def own_peak(self, s: int) -> int:
        """Closed-form peak of stage ``s``'s device without the stripes peers hold there."""
        plan = self.plan_now()
        d = plan.stages[s].devices[0]
        return device_memory(plan, self.model)[d][0].total_bytes - d2d_held_by_device(plan, self.model).get(d, 0)
