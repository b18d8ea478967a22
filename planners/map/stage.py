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

from planners.map.rotor import integrate, min_feasible_budget
from planners.map.rotor import solve as solve_rotor
from specs.plan import CheckpointSegment, LayerSharding
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
                spent: dict | None = None) -> tuple[list[LayerSharding], list[CheckpointSegment]]:
    """§5.3 at ``budget_bytes`` for ``sm`` (planners.map.plan's _StageModel), recorded in ``choice``
    (its StageChoice); when nothing fits, the minimum-memory choice and its minimum budget.
    ``notes`` gains what a reader of map.json should know; ``spent`` (PHASES[2], PHASES[3] ->
    seconds) the ILP's and rotor's wall time."""
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
    res = integrate(sm.problem, sm.chain, budget_bytes, alpha=policy.alpha, n=policy.budgets,
                    memory_slots=policy.memory_slots, ilp_time_limit_s=policy.ilp_time_limit_s, progress=progress,
                    below=budgets_below(policy))
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
        return sm.shardings(res.ilp.choice), segments(res.rotor.segments, sm.layers.start)
    # §5.3's budgets all failed (its ILP counts every activation, so near the minimum no inflated
    # budget leaves rotor room): the least-memory strategies, checkpointed by rotor within B if it can
    tiny = sm.problem(1)
    low = tuple(min(range(len(nd.memory_bytes)), key=lambda i: (nd.memory_bytes[i], nd.costs_s[i])) for nd in tiny.nodes)
    shard = sm.shardings(low)
    chain = sm.chain_of_shardings(shard)
    choice.ilp_time_s = sum(chain.t_fwd(l) + chain.t_bwd(l) for l in range(len(chain)))
    rot = solve_rotor(chain, budget_bytes, policy.memory_slots, find_min=False)
    if rot.feasible:
        choice.recompute_s = rot.recompute_s
        choice.tried.append({"k": None, "ilp_budget_bytes": None, "total_s": choice.ilp_time_s + rot.recompute_s,
                             "note": "least-memory strategies"})
        spent[PHASES[3]] += time.perf_counter() - t1
        return shard, segments(rot.segments, sm.layers.start)
    need = min_feasible_budget(chain, policy.memory_slots, lower_bytes=budget_bytes)
    choice.min_budget_bytes = need
    rot, at = shallow(chain, need, policy.memory_slots)
    if at != need and notes is not None:
        notes.append(f"stage {choice.stage}: the minimum-memory checkpointing nests deeper than {MAX_NESTING} "
                     f"levels; the plan checkpoints within {size_text(at)} instead of {size_text(need)}")
    choice.recompute_s = rot.recompute_s if rot.feasible else 0.0
    spent[PHASES[3]] += time.perf_counter() - t1
    return shard, segments(rot.segments, sm.layers.start) if rot.feasible else []


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
