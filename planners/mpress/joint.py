"""Joint compaction across stages (MPress §III-D, Table IV): a stage where only D2D swap hides a
tensor gets room on a peer that compacts more, cheaply, to host it.

The per-stage greedy (choice.py ``fill``) compacts every over-full stage to just under its
capacity, so when every stage overflows the base pipeline no peer has spare memory and D2D never
engages. MPress's Table IV shows the other shape: later stages compacted *more* (recompute and
CPU swap are cheap there, §III-D: "prioritize Recomputation to alleviate the memory limitations
of the latter layers") serve as D2D targets for the early, heavy stages whose short-lived tensors
only D2D can hide. :func:`room_for_d2d` is that improvement move: for a source layer whose
compaction costs (recompute, or a CPU swap that does not hide) and whose D2D swap would hide, each
of its stage's mapped targets short of room compacts its own kept layers, cheapest per saved byte
first with the tie rules of choice.py (hidden CPU swaps, then recompute of late, consecutive
layers), until the stripes fit; then the source layer moves to D2D. The candidate is kept when the
emulated iteration is faster and fits (the improve step's acceptance rule) and only tried when the
targets' added estimate is below the source's (so the emulator is not asked about hopeless moves).

Pure: no I/O, no clocks; the order of candidates is a total order on (cost, stage, layer).
"""
from __future__ import annotations

from planners.mpress.assign import Assignment, size_text
from planners.mpress.choice import TIE_ORDER, cheapest_layer, marginal_cost_s, reason
from planners.mpress.emulate import Emulator, better
from planners.mpress.facts import CPU, D2D, RC


def d2d_hides(st: Assignment, key: tuple[int, int]) -> bool:
    """Whether ``key``'s D2D round trip over its stage's stripes hides in its live interval (a
    per-tensor swap: each of its tensors' in its own)."""
    f = st.facts[key]
    sub = st.tensors.get(key)
    if sub is not None:
        return all(t.d2d_s != float("inf") and t.hides(D2D) for t in f.subset(sub))
    return f.d2d_s != float("inf") and 2 * f.d2d_s <= f.live_s


def full_room(st: Assignment, key: tuple[int, int]) -> bool:
    """Whether the spare peer memory left holds ``key``'s D2D swap of what it moves now (every
    microbatch, every tensor it swaps)."""
    sub = st.tensors.get(key)
    fit = st.d2d_fit(key, sub)
    return fit is not None and fit[1] == 1 and fit[2] == sub


def sources(st: Assignment) -> list[tuple[int, int]]:
    """Layers whose compaction costs time (recompute, or a CPU swap that does not hide) and whose
    D2D swap would hide, costliest estimate first (then stage, layer)."""
    keys = [k for k, a in st.actions.items()
            if a in (RC, CPU) and st.cost_s(k, a) > 0 and k not in st.no_d2d and d2d_hides(st, k)]
    return sorted(keys, key=lambda k: (-st.cost_s(k, st.actions[k]), k))


def shortfall(st: Assignment, key: tuple[int, int], targets=None) -> dict[int, int]:
    """Target stage -> bytes it lacks to hold its stripe of ``key``'s every in-flight microbatch,
    striped over ``targets`` ((stage, weight), ...; default: the mapping's for its stage)."""
    targets = st.mapping.targets[key[0]] if targets is None else targets
    total = sum(w for _, w in targets)
    held = st.held_bytes(key, 1)
    return {t: round(held * w / total) - st.spare_left[t] for t, w in targets
            if round(held * w / total) > st.spare_left[t]}


def load_s(st: Assignment, s: int) -> float:
    """Stage ``s``'s compaction estimate per microbatch: the sum of its layers' Table III costs."""
    return sum(st.cost_s(k, a) for k, a in sorted(st.actions.items(), key=lambda x: x[0]) if k[0] == s)


