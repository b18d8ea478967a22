"""One MAP stage solved at one budget (MAP §5.3, planners.map.plan's step 3), the phase clock of
map_search's ``phase`` callback, and the bounds a plan's checkpoint tree must respect.

:func:`solve_stage`: §5.3's ILP budgets each checkpointed by rotor (planners.map.rotor.integrate);
when none fits, the least-memory strategies checkpointed within the budget, or at the smallest
budget that fits (then the answer is "does not fit" with that minimum). Pure: no I/O (the
``phase`` callback and the notes carry everything out).
"""
from __future__ import annotations

import math
import time

from planners.map import linearise
from planners.map.rotor import integrate, min_feasible_budget
from planners.map.rotor import solve as solve_rotor
from specs.plan import CheckpointSegment, LayerSharding, NodeGroup
from specs.units import size_text

GIB = 1 << 30
#: ILP budgets tried below B (planners.map.rotor.integrate's ``below``) when the policy names none
#: (``policy.budgets_below``): B (1+alpha)^(-j/4), j = 1..12, down to B / (1+alpha)^3 (0.51 B at alpha
#: 0.25), stopping at the first infeasible one
BUDGETS_BELOW = 12
#: the deepest checkpoint tree a plan holds: specs.plan serialises one JSON level per nesting level
#: (pydantic refuses past ~255: 254 levels serialise, 256 do not) and the executor nests one
#: torch.utils.checkpoint call per level
MAX_NESTING = 128
#: what rotor's checkpoint spacing cost against its exact table (benchmarks/map_scale.py --spacing)
SPACING_LOSS = "1.1 %"
#: map_search's phases, as ``phase`` names them (tracing the op graphs happens before, in the shell)
PHASES = ("mesh (cluster detection)", "strategy table", "ILP (block DP)", "rotor checkpointing", "simulation")


def shallow(chain, need: int, slots: int):
    """(rotor's solution, the budget it used): at ``need``, or, when that checkpoint tree nests
    deeper than MAX_NESTING, at the first of need (1 + 2^-10), need (1 + 2^-9), ... whose tree does
    not. At its minimum budget a long chain stores only a^0 and recomputes everything before each
    backward, one nesting level per layer (a 262-layer chain: 262 levels and 669 s of recomputation
    per microbatch, more than a plan holds); 0.1-0.4 % more budget already nests a few levels."""
    rot, at = solve_rotor(chain, need, slots, find_min=False), need
    for k in range(21):
        if not rot.feasible or nesting(rot.segments) <= MAX_NESTING:
            break
        at = need + (need >> (10 - k) if k < 10 else need * (k - 9))
        rot = solve_rotor(chain, at, slots, find_min=False)
    return rot, at


def segments(segs, start: int) -> list[CheckpointSegment]:
    return [CheckpointSegment(start=g.start + start, stop=g.stop + start, checkpointed=g.checkpointed,
                              children=segments(g.children, start)) for g in segs]


