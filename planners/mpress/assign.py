"""The MPress planner's working state (planners/mpress/planner.py drives it): what each layer's
techniques cost, which layers have which action, the spare peer memory left, and the closed-form
check of a candidate (MPress §III-C/D).

- :class:`LayerFacts`: per layer of a stage, its saved bytes, its live interval read off the
  simulated schedule (§III-D footnote 1) and the one-way time of a CPU and a D2D swap;
- :class:`Assignment`: the per-layer actions being built, with the greedy fill (cheapest per
  saved byte first), the spare-memory ledger of the D2D targets and the forwards' swap stalls.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from simulator.analytic import d2d_held_by_device, device_memory
from planners.mpress.mapping import Mapping
import costs.activations
import costs.collectives
import costs.layer_time
import costs.params
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import ModelSpec
from specs.plan import D2DTarget, LayerMemory, MemoryAction, Plan

KEEP, RC, CPU, D2D = MemoryAction.keep, MemoryAction.recompute, MemoryAction.cpu_swap, MemoryAction.d2d_swap
GIB = float(1 << 30)


def size_text(nbytes: float) -> str:
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
        if action is RC:
            return self.fwd_s
        one_way = self.cpu_s if action is CPU else self.d2d_s
        return max(0.0, 2 * one_way - self.live_s)


# ---- inputs: the simulated schedule ------------------------------------------------------------

def _pass_times(trace: dict) -> dict[tuple[str, int, int], int]:
    """(F|B, stage, microbatch) -> start ns, from the simulator's compute slices."""
    from simulator.trace import x_slices

    out = {}
    for _, name, start, _, cat in x_slices(trace):
        if cat in ("forward", "backward"):
            kind, s, mb = name.split()
            out[(kind, int(s[1:]), int(mb[2:]))] = start
    return out


def layer_facts(plan: Plan, model: ModelSpec, hardware: HardwareSpec, trace: dict, mapping: Mapping) -> dict:
    """LayerFacts per (stage, layer) from the base plan's simulated schedule."""
    starts = _pass_times(trace)
    m = plan.training.microbatches
    p = len(plan.stages)
    share = min(hardware.host.gpus_per_pcie_switch, p)  # every stage may swap at once
    pcie = LinkSpec(kind="pcie", bw_gbps=hardware.host.pcie_gbps / share, latency_s=hardware.host.pcie_latency_s)
    out = {}
    for s, stage in enumerate(plan.stages):
        b = costs.params.samples_per_replica(plan, stage)
        times = [costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l)[:2] for l in stage.layers]
        links = [hardware.link(mapping.device_of_stage[s], mapping.device_of_stage[t]) for t, _ in mapping.targets[s]]
        lat = max((link.latency_s for link in links), default=0.0)
        for j, l in enumerate(stage.layers):
            nbytes = costs.activations.layer_saved_bytes(model.layers[l], b, stage.tp)
            fwd_done = sum(f for f, _ in times[: j + 1])
            bwd_after = sum(bb for _, bb in times[j + 1:])
            live = min(((starts[("B", s, k)] - starts[("F", s, k)]) / 1e9 - fwd_done + bwd_after
                        for k in range(m) if ("B", s, k) in starts and ("F", s, k) in starts), default=0.0)
            d2d = _striped_s(nbytes, links, [w for _, w in mapping.targets[s]], lat) if links else float("inf")
            out[(s, l)] = LayerFacts(stage=s, layer=l, saved_bytes=nbytes, fwd_s=times[j][0], live_s=max(live, 0.0),
                                     cpu_s=costs.collectives.transfer_s(nbytes, pcie), d2d_s=d2d)
    return out


def _striped_s(nbytes: int, links: list, weights: list[float], latency_s: float) -> float:
    """One direction of a tensor striped by ``weights`` over ``links`` (MPress §III-C): the
    slowest stripe decides."""
    total = sum(weights)
    return latency_s + max(nbytes * w / total / (link.total_bw_gbps * 1e9) for link, w in zip(links, weights))


# ---- plan edits --------------------------------------------------------------------------------

