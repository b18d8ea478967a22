"""Issue 22: rotor (MAP §5.2, Theorem 5.1) over long chains of repeated layers. The table computed
once per distinct range and vectorised over the checkpoint position (planners.map.rotor_table) must
equal the straightforward loop of eqs. 3-6 value for value and choice for choice; the slot
thresholds must decide feasibility as the table does; min_feasible_budget must find the budget a
plain scan finds; a restricted checkpoint spacing must be exact over its family (brute force) and
never faster than the exact table."""
from __future__ import annotations

import random

import numpy as np
import pytest

import planners.map.rotor as rotor
from costs.rotor import INF, Chain, simulate_peak
from planners.map.rotor_table import Structure, Table


def _reference(chain: Chain, budget: int, slots: int):
    """Eqs. 3-6 as a plain loop over (s, t, s'): C[s, t] and W[s, t] (absolute s', -1 for F_all),
    with the departures planners.map.rotor's doc lists (max over the forwards run, u_fcomm paid)."""
    L = len(chain)
    sl = lambda x: -(-int(x) * slots // budget) if x > 0 else 0
    G = lambda t: chain.w_delta[t] if t < L - 1 else 0
    A, AB = [sl(x) for x in chain.w_a], [sl(x) for x in chain.w_abar]
    of = [chain.o_f[l] + chain.o_fcomm[l] for l in range(L)]
    bwd = [chain.w_abar[l] + chain.w_delta[l] + chain.delta_in(l) + chain.o_b[l] + chain.o_bcomm[l] for l in range(L)]
    tf = [chain.t_fwd(l) for l in range(L)]
    m = np.arange(slots + 1)

    def shift(arr, k):
        out = np.full_like(arr, INF)
        if k <= slots:
            out[k:] = arr[:len(arr) - k] if k > 0 else arr
        return out

    C, W = {}, {}
    for d in range(L):
        for s in range(L - d):
            t = s + d
            thr = sl(max(G(t) + chain.w_abar[s] + of[s], bwd[s]))
            if d == 0:
                best = np.where(m >= thr, tf[s] + chain.t_bwd(s), INF)
            else:
                best = np.where(m >= max(thr, AB[s]), tf[s] + chain.t_bwd(s) + shift(C[s + 1, t], AB[s]), INF)
            choice = np.full(slots + 1, -1)
            fwd_bytes, fwd_time = G(t) + chain.w_a[s] + of[s], tf[s]
            for sp in range(s + 1, t + 1):
                if sp > s + 1:
                    j = sp - 1
                    fwd_bytes = max(fwd_bytes, G(t) + chain.w_a[j - 1] + chain.w_a[j] + of[j])
                    fwd_time += tf[j]
                val = fwd_time + shift(C[sp, t], A[sp - 1]) + C[s, sp - 1]
                val = np.where(m >= max(sl(fwd_bytes), A[sp - 1]), val, INF)
                better = val < best
                best, choice = np.where(better, val, best), np.where(better, sp, choice)
            C[s, t], W[s, t] = best, choice
    return C, W


def _chain(rng: random.Random, L: int, kinds: int, runs: bool) -> Chain:
    """An embedding, a head and L-2 layers of ``kinds`` kinds: in runs (as §5.3's ILP mixes two
    strategies over identical layers) or shuffled."""
    proto = []
    for _ in range(kinds + 2):
        a = rng.randint(1, 12)
        proto.append(dict(u_f=rng.uniform(0.1, 2.0), u_b=rng.uniform(0.1, 4.0), u_fcomm=rng.uniform(0, 0.5),
                          u_bcomm=rng.uniform(0, 0.5), w_a=a, w_abar=a + rng.randint(0, 15),
                          w_delta=a if rng.random() < 0.7 else rng.randint(1, 12), o_f=rng.randint(0, 4),
                          o_b=rng.randint(0, 6), o_fcomm=rng.randint(0, 3), o_bcomm=rng.randint(0, 3)))
    if runs:
        cuts = sorted(rng.sample(range(1, L - 1), min(kinds - 1, L - 2))) if L > 2 else []
        mid = [next(k for k, c in enumerate(cuts + [L]) if i < c) % kinds for i in range(1, L - 1)]
    else:
        mid = [rng.randrange(kinds) for _ in range(L - 2)]
    seq = ([kinds] + mid + [kinds + 1])[:L]
    fields = {k: tuple(proto[i][k] for i in seq) for k in proto[0]}
    return Chain(**fields, w_input=rng.randint(0, 8), w_delta_input=rng.randint(0, 4), fixed_bytes=rng.randint(0, 10))


@pytest.mark.parametrize("seed", range(40))
def test_table_equals_the_plain_loop(seed):
    rng = random.Random(seed)
    chain = _chain(rng, rng.randint(1, 24), rng.randint(1, 3), runs=seed % 2 == 0)
    slots, budget = rng.choice([7, 40, 120]), rng.randint(10, 160)
    C, W = _reference(chain, budget, slots)
    tab = Table(Structure(chain), budget, slots)
    tab.build()
    L = len(chain)
    for s in range(L):
        for t in range(s, L):
            assert np.array_equal(tab.C[tab.st.key[s, t]], C[s, t]), (s, t)     # bit for bit, inf included
            assert [tab.choice(s, t, m) for m in range(slots + 1)] == W[s, t].tolist(), (s, t)
    m0 = slots - tab.slots(chain.w_input + chain.fixed_bytes)
    fits = m0 >= 0 and np.isfinite(C[0, L - 1][m0])
    assert (m0 >= 0 and tab.threshold() <= m0) == fits


def test_repeated_layers_share_rows():
    """500 identical layers between an embedding and a head: about 4 L distinct ranges, not L^2 / 2."""
    rng = random.Random(0)
    chain = _chain(rng, 502, 1, runs=True)
    st = Structure(chain)
    assert len(st.reps) < 5 * 502
    assert st.work(500) < rotor.MAX_EXACT_CELLS


@pytest.mark.parametrize("seed", range(12))
def test_min_feasible_budget_equals_a_scan(seed):
    rng = random.Random(100 + seed)
    chain = _chain(rng, rng.randint(2, 12), 2, runs=True)
    slots, lower = rng.choice([5, 30]), rng.randint(1, 40)
    found = rotor.min_feasible_budget(chain, slots, lower_bytes=lower)
    fits = lambda b: np.isfinite(_reference(chain, b, slots)[0][0, len(chain) - 1][
        slots - (-(-(chain.w_input + chain.fixed_bytes) * slots // b))]) if \
        -(-(chain.w_input + chain.fixed_bytes) * slots // b) <= slots else False
    assert fits(found)
    assert found == lower or not fits(found - 1)


def _persistent(s, t, allowed):
    """Every persistent sequence of stages s..t whose checkpoints a^{s'-1} have allowed s'."""
    if s == t:
        yield [("F_all", s), ("B", s)]
        return
    for rest in _persistent(s + 1, t, allowed):
        yield [("F_all", s)] + rest + [("B", s)]
    for sp in range(s + 1, t + 1):
        if allowed(sp):
            fwd = [("F_ck", s)] + [("F_none", j) for j in range(s + 1, sp)]
            for right in _persistent(sp, t, allowed):
                for left in _persistent(s, sp - 1, allowed):
                    yield fwd + right + left


@pytest.mark.parametrize("seed", range(16))
def test_checkpoint_spacing_is_exact_over_its_family(seed, monkeypatch):
    rng = random.Random(200 + seed)
    chain = _chain(rng, rng.randint(3, 6), 2, runs=seed % 2 == 0)
    every = rng.choice([2, 3])
    op_time = lambda seq: sum(chain.t_fwd(l) if op != "B" else chain.t_bwd(l) for op, l in seq)
    runs = [(simulate_peak(chain, q), op_time(q)) for q in _persistent(0, len(chain) - 1, lambda sp: sp % every == 0)]
    exact = {}
    for budget in sorted({p for p, _ in runs}):
        exact[budget] = rotor.solve(chain, budget, memory_slots=budget)      # one byte per slot: exact
        monkeypatch.setattr(rotor, "EVERY", every)
        sol = rotor.solve(chain, budget, memory_slots=budget)
        monkeypatch.setattr(rotor, "EVERY", None)
        assert sol.feasible and sol.peak_bytes <= budget
        if sol.every == every:       # else the family did not fit and the spacing was halved
            assert sol.time_s == pytest.approx(min(t for p, t in runs if p <= budget), abs=1e-9)
            assert all(g.stop % every == 0 for g in sol.segments if g.checkpointed and g.stop < len(chain))
        assert sol.time_s >= exact[budget].time_s - 1e-9


def test_spacing_never_loses_feasibility(monkeypatch):
    """Near its smallest budget a sparse spacing does not fit: it is halved until it does."""
    rng = random.Random(7)
    chain = _chain(rng, 40, 2, runs=True)
    need = rotor.min_feasible_budget(chain, 200)
    monkeypatch.setattr(rotor, "EVERY", 16)
    sol = rotor.solve(chain, need, 200, find_min=False)
    assert sol.feasible and sol.peak_bytes <= need
