"""MPress's emulator feedback, repair (§III-B step 5, §III-D): while the emulated candidate does
not fit, a stage over capacity on its own gets more layers compacted, and a D2D target over
capacity at some moment of its timeline (its own memory plus what peers park there) gives back
its largest stripes.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from simulator.analytic import d2d_held_by_device
from planners.mpress.assign import Assignment, size_text
from planners.mpress.choice import fill, options, reason
from planners.mpress.emulate import Emulator, ooms, peak_of
from planners.mpress.facts import CPU, D2D, KEEP, RC


def repair(em: Emulator, st: Assignment, allowed: list):
    """Emulate ``st``'s plan and repair it until it fits, nothing is left to compact or the
    budget is spent; returns the last simulation."""
    sim = em.run(st.plan_now())
    while em.left:
        over = ooms(sim)
        if not over:
            break
        if not repair_round(em, st, sim, over, allowed):
            em.log.append(f"emulator {em.sims}: nothing left to compact: the closest plan does not fit")
            break
        sim = em.run(st.plan_now())
    return sim


def repair_round(em: Emulator, st: Assignment, sim, over: dict, allowed: list) -> bool:
    """One repair of every device over capacity in ``sim``, lowest device first; whether
    anything changed. A stage of several devices (dp x tp, planners/mpress/compact.py) is
    compacted once, for its lowest device over capacity: its replicas and TP ranks hold alike."""
    changed = False
    plan_now = st.plan_now()
    stage_of = {d: s for s, stage in enumerate(plan_now.stages) for d in stage.devices}
    done: set[int] = set()
    for device, over_b in sorted(over.items()):
        held = d2d_held_by_device(plan_now, st.model).get(device, 0)
        if held:  # a target over capacity at some moment: take back its largest stripes
            changed |= take_back_stripes(em, st, device, over_b, allowed)
        if device in stage_of and stage_of[device] not in done:  # a stage over on its own: learn the gap, assign more
            done.add(stage_of[device])
            changed |= compact_more(em, st, sim, stage_of[device], device, over_b, allowed)
    return changed


def take_back_stripes(em: Emulator, st: Assignment, device: int, over_b: int, allowed: list) -> bool:
    """Move the largest D2D layers striped onto ``device`` to another technique (or keep) until
    ``over_b`` bytes are freed; they may not use D2D again. Whether any moved."""
    mapping = st.mapping
    mine = sorted(((st.held_bytes(k), k) for k, a in st.actions.items()
                   if a is D2D and device in [mapping.device_of_stage[t] for t, _ in st.stripes[k]]),
                  reverse=True)
    freed = 0
    changed = False
    for nbytes, key in mine:
        if freed >= over_b:
            break
        st.no_d2d.add(key)
        fallback = options(st, key, [a for a in allowed if a is not D2D])
        if fallback:
            cost, action = fallback[0]
            st.set(key, action, "")  # first the action: reason() reads its microbatch period
            st.why[key] = reason(st, key, action, cost) + f" (D2D stripes overfilled device {device})"
        else:
            st.set(key, KEEP, f"keep: D2D stripes overfilled device {device}, no other technique allowed")
        freed += nbytes
        changed = True
    em.log.append(f"emulator {em.sims}: target device {device} over by {size_text(over_b)} at its peak; "
                  f"took back {size_text(freed)} of stripes")
    return changed


def compact_more(em: Emulator, st: Assignment, sim, s: int, device: int, over_b: int, allowed: list) -> bool:
    """Stage ``s`` (on ``device``) is over in ``sim``: learn what the simulated timeline holds beyond the closed
    form (e.g. an output still in flight), so the closed form steers the next assignment, and
    compact more of its layers. Whether anything changed."""
    simulated = peak_of(sim, device)
    st.margin[s] = max(st.margin[s] + 1, simulated - st.own_peak(s))
    before = _stage_state(st, s)
    grew = fill(st, st.over(), [a for a in allowed])
    if not grew and RC in allowed:
        grew = recompute_busiest_swap(st, s)
    mine = _stage_state(st, s) != before  # fill may have grown other stages only
    em.log.append(f"emulator {em.sims}: stage {s} over by {size_text(over_b)}; "
                  + ("more layers compacted" if mine else "nothing more to compact on it"))
    return grew


def _stage_state(st: Assignment, s: int) -> tuple:
    """Stage ``s``'s actions and optimizer swap, to tell whether a repair changed them."""
    return (tuple(sorted((k, a.value) for k, a in st.actions.items() if k[0] == s)), s in st.opt_swap)


def recompute_busiest_swap(st: Assignment, s: int) -> bool:
    """Every layer of stage ``s`` has an action: recompute, which frees deterministically,
    replaces the swap with the busiest channel. Whether there was one."""
    swaps = sorted((st.one_way_s(k, a), k)
                   for k, a in st.actions.items() if k[0] == s and a in (CPU, D2D))
    if not swaps:
        return False
    key = swaps[-1][1]
    st.set(key, RC, reason(st, key, RC, st.facts[key].fwd_s) + " (its swap left bytes on the device)")
    return True
