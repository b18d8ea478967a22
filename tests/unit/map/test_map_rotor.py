"""rotor with MAP's communication terms (planners/map/rotor.py) against brute force on small chains."""
from __future__ import annotations

import random

import pytest

from planners.map.problem import IlpNode, IlpProblem
from costs.rotor import Chain, Segment, simulate_peak
from planners.map.rotor import integrate, solve


def _chain(rng: random.Random, L: int) -> Chain:
    w_a = tuple(rng.randint(1, 12) for _ in range(L))
    return Chain(
        u_f=tuple(round(rng.uniform(0.1, 2.0), 2) for _ in range(L)),
        u_b=tuple(round(rng.uniform(0.1, 4.0), 2) for _ in range(L)),
        u_fcomm=tuple(round(rng.uniform(0.0, 0.5), 2) for _ in range(L)),
        u_bcomm=tuple(round(rng.uniform(0.0, 0.5), 2) for _ in range(L)),
        w_a=w_a, w_abar=tuple(a + rng.randint(0, 15) for a in w_a),
        w_delta=tuple(a if rng.random() < 0.7 else rng.randint(1, 12) for a in w_a),
        o_f=tuple(rng.randint(0, 4) for _ in range(L)), o_b=tuple(rng.randint(0, 6) for _ in range(L)),
        o_fcomm=tuple(rng.randint(0, 3) for _ in range(L)), o_bcomm=tuple(rng.randint(0, 3) for _ in range(L)),
        w_input=rng.randint(0, 8), w_delta_input=rng.randint(0, 4), fixed_bytes=rng.randint(0, 10))


def _persistent(s: int, t: int):
    """Every persistent sequence for stages s..t (rotor's family: F_all at s, or a checkpoint a^{s'-1})."""
    if s == t:
        yield [("F_all", s), ("B", s)]
        return
    for rest in _persistent(s + 1, t):
        yield [("F_all", s)] + rest + [("B", s)]
    for sp in range(s + 1, t + 1):
        fwd = [("F_ck", s)] + [("F_none", j) for j in range(s + 1, sp)]
        for right in _persistent(sp, t):
            for left in _persistent(s, sp - 1):
                yield fwd + right + left


def _op_time(chain: Chain, seq) -> float:
    return sum(chain.u_f[l] + chain.u_fcomm[l] if op != "B" else chain.u_b[l] + chain.u_bcomm[l] for op, l in seq)


def _brute(chain: Chain):
    """(peak, time) of every persistent sequence."""
    return [(simulate_peak(chain, seq), _op_time(chain, seq)) for seq in _persistent(0, len(chain) - 1)]


def _expand(segs) -> list:
    """The op order nested torch.utils.checkpoint gives for ``segs``: every forward in order, then the
    backwards in reverse; a checkpointed segment runs F_ck/F_none forward and, at its backward,
    recomputes its children with their own structure."""
    fwd, bwd = [], []
    for g in segs:
        stages = range(g.start, g.stop)
        if g.checkpointed:
            fwd += [("F_ck" if l == g.start else "F_none", l) for l in stages]
            bwd = _expand(g.children) + bwd
        else:
            fwd += [("F_all", l) for l in stages]
            bwd = [("B", l) for l in reversed(stages)] + bwd
    return fwd + bwd


@pytest.mark.parametrize("seed", range(30))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    chain = _chain(rng, rng.randint(2, 6))
    runs = _brute(chain)
    lo, hi = min(p for p, _ in runs), max(p for p, _ in runs)
    for budget in sorted({lo, rng.randint(lo, hi), hi, hi + 5}):
        best = min(t for p, t in runs if p <= budget)
        sol = solve(chain, budget, memory_slots=budget)     # one byte per slot: the DP is exact
        assert sol.feasible and sol.time_s == pytest.approx(best, abs=1e-9)
        assert sol.peak_bytes == simulate_peak(chain, sol.sequence) <= budget
        assert sol.time_s == pytest.approx(_op_time(chain, sol.sequence), abs=1e-9)
        assert [l for op, l in sol.sequence if op == "B"] == list(reversed(range(len(chain))))
        assert list(sol.sequence) == _expand(sol.segments)  # the segments realise the sequence
    below = solve(chain, lo - 1, memory_slots=lo - 1) if lo > 1 else None
    if below is not None:
        assert not below.feasible and below.min_budget_bytes >= lo


@pytest.mark.parametrize("seed", range(6))
def test_coarse_slots_stay_within_budget_and_monotone(seed):
    rng = random.Random(100 + seed)
    chain = _chain(rng, 6)
    runs = _brute(chain)
    lo, hi = min(p for p, _ in runs), max(p for p, _ in runs)
    last = float("inf")
    for budget in range(lo, hi + 20):
        sol = solve(chain, budget, memory_slots=16)       # rounding up: never over, sometimes slower
        if sol.feasible:
            assert sol.peak_bytes <= budget
            assert sol.time_s >= min(t for p, t in runs if p <= budget) - 1e-9
            assert sol.time_s <= last + 1e-9               # a larger budget is never slower
            last = sol.time_s
        else:
            assert last == float("inf")                    # once feasible, stays feasible