def with_actions(plan: Plan, actions: dict[tuple[int, int], MemoryAction], mapping: Mapping,
                  stripes: dict | None = None, opt_swap: frozenset | set = frozenset(),
                  period: dict | None = None) -> Plan:
    """``plan`` with stage devices from ``mapping`` and the given per-layer actions (others keep);
    a D2D swap stripes over ``stripes[(stage, layer)]`` ((target stage, weight), ...)."""
    stages = []
    for s, stage in enumerate(plan.stages):
        items = []
        for l in stage.layers:
            action = actions.get((s, l), KEEP)
            if action is KEEP:
                continue
            targets = ([D2DTarget(device=mapping.device_of_stage[t], weight=w) for t, w in stripes[(s, l)]]
                       if action is D2D else [])
            items.append(LayerMemory(layer=l, action=action, targets=targets,
                                     microbatch_period=(period or {}).get((s, l), 1)))
        offload = stage.offload.model_copy(update={"optimizer_swap": s in opt_swap})
        stages.append(stage.model_copy(update={"devices": [mapping.device_of_stage[s]], "memory": items,
                                               "offload": offload}))
    return plan.model_copy(update={"stages": stages})


def analytic_over(plan: Plan, model: ModelSpec, capacity: int, margin: dict[int, int] | None = None) -> dict[int, int]:
    """Stage -> bytes its device is over ``capacity`` by, closed form, own memory only (what a
    stage's own actions can fix; targets are checked on the simulated timeline)."""
    out = {}
    held = d2d_held_by_device(plan, model)
    mem = device_memory(plan, model)
    for s, stage in enumerate(plan.stages):
        d = stage.devices[0]
        own = mem[d][0].total_bytes - held.get(d, 0)
        out[s] = max(0, own + (margin or {}).get(s, 0) - capacity)
    return out


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
        self.opt_swap: set[int] = set()  # stages whose optimizer state lives on the host between steps
        self.opt_why: dict[int, str] = {}
        self.spare_left: dict[int, int] = {}  # target stage -> bytes it can still hold (set by the search)
        self.margin = {s: 0 for s in range(len(plan.stages))}  # simulated peak above the closed form
        self.in_flight = {s: costs.activations.in_flight_microbatches(plan, s) for s in range(len(plan.stages))}
        self.fwd_s: dict[int, float] = {}  # stage -> one forward pass (set by the search)
        self.bwd_s: dict[int, float] = {}

    def plan_now(self, actions=None) -> Plan:
        return with_actions(self.plan, self.actions if actions is None else actions, self.mapping, self.stripes,
                             self.opt_swap, self.period)

    def channel_s(self, s: int, action: MemoryAction, actions=None) -> float:
        """One direction of stage ``s``'s ``action`` channel per microbatch, in seconds."""
        acts = self.actions if actions is None else actions
        f = self.facts
        return sum((f[k].cpu_s if action is CPU else f[k].d2d_s) for k, a in acts.items() if k[0] == s and a is action)

    def marginal_cost_s(self, key: tuple[int, int], action: MemoryAction) -> float:
        """Extra seconds per microbatch of giving ``key`` ``action`` now: its own unhidden time
        plus the stall it adds to its stage's forwards (:meth:`stall_s`)."""
        fact = self.facts[key]
        cost = fact.cost_s(action)
        if action in (CPU, D2D):
            used = self.channel_s(key[0], action)
            one = fact.cpu_s if action is CPU else fact.d2d_s
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
        mine = self.stripes.get(key, ()) if self.actions.get(key) is D2D else ()
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
            if a is D2D and self.stripes_for(key) is None:
                continue
            out.append((self.marginal_cost_s(key, a), a))
        return sorted(out, key=lambda x: (x[0], [D2D, CPU, RC].index(x[1])))

    def set(self, key: tuple[int, int], action: MemoryAction, why: str) -> None:
        stripes, period = self.stripes_for(key) if action is D2D else (None, 1)
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
        if action is D2D:
            self.stripes[key] = stripes
            total = sum(w for _, w in stripes)
            for t, w in stripes:
                self.spare_left[t] -= round(self.held_bytes(key) * w / total)
        self.why[key] = why

    def reason(self, key, action: MemoryAction, cost_s: float) -> str:
        f = self.facts[key]
        live = f"live {f.live_s * 1e3:.1f} ms"
        if action is RC:
            return f"recompute: one more forward, {f.fwd_s * 1e3:.2f} ms, is the cheapest ({live})"
        one = f.cpu_s if action is CPU else f.d2d_s
        where = "PCIe" if action is CPU else "NVLink stripes"
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
                    if CPU in techniques and s not in self.opt_swap:
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
        return analytic_over(self.plan_now(), self.model, self.capacity, self.margin)

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
        return device_memory(plan, self.model)[d][0].total_bytes - d2d_held_by_device(plan, self.model).get(d, 0)