def make_room(st: Assignment, key: tuple[int, int], allowed: list, budget_s: float) -> list | None:
    """Compact kept layers of ``key``'s targets, cheapest first (choice.cheapest_layer, without
    D2D: a target's own tensors go to the host or are recomputed), until every stripe of ``key``
    fits with every microbatch; their spare grows by what each frees at the target's peak. Returns
    the (layer key, technique, estimate) list, or None when the room cannot be made or a target's
    compaction estimate would reach ``budget_s`` (the source stage's now): every stage runs every
    microbatch, so moving time from the source to a stage that ends up as loaded cannot shorten the
    pipeline's slowest stage (the caller restores)."""
    cheap = [a for a in TIE_ORDER if a in allowed and a is not D2D]
    # stripes go to the targets less loaded than the source (Assignment.stripes_for drops the
    # others: they are left short of room)
    light = [(t, w) for t, w in st.mapping.targets[key[0]] if load_s(st, t) < budget_s]
    if not light:
        return None
    made = []
    for t, lack in sorted(shortfall(st, key, light).items()):
        spent = load_s(st, t)
        while lack > 0:
            best = cheapest_layer(st, t, cheap)
            if best is None:
                return None
            _, layer, a, cost, sub = best
            spent += cost
            if spent >= budget_s:
                return None
            st.set(layer, a, "", sub)
            st.why[layer] = reason(st, layer, a, cost) + f" (room for stage {key[0]} layer {key[1]}'s D2D stripes)"
            freed = st.held_bytes(layer)
            st.spare_left[t] += freed
            lack -= freed
            made.append((layer, a, cost))
    return made


def room_for_d2d(em: Emulator, st: Assignment, allowed: list, best):
    """The joint move over every source layer (:func:`sources`), each kept if the emulated
    iteration is faster and fits; returns the best simulation. Logs each kept move and a summary
    of what it tried."""
    if D2D not in allowed or not any(st.mapping.targets):
        return best
    tried = kept = no_room = 0
    # (source stage, room made) -> (estimated saving, bytes moved) of a move that fit but was not
    # faster: a later source (costliest first) of that stage needing the same room, saving no more
    # and moving no fewer bytes over the same links, is not emulated
    slower: dict[tuple, tuple[float, int]] = {}
    for key in sources(st):
        if not em.left:
            break
        current = st.actions.get(key)
        if current not in (RC, CPU) or key in st.no_d2d:
            continue  # an earlier move of this pass changed it
        if full_room(st, key):
            continue  # room already: the other moves try D2D for it
        saved = st.snapshot()
        budget_s = load_s(st, key[0])
        made = make_room(st, key, allowed, budget_s)
        if made is None or not full_room(st, key):
            st.restore(saved)
            no_room += 1
            continue
        sub = st.tensors.get(key)
        cost = marginal_cost_s(st, key, D2D, sub)
        room = (key[0], tuple(sorted((l, a.value, s_) for l, a, s_ in made)))
        saving, moved = st.cost_s(key, current) - cost, st.held_bytes(key)
        if room in slower and saving <= slower[room][0] and moved >= slower[room][1]:
            st.restore(saved)
            continue
        st.set(key, D2D, "", sub)
        plan = st.plan_now()
        own = st.own(plan)
        targets = st.targets_of(key)
        over_now = st.over(plan, own, targets)
        if any(over_now.get(s_, 0) for s_ in {key[0]} | {l[0] for l, _, _ in made} | set(targets)):
            st.restore(saved)
            no_room += 1
            continue
        tried += 1
        t = em.run(plan)
        best_t, new_t = best.result.iteration_time_s, t.result.iteration_time_s
        if better(t, best_t):
            kept += 1
            room = ", ".join(f"s{l[0]} layer {l[1]} {a.value}" for l, a, _ in made) or "spare already there"
            em.log.append(f"emulator {em.sims}: stage {key[0]} layer {key[1]} {current.value} -> d2d_swap, room made "
                          f"on its targets ({room}; {size_text(st.held_bytes(key))}): {best_t:.3f} -> {new_t:.3f} s")
            st.why[key] = (reason(st, key, D2D, cost) + " (peers compacted more to host it)"
                           + f" (emulator: {best_t:.3f} -> {new_t:.3f} s per iteration)")
            best = t
        else:
            st.restore(saved)
            for s_ in sorted({key[0]} | {l[0] for l, _, _ in made}):
                st.learn_from(plan, t, s_, own)
            if not any(d.oom for d in t.result.devices):
                slower[room] = (saving, moved)
    if tried or no_room:
        em.log.append(f"joint compaction: {tried} D2D move{'s' if tried != 1 else ''} with room made on peers "
                      f"emulated, {kept} kept; {no_room} source layer{'s' if no_room != 1 else ''} without a "
                      f"peer less loaded that could make the room")
    return best
