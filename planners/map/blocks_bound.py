"""The bounded-table fallback of planners.map.blocks (issue 26: a 2x2x2 mesh's three-node factors
hold ~1 M keys, more than blocks.MAX_TABLE_ROWS): MAP eq. (1)'s budget row relaxed (Lagrangian,
min time + lam * bytes, each lam solved exactly by planners.map.fastest's dense min-sum), then a
one-node-at-a-time local search. The result fits; the exact optimum lies in [bound_s, time_s].
Pure: no I/O.
"""
from __future__ import annotations

import copy

import numpy as np

from planners.map.block_graph import _neighbours, _reduced, _signature
from planners.map.fastest import fastest_choice
from planners.map.problem import IlpProblem, IlpSolution, Reduced, evaluate


def lagrangian(problem: IlpProblem, blocks, taus, min_choice) -> IlpSolution:
    """Fallback when a factor outgrows MAX_TABLE_ROWS (issue 26: a 2x2x2 mesh's three-node factors
    hold ~1 M keys): the Lagrangian relaxation of eq. (1)'s budget row, min time + lam * bytes, solved
    exactly for each lam by planners.map.fastest (dense min-sum, no Pareto sets). lam follows the
    breakpoint iteration (the lam at which the last minimiser over the budget and the last one under it
    tie) until no minimiser beats that tie. Returns the fastest minimiser that fits (true bytes <= the
    budget), status "lagrangian", with bound_s the dual bound max_lam (min(time + lam bytes) - lam B):
    the exact optimum lies in [bound_s, time_s] (a duality gap remains where the optimum is not a
    minimiser for any lam). None of it needs a table with bytes: memory stays that of fastest's tables."""
    exact = _reduced(problem)
    nbr = _neighbours(exact)
    base_cost = exact.cost
    budget = problem.budget_bytes

    def solve(lam: float):
        red = copy.copy(exact)
        red.cost = {n: c + lam * exact.mem[n] for n, c in base_cost.items()} if isinstance(base_cost, dict) else \
            [c + lam * m for c, m in zip(base_cost, exact.mem)]
        nb = _neighbours(red)
        pos = fastest_choice(red, nb, blocks, taus, lambda blk, sigma, tau: _signature(red, nb, blk, sigma, tau))
        if pos is None:
            return None
        full = list(range(len(problem.nodes)))
        for n in red.fixed:
            full[n] = int(red.keep[n][0])
        for n, p in zip((n for blk in blocks for n in blk), pos):
            full[n] = int(red.keep[n][p])
        t, m = evaluate(problem, tuple(full))
        return tuple(full), t, m

    t_min, min_mem = evaluate(problem, min_choice)
    best = (min_choice, t_min, min_mem)                      # fits (checked by the caller)
    lo = solve(0.0)
    if lo is None:
        return IlpSolution(min_choice, t_min, min_mem, "lagrangian", min_mem, None)
    hi = (min_choice, t_min, min_mem)
    bound = lo[1]                                            # lam = 0: the fastest time
    if lo[2] <= budget:
        return IlpSolution(lo[0], lo[1], lo[2], "optimal", min_mem, lo[1])
    for _ in range(60):
        if lo[2] <= hi[2]:
            break
        lam = (hi[1] - lo[1]) / (lo[2] - hi[2])
        got = solve(lam)
        if got is None:
            break
        val = got[1] + lam * got[2]
        bound = max(bound, val - lam * budget)
        if val >= lo[1] + lam * lo[2] - 1e-12 * (abs(lo[1]) + lam * lo[2]):
            break                                            # nothing beats the tie: lam is the dual optimum
        if got[2] <= budget:
            hi = got
            if got[1] < best[1]:
                best = got
        else:
            lo = got
    choice = improve(problem, exact, nbr, best[0], budget)
    t, m = evaluate(problem, choice)
    if t > best[1] or m > budget:            # cannot happen (each move is no slower and fits): keep best
        choice, t, m = best
    return IlpSolution(choice, t, m, "lagrangian", min_mem, min(bound, t))


def improve(problem: IlpProblem, red: Reduced, nbr, choice: tuple[int, ...], budget: int,
             passes: int = 20) -> tuple[int, ...]:
    """Local search after :func:`lagrangian`: one node at a time moves to its fastest strategy given its
    neighbours' (its cost plus its edges' entries) whose bytes still fit, while any move gains.
    Every move is no slower and fits, so the result keeps both properties; the dual bound stays."""
    free = [n for n in range(len(problem.nodes)) if n not in red.fixed]
    pos = {n: int(np.nonzero(np.asarray(red.keep[n]) == choice[n])[0][0]) for n in free}
    used = sum(int(red.mem[n][pos[n]]) for n in free) + sum(int(red.mem[n][0]) for n in red.fixed)
    for _ in range(passes):
        moved = False
        for v in free:
            row = red.cost[v].astype(float).copy()
            for u, r in nbr.get(v, {}).items():      # r: rows u, columns v
                if u in pos:
                    row = row + np.asarray(r)[pos[u]]
            cur = pos[v]
            fits = used - int(red.mem[v][cur]) + red.mem[v] <= budget
            gain = row[cur] - np.where(fits, row, np.inf)
            best = int(np.argmax(gain))
            if gain[best] > 1e-12 * max(abs(row[cur]), 1e-30):
                used += int(red.mem[v][best]) - int(red.mem[v][cur])
                pos[v] = best
                moved = True
        if not moved:
            break
    out = list(choice)
    for n in free:
        out[n] = int(red.keep[n][pos[n]])
    return tuple(out)