def solve_stage(sm, budget_bytes: int, policy, choice, progress=None, notes: list[str] | None = None,
                spent: dict | None = None, groups_out: list[NodeGroup] | None = None,
                ) -> tuple[list[LayerSharding], list[CheckpointSegment]]:
    """§5.3 at ``budget_bytes`` for ``sm`` (planners.map.plan's _StageModel), recorded in ``choice``
    (its StageChoice); when nothing fits, the minimum-memory choice and its minimum budget.
    ``notes`` gains what a reader of map.json should know; ``spent`` (PHASES[2], PHASES[3] ->
    seconds) the ILP's and rotor's wall time.

    ``groups_out`` given (and planners.map.linearise.INTRA_BLOCK_CUTS): rotor also checkpoints
    each ILP solution's chain over node groups (§5.2.2-§5.2.4, Algorithm 2) and keeps the faster;
    when that chain wins, ``groups_out`` is filled with its groups (StagePlan.node_groups) and the
    segments index them (from 0). Otherwise ``groups_out`` stays empty and everything is as
    without it (the per-layer chain, segments over layers)."""
    t0 = time.perf_counter()
    spent = {} if spent is None else spent
    choice.min_budget_bytes = 0
    if policy.constrain == "params":  # the baselines' bound: eq. 1 alone, parameter state only, no rotor
        from planners.map.ilp import solve as solve_ilp

        sol = solve_ilp(sm.problem(budget_bytes), time_limit_s=policy.ilp_time_limit_s)
        choice.solve_s += time.perf_counter() - t0
        spent[PHASES[2]] = spent.get(PHASES[2], 0.0) + time.perf_counter() - t0
        if sol.status == "infeasible":
            choice.min_budget_bytes = sol.min_memory_bytes
        choice.ilp_time_s = sol.time_s
        return sm.shardings(sol.choice), []
    sm.quantum_of = budget_bytes
    intra = groups_out is not None and linearise.INTRA_BLOCK_CUTS
    builder = (lambda sol: _both_chains(sm, sol)) if intra else sm.chain
    res = integrate(sm.problem, builder, budget_bytes, alpha=policy.alpha, n=policy.budgets,
                    memory_slots=policy.memory_slots, ilp_time_limit_s=policy.ilp_time_limit_s, progress=progress,
                    below=budgets_below(policy))
    if intra and res.alternative == 1 and nesting(res.rotor.segments) > MAX_NESTING:
        # the node-group tree won but nests deeper than a plan holds (MAX_NESTING; a chain over n
        # groups nests at most n deep, one level per layer near its minimum budget): solve again,
        # each ILP solution's group chain offered only where its tree at B is shallow enough
        dropped: list[int] = []
        res = integrate(sm.problem, lambda sol: _both_chains(sm, sol, (budget_bytes, policy.memory_slots, dropped)),
                        budget_bytes, alpha=policy.alpha, n=policy.budgets, memory_slots=policy.memory_slots,
                        ilp_time_limit_s=policy.ilp_time_limit_s, below=budgets_below(policy))   # progress: reported once
        if notes is not None:
            notes.append(f"stage {choice.stage}: rotor's checkpoints over node groups nest deeper than {MAX_NESTING} "
                         f"levels within {size_text(budget_bytes)} for {len(dropped)} strategy choice(s); those "
                         "are checkpointed per layer")
    grouped = intra and res.alternative == 1
    if res.rotor is not None and not grouped and _too_deep(res.rotor):
        # the per-layer tree nests deeper than a plan holds (a stage of more than MAX_NESTING layers
        # near its minimum budget recomputes layer by layer, one level each): solve again, each ILP
        # solution's per-layer chain offered only where its tree at B is shallow enough; none is:
        # the fallback below (its trees bounded the same way, shallow())
        dropped = []
        screen = (budget_bytes, policy.memory_slots, dropped)
        res = integrate(sm.problem, lambda sol: _shallow_chains(sm, sol, screen, intra), budget_bytes,
                        alpha=policy.alpha, n=policy.budgets, memory_slots=policy.memory_slots,
                        ilp_time_limit_s=policy.ilp_time_limit_s, below=budgets_below(policy))
        # the per-layer chain, when kept, is the first alternative and has one stage per layer
        grouped = intra and res.chain is not None and len(res.chain) > len(sm.layers)
        if notes is not None:
            notes.append(f"stage {choice.stage}: rotor's per-layer checkpoints nest deeper than {MAX_NESTING} "
                         f"levels within {size_text(budget_bytes)} for {len(dropped)} strategy choice(s); those "
                         "are not planned")
    choice.solve_s += time.perf_counter() - t0
    spent[PHASES[2]] = spent.get(PHASES[2], 0.0) + res.ilp_s
    spent[PHASES[3]] = spent.get(PHASES[3], 0.0) + res.rotor_s
    t1 = time.perf_counter()
    choice.tried = [{"k": k, "ilp_budget_bytes": b, "total_s": (t if math.isfinite(t) else None)} for k, b, t in res.tried]
    if res.ilp is not None and res.rotor is not None and math.isfinite(res.total_s):
        choice.ilp_time_s, choice.recompute_s, choice.budget_k = res.ilp.time_s, res.rotor.recompute_s, res.k
        if res.rotor.every > 1 and notes is not None:
            notes.append(f"stage {choice.stage}: its {len(sm.layers)}-layer chain is past rotor's exact table "
                         f"(planners.map.rotor.MAX_EXACT_CELLS): checkpoints only every {res.rotor.every} layers "
                         f"(against the exact table on smaller models, benchmarks/map_scale.py --spacing: at most "
                         f"{SPACING_LOSS} slower)")
        if grouped:    # the chain over node groups won: the plan carries its groups
            shard = sm.shardings(res.ilp.choice)
            return shard, _group_segments(sm, _linear(sm, shard), res.rotor, choice, notes, groups_out)
        return sm.shardings(res.ilp.choice), segments(res.rotor.segments, sm.layers.start)
    # §5.3's budgets all failed (its ILP counts every activation, so near the minimum no inflated
    # budget leaves rotor room): the least-memory strategies, checkpointed by rotor within B if it can
    tiny = sm.problem(1)
    low = tuple(min(range(len(nd.memory_bytes)), key=lambda i: (nd.memory_bytes[i], nd.costs_s[i])) for nd in tiny.nodes)
    shard = sm.shardings(low)
    chain = sm.chain_of_shardings(shard)
    choice.ilp_time_s = sum(chain.t_fwd(l) + chain.t_bwd(l) for l in range(len(chain)))
    rot = solve_rotor(chain, budget_bytes, policy.memory_slots, find_min=False)
    if rot.feasible and not _too_deep(rot):
        choice.recompute_s = rot.recompute_s
        choice.tried.append({"k": None, "ilp_budget_bytes": None, "total_s": choice.ilp_time_s + rot.recompute_s,
                             "note": "least-memory strategies"})
        spent[PHASES[3]] += time.perf_counter() - t1
        return shard, segments(rot.segments, sm.layers.start)
    lin = _linear(sm, shard) if intra else None
    if lin is not None and len(lin.chain) <= len(chain):
        lin = None                      # no layer has an inner cut: the per-layer chain alone
    if lin is not None:                 # the same strategies over node groups, within B and shallow enough
        rot = solve_rotor(lin.chain, budget_bytes, policy.memory_slots, find_min=False)
        if rot.feasible and not _too_deep(rot):
            choice.recompute_s = rot.recompute_s
            choice.tried.append({"k": None, "ilp_budget_bytes": None, "total_s": choice.ilp_time_s + rot.recompute_s,
                                 "note": "least-memory strategies over node groups"})
            spent[PHASES[3]] += time.perf_counter() - t1
            return shard, _group_segments(sm, lin, rot, choice, notes, groups_out)
    need = min_feasible_budget(chain, policy.memory_slots, lower_bytes=budget_bytes)
    rot, at = shallow(chain, need, policy.memory_slots)
    # need == B: it fits B only with a tree too deep to hold; the holdable one needs ``at``
    choice.min_budget_bytes = need if need > budget_bytes else at
    if lin is not None:                 # MAX_NESTING over the group chain the same way (shallow); lower wins
        need_g = min_feasible_budget(lin.chain, policy.memory_slots, lower_bytes=budget_bytes)
        rot_g, at_g = shallow(lin.chain, need_g, policy.memory_slots)
        if rot_g.feasible and at_g < at and not _too_deep(rot_g):
            # need_g == B: the groups fit B only with a tree too deep to hold; the holdable one needs at_g
            choice.min_budget_bytes = need_g if need_g > budget_bytes else at_g
            if at_g != need_g and notes is not None:
                notes.append(f"stage {choice.stage}: the minimum-memory checkpointing over node groups nests deeper "
                             f"than {MAX_NESTING} levels; the plan checkpoints within {size_text(at_g)} instead of "
                             f"{size_text(need_g)}")
            choice.recompute_s = rot_g.recompute_s
            spent[PHASES[3]] += time.perf_counter() - t1
            return shard, _group_segments(sm, lin, rot_g, choice, notes, groups_out)
    if at != need and notes is not None:
        notes.append(f"stage {choice.stage}: the minimum-memory checkpointing nests deeper than {MAX_NESTING} "
                     f"levels; the plan checkpoints within {size_text(at)} instead of {size_text(need)}")
    choice.recompute_s = rot.recompute_s if rot.feasible else 0.0
    spent[PHASES[3]] += time.perf_counter() - t1
    return shard, segments(rot.segments, sm.layers.start) if rot.feasible else []


