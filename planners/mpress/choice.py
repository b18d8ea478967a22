"""Which technique a layer gets (MPress §III-B step 3: "a simple cost model, which compares the
time cost of different optimizations"; §III-D: the initial assignment, cheapest first).

- :func:`marginal_cost_s`: a technique's extra seconds per microbatch given what the stage
  already swaps (Table III plus the forwards' swap stalls), and :func:`options`, cheapest first;
- :func:`choices`: the same with per-tensor swaps (a layer whose spec lists its saved tensors:
  the tensors whose own swap hides, when the whole layer's does not; MPress §III-D decides per
  tensor), and :func:`trim`: a swap cut to the longest-lived tensors that cover the stage's need;
- :func:`reason`: the why text a choice is logged with;
- :func:`fill`: the greedy per-layer assignment of the over-full stages, cheapest per saved byte;
- :func:`initial_assignment`: the facts read off the base's schedule and the first fill.

Pure: no I/O, no clocks; they read and edit a planners/mpress/assign.py ``Assignment``.
"""
from __future__ import annotations

from planners.mpress.assign import Assignment, period_text, size_text
from planners.mpress.facts import CPU, D2D, RC, layer_facts
from planners.mpress.mapping import Mapping
import costs.layer_time
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan

SWAPS = (CPU, D2D)


def channel_s(st: Assignment, s: int, action: MemoryAction, actions=None, skip=None) -> float:
    """One direction of stage ``s``'s ``action`` channel per microbatch, in seconds (a per-tensor
    swap counts its tensors'), without layer ``skip``."""
    acts = st.actions if actions is None else actions
    return sum(st.one_way_s(k, action) for k, a in acts.items() if k[0] == s and a is action and k != skip)


def marginal_cost_s(st: Assignment, key: tuple[int, int], action: MemoryAction, tensors=None) -> float:
    """Extra seconds per microbatch of giving ``key`` ``action`` now (a swap of ``tensors`` of it
    only, when given): its own unhidden time plus the stall it adds to its stage's forwards
    (:func:`stall_s`)."""
    cost = st.cost_s(key, action, tensors)
    if action in SWAPS:
        used = channel_s(st, key[0], action, skip=key)
        one = st.one_way_s(key, action, tensors)
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
#: CPU before recompute at equal cost: §III-D recomputes only "when the imposed extra latency by
#: itself is smaller [than] GPU-CPU swap", and assigns "GPU-CPU swap to the remaining tensors".
#: Checked against the text (issue H4): the order is the paper's; "recompute over D2D when
#: cheaper" needs no tie rule (the cheaper estimate wins before TIE_ORDER is read).
TIE_ORDER = (CPU, RC, D2D)


def cost_key_us(cost_s: float) -> int:
    """A cost estimate in whole microseconds: "the same extra overhead" (Table III prints whole ms)
    must not be decided by float noise between two sums of the same terms."""
    return round(cost_s * 1e6)


def options(st: Assignment, key: tuple[int, int], techniques) -> list[tuple[float, MemoryAction]]:
    """(marginal cost, technique) for ``key``, whole layer, cheapest first, equal costs (to the
    microsecond) in :data:`TIE_ORDER`; D2D only where the spare peer memory left holds some of it."""
    out = []
    for a in techniques:
        if a is D2D and st.d2d_fit(key) is None:
            continue
        out.append((marginal_cost_s(st, key, a), a))
    return sorted(out, key=lambda x: (cost_key_us(x[0]), TIE_ORDER.index(x[1])))


def hiding_tensors(st: Assignment, key: tuple[int, int], action: MemoryAction) -> tuple[int, ...]:
    """The saved tensors of ``key`` whose own ``action`` round trip fits in their own live interval
    (MPress §III-D: a swap adds no delay then), longest-lived first."""
    return tuple(t.index for t in st.facts[key].by_live() if t.hides(action))


