"""The reduced graph's helpers shared by planners.map.blocks (the exact block DP) and
planners.map.blocks_bound (its bounded fallback): the cached reduction of one IlpProblem, each
node's neighbour matrices, and a block's frontier signature. Pure: no I/O.
"""
from __future__ import annotations

import numpy as np

from planners.map.problem import IlpProblem, Reduced


def _neighbours(red: Reduced) -> dict[int, dict[int, np.ndarray]]:
    """nbr[v][u]: the edge matrix with rows indexed by u's strategy, columns by v's."""
    nbr: dict[int, dict[int, np.ndarray]] = {}
    for (u, v), r in red.edges.items():
        nbr.setdefault(v, {})[u] = r
        nbr.setdefault(u, {})[v] = r.T
    return nbr


def _signature(red: Reduced, nbr, local, sigma, tau) -> bytes:
    """Everything the block's frontier depends on, in block-local positions."""
    pos = {n: i for i, n in enumerate(sigma)} | {n: len(sigma) + i for i, n in enumerate(local)}
    parts = [repr((len(sigma), len(local), [pos[n] for n in tau], [len(red.cost[n]) for n in sigma])).encode()]
    for n in local:
        parts += [red.cost[n].tobytes(), red.mem[n].tobytes()]
        for u in sorted(nbr.get(n, {}), key=lambda x: pos.get(x, -1)):
            if u in pos and pos[u] < pos[n]:
                parts += [repr((pos[u], pos[n])).encode(), nbr[n][u].tobytes()]
    return b"|".join(parts)


_REDUCED: list = []     # the last reduction: §5.3 poses one graph at up to 11 budgets (Reduced ignores them)


def _reduced(problem: IlpProblem) -> Reduced:
    if _REDUCED and _REDUCED[0] is problem.nodes and _REDUCED[1] is problem.edges:
        return _REDUCED[2]
    red = Reduced(problem)
    tuples = isinstance(problem.nodes, tuple) and isinstance(problem.edges, tuple)    # immutable: reusable
    _REDUCED[:] = [problem.nodes, problem.edges, red] if tuples else []
    return red
