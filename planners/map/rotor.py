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

from dataclasses import dataclass
from typing import Callable

import numpy as np

from costs.rotor import INF, Chain, Segment, simulate_peak
from planners.map.ilp import solve as solve_ilp
from planners.map.problem import IlpProblem, IlpSolution


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


class _Table:
    """C[s][t]: numpy array over m = 0..S slots of the best time (inf: infeasible); W[s][t]: the
    choice (-1: F_all at s, s' >= 1: checkpoint a^{s'-1})."""

    def __init__(self, chain: Chain, budget_bytes: int, slots: int) -> None:
        self.chain, self.S, self.B = chain, slots, budget_bytes
        L = len(chain)
        sl = self.slots
        G = lambda t: chain.w_delta[t] if t < L - 1 else 0          # delta^t live from the start unless t is last
        self.A = [sl(x) for x in chain.w_a]
        self.AB = [sl(x) for x in chain.w_abar]
        of = [chain.o_f[l] + chain.o_fcomm[l] for l in range(L)]
        bwd = [chain.w_abar[l] + chain.w_delta[l] + chain.delta_in(l) + chain.o_b[l] + chain.o_bcomm[l] for l in range(L)]
        tf = [chain.t_fwd(l) for l in range(L)]
        m = np.arange(slots + 1)
        self.C: dict[tuple[int, int], np.ndarray] = {}
        self.W: dict[tuple[int, int], np.ndarray] = {}
        for d in range(L):
            for s in range(L - d):
                t = s + d
                # C_all (eq. 5), gated by m_all (eq. 6): F_all^s's peak with delta^t, and B^s's peak
                thr = sl(max(G(t) + chain.w_abar[s] + of[s], bwd[s]))
                if d == 0:
                    best = np.where(m >= thr, tf[s] + chain.t_bwd(s), INF)
                else:
                    best = np.where(m >= max(thr, self.AB[s]), tf[s] + chain.t_bwd(s) + self._shift(self.C[s + 1, t], self.AB[s]), INF)
                choice = np.full(slots + 1, -1, dtype=np.int32)
                fwd_bytes, fwd_time = G(t) + chain.w_a[s] + of[s], tf[s]
                for sp in range(s + 1, t + 1):                 # C_ck (eq. 5): checkpoint a^{sp-1}
                    if sp > s + 1:
                        j = sp - 1                             # F_none^j holds a^{j-1} and a^j
                        fwd_bytes = max(fwd_bytes, G(t) + chain.w_a[j - 1] + chain.w_a[j] + of[j])
                        fwd_time += tf[j]
                    gate = max(sl(fwd_bytes), self.A[sp - 1])
                    val = fwd_time + self._shift(self.C[sp, t], self.A[sp - 1]) + self.C[s, sp - 1]
                    val = np.where(m >= gate, val, INF)
                    better = val < best                        # ties keep F_all, then the earliest checkpoint
                    best = np.where(better, val, best)
                    choice = np.where(better, sp, choice)
                self.C[s, t], self.W[s, t] = best, choice

    def slots(self, nbytes: int) -> int:
        """ceil(nbytes * S / B): sizes round up, so accepted sums never exceed the budget."""
        return -(-int(nbytes) * self.S // self.B) if nbytes > 0 else 0

    def _shift(self, arr: np.ndarray, k: int) -> np.ndarray:
        out = np.full_like(arr, INF)
        if k <= self.S:
            out[k:] = arr[:len(arr) - k] if k > 0 else arr
        return out

    def backtrack(self, s: int, t: int, m: int) -> tuple[list[tuple[str, int]], list[Segment]]:
        if s == t:
            return [("F_all", s), ("B", s)], [Segment(s, s + 1, False)]
        sp = int(self.W[s, t][m])
        if sp < 0:
            ops, segs = self.backtrack(s + 1, t, m - self.AB[s])
            return [("F_all", s)] + ops + [("B", s)], [Segment(s, s + 1, False)] + segs
        right_ops, right = self.backtrack(sp, t, m - self.A[sp - 1])
        left_ops, left = self.backtrack(s, sp - 1, m)
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


def _run(chain: Chain, budget_bytes: int, slots: int) -> tuple[float, list, list] | None:
    if budget_bytes <= 0:
        return None
    tab = _Table(chain, budget_bytes, slots)
    m0 = slots - tab.slots(chain.w_input + chain.fixed_bytes)
    if m0 < 0 or not np.isfinite(tab.C[0, len(chain) - 1][m0]):
        return None
    ops, segs = tab.backtrack(0, len(chain) - 1, m0)
    return float(tab.C[0, len(chain) - 1][m0]), ops, _merge(segs)


def min_feasible_budget(chain: Chain, memory_slots: int = 500, lower_bytes: int = 0) -> int:
    """Smallest budget (bytes) :func:`solve` accepts with this slot count; feasibility is monotone in
    the budget (see module doc), so doubling then bisection finds it."""
    lo, hi = max(lower_bytes, 0), max(lower_bytes, 1)
    while _run(chain, hi, memory_slots) is None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _run(chain, mid, memory_slots) is not None else (mid, hi)
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
    _, ops, segs = res
    seq = tuple(ops)
    time_s = sum(chain.t_fwd(l) if op != "B" else chain.t_bwd(l) for op, l in seq)   # the ops' sum, not the table's
    return RotorSolution(time_s, True, seq, tuple(segs), simulate_peak(chain, seq), budget_bytes, time_s - base)


@dataclass(frozen=True)
class Integrated:
    """MAP §5.3's pick: ``k`` the winning budget exponent (ILP budget = budget * (1+alpha)^k),
    ``total_s`` = ILP time + rotor's recomputation; ``tried``: (k, ilp budget, total or inf)."""

    k: int | None
    ilp: IlpSolution | None
    chain: Chain | None
    rotor: RotorSolution | None
    total_s: float
    tried: tuple[tuple[int, int, float], ...]


def integrate(ilp_problem_builder: Callable[[int], IlpProblem], chain_builder: Callable[[IlpSolution], Chain],
              budget_bytes: int, alpha: float = 0.25, n: int = 10, memory_slots: int = 500,
              ilp_time_limit_s: float = 60.0, progress: Callable[[int, int], None] | None = None) -> Integrated:
    """MAP §5.3: the ILP alone would squeeze its strategies into the budget and leave rotor nothing to
    do, so it is solved at inflated budgets budget*(1+alpha)^k, k = 0..n-1; each solution's chain
    (``chain_builder``) is checkpointed by rotor within the *real* budget; the fastest ILP time +
    recomputation wins. Ties keep the smaller k. Once an ILP budget admits the unconstrained optimum
    (solved once, first), larger budgets reuse it instead of solving again."""
    best: tuple = (INF, None, None, None, None)
    tried = []
    probe = ilp_problem_builder(budget_bytes)
    roomy = sum(max(nd.memory_bytes) for nd in probe.nodes)
    free = solve_ilp(ilp_problem_builder(roomy), time_limit_s=ilp_time_limit_s)
    for k in range(n):
        ilp_budget = int(budget_bytes * (1 + alpha) ** k)
        if ilp_budget >= free.memory_bytes and free.status == "optimal":
            sol = free
        else:
            sol = solve_ilp(ilp_problem_builder(ilp_budget), time_limit_s=ilp_time_limit_s)
        total = INF
        if sol.status != "infeasible":
            chain = chain_builder(sol)
            rot = solve(chain, budget_bytes, memory_slots, find_min=False)
            if rot.feasible and rot.peak_bytes <= budget_bytes:
                total = sol.time_s + rot.recompute_s
                if total < best[0]:
                    best = (total, k, sol, chain, rot)
        tried.append((k, ilp_budget, total))
        if progress is not None:
            progress(k + 1, n)
    total, k, sol, chain, rot = best
    return Integrated(k, sol, chain, rot, total, tuple(tried))
