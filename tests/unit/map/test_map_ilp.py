"""MAP eq. (1) ILP (planners/map/ilp.py) against brute force on small random graphs."""
from __future__ import annotations

import itertools
import random

import pytest

from planners.map.ilp import solve
from planners.map.problem import IlpEdge, IlpNode, IlpProblem


def _random_problem(rng: random.Random, budget_kind: str) -> IlpProblem:
    n = rng.randint(3, 7)
    nodes = []
    for k in range(n):
        s = rng.randint(2, 4)
        costs = tuple(round(rng.uniform(0.0, 2.0), 3) for _ in range(s))
        mem = tuple(rng.randint(1, 50) for _ in range(s))
        if rng.random() < 0.2:                          # a duplicate strategy: ties must not break anything
            costs, mem = costs + (costs[0],), mem + (mem[0],)
        nodes.append(IlpNode(f"n{k}", costs, mem))
    edges = []
    for dst in range(1, n):
        for src in rng.sample(range(dst), k=min(dst, rng.randint(1, 2))):
            edges.append(IlpEdge(src, dst, tuple(tuple(round(rng.uniform(0.0, 1.5), 3) if rng.random() < 0.7 else 0.0
                                                       for _ in nodes[dst].costs_s) for _ in nodes[src].costs_s)))
    return _with_budget(rng, nodes, edges, budget_kind)


def _brute(nodes, edges, budget):
    """Every assignment, summed here (not with the module's evaluate)."""
    best, mems = None, []
    for choice in itertools.product(*(range(len(nd.costs_s)) for nd in nodes)):
        mem = sum(nd.memory_bytes[c] for nd, c in zip(nodes, choice))
        mems.append(mem)
        if mem > budget:
            continue
        t = sum(nd.costs_s[c] for nd, c in zip(nodes, choice)) + sum(e.cost_s[choice[e.src]][choice[e.dst]] for e in edges)
        if best is None or t < best:
            best = t
    return best, min(mems), sorted(set(mems))


def _with_budget(rng, nodes, edges, kind):
    _, lo, levels = _brute(nodes, edges, float("inf"))
    budget = {"infeasible": lo - rng.randint(1, 5), "tight": rng.choice(levels),
              "min": lo, "loose": levels[-1] + 10, "mid": (lo + levels[-1]) // 2}[kind]
    return IlpProblem(tuple(nodes), tuple(edges), budget)


def _tol(p: IlpProblem) -> float:
    """Float tolerance from the magnitudes summed: 1e-9 of the largest possible objective."""
    total = sum(max(nd.costs_s) for nd in p.nodes) + sum(max(map(max, e.cost_s)) for e in p.edges)
    return 1e-9 * max(total, 1.0)


KINDS = ["infeasible", "tight", "min", "loose", "mid"]


@pytest.mark.parametrize("formulation", ["marginal", "product"])
@pytest.mark.parametrize("seed", range(30))
def test_matches_brute_force(seed, formulation):
    rng = random.Random(seed)
    p = _random_problem(rng, KINDS[seed % len(KINDS)])
    best, lo, _ = _brute(p.nodes, p.edges, p.budget_bytes)
    sol = solve(p, formulation=formulation)
    assert sol.min_memory_bytes == lo
    if best is None:
        assert sol.status == "infeasible"
        assert sol.memory_bytes == lo             # the reported choice reaches the true minimum
        return
    assert sol.status == "optimal"
    # the returned choice is real: its own sums (recomputed here) are the objective and fit the budget
    mem = sum(nd.memory_bytes[c] for nd, c in zip(p.nodes, sol.choice))
    t = sum(nd.costs_s[c] for nd, c in zip(p.nodes, sol.choice)) + sum(e.cost_s[sol.choice[e.src]][sol.choice[e.dst]] for e in p.edges)
    assert mem == sol.memory_bytes <= p.budget_bytes
    assert t == pytest.approx(sol.time_s, abs=_tol(p))
    assert sol.time_s == pytest.approx(best, abs=_tol(p))


def test_infeasible_names_the_minimum():
    nodes = (IlpNode("a", (1.0, 2.0), (10, 4)), IlpNode("b", (1.0, 3.0), (8, 5)))
    sol = solve(IlpProblem(nodes, (IlpEdge(0, 1, ((0.0, 1.0), (1.0, 0.0))),), 8))
    assert sol.status == "infeasible" and sol.min_memory_bytes == 9 and sol.choice == (1, 1)


def test_exactly_tight_budget_is_feasible():
    nodes = (IlpNode("a", (1.0, 2.0), (10, 4)), IlpNode("b", (1.0, 3.0), (8, 5)))
    sol = solve(IlpProblem(nodes, (), 9))
    assert sol.status == "optimal" and sol.memory_bytes == 9 and sol.time_s == pytest.approx(5.0)


def test_parallel_and_reversed_edges_add_up():
    nodes = (IlpNode("a", (0.0, 0.0), (1, 1)), IlpNode("b", (0.0, 0.0), (1, 1)))
    edges = (IlpEdge(0, 1, ((5.0, 0.0), (1.0, 5.0))), IlpEdge(1, 0, ((5.0, 2.0), (0.0, 5.0))))
    sol = solve(IlpProblem(nodes, edges, 10))
    # (a, b): (0,0) 5+5, (0,1) 0+0, (1,0) 1+2, (1,1) 5+5 -- the reversed edge is read transposed
    assert sol.choice == (0, 1) and sol.time_s == pytest.approx(0.0)


def test_deterministic_on_ties():
    rng = random.Random(7)
    nodes = [IlpNode(f"n{k}", (1.0, 1.0, 1.0), (5, 5, 5)) for k in range(6)]
    edges = [IlpEdge(k, k + 1, ((0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.0))) for k in range(5)]
    p = IlpProblem(tuple(nodes), tuple(edges), 30)
    first = solve(p)
    assert all(solve(p).choice == first.choice for _ in range(3))
    q = _random_problem(rng, "mid")
    assert solve(q).choice == solve(q).choice


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="expected"):
        IlpProblem((IlpNode("a", (1.0,), (1,)), IlpNode("b", (1.0, 2.0), (1, 2))), (IlpEdge(0, 1, ((1.0,),)),), 5)