def choices(st: Assignment, key: tuple[int, int], techniques) -> list[tuple[float, MemoryAction, tuple | None]]:
    """(marginal cost, technique, tensors or None for the whole layer) for ``key``, cheapest per
    byte moved first, then :data:`TIE_ORDER`, then more bytes. Besides :func:`options`, a layer
    with saved tensors whose whole swap does not hide offers the swap of its tensors that do
    (§III-D: swap when the transfer hides in the tensor's live interval). A layer without saved
    tensors: exactly :func:`options` (its bytes are the same for every technique)."""
    out = [(c, a, None) for c, a in options(st, key, techniques)]
    f = st.facts[key]
    if f.tensors:
        for a in techniques:
            if a in SWAPS and f.cost_s(a) > 0 and (sub := hiding_tensors(st, key, a)):
                if a is D2D and st.d2d_fit(key, sub) is None:
                    continue
                out.append((marginal_cost_s(st, key, a, sub), a, tuple(sorted(sub))))
    return sorted(out, key=lambda x: (cost_key_us(x[0]) / max(st.moved_bytes(key, x[2]), 1),
                                      TIE_ORDER.index(x[1]), -st.moved_bytes(key, x[2])))


def trim(st: Assignment, key: tuple[int, int], action: MemoryAction, tensors: tuple | None) -> tuple | None:
    """The swap of ``key`` (``tensors`` of it, None: whole) cut to the fewest of its saved tensors,
    longest-lived first, that bring its stage within capacity (closed form with the learnt margin):
    where the stage needs fewer bytes than the choice moves, MPress moves the tensors it needs
    (§III-D decides per tensor). Unchanged when even all of them do not cover the need, or the
    layer lists no tensors, or ``action`` is not a swap (only swaps move single tensors)."""
    f = st.facts[key]
    if action not in SWAPS or not f.tensors:
        return tensors
    pool = [t.index for t in f.by_live() if tensors is None or t.index in tensors]
    saved = st.snapshot()

    def fits(n: int) -> bool:
        st.set(key, action, "", tuple(pool[:n]))
        ok = st.over()[key[0]] <= 0 and (action is not D2D or len(st.tensors.get(key) or ()) == n)
        st.restore(saved)
        return ok

    if not pool or not fits(len(pool)):
        return tensors
    lo, hi = 1, len(pool)  # the closed form's need falls as tensors are added: bisect the fewest
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return tuple(sorted(pool[:lo]))


def _tensor_text(st: Assignment, key, action: MemoryAction, sub: tuple) -> str:
    """'3 of 7 saved tensors (attn.softmax 12.00 MiB: 2 x 1.10 ms in its live 30.2 ms, hides; ...);
    the rest of the layer keeps'."""
    f = st.facts[key]
    parts = []
    for t in f.subset(sub):
        one = t.one_way_s(action)
        hid = "hides" if t.hides(action) else "does not hide"
        parts.append(f"{t.name} {size_text(t.nbytes)}: 2 x {one * 1e3:.2f} ms in its live {t.live_s * 1e3:.1f} ms, {hid}")
    return (f"{len(sub)} of {len(f.tensors)} saved tensors ({'; '.join(parts)}); the rest of the layer keeps")


def reason(st: Assignment, key, action: MemoryAction, cost_s: float) -> str:
    f = st.facts[key]
    live = f"live {f.live_s * 1e3:.1f} ms"
    if action is RC:
        return f"recompute: one more forward, {f.fwd_s * 1e3:.2f} ms, is the cheapest ({live})"
    where = "PCIe" if action is CPU else "NVLink stripes"
    sub = st.tensors.get(key) if st.actions.get(key) is action else None
    if sub is not None:
        room = " (the peers' spare memory holds no more)" if action is D2D and len(sub) < len(f.tensors) else ""
        return (f"{action.value}: {_tensor_text(st, key, action, sub)}{room}; over {where}, "
                f"extra {cost_s * 1e3:.2f} ms/microbatch")
    one = f.cpu_s if action is CPU else f.d2d_s
    hid = "hides in" if 2 * one <= f.live_s else "does not hide in"
    every = st.period.get(key, 1)
    which = f"; {period_text(every)} (the peers' spare memory holds no more)" if every > 1 else ""
    return (f"{action.value}: round trip 2 x {one * 1e3:.2f} ms over {where} {hid} its {live}; "
            f"extra {cost_s * 1e3:.2f} ms/microbatch{which}")


