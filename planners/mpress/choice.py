"""Which technique a layer gets (MPress §III-B step 3: "a simple cost model, which compares the
time cost of different optimizations"; §III-D: the initial assignment, cheapest first).

- :func:`marginal_cost_s`: a technique's extra seconds per microbatch given what the stage
  already swaps (Table III plus the forwards' swap stalls), and :func:`options`, cheapest first;
- :func:`reason`: the why text a choice is logged with;
- :func:`fill`: the greedy per-layer assignment of the over-full stages, cheapest per saved byte;
- :func:`initial_assignment`: the facts read off the base's schedule and the first fill.

Pure: no I/O, no clocks; they read and edit a planners/mpress/assign.py ``Assignment``.
"""
from __future__ import annotations

from planners.mpress.assign import Assignment, period_text
from planners.mpress.facts import CPU, D2D, RC, layer_facts
from planners.mpress.mapping import Mapping
import costs.layer_time
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan


def channel_s(st: Assignment, s: int, action: MemoryAction, actions=None) -> float:
    """One direction of stage ``s``'s ``action`` channel per microbatch, in seconds."""
    acts = st.actions if actions is None else actions
    f = st.facts
    return sum((f[k].cpu_s if action is CPU else f[k].d2d_s) for k, a in acts.items() if k[0] == s and a is action)


def marginal_cost_s(st: Assignment, key: tuple[int, int], action: MemoryAction) -> float:
    """Extra seconds per microbatch of giving ``key`` ``action`` now: its own unhidden time
    plus the stall it adds to its stage's forwards (:func:`stall_s`)."""
    fact = st.facts[key]
    cost = fact.cost_s(action)
    if action in (CPU, D2D):
        used = channel_s(st, key[0], action)
        one = fact.cpu_s if action is CPU else fact.d2d_s
        cost += stall_s(st, key[0], used + one) - stall_s(st, key[0], used)
    return cost


def stall_s(st: Assignment, s: int, channel_s: float) -> float:
    """Mean wait per microbatch of stage ``s`` whose swap-outs take ``channel_s`` per
    microbatch: a forward waits for the previous microbatch's swap-outs (simulator, executor),
    so the warm-up forwards (back to back, one per in-flight microbatch) wait for what exceeds
    a forward, the steady-state ones for what exceeds a forward and a backward."""
    m, n = st.plan.training.microbatches, min(st.in_flight[s], st.plan.training.microbatches)
    f, fb = st.fwd_s[s], st.fwd_s[s] + st.bwd_s[s]
    return (n * max(0.0, channel_s - f) + (m - n) * max(0.0, channel_s - fb)) / m


#: tie order between techniques whose estimates are equal (MPress §IV-D, Table III): a CPU swap
#: that hides is preferred to a D2D swap that hides (t1: "D2D swap can be saved for other tasks
#: with more stringent demands"), recompute to a D2D swap of the same cost (t3: "Recomputation does
#: not consume limited spare GPU memory"); D2D last, as spare peer memory is scarce (§III-D bullet 4).
TIE_ORDER = (CPU, RC, D2D)


def cost_key_us(cost_s: float) -> int:
    """A cost estimate in whole microseconds: "the same extra overhead" (Table III prints whole ms)
    must not be decided by float noise between two sums of the same terms."""
    return round(cost_s * 1e6)


def options(st: Assignment, key: tuple[int, int], techniques) -> list[tuple[float, MemoryAction]]:
    """(marginal cost, technique) for ``key``, cheapest first, equal costs (to the microsecond) in
    :data:`TIE_ORDER`; D2D only where the spare peer memory left holds some of it."""
    out = []
    for a in techniques:
        if a is D2D and st.stripes_for(key) is None:
            continue
        out.append((marginal_cost_s(st, key, a), a))
    return sorted(out, key=lambda x: (cost_key_us(x[0]), TIE_ORDER.index(x[1])))