def _group_segments(sm, lin, rot, choice, notes, groups_out) -> list[CheckpointSegment]:
    """Rotor's tree over node groups as the plan holds it: ``groups_out`` filled with the groups
    (StagePlan.node_groups), the segments indexing them from 0."""
    groups_out[:] = lin.node_groups(sm.model)
    if notes is not None:
        inside = sum(1 for g in range(1, len(lin.groups)) if lin.groups[g][0] == lin.groups[g - 1][0])
        notes.append(f"stage {choice.stage}: rotor's checkpoints over node groups (MAP Algorithm 2: "
                     f"{len(lin.groups)} groups, {inside} cuts inside layers) beat the per-layer chain; "
                     "the plan's checkpoint segments index its node_groups")
    return segments(rot.segments, 0)


def _linear(sm, shardings: list[LayerSharding]):
    return linearise.linear_chain(sm.model, sm.hardware, sm.training, sm.layers, sm.mesh, {sh.layer: sh for sh in shardings})


def _both_chains(sm, sol, screen: tuple[int, int, list[int]] | None = None):
    """integrate's chain_builder with Algorithm 2: (the per-layer chain, the chain over node groups)
    of one ILP solution; the per-layer chain alone when no layer has an inner cut. ``screen``
    (budget bytes, memory slots, dropped): also alone when rotor's tree over the groups at that
    budget (the solve integrate repeats) nests deeper than MAX_NESTING; ``dropped`` gains its length."""
    shard = sm.shardings(sol.choice)
    per_layer = sm.chain_of_shardings(shard)
    lin = _linear(sm, shard).chain
    if len(lin) <= len(per_layer):
        return per_layer
    if screen is not None and len(lin) > MAX_NESTING:   # n stages nest at most n deep: only long chains are checked
        budget_bytes, slots, dropped = screen
        if _too_deep(solve_rotor(lin, budget_bytes, slots, find_min=False)):
            dropped.append(len(lin))
            return per_layer
    return per_layer, lin


