"""MAP eq. (1) without its budget row on a chain of blocks: the fastest choice, by min-sum variable
elimination on dense tables (MAP §5.1's objective; the budget handled by the caller).

Why it exists (issue 26): on a 3-D mesh a linear has 125 strategies (each of 3 axes on one of its 4
dims or none), and the block DP of planners/map/blocks.py keeps a Pareto set of (time, bytes) per
assignment of up to three such nodes (~2 M sets): 232 s for one unconstrained solve of
experiment=map_gpt2_delta. Without the bytes each set is one number, a table is a numpy array with
one axis per node of its scope, a join is a broadcast sum and an elimination a min (argmin kept to
recover the choice): the same elimination order, seconds instead of minutes.

When the fastest choice's bytes fit the budget it is eq. (1)'s optimum: dropping a constraint
cannot make the optimum slower, and this point meets it. solve_blocks tries it first; MAP §5.3's
integrate (planners.map.rotor) poses the unconstrained problem first, which this always answers.

Exact: every table entry is a minimum over the eliminated nodes given its scope (Bertele &
Brioschi's nonserial DP); ties go to the lowest strategy index (numpy's argmin), so the answer is
deterministic. Times are float sums in elimination order: a choice within float rounding of the
optimum may be returned instead of another one; its time is recomputed from the input by the caller.
Refuses (returns None) when a table would exceed MAX_CELLS, so the caller falls back to the Pareto DP.
"""
from __future__ import annotations

import numpy as np

from planners.map.problem import Reduced

#: largest dense table (float64 cells) an elimination may build: 2^25 cells = 256 MiB
MAX_CELLS = 1 << 25


class _Factor:
    __slots__ = ("scope", "table")

    def __init__(self, scope: list[int], table: np.ndarray) -> None:
        self.scope, self.table = scope, table


def _expand(f: _Factor, scope: list[int], size: dict[int, int]) -> np.ndarray:
    """``f``'s table viewed on ``scope`` (a superset of f.scope): its axes moved into scope order,
    size-1 axes where f does not depend."""
    order = sorted(range(len(f.scope)), key=lambda i: scope.index(f.scope[i]))
    t = np.transpose(f.table, order) if f.scope else f.table
    shape = [size[v] if v in f.scope else 1 for v in scope]
    return t.reshape(shape)


def _sum(factors: list[_Factor], size: dict[int, int]) -> _Factor:
    scope: list[int] = []
    for f in factors:
        scope += [v for v in f.scope if v not in scope]
    total = np.zeros([size[v] for v in scope])
    for f in factors:
        total = total + _expand(f, scope, size)
    return _Factor(scope, total)


def block_table(red: Reduced, nbr, local: list[int], sigma: list[int], tau: list[int]):
    """For one block: T[sigma state, tau state] (flattened row-major over the boundary nodes'
    strategy counts) = the least time of its nodes, inner edges and edges from ``sigma`` into it,
    and a function state pair -> positions (in red.keep) of ``local``. None if a table would exceed
    MAX_CELLS."""
    size = {n: len(red.cost[n]) for n in sigma + local}
    inside = set(local) | set(sigma)
    factors = [_Factor([n], red.cost[n].astype(float)) for n in local]
    for n in local:
        for u, r in nbr.get(n, {}).items():       # r: rows u, columns n; each edge once
            if u in inside and (u in sigma or local.index(u) < local.index(n)):
                factors.append(_Factor([u, n], np.asarray(r, dtype=float)))
    steps = []                                    # (v, its rest-scope, argmin table)
    todo = [n for n in local if n not in tau]
    while todo:
        def width(v):
            scope = {u for f in factors if v in f.scope for u in f.scope}
            return int(np.prod([size[u] for u in scope], dtype=np.int64)), local.index(v)
        v = min(todo, key=width)
        if width(v)[0] > MAX_CELLS:
            return None
        todo.remove(v)
        mine = [f for f in factors if v in f.scope]
        factors = [f for f in factors if v not in f.scope]
        acc = _sum(mine, size)
        j = acc.scope.index(v)
        rest = acc.scope[:j] + acc.scope[j + 1:]
        steps.append((v, rest, np.argmin(acc.table, axis=j)))
        factors.append(_Factor(rest, np.min(acc.table, axis=j)))
    bound = sigma + tau
    if int(np.prod([size[u] for u in bound], dtype=np.int64)) > MAX_CELLS:
        return None
    whole = _sum(factors + [_Factor([u], np.zeros(size[u])) for u in bound], size)
    table = np.transpose(whole.table, [whole.scope.index(u) for u in bound])
    n_sig = int(np.prod([size[u] for u in sigma], dtype=np.int64))
    table = table.reshape(n_sig, -1)

    def recover(s_idx: int, t_idx: int) -> list[int]:
        val = {}
        if sigma:
            val.update(zip(sigma, np.unravel_index(s_idx, [size[u] for u in sigma])))
        if tau:
            val.update(zip(tau, np.unravel_index(t_idx, [size[u] for u in tau])))
        for v, rest, arg in reversed(steps):
            val[v] = arg[tuple(int(val[u]) for u in rest)]
        return [int(val[n]) for n in local]
    return table, recover


def fastest_choice(red: Reduced, nbr, blocks: list[list[int]], taus: list[list[int]], signature) -> list[int] | None:
    """Positions (in red.keep) per free node of the fastest choice over the chain, or None when a
    table is too large. ``signature(local, sigma, tau)``: the key under which identical blocks
    share one table (planners.map.blocks._signature)."""
    cache: dict[bytes, tuple] = {}
    tables = []
    for b, blk in enumerate(blocks):
        sigma = taus[b - 1] if b else []
        key = signature(blk, sigma, taus[b])
        if key not in cache:
            got = block_table(red, nbr, blk, sigma, taus[b])
            if got is None:
                return None
            cache[key] = got
        tables.append(cache[key])
    f = tables[0][0][0]                            # block 0 has no in-state
    args = []
    for table, _ in tables[1:]:
        tot = f[:, None] + table
        args.append(np.argmin(tot, axis=0))
        f = np.min(tot, axis=0)
    tau = int(np.argmin(f))
    pos: dict[int, int] = {}
    for b in range(len(blocks) - 1, -1, -1):
        sig = int(args[b - 1][tau]) if b else 0
        pos.update(zip(blocks[b], tables[b][1](sig, tau)))
        tau = sig
    return [pos[n] for blk in blocks for n in blk]
