"""MPress's emulator feedback, improve (§III-B step 5, §III-D last paragraph): once the candidate
fits, try the costliest compactions with other techniques and accept a change only if the emulated
iteration is faster (or, for less data moved, no slower) and still fits.

In order: map again for the room compaction made (Fig. 6) when no stage had spare memory at
first; keep optimizer state resident where it fits; the costliest compacted layers with the other
techniques, then as keep; hidden CPU swaps to spare peer memory; optimizer state once more.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from planners.mpress.assign import Assignment
from planners.mpress.base import mapping_text
from planners.mpress.choice import marginal_cost_s, options, reason
from planners.mpress.emulate import Emulator, better, no_worse
from planners.mpress.facts import CPU, D2D, KEEP, layer_facts
from planners.mpress.mapping import search_mapping
from planners.policy import MPressPolicy
from specs.hardware import HardwareSpec


def remap(em: Emulator, st: Assignment, policy: MPressPolicy, hardware: HardwareSpec, devices: list,
          boundary: list, trace: dict, capacity: int, best):
    """Every stage overflowed the base plan, so there was no spare memory to map for; now that
    recompute, CPU swaps and optimizer swaps made room, map again (Fig. 6) for the costly
    compactions: their bytes are the demand, what the devices have left the spare. Returns the
    best simulation (the remapped one if it is no slower)."""
    p = len(devices)
    peak_now = {d.device: d.peak_bytes for d in best.result.devices}
    dev_now = st.mapping.device_of_stage
    demand2 = [sum(st.held_bytes(k) for k, a in st.actions.items() if k[0] == s and st.facts[k].cost_s(a) > 0)
               for s in range(p)]
    spare2 = [max(0, capacity - peak_now[dev_now[s]]) if not demand2[s] else 0 for s in range(p)]
    if not (any(demand2) and any(spare2)):
        return best
    new = search_mapping(hardware, devices, demand2, spare2, boundary, striping=policy.striping, mode=policy.mapping)
    saved, old_map, old_facts = st.snapshot(), st.mapping, st.facts
    st.mapping, st.spare_left = new, dict(enumerate(spare2))
    st.facts = layer_facts(st.plan, st.model, hardware, trace, new)
    t = em.run(st.plan_now())
    if no_worse(t, best.result.iteration_time_s):
        em.log.append(f"emulator {em.sims}: mapped again for the room compaction made " + mapping_text(new))
        return t
    st.restore(saved)
    st.mapping, st.facts = old_map, old_facts
    return best


def improve(em: Emulator, st: Assignment, allowed: list, best):
    """The improvement rounds on a fitting candidate (``best``, its simulation); returns the
    best simulation. The optimizer swap is the costliest (its whole state crosses PCIe twice an
    iteration): first see which stages fit without it now that their activations are compacted,
    and again at the end, after the layers' actions changed."""
    best = keep_optimizers(em, st, best)
    best = other_techniques(em, st, allowed, best)
    best = cpu_swaps_to_peers(em, st, best)
    return keep_optimizers(em, st, best)


def keep_optimizers(em: Emulator, st: Assignment, best):
    """Drop each stage's optimizer swap where the emulation is no slower without it."""
    for s in sorted(st.opt_swap):
        if not em.left:
            break
        saved = st.snapshot()
        st.opt_swap.discard(s)
        t = em.run(st.plan_now())
        best_t = best.result.iteration_time_s
        if no_worse(t, best_t):  # as fast and less PCIe traffic: keep it resident
            em.log.append(f"emulator {em.sims}: stage {s} keeps its optimizer state: {best_t:.3f} -> "
                          f"{t.result.iteration_time_s:.3f} s")
            st.opt_why.pop(s, None)
            best = t
        else:
            st.restore(saved)
    return best


def other_techniques(em: Emulator, st: Assignment, allowed: list, best):
    """The compacted layers, costliest estimate first, each tried with the other techniques."""
    order = sorted(st.actions, key=lambda k: (-st.facts[k].cost_s(st.actions[k]), k))
    for key in order:
        if not em.left:
            break
        current = st.actions.get(key)
        if current is None:
            continue
        best = try_layer(em, st, key, current, allowed, best)
    return best


def try_layer(em: Emulator, st: Assignment, key: tuple[int, int], current, allowed: list, best):
    """Every other technique for ``key``, cheapest estimate first, then keep: the estimate misses
    link contention (a D2D stripe delays a pipeline send on the same NVLink), the emulator not.
    The first that is faster (keep: no slower) stays."""
    tries = [a for _, a in options(st, key, allowed) if a is not current]
    tries.append(KEEP)
    for a in tries:
        if not em.left:
            break
        saved = st.snapshot()
        cost = marginal_cost_s(st, key, a) if a is not KEEP else 0.0
        st.set(key, a, "")
        if a is KEEP and st.over()[key[0]]:
            st.restore(saved)  # the closed form already says it would not fit
            continue
        t = em.run(st.plan_now())
        best_t = best.result.iteration_time_s
        # faster; or, for keep, no slower (nothing to move is better than a hidden move)
        if no_worse(t, best_t) if a is KEEP else better(t, best_t):
            em.log.append(f"emulator {em.sims}: stage {key[0]} layer {key[1]} {current.value} -> {a.value}: "
                          f"{best_t:.3f} -> {t.result.iteration_time_s:.3f} s")
            st.why[key] = ((reason(st, key, a, cost) if a is not KEEP else "keep: fits without compaction")
                           + f" (emulator: {best_t:.3f} -> {t.result.iteration_time_s:.3f} s per iteration)")
            return t
        st.restore(saved)
    return best


def cpu_swaps_to_peers(em: Emulator, st: Assignment, best):
    """Spare peer memory left over: a CPU swap that hides is moved to it if that is no slower.
    A departure from §III-D, which keeps D2D for the tensors that need it: by now every tensor
    has had its chance, and a D2D stripe leaves the host link (shared by the GPUs of a PCIe
    switch, and by optimizer swaps) and host memory alone."""
    for key in sorted((k for k, a in st.actions.items() if a is CPU), key=lambda k: (-st.held_bytes(k), k)):
        if not em.left or st.stripes_for(key) is None:
            continue
        saved = st.snapshot()
        st.set(key, D2D, "")
        t = em.run(st.plan_now())
        best_t = best.result.iteration_time_s
        if no_worse(t, best_t):
            em.log.append(f"emulator {em.sims}: stage {key[0]} layer {key[1]} cpu_swap -> d2d_swap (spare peer memory "
                          f"left): {best_t:.3f} -> {t.result.iteration_time_s:.3f} s")
            st.why[key] = reason(st, key, D2D, st.facts[key].cost_s(D2D)) + " (spare peer memory left over)"
            best = t
        else:
            st.restore(saved)
    return best
