"""MAP's activation-checkpoint solver: rotor's dynamic program with communication terms (MAP §5.2,
Theorem 5.1; Herrmann et al. 2019, "Optimal checkpointing for heterogeneous chains"), and MAP §5.3's
integration with the intra-op ILP. Pure: no I/O, no torch.

The chain, the operations (MAP Table 1: F_all, F_ck, F_none, B) and their live bytes are
costs.rotor's; this module is the DP that picks a sequence of them under a budget.

The DP is Theorem 5.1 (eqs. 3-6) over C(s, t, m): the best time to run stages s..t given their
input (held by the caller, outside m) and, unless t is the last stage, delta^t (inside m), ending
with delta^{s-1}. Two choices at s: F_all^s then (s+1..t) with m - |a-bar^s| (C_all, eq. 5), or a
checkpoint: F_ck^s F_none^{s+1..s'-1}, then (s'..t) with m - |a^{s'-1}|, then (s..s'-1) with m
(C_ck, eq. 5). Two deliberate departures from the printed equations, both so that the DP's bytes
are exactly those of :func:`simulate_peak`: the forward threshold of a checkpoint at s' takes the max
over the forwards it runs (s..s'-1), not over all of s..t as eq. 6's m_empty does, and the recomputed
forwards pay u_fcomm too (eq. 5 as printed sums u_f only; the collective runs whenever the forward
does).

Memory is discretised into ``memory_slots`` slots of budget/slots bytes (rotor, §5): every size is
rounded *up* to whole slots and the budget *down*, so a sequence the DP accepts never exceeds the
budget in bytes; and a larger budget (same slot count) makes every rounded size smaller or equal,
so feasibility and time are monotone in the budget.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from costs.rotor import INF, Chain, Segment, simulate_peak
from planners.map.ilp import solve as solve_ilp
from planners.map.problem import IlpProblem, IlpSolution
from planners.map.rotor_table import Structure, Table


@dataclass(frozen=True)
class RotorSolution:
    """``time_s``: the sequence's total (sum of its ops, recomputation included); ``recompute_s``:
    its excess over one forward and one backward per stage; ``peak_bytes``: from
    :func:`simulate_peak`; ``min_budget_bytes``: when infeasible, the smallest budget this slot
    count accepts (else None)."""

    time_s: float
    feasible: bool
    sequence: tuple[tuple[str, int], ...]
    segments: tuple[Segment, ...]
    peak_bytes: int
    budget_bytes: int
    recompute_s: float
    min_budget_bytes: int | None = None
    every: int = 1               # checkpoints allowed every this many layers (1: exact; see _run)


def _backtrack(tab: Table, s: int, t: int, m: int) -> tuple[list[tuple[str, int]], list[Segment]]:
    if s == t:
        return [("F_all", s), ("B", s)], [Segment(s, s + 1, False)]
    sp = tab.choice(s, t, m)
    if sp < 0:
        ops, segs = _backtrack(tab, s + 1, t, m - tab.AB[s])
        return [("F_all", s)] + ops + [("B", s)], [Segment(s, s + 1, False)] + segs
    right_ops, right = _backtrack(tab, sp, t, m - tab.A[sp - 1])
    left_ops, left = _backtrack(tab, s, sp - 1, m)
    fwd = [("F_ck", s)] + [("F_none", j) for j in range(s + 1, sp)]
    return fwd + right_ops + left_ops, [Segment(s, sp, True, tuple(_merge(left)))] + right


def _merge(segs: list[Segment]) -> list[Segment]:
    """Adjacent stored (non-checkpointed) stages become one segment."""
    out: list[Segment] = []
    for g in segs:
        if out and not g.checkpointed and not out[-1].checkpointed:
            out[-1] = Segment(out[-1].start, g.stop, False)
        else:
            out.append(g)
    return out


def _feasible(st: Structure, budget_bytes: int, slots: int) -> tuple[Table, int] | None:
    """The table at this budget and the slots left beside the input and fixed bytes, or None when no
    sequence fits (decided by the slot thresholds alone, without the table's rows)."""
    if budget_bytes <= 0:
        return None
    tab = Table(st, budget_bytes, slots)
    m0 = slots - tab.slots(st.chain.w_input + st.chain.fixed_bytes)
    if m0 < 0 or tab.threshold() > m0:
        return None
    return tab, m0


#: the most cells (rows x checkpoint options x (slots + 1)) the exact table may fill, about 2 s on one
#: core; past it checkpoints are restricted to every 2nd, 4th, ... layer (see :func:`_run`). A chain
#: of L identical layers fills about 2 L^2 (slots + 1) cells (exact up to L = 700 at 500 slots), one
#: of arbitrary layers L^3 / 6 (slots + 1) (L = 180)
MAX_EXACT_CELLS = 500_000_000
#: the checkpoint spacing to use whatever the size (None: the finest within MAX_EXACT_CELLS); the
#: benchmark and the tests set it to measure what a spacing loses against the exact table
EVERY: int | None = None


def _spacing(chain: Chain, slots: int) -> Structure:
    every = EVERY or 1
    st = Structure(chain, every)
    while EVERY is None and st.work(slots) > MAX_EXACT_CELLS and every < len(chain):
        every *= 2
        st = Structure(chain, every)
    return st


def _run(chain: Chain, budget_bytes: int, slots: int) -> tuple[float, list, list, int] | None:
    """(table time, ops, segments, checkpoint spacing) or None when nothing fits. MAP §5.2.1's DP is
    exact up to MAX_EXACT_CELLS. Past it (issue 22: 500 layers whose strategies differ in runs, 55
    of one kind, 75 of another, the rest of the first, keep 84k distinct ranges and took 65 s) the
    checkpoints a^{s'-1} are restricted to s' = every, 2 every, ... (every a power of two, the
    smallest within the cap) and the DP is exact over that family: the rows exist only for ranges
    ending before an allowed s' or at the chain's end, which are all the recursion reads, and the
    sequence's bytes and time stay exact. A restriction can only lose time, or feasibility near
    the smallest budget: then, if the exact thresholds say the chain fits, the spacing is halved
    until it fits, so feasibility is never lost. Measured against the exact table (benchmarks/
    map_scale.py --spacing, forcing the spacing on models small enough for both): gpt3_2b6 (34
    layers) at 8-24 GiB loses at most 0.37 % of the iteration at every 2 or 4 and 1.03 % at every
    8, stronghold_gpt_l20 and gpt_10b3 nothing; stronghold_gpt_l500 at 120 GiB (every 8 chosen)
    0.14 %, in 3.7 s instead of 38 s."""
    if budget_bytes <= 0 or -(-(chain.w_input + chain.fixed_bytes) * slots // budget_bytes) > slots:
        return None                           # the fixed bytes alone exceed the budget (Table.slots)
    st = _spacing(chain, slots)
    hit = _feasible(st, budget_bytes, slots)
    if hit is None and st.every > 1 and _feasible(Structure(chain), budget_bytes, slots) is not None:
        while hit is None:
            st = Structure(chain, st.every // 2)
            hit = _feasible(st, budget_bytes, slots)
    if hit is None:
        return None
    tab, m0 = hit
    tab.build()
    L = len(chain)
    if not np.isfinite(tab.value(0, L - 1, m0)):       # the thresholds said it fits: cannot happen
        raise AssertionError("rotor: the slot threshold and the table disagree")
    ops, segs = _backtrack(tab, 0, L - 1, m0)
    return tab.value(0, L - 1, m0), ops, _merge(segs), st.every


def min_feasible_budget(chain: Chain, memory_slots: int = 500, lower_bytes: int = 0) -> int:
    """Smallest budget (bytes) :func:`solve` accepts with this slot count; feasibility is monotone in
    the budget (see module doc), so doubling then bisection finds it (each probe: the slot
    thresholds only, planners.map.rotor_table)."""
    st = Structure(chain)
    ok = lambda b: _feasible(st, b, memory_slots) is not None
    lo, hi = max(lower_bytes, 0), max(lower_bytes, 1)
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def solve(chain: Chain, budget_bytes: int, memory_slots: int = 500, find_min: bool = True) -> RotorSolution:
    """Fastest persistent checkpointing sequence of ``chain`` within ``budget_bytes`` (everything:
    fixed bytes, the input, activations, gradients, temporaries). Infeasible: feasible=False,
    time inf, and (``find_min``) ``min_budget_bytes``."""
    base = sum(chain.t_fwd(l) + chain.t_bwd(l) for l in range(len(chain)))
    res = _run(chain, budget_bytes, memory_slots)
    if res is None:
        need = min_feasible_budget(chain, memory_slots, lower_bytes=budget_bytes) if find_min else None
        return RotorSolution(INF, False, (), (), 0, budget_bytes, INF, need)
    _, ops, segs, every = res
    seq = tuple(ops)
    time_s = sum(chain.t_fwd(l) if op != "B" else chain.t_bwd(l) for op, l in seq)   # the ops' sum, not the table's
    return RotorSolution(time_s, True, seq, tuple(segs), simulate_peak(chain, seq), budget_bytes, time_s - base,
                         every=every)


@dataclass(frozen=True)
class Integrated:
    """MAP §5.3's pick: ``k`` the winning budget exponent (ILP budget = budget * (1+alpha)^k; k < 0:
    below the budget, budget * (1+alpha)^(k/BELOW_STEPS), see :func:`budget_grid`), ``total_s`` = ILP time + rotor's recomputation;
    ``tried``: (k, ilp budget, total or inf), in the order solved."""

    k: int | None
    ilp: IlpSolution | None
    chain: Chain | None
    rotor: RotorSolution | None
    total_s: float
    tried: tuple[tuple[int, int, float], ...]
    ilp_s: float = 0.0           # wall time in the ILP solves
    rotor_s: float = 0.0         # wall time pricing the chains and checkpointing them
    alternative: int = 0         # which of chain_builder's chains won (one chain: 0)


#: an alternative chain of the same ILP solution (integrate's ``chain_builder``) wins only when faster
#: by more than this share: the chains sum the same per-operator times grouped differently, so an
#: equal schedule differs by float64 reassociation alone (~1e-16 per term)
ALT_RTOL = 1e-9

#: the grid under B is finer than §5.3's steps above it: BELOW_STEPS budgets per factor (1 + alpha).
#: On δ's 2 x 2 x 2 mesh at 40 GiB the fastest ILP budget is 0.9 B (1.091 s after rotor, against
#: 1.273 s at B and an infeasible ILP at 0.8 B = B / 1.25): whole (1 + alpha) steps miss it
BELOW_STEPS = 4


def budget_grid(budget_bytes: int, alpha: float, n: int, below: int) -> list[tuple[int, int]]:
    """(k, ILP budget) in the order :func:`integrate` solves them: §5.3's B(1+alpha)^k, k = 0..n-1,
    then the grid's lower half B(1+alpha)^(k/BELOW_STEPS), k = -1..-below (ILP budgets under B)."""
    return ([(k, int(budget_bytes * (1 + alpha) ** k)) for k in range(n)]
            + [(-j, int(budget_bytes * (1 + alpha) ** (-j / BELOW_STEPS))) for j in range(1, below + 1)])


def integrate(ilp_problem_builder: Callable[[int], IlpProblem], chain_builder: Callable[[IlpSolution], Chain],
              budget_bytes: int, alpha: float = 0.25, n: int = 10, memory_slots: int = 500,
              ilp_time_limit_s: float = 60.0, progress: Callable[[int, int], None] | None = None,
              below: int = 0) -> Integrated:
    """MAP §5.3: the ILP alone would squeeze its strategies into the budget and leave rotor nothing to
    do, so it is solved at inflated budgets budget*(1+alpha)^k, k = 0..n-1; each solution's chain
    (``chain_builder``) is checkpointed by rotor within the *real* budget; the fastest ILP time +
    recomputation wins. Ties keep the one solved first. Once an ILP budget admits the unconstrained
    optimum (solved once, first), larger budgets reuse it instead of solving again.

    ``below`` > 0 generalises §5.3's inflation to a grid around B: also budget (1+alpha)^(-j/BELOW_STEPS),
    j = 1..below (recorded as k = -j). The ILP's row counts every saved activation as kept, so at B it may have to keep
    replicated (fast, memory-heavy) strategies whose chain rotor then recomputes a lot; a smaller ILP
    budget shards more and may leave rotor less to recompute (issue 26: δ's 2 x 2 x 2 mesh at 40 GiB).
    The lower half stops at the first infeasible ILP (the ILP's feasibility is monotone in its
    budget); a solution already tried (same choice) is not checkpointed again.

    ``chain_builder`` may return several chains for one ILP solution, alternatives that run the same
    strategies (planners.map.linearise: per layer, and per node group, MAP §5.2.2's Algorithm 2);
    each is checkpointed and the fastest that fits counts (a later one must be faster by more than
    ALT_RTOL: ties keep the first), recorded in
    ``alternative``. Neither chain's rotor family contains the other's: a node group stored with
    F_all keeps its input a^{g-1} to its backward, where the whole layer may free it once read."""
    best: tuple = (INF, None, None, None, None, 0)
    tried = []
    t0 = time.perf_counter()
    probe = ilp_problem_builder(budget_bytes)
    roomy = sum(max(nd.memory_bytes) for nd in probe.nodes)
    free = solve_ilp(ilp_problem_builder(roomy), time_limit_s=ilp_time_limit_s)
    rotor_s = 0.0
    grid = budget_grid(budget_bytes, alpha, n, below)
    seen: dict[tuple[int, ...], float] = {}
    for i, (k, ilp_budget) in enumerate(grid):
        if k < 0 and tried and tried[-1][0] < 0 and tried[-1][3]:
            tried.append((k, ilp_budget, INF, True))       # a smaller budget than an infeasible one
        else:
            if ilp_budget >= free.memory_bytes and free.status == "optimal":
                sol = free
            else:
                sol = solve_ilp(ilp_problem_builder(ilp_budget), time_limit_s=ilp_time_limit_s)
            total = INF
            if sol.status != "infeasible" and tuple(sol.choice) in seen:
                total = seen[tuple(sol.choice)]
            elif sol.status != "infeasible":
                t1 = time.perf_counter()
                built = chain_builder(sol)
                mine: tuple = (INF,)
                for alt, chain in enumerate((built,) if isinstance(built, Chain) else tuple(built)):
                    rot = solve(chain, budget_bytes, memory_slots, find_min=False)
                    if rot.feasible and rot.peak_bytes <= budget_bytes:
                        got = sol.time_s + rot.recompute_s
                        if got < mine[0] * (1 - ALT_RTOL):
                            mine = (got, k, sol, chain, rot, alt)
                total = mine[0]
                if total < best[0]:
                    best = mine
                rotor_s += time.perf_counter() - t1
                seen[tuple(sol.choice)] = total
            tried.append((k, ilp_budget, total, sol.status == "infeasible"))
        if progress is not None:
            progress(i + 1, len(grid))
    total, k, sol, chain, rot, alt = best
    return Integrated(k, sol, chain, rot, total, tuple(t[:3] for t in tried), time.perf_counter() - t0 - rotor_s,
                      rotor_s, alt)
