"""MPress's emulator feedback, improve (§III-B step 5, §III-D last paragraph): once the candidate
fits, try the costliest compactions with other techniques and accept a change only if the emulated
iteration is faster (or, for less data moved, no slower) and still fits.

First, once: map again for the room compaction made (Fig. 6) when no layer is D2D-swapped after
the repair, typically because no stage had spare memory at first (:func:`remap`). Then rounds
(:func:`improve`). A *round* (:class:`Round`,
:func:`improve_round`) is one pass over every candidate move of the assignment it starts from, in
order: keep optimizer state resident where it fits; the compacted layers, costliest estimate
first, with the other techniques, then as keep; hidden CPU swaps to spare peer memory; the
recomputed layers once more with D2D swap to the spare peer memory the round's moves freed; the
costly compactions whose D2D swap would hide, with room made for them on less loaded peers that
compact more (planners/mpress/joint.py, MPress Table IV); optimizer state once more. Rounds
repeat, each from what the last one kept, until a round makes the iteration less than
``policy.min_round_gain`` (0.5 %) faster, a round has no move to try, or the safety cap
``policy.max_simulations`` is spent; the outcome says which.

A round's small gain need not mean the next round has nothing to find: a move late in a round
(a D2D-swapped layer moved to CPU swap) can free the peer memory a recomputed layer tried earlier
in it needed for D2D. The round's last layer pass (:func:`recomputes_to_peers`) retries those
layers for that reason; other orders of moves can still hide a gain from a round that stops the
search (docs/mpress.md, "Where we differ" 5 and 9). An optimizer swap is only ever dropped here,
never added in exchange for fewer compacted layers.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.mpress.assign import Assignment, analytic_over
from planners.mpress.base import mapping_text
from planners.mpress.choice import choices, marginal_cost_s, reason
from planners.mpress.emulate import TIE, Emulator, better, fits, no_worse
from planners.mpress.facts import CPU, D2D, KEEP, RC, layer_facts
from planners.mpress.joint import room_for_d2d
from planners.mpress.mapping import search_mapping
from planners.policy import MPressPolicy
from specs.hardware import HardwareSpec


def remap(em: Emulator, st: Assignment, policy: MPressPolicy, hardware: HardwareSpec, devices: list,
          boundary: list, trace: dict, capacity: int, best, pairs=None):
    """No layer is D2D-swapped after the repair (typically: every stage overflowed the base plan,
    so there was no spare memory to map for); now that recompute, CPU swaps and optimizer swaps
    made room, map again (Fig. 6) for the costly compactions: their bytes are the demand; the
    spare a stage offers is the room left on its device plus what its kept layers would free
    (joint.py makes that room when a peer's D2D swap needs it), and the ledger of spare memory
    starts from the room there is. The host uplinks count too (:func:`host_bytes`, mapping.py:
    what a stage does not place on a peer leaves over the PCIe uplink its switch shares, so the
    search keeps heavy stages from sharing one). ``pairs``: the
    source->target stage rule of a fixed layout (search_mapping; identity mapping only), a stage
    with no allowed target demands nothing. Returns the best simulation (the remapped one if it
    is no slower)."""
    p = len(devices)
    peak_now = {d.device: d.peak_bytes for d in best.result.devices}
    dev_now = st.mapping.device_of_stage
    demand2 = [sum(st.held_bytes(k) for k, a in st.actions.items() if k[0] == s and st.cost_s(k, a) > 0)
               if pairs is None or any(pairs[s]) else 0 for s in range(p)]
    room = [max(0, capacity - peak_now[dev_now[s]]) for s in range(p)]
    # the spare a stage could offer: its room now plus what its kept layers would free if it
    # compacted more (planners/mpress/joint.py makes that room when a peer's D2D swap needs it;
    # MPress Table IV: later stages compacted more host the early stages' D2D swaps)
    spare2 = [room[s] + sum(st.held_bytes((s, l)) for l in st.plan.stages[s].layers if (s, l) not in st.actions)
              for s in range(p)]
    host2 = host_bytes(st, demand2)
    if not (any(demand2) and any(spare2)):
        return best
    new = search_mapping(hardware, devices, demand2, spare2, boundary, striping=policy.striping, mode=policy.mapping,
                         pairs=pairs, host_bytes=host2)
    saved, old_map, old_facts = st.snapshot(), st.mapping, st.facts
    st.mapping, st.spare_left = new, dict(enumerate(room))  # the room there is; joint.py makes more
    st.facts = layer_facts(st.plan, st.model, hardware, trace, new)
    t = em.run(st.plan_now())
    if no_worse(t, best.result.iteration_time_s):
        em.log.append(f"emulator {em.sims}: mapped again for the room compaction made " + mapping_text(new))
        return t
    st.restore(saved)
    st.mapping, st.facts = old_map, old_facts
    return best


def host_bytes(st: Assignment, demand: list) -> list[int]:
    """Per stage, what it sheds besides ``demand`` (mapping.py's host uplink term): the base
    pipeline's closed-form overflow of its own memory (MPress Fig. 6's "overflowed gpus": what the
    stage must move off its device whatever the mapping; analytic_over, without any action) less
    the ``demand`` the mapping may place in peer memory; the mapping adds the unplaced part of
    ``demand``. What is not placed on a peer leaves over the PCIe uplink or is recomputed."""
    over = analytic_over(st.plan, st.model, st.capacity)
    return [max(0, over[s] - int(demand[s])) for s in range(len(st.plan.stages))]


#: the default of ``policy.min_round_gain``: a round that makes the iteration less than 0.5 %
#: faster ends the search (MPress §III-D: "terminates if the subsequent assignment brings
#: nonvisible performance gains over the previous one")
MIN_ROUND_GAIN = 0.005


@dataclass(frozen=True)
class Round:
    """One round of the search: one pass of the improve step over every candidate move of the
    assignment it starts from (:func:`improve_round`), its best iteration before and after."""

    number: int
    start_s: float
    end_s: float
    candidates: int     # candidate plans emulated (simulated, or read back when seen before)
    simulations: int    # the search's simulations so far, at the end of the round

    @property
    def gain(self) -> float:
        """How much faster the round made the iteration, as a fraction of where it started."""
        return (self.start_s - self.end_s) / self.start_s if self.start_s > 0 else 0.0


def cap_text(em: Emulator) -> str:
    return f"safety cap of {em.budget} simulations reached (policy.max_simulations)"


def improve(em: Emulator, st: Assignment, allowed: list, best, min_gain: float = MIN_ROUND_GAIN):
    """Rounds of :func:`improve_round` on a fitting candidate (``best``, its simulation) until
    one makes the iteration less than ``min_gain`` faster (converged), one has no move to try,
    or the safety cap of simulations is spent. Returns (best simulation, rounds, why it stopped)."""
    rounds: list[Round] = []
    while True:
        if em.capped:
            return best, tuple(rounds), cap_text(em)
        start, before = best.result.iteration_time_s, em.sims + em.hits
        best = improve_round(em, st, allowed, best)
        r = Round(len(rounds) + 1, start, best.result.iteration_time_s, em.sims + em.hits - before, em.sims)
        rounds.append(r)
        em.log.append(f"round {r.number}: {r.start_s:.3f} -> {r.end_s:.3f} s ({100 * max(r.gain, 0.0):.2f} % faster), "
                      f"{r.candidates} candidates, {em.sims} simulations so far")
        if em.capped:
            return best, tuple(rounds), cap_text(em) + f" in round {r.number}"
        if not r.candidates:
            return best, tuple(rounds), f"no move left (round {r.number} had no candidate)"
        if r.gain < min_gain:
            return best, tuple(rounds), (f"converged: round {r.number} improved {100 * max(r.gain, 0.0):.2f} % "
                                         f"< {100 * min_gain:g} %")
        if r.gain <= 0:  # min_gain 0: until a round gains nothing
            return best, tuple(rounds), f"converged: round {r.number} improved nothing"


def improve_round(em: Emulator, st: Assignment, allowed: list, best):
    """One round: every candidate move of the assignment, each kept if the emulation says so;
    returns the best simulation. The optimizer swap is the costliest (its whole state crosses
    PCIe twice an iteration): first see which stages fit without it now that their activations
    are compacted, then the compacted layers with the other techniques and as keep, the hidden
    CPU swaps to spare peer memory, the recomputed layers once more in spare peer memory (the
    moves before may have freed some: :func:`recomputes_to_peers`), the costly compactions with
    room made on their peers (joint.py :func:`room_for_d2d`), and the optimizer swaps again, after
    the layers' actions changed."""
    best = keep_optimizers(em, st, best)
    best = other_techniques(em, st, allowed, best)
    best = cpu_swaps_to_peers(em, st, best)
    best = recomputes_to_peers(em, st, best)
    best = room_for_d2d(em, st, allowed, best)
    return keep_optimizers(em, st, best)


def keep_optimizers(em: Emulator, st: Assignment, best):
    """Drop each stage's optimizer swap where the emulation is no slower without it."""
    for s in sorted(st.opt_swap):
        if not em.left:
            break
        saved = st.snapshot()
        st.opt_swap.discard(s)
        plan = st.plan_now()
        if st.over(plan)[s]:
            st.restore(saved)  # the closed form already says the state does not fit back
            continue
        t = em.run(plan)
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
    order = sorted(st.actions, key=lambda k: (-st.cost_s(k, st.actions[k]), k))
    slower: dict[tuple, float] = {}  # see try_layer
    for key in order:
        if not em.left:
            break
        current = st.actions.get(key)
        if current is None:
            continue
        t = try_layer(em, st, key, current, allowed, best, slower)
        if t is not best:
            slower.clear()  # a move was kept: what the others were compared with changed
        best = t
    return best


def try_layer(em: Emulator, st: Assignment, key: tuple[int, int], current, allowed: list, best,
              slower: dict | None = None):
    """Every other technique for ``key``, cheapest estimate first, then keep: the estimate misses
    link contention (a D2D stripe delays a pipeline send on the same NVLink), the emulator not.
    The first that is faster (keep: no slower) stays. A layer with saved tensors also tries the
    swap of those whose own round trip hides (choice.choices, MPress §III-D).

    Not emulated (the emulator's feedback, §III-B step 5, steering what is tried): a try the
    closed form with the learnt margins says overfills its stage or its D2D targets
    (Assignment.over, learn_from); keep once a try that freed some of the layer overfilled; and,
    with ``slower`` (other_techniques' record of this pass, cleared when a move is kept), a try
    of a like layer (same stage, current action, technique and bytes moved) estimated to save no
    more than one that fit and left the iteration where it was (GPT-25.5B on DGX-1: the like
    layers of a stage off the critical path)."""
    now = st.tensors.get(key)
    tries = [(a, sub) for _, a, sub in choices(st, key, allowed) if (a, sub) != (current, now)]
    tries.append((KEEP, None))
    own_oom = False
    for a, sub in tries:
        if not em.left:
            break
        if a is KEEP and own_oom:
            break  # a try that freed some of the layer already overfilled its device
        saved = st.snapshot()
        cost = marginal_cost_s(st, key, a, sub) if a is not KEEP else 0.0
        like = (key[0], current, st.tensors.get(key), a, st.moved_bytes(key, sub))
        saving = st.cost_s(key, current) - cost
        if slower is not None and saving <= slower.get(like, float("-inf")):
            continue  # a like layer's same move, estimated to save as much, fit and was not faster
        st.set(key, a, "", sub)
        plan = st.plan_now()
        own = st.own(plan)
        targets = st.targets_of(key)
        over = st.over(plan, own, targets)
        if over[key[0]] or any(over[t] for t in targets):
            st.restore(saved)  # the closed form already says it would not fit
            continue
        t = em.run(plan)
        best_t = best.result.iteration_time_s
        # faster; or, for keep, no slower (nothing to move is better than a hidden move)
        if no_worse(t, best_t) if a is KEEP else better(t, best_t):
            em.log.append(f"emulator {em.sims}: stage {key[0]} layer {key[1]} {current.value} -> {a.value}: "
                          f"{best_t:.3f} -> {t.result.iteration_time_s:.3f} s")
            st.why[key] = ((reason(st, key, a, cost) if a is not KEEP else "keep: fits without compaction")
                           + f" (emulator: {best_t:.3f} -> {t.result.iteration_time_s:.3f} s per iteration)")
            if a is KEEP and key[0] in st.opt_swap:  # its reason said every layer was compacted
                st.opt_why[key[0]] = (f"{st.opt_why[key[0]].split('; ')[0]}; still swapped after layer {key[1]} "
                                      f"went back to keep (the emulator kept both)")
            return t
        st.restore(saved)
        own_oom |= st.learn_from(plan, t, key[0], own)
        if slower is not None and fits(t) and abs(t.result.iteration_time_s - best_t) <= TIE * best_t:
            slower[like] = max(saving, slower.get(like, saving))  # it fit and the iteration did not move
    return best


def cpu_swaps_to_peers(em: Emulator, st: Assignment, best):
    """Spare peer memory left over: a CPU swap is moved to it only if the emulated iteration is
    faster. A CPU swap that hides is not moved when D2D is merely no slower: MPress Table III t1
    keeps such a tensor on the host ("D2D swap can be saved for other tasks with more stringent
    demands", §IV-D), so the peers' memory stays free for a later move (planners/mpress/joint.py,
    recomputes_to_peers). A CPU swap that the host link's contention (the GPUs of a PCIe switch,
    optimizer swaps) leaves unhidden does gain from the move, and the emulator sees it."""
    keys = sorted((k for k, a in st.actions.items() if a is CPU), key=lambda k: (-st.held_bytes(k), k))
    return _to_peers(em, st, best, keys, "cpu_swap", "spare peer memory left over", better,
                     lambda key: st.cost_s(key, D2D), timed=True)


def recomputes_to_peers(em: Emulator, st: Assignment, best):
    """The recomputed layers, costliest estimate first, once more with D2D swap to the spare peer
    memory left, each kept only if faster (as :func:`try_layer` keeps a D2D move). MPress §III-D
    replaces recomputation and GPU-CPU swap with D2D swap "whenever possible, e.g., when there is
    spare GPU memory". Move order: within a round the recomputed layers are tried (in
    :func:`other_techniques`) before the moves that free peer memory (a D2D-swapped layer that
    the same pass turns into a CPU swap or keep), so without this last pass the round could end
    with room a recomputed layer needed, and a round that gains little stops the search before
    the next round tries again (DGX-2 gpt_15b4 under the swap model before issue 23: stage 0
    layer 5, 2.5 % faster; since then no preset needs the move, docs/mpress.md)."""
    keys = sorted((k for k, a in st.actions.items() if a is RC), key=lambda k: (-st.cost_s(k, RC), k))
    return _to_peers(em, st, best, keys, "recompute", "spare peer memory freed this round", better,
                     lambda key: marginal_cost_s(st, key, D2D), timed=True)


def _to_peers(em: Emulator, st: Assignment, best, keys, source: str, note: str, accept, cost_of, timed: bool):
    """Each of ``keys`` (layers now under ``source``) moved to D2D swap where peers have the room,
    kept when ``accept(simulation, best seconds)``; ``cost_of(key)``, taken before the move, is the
    estimate its reason quotes, and ``note`` says why the move is tried now. A per-tensor CPU swap
    moves the same tensors to the peers."""
    for key in keys:
        if not em.left:
            break
        sub = st.tensors.get(key)
        if st.d2d_fit(key, sub) is None:
            continue
        saved = st.snapshot()
        cost = cost_of(key)
        st.set(key, D2D, "", sub)
        plan = st.plan_now()
        own = st.own(plan)
        targets = st.targets_of(key)
        over = st.over(plan, own, targets)
        if over[key[0]] or any(over[t] for t in targets):
            st.restore(saved)
            continue
        t = em.run(plan)
        best_t, new_t = best.result.iteration_time_s, t.result.iteration_time_s
        if accept(t, best_t):
            em.log.append(f"emulator {em.sims}: stage {key[0]} layer {key[1]} {source} -> d2d_swap ({note}): "
                          f"{best_t:.3f} -> {new_t:.3f} s")
            st.why[key] = (reason(st, key, D2D, cost) + f" ({note})"
                           + (f" (emulator: {best_t:.3f} -> {new_t:.3f} s per iteration)" if timed else ""))
            best = t
        else:
            st.restore(saved)
            st.learn_from(plan, t, key[0], own)
    return best