def _shallow_chains(sm, sol, screen: tuple[int, int, list[int]], intra: bool) -> tuple:
    """integrate's chain_builder bounded by MAX_NESTING: the per-layer chain of ``sol`` (and, with
    ``intra``, its chain over node groups, screened by :func:`_both_chains`), less the per-layer
    chain where rotor's tree at the budget nests deeper than MAX_NESTING (``dropped`` gains its
    length); nothing left: the solution is not planned."""
    built = _both_chains(sm, sol, screen) if intra else sm.chain(sol)
    chains = built if isinstance(built, tuple) else (built,)
    budget_bytes, slots, dropped = screen
    per_layer = chains[0]
    if len(per_layer) > MAX_NESTING and _too_deep(solve_rotor(per_layer, budget_bytes, slots, find_min=False)):
        dropped.append(len(per_layer))
        return chains[1:]
    return chains


def _too_deep(rot) -> bool:
    return rot.feasible and nesting(rot.segments) > MAX_NESTING


def budgets_below(policy) -> int:
    """How many ILP budgets under B §5.3's grid tries (``policy.budgets_below`` where the policy has it)."""
    got = getattr(policy, "budgets_below", None)
    return BUDGETS_BELOW if got is None else int(got)


class Clock:
    """Wall time per phase for the ``phase`` callback (the planner prints nothing itself)."""

    def __init__(self, phase) -> None:
        self.phase, self.t, self.spent = phase, time.perf_counter(), {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        if self.phase is not None:
            self.phase(name, now - self.t)
        self.t = now

    def split(self, *names: str) -> None:
        """The solve phases measured inside (``spent``); the rest of the lap goes to the last."""
        now = time.perf_counter()
        inside = [self.spent.pop(n, 0.0) for n in names]
        inside[-1] += max(now - self.t - sum(inside), 0.0)
        if self.phase is not None:
            for n, sec in zip(names, inside):
                self.phase(n, sec)
        self.t = now


def nesting(segs) -> int:
    """Levels of nested checkpoints in a rotor segment tree (0: none)."""
    return max((1 + nesting(g.children) if g.checkpointed else 0 for g in segs), default=0)


__all__ = ["BUDGETS_BELOW", "MAX_NESTING", "budgets_below", "PHASES", "Clock", "nesting", "segments", "shallow", "solve_stage"]
