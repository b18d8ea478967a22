"""Issue 26: the block DP's factor tables stay bounded (planners/map/blocks.py MAX_TABLE_ROWS).
Over the bound, rows' bytes are rounded up to a coarser grid ("rounded": fits the budget in true
bytes, no slower than the exact optimum under budget - rounding_bytes); where even one row per key
is too many, the Lagrangian fallback ("lagrangian": fits, exact optimum in [bound_s, time_s])."""
from __future__ import annotations

import random

import numpy as np
import pytest

import planners.map.blocks as blocks
from planners.map.problem import IlpEdge, IlpNode, IlpProblem


def _chain(seed: int, n_blocks: int = 3, per: int = 4, k: int = 5):
    """Identical blocks of ``per`` nodes (k strategies, bytes spread 1..1000 so Pareto sets are long),
    every pair inside a block linked (three-node factors), the last node feeding the next block's first."""
    rng = random.Random(seed)
    spec = [(tuple(round(rng.uniform(0, 2), 4) for _ in range(k)), tuple(rng.randint(1, 1000) for _ in range(k)))
            for _ in range(per)]
    mats = {(i, j): tuple(tuple(round(rng.uniform(0, 1), 4) for _ in range(k)) for _ in range(k))
            for j in range(per) for i in range(j)}
    cross = tuple(tuple(round(rng.uniform(0, 1), 4) for _ in range(k)) for _ in range(k))
    nodes, edges = [], []
    for b in range(n_blocks):
        nodes += [IlpNode(f"b{b}n{i}", c, m) for i, (c, m) in enumerate(spec)]
        edges += [IlpEdge(b * per + i, b * per + j, r) for (i, j), r in mats.items()]
        if b:
            edges.append(IlpEdge(b * per - 1, b * per, cross))
    return tuple(nodes), tuple(edges), tuple(tuple(range(b * per, (b + 1) * per)) for b in range(n_blocks))


def _solve(monkeypatch, problem, limit):
    blocks._FRONTIERS.clear()
    blocks._FAST.clear()
    monkeypatch.setattr(blocks, "MAX_TABLE_ROWS", limit)
    return blocks.solve_blocks(problem)


def _budget(nodes, frac):
    lo = sum(min(n.memory_bytes) for n in nodes)
    hi = sum(max(n.memory_bytes) for n in nodes)
    return int(lo + frac * (hi - lo))


def _spy(monkeypatch, name, record):
    real = getattr(blocks, name)
    def spy(*a, **k):
        out = real(*a, **k)
        record.append(out if isinstance(out, int) else len(out.t))
        return out
    monkeypatch.setattr(blocks, name, spy)
    return real


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rounded_tables_stay_under_the_row_bound_and_the_plan_fits(monkeypatch, seed):
    nodes, edges, blks = _chain(seed)
    problem = IlpProblem(nodes, edges, _budget(nodes, 0.3), blks)
    monkeypatch.setattr(blocks, "MAX_TABLE_ROWS", 1 << 30)      # exact, but the key counts get recorded
    keys, rows = [], []
    _spy(monkeypatch, "_widths", keys)
    real_join = _spy(monkeypatch, "_join", rows)
    blocks._FRONTIERS.clear()
    blocks._FAST.clear()
    exact = blocks.solve_blocks(problem)
    assert exact.status == "optimal"
    limit = max(keys)             # every factor's keys fit, its Pareto rows do not:
    assert max(rows) > limit
    rows.clear()
    got = _solve(monkeypatch, problem, limit)
    assert got.status == "rounded" and got.rounding_bytes > 0        # the bound did bind
    assert max(rows) <= limit
    assert got.memory_bytes <= problem.budget_bytes                   # true bytes fit
    assert got.time_s >= exact.time_s - 1e-9
    monkeypatch.setattr(blocks, "_join", real_join)
    tighter = _solve(monkeypatch, IlpProblem(nodes, edges, problem.budget_bytes - got.rounding_bytes, blks), None)
    if tighter.status == "optimal":                                   # the stated bound on the loss
        assert got.time_s <= tighter.time_s + 1e-9


@pytest.mark.parametrize("seed", [0, 3])
def test_too_many_keys_falls_back_to_the_lagrangian_with_a_valid_bound(monkeypatch, seed):
    nodes, edges, blks = _chain(seed)
    problem = IlpProblem(nodes, edges, _budget(nodes, 0.3), blks)
    exact = _solve(monkeypatch, problem, None)
    keys = []
    _spy(monkeypatch, "_widths", keys)
    _solve(monkeypatch, problem, 1 << 30)
    got = _solve(monkeypatch, problem, max(keys) - 1)     # the widest factor has more keys than rows allowed
    assert got.status == "lagrangian"
    assert got.memory_bytes <= problem.budget_bytes
    assert got.bound_s is not None and got.bound_s <= exact.time_s + 1e-9 <= got.time_s + 2e-9
    assert np.isclose(sum(n.costs_s[c] for n, c in zip(nodes, got.choice)) +
                      sum(np.asarray(e.cost_s)[got.choice[e.src], got.choice[e.dst]] for e in edges), got.time_s)