def _tie(st: Assignment, key: tuple[int, int], a: MemoryAction, tensors) -> tuple:
    """Equal cost per byte: a swap goes to the longer-lived layer (or tensor); recompute to a layer
    next to one already recomputed, then to the later layer (MPress §III-D)."""
    s, l = key
    if a is RC:
        beside = any(st.actions.get((s, n)) is RC for n in (l - 1, l + 1))
        return (not beside, -l)
    f = st.facts[key]
    live = max(t.live_s for t in f.subset(tensors)) if tensors else f.live_s
    return (False, -live)


def cheapest_layer(st: Assignment, s: int, techniques):
    """The layer of stage ``s`` that is cheapest per saved byte to compact: (rank, key, technique,
    cost, tensors or None for the whole layer), or None. A layer without an action offers
    :func:`choices`; a layer whose swap moves some of its tensors only may take a whole-layer
    technique instead, ranked by the cost and bytes it adds. Ties (equal cost per byte, to the
    microsecond): the technique in :data:`TIE_ORDER`; a swap goes to the longer-lived layer (more
    time to hide in); recompute goes to a layer next to one already recomputed, then to the later
    layer (MPress §III-D: "prioritize Recomputation to alleviate the memory limitations of the
    latter layers", "apply Recomputation to reduce tensors from consecutive layers")."""
    best = None
    for l in st.plan.stages[s].layers:
        key = (s, l)
        current = st.actions.get(key)
        if current is None:
            opts = choices(st, key, techniques)
            if not opts:
                continue
            cost, a, sub = opts[0]
            added_cost, added_bytes = cost, st.moved_bytes(key, sub)
        elif key in st.tensors:  # a per-tensor swap: the whole layer may move yet
            now_cost, now_bytes = marginal_cost_s(st, key, current, st.tensors[key]), st.moved_bytes(key)
            # a whole D2D swap only where the spare memory holds the whole layer (else d2d_fit
            # would give back the tensors it has: no progress)
            opts = [(c - now_cost, a) for c, a in options(st, key, techniques)
                    if a is not D2D or (st.d2d_fit(key) or (None, 0, ()))[2] is None]
            if not opts or st.facts[key].saved_bytes <= now_bytes:
                continue
            added_cost, a = min(opts, key=lambda x: (cost_key_us(x[0]), TIE_ORDER.index(x[1])))
            cost, sub, added_bytes = added_cost + now_cost, None, st.facts[key].saved_bytes - now_bytes
        else:
            continue
        rank = (cost_key_us(added_cost) / max(added_bytes, 1), TIE_ORDER.index(a), *_tie(st, key, a, sub), l)
        if best is None or rank < best[0]:
            best = (rank, key, a, cost, sub)
    return best


def fill(st: Assignment, over: dict[int, int], techniques) -> bool:
    """Assign layers of over-full stages, cheapest per saved byte first (§III-D initial
    assignment), until the closed form fits each stage's capacity less its margin; a swap of a
    layer with saved tensors moves only the longest-lived ones the stage needs (:func:`trim`).
    Returns whether anything changed."""
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
            _, key, a, _, sub = best
            sub = trim(st, key, a, sub)
            cost = marginal_cost_s(st, key, a, sub)
            before = (st.actions.get(key), st.tensors.get(key), st.period.get(key))
            st.set(key, a, "", sub)
            if (st.actions.get(key), st.tensors.get(key), st.period.get(key)) == before:
                stuck.add(s)  # the spare memory took no more of it: nothing moved
                continue
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
