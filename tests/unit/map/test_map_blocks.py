"""The block DP for MAP eq. (1) (planners/map/blocks.py) against brute force and the ILP on small
chains of blocks: identical (the transformer case, frontiers shared) and all different."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from planners.map.blocks import solve_blocks
from planners.map.ilp import solve
from planners.map.problem import IlpEdge, IlpNode, IlpProblem


def _matrix(rng, ku, kv):
    return tuple(tuple(round(rng.uniform(0.0, 1.5), 3) if rng.random() < 0.7 else 0.0 for _ in range(kv))
                 for _ in range(ku))


def _chain(rng: random.Random, identical: bool):
    """2-4 blocks of 2-4 nodes (2-3 strategies), a random DAG inside each block and 1-3 edges from
    a block to the next (either direction, any node, sometimes two in parallel)."""
    n_blocks, per = rng.randint(2, 4), rng.randint(2, 4)
    while n_blocks * per > 10:                       # brute force stays under ~60k assignments
        per -= 1
    def block_spec():
        ks = [rng.randint(2, 3) for _ in range(per)]
        nodes = []
        for k in ks:
            costs = tuple(round(rng.uniform(0.0, 2.0), 3) for _ in range(k))
            mem = tuple(rng.randint(1, 30) for _ in range(k))
            if rng.random() < 0.2:                   # a duplicate strategy: ties must not break anything
                costs, mem = costs + (costs[0],), mem + (mem[0],)
            nodes.append(IlpNode("x", costs, mem))
        inner = [(src, dst) for dst in range(1, per) for src in rng.sample(range(dst), k=min(dst, rng.randint(1, 2)))]
        cross = [(rng.randrange(per), rng.randrange(per), rng.random() < 0.3) for _ in range(rng.randint(1, 3))]
        return nodes, inner, cross
    specs = [block_spec()] * n_blocks if identical else [block_spec() for _ in range(n_blocks)]
    mats = {}
    def mat(key, ku, kv):                            # identical blocks share their matrices too
        if not identical or key not in mats:
            mats[key] = _matrix(rng, ku, kv)
        return mats[key]
    nodes, edges = [], []
    for b, (bn, inner, cross) in enumerate(specs):
        base = b * per
        nodes += [dataclasses.replace(nd, name=f"b{b}n{i}") for i, nd in enumerate(bn)]
        for src, dst in inner:
            edges.append(IlpEdge(base + src, base + dst, mat(("in", src, dst), len(bn[src].costs_s), len(bn[dst].costs_s))))
        if b:
            prev = specs[b - 1][0]
            for j, (u, v, backwards) in enumerate(cross):
                m = mat(("x", j), len(prev[u].costs_s), len(bn[v].costs_s))
                if backwards:                        # the same cost, stored from the later block
                    edges.append(IlpEdge(base + v, base - per + u, tuple(zip(*m))))
                else:
                    edges.append(IlpEdge(base - per + u, base + v, m))
    blocks = tuple(tuple(range(b * per, (b + 1) * per)) for b in range(n_blocks))
    return nodes, edges, blocks


def _brute(nodes, edges):
    """(time, bytes) of every assignment, summed here with numpy (not with the module's evaluate)."""
    grid = np.stack(np.meshgrid(*[np.arange(len(nd.costs_s)) for nd in nodes], indexing="ij"), -1).reshape(-1, len(nodes))
    t = sum(np.asarray(nd.costs_s)[grid[:, i]] for i, nd in enumerate(nodes))
    t = t + sum(np.asarray(e.cost_s)[grid[:, e.src], grid[:, e.dst]] for e in edges)
    m = sum(np.asarray(nd.memory_bytes)[grid[:, i]] for i, nd in enumerate(nodes))
    return t, m


KINDS = ["infeasible", "tight", "min", "loose", "mid", "tight"]


@pytest.mark.parametrize("identical", [True, False])
@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force_and_ilp(seed, identical):
    rng = random.Random(seed)
    nodes, edges, blocks = _chain(rng, identical)
    t_all, m_all = _brute(nodes, edges)
    levels = np.unique(m_all)
    kind = KINDS[seed % len(KINDS)]
    budget = int({"infeasible": levels[0] - rng.randint(1, 5), "tight": rng.choice(list(levels)), "min": levels[0],
                  "loose": levels[-1] + 10, "mid": (levels[0] + levels[-1]) // 2}[kind])
    p = IlpProblem(tuple(nodes), tuple(edges), budget, blocks)
    sol = solve_blocks(p)
    assert sol.min_memory_bytes == levels[0]
    fits = m_all <= budget
    if not fits.any():
        assert sol.status == "infeasible" and sol.memory_bytes == levels[0]
        return
    best = float(t_all[fits].min())
    tol = 1e-9 * max(float(np.abs(t_all).max()), 1.0)
    mine = np.all(np.stack(np.meshgrid(*[np.arange(len(nd.costs_s)) for nd in nodes], indexing="ij"), -1)
                  .reshape(-1, len(nodes)) == np.asarray(sol.choice), axis=1)
    assert sol.status == "optimal"
    assert m_all[mine][0] == sol.memory_bytes <= budget       # the returned choice is real and fits
    assert sol.time_s == pytest.approx(float(t_all[mine][0]), abs=tol)
    assert sol.time_s == pytest.approx(best, abs=tol)
    ilp = solve(dataclasses.replace(p, blocks=None))
    assert ilp.time_s == pytest.approx(sol.time_s, abs=tol)


@pytest.mark.parametrize("seed", range(100, 108))
def test_every_budget_level(seed):
    """Each distinct byte total as the budget (each one tight), and one byte under the least: the
    bounds and thresholds see every regime, including labels all cut before the last block."""
    nodes, edges, blocks = _chain(random.Random(seed), seed % 2 == 0)
    t_all, m_all = _brute(nodes, edges)
    for budget in [int(m_all.min()) - 1] + [int(x) for x in np.unique(m_all)]:
        sol = solve_blocks(IlpProblem(tuple(nodes), tuple(edges), budget, blocks))
        fits = m_all <= budget
        if not fits.any():
            assert sol.status == "infeasible"
            continue
        assert sol.memory_bytes <= budget
        assert sol.time_s == pytest.approx(float(t_all[fits].min()), abs=1e-9 * max(float(t_all.max()), 1.0))


def test_solve_uses_blocks_when_given():
    rng = random.Random(3)
    nodes, edges, blocks = _chain(rng, True)
    p = IlpProblem(tuple(nodes), tuple(edges), 10 ** 6, blocks)
    assert solve(p).choice == solve_blocks(p).choice
    assert solve(p, method="ilp").time_s == pytest.approx(solve(p).time_s, abs=1e-9)
    with pytest.raises(ValueError, match="method"):
        solve(p, method="dp")
    with pytest.raises(ValueError, match="needs problem.blocks"):
        solve_blocks(dataclasses.replace(p, blocks=None))


def test_identical_blocks_share_work_and_stay_deterministic():
    """32 copies of a 3-node block, a budget that binds: same answer every time, and the ILP's."""
    node = IlpNode("n", (1.0, 0.6, 0.3), (4, 7, 11))
    r = ((0.0, 0.2, 0.5), (0.2, 0.0, 0.2), (0.5, 0.2, 0.0))
    nodes = [node] * 96
    edges = [IlpEdge(3 * b + i, 3 * b + i + 1, r) for b in range(32) for i in range(2)]
    edges += [IlpEdge(3 * b + 2, 3 * b + 3, r) for b in range(31)] + [IlpEdge(3 * b, 3 * b + 3, r) for b in range(31)]
    blocks = tuple((3 * b, 3 * b + 1, 3 * b + 2) for b in range(32))
    p = IlpProblem(tuple(nodes), tuple(edges), 96 * 6, blocks)
    first = solve_blocks(p)
    assert all(solve_blocks(p).choice == first.choice for _ in range(2))
    assert first.memory_bytes <= p.budget_bytes and first.status == "optimal"
    assert first.time_s == pytest.approx(solve(p, method="ilp").time_s, abs=1e-9)


def test_rejects_bad_blocks():
    nodes = tuple(IlpNode(f"n{i}", (1.0,), (1,)) for i in range(3))
    with pytest.raises(ValueError, match="exactly once"):
        IlpProblem(nodes, (), 5, ((0,), (1,)))
    with pytest.raises(ValueError, match="not the same or consecutive"):
        IlpProblem(nodes, (IlpEdge(0, 2, ((0.0,),)),), 5, ((0,), (1,), (2,)))
