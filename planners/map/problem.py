"""MAP eq. (1)'s problem (MAP §5.1): nodes with one cost/bytes entry per sharding strategy, edges
with layout-conversion matrices R_uv, a budget; a solution's time and bytes (:func:`evaluate`); and
the exact reductions both solvers start from (:class:`Reduced`: parallel edges summed, dominated
strategies dropped, single-strategy nodes folded; see planners.map.ilp's module doc for why each
is exact). Solved by planners.map.ilp (HiGHS) or planners.map.blocks (the block DP).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the (nodes, edges, blocks) tuples IlpProblem last checked: MAP §5.3 poses one graph at up to 11
#: budgets, and the checks cost more than a block DP solve of a 500-layer chain
_CHECKED: tuple | None = None


@dataclass(frozen=True)
class IlpNode:
    """One operator: per candidate strategy, its time (compute + intra-op communication, s) and the
    bytes it keeps on a device."""

    name: str
    costs_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.costs_s or len(self.costs_s) != len(self.memory_bytes):
            raise ValueError(f"node {self.name!r}: costs_s and memory_bytes need one entry per strategy (>= 1)")


@dataclass(frozen=True)
class IlpEdge:
    """Data from node ``src`` to node ``dst``; ``cost_s[i][j]``: resharding time from src's strategy i
    to dst's strategy j (MAP's R(p, S_p, n))."""

    src: int
    dst: int
    cost_s: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class IlpProblem:
    """``blocks`` (optional): node indices per block, in chain order (a transformer's layers); every
    node in exactly one block, every edge inside a block or between consecutive blocks. When given,
    :func:`solve` uses the exact block DP of planners/map/blocks.py instead of HiGHS."""

    nodes: tuple[IlpNode, ...]
    edges: tuple[IlpEdge, ...]
    budget_bytes: int
    blocks: tuple[tuple[int, ...], ...] | None = None
    #: block DP only: each block's bytes are rounded UP to a multiple of this (0: exact). Coarser
    #: bytes collapse the chain's Pareto labels (a traced 2.7B graph: 80 s exact); the choice stays
    #: within the budget in true bytes and is optimal up to blocks x quantum bytes of slack
    memory_quantum_bytes: int = 0

    def __post_init__(self) -> None:
        global _CHECKED
        if _CHECKED is not None and isinstance(self.nodes, tuple) and isinstance(self.edges, tuple) and \
                all(a is b for a, b in zip(_CHECKED, (self.nodes, self.edges, self.blocks))):
            return       # the same (immutable) nodes, edges and blocks at another budget: checked already
        n = len(self.nodes)
        for e in self.edges:
            if not (0 <= e.src < n and 0 <= e.dst < n) or e.src == e.dst:
                raise ValueError(f"edge {e.src}->{e.dst}: endpoints must be two distinct nodes of {n}")
            shape = np.shape(np.asarray(e.cost_s, dtype=float))
            want = (len(self.nodes[e.src].costs_s), len(self.nodes[e.dst].costs_s))
            if shape != want:
                raise ValueError(f"edge {e.src}->{e.dst}: cost_s is {shape}, expected {want} (src x dst strategies)")
        if self.blocks is not None:
            where = {v: b for b, blk in enumerate(self.blocks) for v in blk}
            if sorted(v for blk in self.blocks for v in blk) != list(range(n)):
                raise ValueError(f"blocks must hold every node 0..{n - 1} exactly once")
            for e in self.edges:
                if abs(where[e.src] - where[e.dst]) > 1:
                    raise ValueError(f"edge {e.src}->{e.dst}: blocks {where[e.src]} and {where[e.dst]} "
                                     "are not the same or consecutive")
        _CHECKED = (self.nodes, self.edges, self.blocks) if isinstance(self.blocks, (tuple, type(None))) else None


@dataclass(frozen=True)
class IlpSolution:
    """``choice[n]``: the strategy index of node n. ``status``: "optimal"; "time_limit" (the best
    feasible found when HiGHS stopped, not proven optimal); "infeasible" (then ``choice`` is the
    fastest-per-node among each node's smallest strategies, whose memory is ``min_memory_bytes``);
    "rounded" (block DP whose factors outgrew blocks.MAX_TABLE_ROWS: the choice fits the budget in true
    bytes and is no slower than the exact optimum under budget - ``rounding_bytes``)."""

    choice: tuple[int, ...]
    time_s: float
    memory_bytes: int
    status: str
    min_memory_bytes: int
    bound_s: float | None = None      # proven lower bound on the optimal time (== time_s when optimal)
    rounding_bytes: int = 0           # "rounded": the bytes the block DP's rounding may have given away


def evaluate(problem: IlpProblem, choice: tuple[int, ...]) -> tuple[float, int]:
    """(time_s, memory_bytes) of an assignment, summed in node order then edge order."""
    t = sum(nd.costs_s[c] for nd, c in zip(problem.nodes, choice))
    t += sum(e.cost_s[choice[e.src]][choice[e.dst]] for e in problem.edges)
    return float(t), sum(int(nd.memory_bytes[c]) for nd, c in zip(problem.nodes, choice))


class Reduced:
    """The problem after the exact reductions: per node the kept original indices, costs and bytes;
    the merged edges; the constants of fixed nodes."""

    def __init__(self, problem: IlpProblem) -> None:
        self.keep = [np.arange(len(nd.costs_s)) for nd in problem.nodes]
        self.cost = [np.asarray(nd.costs_s, dtype=float) for nd in problem.nodes]
        self.mem = [np.asarray(nd.memory_bytes, dtype=np.int64) for nd in problem.nodes]
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        for e in problem.edges:
            u, v, r = e.src, e.dst, np.asarray(e.cost_s, dtype=float)
            if u > v:
                u, v, r = v, u, r.T
            self.edges[(u, v)] = self.edges[(u, v)] + r if (u, v) in self.edges else r.copy()
        self.fixed: dict[int, int] = {}      # node -> position in keep (its only one left)
        self._index: dict[int, list[tuple[int, int]]] | None = None
        while self._prune() | self._fix():
            pass

    def _incident(self, n: int) -> list[np.ndarray]:
        """Rows (one per strategy of n) of every edge touching n, in the edges' order."""
        out = []
        for key in self._touching(n):
            r = self.edges[key]
            out.append(r if key[0] == n else r.T)
        return out

    def _touching(self, n: int) -> list[tuple[int, int]]:
        """The edge keys touching n, in dict order (an index rebuilt when the edge set changed: a
        scan per node made the reductions quadratic in a 500-layer chain)."""
        if self._index is None:
            self._index = {}
            for key in self.edges:
                self._index.setdefault(key[0], []).append(key)
                if key[1] != key[0]:
                    self._index.setdefault(key[1], []).append(key)
        return self._index.get(n, [])

    def _prune(self) -> bool:
        changed = False
        for n in range(len(self.keep)):
            if n in self.fixed or len(self.keep[n]) < 2:
                continue
            rows = self._incident(n)
            vec = np.column_stack([self.cost[n], self.mem[n].astype(float)] + rows)
            le = (vec[:, None, :] <= vec[None, :, :]).all(axis=2)       # le[a, b]: a no worse than b
            eq = le & le.T
            k = len(vec)
            lower = np.arange(k)[:, None] < np.arange(k)[None, :]
            beats = (le & ~eq) | (eq & lower)                            # a beats b, or ties it with a lower index
            # Slack dominance (issue 26): a beats b when a's bytes are no more and a's cost, plus per
            # edge the most a's row can exceed b's at any neighbour strategy, is still below b's cost
            # (strictly, or equal with a lower index): swapping b -> a cannot slow any solution.
            # Componentwise dominance above is its zero-slack case. The relation is transitive
            # (max(x + y) <= max x + max y), but float rounding could close a cycle, so b goes only
            # while a beater of it is alive: the removals form a forest whose roots survive.
            if k > 2 and k * k * sum(r.shape[1] for r in rows) <= 1 << 26:
                slack = self.cost[n][:, None] - self.cost[n][None, :]      # slack[a, b]: cost_a - cost_b
                for r in rows:
                    if r.shape[1]:
                        slack = slack + (r[:, None, :] - r[None, :, :]).max(axis=2)
                small = self.mem[n][:, None] <= self.mem[n][None, :]
                beats |= small & ((slack < 0) | ((slack == 0) & lower))
            np.fill_diagonal(beats, False)
            alive = np.ones(k, dtype=bool)
            for b in range(k):
                if (beats[:, b] & alive).any():
                    alive[b] = False
            dominated = ~alive
            if dominated.any():
                keep = ~dominated
                self._restrict(n, keep)
                changed = True
        return changed

    def _restrict(self, n: int, keep: np.ndarray) -> None:
        self.keep[n], self.cost[n], self.mem[n] = self.keep[n][keep], self.cost[n][keep], self.mem[n][keep]
        for (u, v) in self._touching(n):     # values replaced in place: the key order is kept
            r = self.edges[(u, v)]
            if u == n:
                self.edges[(u, v)] = r[keep, :]
            elif v == n:
                self.edges[(u, v)] = r[:, keep]

    def _fix(self) -> bool:
        changed = False
        for n in range(len(self.keep)):
            if n in self.fixed or len(self.keep[n]) != 1:
                continue
            self.fixed[n] = 0
            changed = True
            for (u, v) in list(self._touching(n)):
                r = self.edges[(u, v)]
                del self.edges[(u, v)]
                self._index[u].remove((u, v))
                self._index[v].remove((u, v))
                other, row = (v, r[0, :]) if u == n else (u, r[:, 0])
                self.cost[other] = self.cost[other] + row   # a fixed endpoint's edge is a cost of the other node
        return changed


def min_memory_choice(problem: IlpProblem) -> tuple[int, ...]:
    """Per node the smallest-memory strategy, ties to the cheaper then the lower index."""
    return tuple(min(range(len(nd.costs_s)), key=lambda i: (nd.memory_bytes[i], nd.costs_s[i], i)) for nd in problem.nodes)