def reason(st: Assignment, key, action: MemoryAction, cost_s: float) -> str:
    f = st.facts[key]
    live = f"live {f.live_s * 1e3:.1f} ms"
    if action is RC:
        return f"recompute: one more forward, {f.fwd_s * 1e3:.2f} ms, is the cheapest ({live})"
    one = f.cpu_s if action is CPU else f.d2d_s
    where = "PCIe" if action is CPU else "NVLink stripes"
    hid = "hides in" if 2 * one <= f.live_s else "does not hide in"
    every = st.period.get(key, 1)
    which = f"; {period_text(every)} (the peers' spare memory holds no more)" if every > 1 else ""
    return (f"{action.value}: round trip 2 x {one * 1e3:.2f} ms over {where} {hid} its {live}; "
            f"extra {cost_s * 1e3:.2f} ms/microbatch{which}")


def cheapest_layer(st: Assignment, s: int, techniques):
    """The layer of stage ``s`` without an action that is cheapest per saved byte to compact:
    (rank, key, technique, cost), or None. Ties (equal cost per byte, to the microsecond): the
    technique in :data:`TIE_ORDER`; a swap goes to the longer-lived layer (more time to hide in);
    recompute goes to a layer next to one already recomputed, then to the later layer (MPress
    §III-D: "prioritize Recomputation to alleviate the memory limitations of the latter layers",
    "apply Recomputation to reduce tensors from consecutive layers")."""
    best = None
    for l in st.plan.stages[s].layers:
        key = (s, l)
        if key in st.actions:
            continue
        opts = options(st, key, techniques)
        if not opts:
            continue
        cost, a = opts[0]
        f = st.facts[key]
        if a is RC:
            beside = any(st.actions.get((s, n)) is RC for n in (l - 1, l + 1))
            tie = (not beside, -l)
        else:
            tie = (False, -f.live_s)
        rank = (cost_key_us(cost) / max(f.saved_bytes, 1), TIE_ORDER.index(a), *tie, l)
        if best is None or rank < best[0]:
            best = (rank, key, a, cost)
    return best


def fill(st: Assignment, over: dict[int, int], techniques) -> bool:
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
            best = cheapest_layer(st, s, techniques)
            if best is None:
                if CPU in techniques and s not in st.opt_swap and not _state_on_host(st.plan.stages[s]):
                    # every layer's activations are compacted and the stage is still over:
                    # GPU-CPU swap of model data (§II-D), the optimizer state first (used by
                    # the step alone, so it can be away for the whole forward and backward)
                    st.opt_swap.add(s)
                    st.opt_why[s] = ("optimizer state swapped to host between steps: the "
                                     "stage is over capacity with every layer compacted")
                    changed = True
                else:
                    stuck.add(s)
                continue
            _, key, a, cost = best
            st.set(key, a, "")
            st.why[key] = reason(st, key, a, cost)
            changed = True
        over = st.over()


def _state_on_host(stage) -> bool:
    """The stage's optimizer state already lives on the host (ZeRO-Offload, a window): no swap."""
    return stage.offload.optimizer_on_cpu or stage.offload.window_layers is not None


def initial_assignment(base: Plan, model: ModelSpec, hardware: HardwareSpec, trace: dict, mapping: Mapping,
                       allowed: list, capacity: int, spare: list, adopt: bool = False) -> Assignment:
    """The layers' facts from the base's simulated schedule (``trace``) and the §III-D initial
    assignment of the stages over ``capacity``: recompute and CPU swap, D2D replaces the costliest
    later; a D2D-only policy (the paper's "D2D swap" baseline) places D2D from the start.
    ``adopt``: start from the actions ``base`` carries (Assignment.adopt) instead of none."""
    facts = layer_facts(base, model, hardware, trace, mapping)
    st = Assignment(base, model, facts, mapping, allowed, capacity)
    if adopt:
        st.adopt()
    st.spare_left = {t: int(spare[t]) for t in range(len(spare))}
    passes = [costs.layer_time.stage_pass_times_s(model, base, hardware, stage) for stage in base.stages]
    st.fwd_s = {s: f for s, (f, _) in enumerate(passes)}
    st.bwd_s = {s: b for s, (_, b) in enumerate(passes)}
    initial = [a for a in allowed if a is not D2D] or allowed
    fill(st, st.over(), initial)
    return st