def test_min_budget_is_the_true_minimum():
    rng = random.Random(3)
    chain = _chain(rng, 5)
    lo = min(p for p, _ in _brute(chain))
    sol = solve(chain, lo - 3, memory_slots=lo)           # one byte per slot at the true minimum: exact
    assert not sol.feasible and sol.min_budget_bytes == lo
    # fine slots of a non-integer byte size: sizes round up, so at most one byte above the minimum
    fine = solve(chain, lo - 3, memory_slots=100_000).min_budget_bytes
    assert lo <= fine <= lo + 1
    assert solve(chain, fine, 100_000).feasible and not solve(chain, fine - 1, 100_000).feasible


def test_all_fits_means_no_recompute():
    chain = _chain(random.Random(5), 6)
    sol = solve(chain, 10_000)
    base = sum(chain.u_f) + sum(chain.u_b) + sum(chain.u_fcomm) + sum(chain.u_bcomm)
    assert sol.time_s == pytest.approx(base) and sol.recompute_s == pytest.approx(0.0)
    assert sol.segments == (Segment(0, 6, False),)
    assert all(op in ("F_all", "B") for op, _ in sol.sequence)


def test_simulated_peak_closed_form():
    # two stages, all stored: peak at B^1 = fixed + input + abar0 + abar1 + delta1 + delta0 + o_b1 + o_bcomm1
    c = Chain((1.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0), w_a=(4, 4), w_abar=(10, 20), w_delta=(4, 4),
              o_f=(0, 0), o_b=(3, 3), o_fcomm=(0, 0), o_bcomm=(1, 1), w_input=2, fixed_bytes=100)
    assert simulate_peak(c, (("F_all", 0), ("F_all", 1), ("B", 1), ("B", 0))) == 100 + 2 + 10 + 20 + 4 + 4 + 3 + 1
    # recompute stage 0: only a^0 (4) is held while stage 1 runs
    seq = (("F_ck", 0), ("F_all", 1), ("B", 1), ("F_all", 0), ("B", 0))
    assert simulate_peak(c, seq) == 100 + 2 + 4 + 20 + 4 + 4 + 3 + 1
    with pytest.raises(ValueError, match="B"):
        simulate_peak(c, (("F_ck", 0), ("F_none", 1), ("B", 1)))


def test_communication_terms_are_charged():
    base = dict(u_f=(1.0, 1.0, 1.0), u_b=(2.0, 2.0, 2.0), w_a=(10, 10, 10), w_abar=(30, 30, 30),
                w_delta=(10, 10, 10), o_f=(0, 0, 0), o_b=(0, 0, 0), o_fcomm=(0, 0, 0), o_bcomm=(0, 0, 0))
    plain = Chain(u_fcomm=(0.0,) * 3, u_bcomm=(0.0,) * 3, **base)
    comm = Chain(u_fcomm=(0.5,) * 3, u_bcomm=(0.25,) * 3, **base)
    budget = 75                                           # too small to store all three a-bars
    a, b = solve(plain, budget, budget), solve(comm, budget, budget)
    assert a.recompute_s > 0 and b.sequence == a.sequence
    n_fwd = sum(op != "B" for op, _ in b.sequence)
    assert b.time_s == pytest.approx(a.time_s + 0.5 * n_fwd + 0.25 * 3)   # recomputed forwards re-run their collectives


def test_integrate_prefers_a_faster_ilp_plan_that_recomputes():
    budget = 100
    # one op, two strategies: fast (4 s) keeping 20 B of parameters + 120 B of activations, or slow (8 s) keeping 20 + 60
    build = lambda b: IlpProblem((IlpNode("block", (4.0, 8.0), (140, 80)),), (), b)

    def chain_of(sol):
        act = 30 if sol.choice[0] == 0 else 15
        return Chain(u_f=(0.5,) * 4, u_b=(0.5,) * 4, u_fcomm=(0.0,) * 4, u_bcomm=(0.0,) * 4, w_a=(act,) * 4,
                     w_abar=(act,) * 4, w_delta=(5,) * 4, o_f=(0,) * 4, o_b=(0,) * 4, o_fcomm=(0,) * 4,
                     o_bcomm=(0,) * 4, fixed_bytes=20)
    res = integrate(build, chain_of, budget, alpha=0.25, n=4)
    assert res.k == 2                                     # 100 * 1.25^2 = 156 is the first ILP budget admitting 140
    assert res.ilp.choice == (0,) and res.rotor.peak_bytes <= budget and res.rotor.recompute_s > 0
    assert res.total_s == pytest.approx(4.0 + res.rotor.recompute_s) and res.total_s < 8.0
    assert [t for _, _, t in res.tried][:2] == [8.0, 8.0]


@pytest.mark.parametrize("seed", range(12))
def test_sequence_of_inverts_the_segments(seed):
    """The plan carries rotor's segment tree, not its sequence: sequence_of must rebuild the very
    sequence the DP chose (the simulator and the executor run the tree)."""
    from costs.rotor import sequence_of, walk
    from planners.map.rotor import min_feasible_budget

    rng = random.Random(seed)
    chain = _chain(rng, rng.randint(1, 7))
    lo = min_feasible_budget(chain, memory_slots=200)
    for budget in (lo, int(lo * 1.3), lo * 4):
        sol = solve(chain, budget, memory_slots=200, find_min=False)
        assert sol.feasible
        assert sequence_of(sol.segments, len(chain)) == sol.sequence
        steps = walk(chain, sol.sequence)
        assert max(p for _, p in steps) == sol.peak_bytes
        # after the whole sequence only delta^{-1} (and the fixed bytes and input) are live
        assert steps[-1][0] == chain.fixed_bytes + chain.w_input + chain.w_delta_input
