"""MAP eq. (1) solved exactly on a chain of blocks (a transformer's layers) by dynamic programming over
Pareto sets of (time, bytes): the single budget row that makes the ILP branch (planners/map/ilp.py)
becomes one dimension of a label, and the 32 identical layers are priced once.

Input: ``IlpProblem.blocks``, node indices per block in chain order, every edge inside one block or
between two consecutive blocks (checked by IlpProblem). Steps, after map_ilp's exact reductions:

0. First eq. (1) without its budget row (planners/map/fastest.py: min-sum elimination on dense
   tables, no Pareto sets); when that choice's bytes fit, it is the optimum and the rest is skipped
   (issue 26: a 3-D mesh's unconstrained solve took 232 s in the Pareto frontiers below).
1. Per block b its *out-boundary* tau_b: its free nodes with an edge into block b+1; the block's
   *in-boundary* is tau_{b-1}. A boundary state is one strategy per boundary node.
2. Per block, for every (in-state sigma, out-state tau), the Pareto set of (time, bytes) over the
   block's assignments, with their per-node choice. Time counts the block's node costs, its inner
   edges and the edges from tau_{b-1} into it, so every edge is counted exactly once (by the block
   holding its later endpoint). Computed by variable elimination with Pareto sets as factor values
   (Bertele & Brioschi's nonserial DP with a vector objective): the boundary nodes are kept, every
   other node is eliminated in a greedy order (smallest joined table first) by joining the factors
   that hold it and keeping, per assignment of the rest, the Pareto points; the eliminated node's
   strategy rides along with each point. A transformer block has treewidth 2 (its two residual
   cycles), so tables stay at three nodes' strategies. The last join of each step drops the
   eliminated node from the key as its pairs form (_join_exact: pairs that a kept point beats are
   cut before any sort, so the three-node table with the node in its key is never built; issue 26:
   the 2x2x2 mesh's gpt3_2b6 / 20 GiB solve went from 150-180 s to ~20 s, the same choice).
   Blocks with the same reduced data (node costs/bytes, edges, boundaries) share one computation:
   in the benchmark, blocks 1..30 of 32 (block 0 has no in-edges, the last no out-edges, so the
   reductions prune them differently).
3. A DP over the blocks with labels (tau_b, time, bytes): a label of block b-1 with out-state sigma
   joins every frontier point of block b with in-state sigma; per out-state only the Pareto set is
   kept. Then the fastest final label, and its choice followed back.
4. Bounds that prune labels (they do not change the answer): a label is dropped when its bytes plus
   the least bytes of the later blocks exceed the budget, or when a lower bound on every completion's
   time (Lagrangian: min over completions of time + lam * bytes, minus lam * the bytes left; lam at
   the dual optimum, found on the frontiers in a few scalar DPs) puts it above a threshold theta.
   theta is tried at lb + (ub - lb) / 1024, / 64, / 16, / 4, then ub (lb: the dual bound; ub: the
   fastest Lagrangian minimiser that fits, a real solution); a run whose best label is <= theta is
   exact, and every such run returns the same choice (see solve_blocks).

Exactness: eq. (1)'s objective and memory are sums over blocks once each edge is attributed to the
block of its later endpoint; given the boundary state between two blocks, the two sides add up
independently. So a solution whose restriction to a prefix is Pareto-dominated (same boundary state,
no faster and no smaller) can be replaced on that prefix without losing time or bytes: keeping only
Pareto labels per state (and per factor in step 2) loses no optimum -- the classic argument for
resource-constrained shortest paths. The byte cut drops only labels with no feasible completion; the
time cut only labels whose every feasible completion is slower than theta, and when the best final
label is <= theta the optimum's own labels (bound <= optimum <= that label) were all kept.
Memory is exact integer bytes: no discretisation, so no discretisation loss; the answer equals the
ILP's optimum. Times are float sums: solutions within float rounding (~1e-15 relative) may tie
either way (theta carries a 1e-9 relative margin so rounding never cuts the optimum); the returned
choice's time and bytes are recomputed from the input by map_ilp.evaluate.

Size: a Pareto set per state holds at most the distinct byte totals under the budget; the
benchmark's bytes are multiples of 512 KiB and the bounds keep at most ~200 labels per block, so
40/20/10 GiB each solve in under 0.5 s on one core (HiGHS on the whole ILP: 1.2 s, > 10 s, 4.4 s). Boundary
states are the product of the boundary nodes' strategy counts: more than MAX_STATES is refused (cut
the chain where few nodes link two blocks). Deterministic: stable sorts, ties to the first label in
construction order.

Bounded (issue 26: a 2x2x2 mesh's three-node factor reached 11.3 M Pareto rows, GiBs): a factor keeps
at most MAX_TABLE_ROWS rows. Over it, its bytes are rounded UP to a coarser grid (_coarsen; status
"rounded", IlpSolution.rounding_bytes the summed round-ups: the choice fits in true bytes and is no
slower than the exact optimum under budget - rounding_bytes). A block whose elimination would build a
factor with more keys than MAX_TABLE_ROWS (_widths) is solved by the Lagrangian relaxation instead
(planners.map.blocks_bound; status "lagrangian", exact optimum in [bound_s, time_s]).
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np

from planners.map.block_graph import _join_exact, _neighbours, _pareto, _reduced, _signature, _Table
from planners.map.blocks_bound import lagrangian
from planners.map.fastest import fastest_choice
from planners.map.problem import IlpProblem, IlpSolution, Reduced, evaluate, min_memory_choice

MAX_STATES = 1 << 14    # boundary states per block: a frontier and a DP step cost about their square
THETA_FRACTIONS = (1 / 1024, 1 / 64, 1 / 16, 1 / 4, 1.0)   # step 4's thresholds, lb + frac * (ub - lb)
#: pairs of rows one step of a factor join forms at once (_join): ~100 bytes a pair (keys, choices,
#: time, bytes, indices) bound a join's scratch to tens of MiB whatever the cross product's size
JOIN_CHUNK_PAIRS = 1 << 18
#: rows a factor of a block's variable elimination keeps (_coarsen): past it the rows' bytes are
#: rounded up to a coarser grid and the error is reported (IlpSolution.rounding_bytes). None (the
#: default): exact. A factor with more keys (boundary strategy combinations) than it gives way to the
#: Lagrangian fallback (blocks_bound). Measured: at 2^19 the README's gpt3_2b6 / 20 GiB plan came out
#: 26 % slower (2.794 vs 2.208 s) than the exact DP's, so the bound stays opt-in (the 2x2x2 tight
#: budget, 1.1 M keys, needs it: 8 s with it, unbounded memory without).
MAX_TABLE_ROWS: int | None = None


class _TooLarge(Exception):
    """A factor holds more keys than MAX_TABLE_ROWS: the Pareto DP cannot be bounded by rounding."""


def _coarsen(tab: _Table, size: dict, limit: int | None, grid: int) -> _Table:
    """``tab`` with at most ``limit`` rows (or one per key, if there are more keys): while it is over,
    each row's bytes are rounded UP to a multiple of g (g = 2 grid, 4 grid, ...) and per key the fastest
    point per bucket kept (issue 26: a 2x2x2 mesh's three-node factor held 11.3 M Pareto rows). Rounding
    up keeps every kept point's true bytes <= its m, so a choice the DP fits is within the budget in true
    bytes; ``err`` grows by the most any row is rounded up (< g), so a row's m is at most its true
    bytes + err (joins add their inputs' err): the DP's answer is no slower
    than the exact optimum under budget - (the chain's summed err)."""
    if limit is None or len(tab.t) <= limit:
        return tab
    keys = len(np.unique(np.ravel_multi_index(tab.key.T, [size[v] for v in tab.scope]))) if tab.scope else 1
    if keys > limit:            # no grid brings it under limit: solve_blocks falls back to blocks_bound.lagrangian
        raise _TooLarge(f"a factor over {[size[v] for v in tab.scope]} strategies has {keys} keys (> {limit})")
    base = max(int(grid), 1)

    def rounded(k: int) -> _Table:
        g = base << k
        m = -(-tab.m // g) * g
        up = int((m - tab.m).max(initial=0))     # the most any row is rounded up by
        return _prune(_Table(tab.scope, tab.key, tab.t, m, tab.elim, tab.choice, tab.placed, tab.err + up), size)

    # the smallest g = base·2^k that brings the rows under limit, by bisection on k (rows do not grow
    # with g): a doubling loop from g = 2·base needed ~30 prunes of > 2^19 rows when bytes are GiBs
    # (a 20 GiB budget on gpt3_2b6 took minutes). At g above every m each key has one bucket: <= keys rows
    lo, hi = 1, max(int(tab.m.max(initial=0)) // base, 1).bit_length() + 1
    best = rounded(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        trial = rounded(mid)
        if len(trial.t) <= limit:
            hi, best = mid, trial
        else:
            lo = mid + 1
    return best


def _join(a: _Table, b: _Table, size: dict, cap: int, min_of: dict, total_min: int,
          chunk_pairs: int | None = None, limit: int | None = None, grid: int = 1) -> _Table:
    """Every pair of rows that agree on the shared nodes, summed; then the points that cannot fit
    (bytes + the least bytes of the nodes not yet placed > cap) and the dominated ones are dropped.

    Streamed: the pairs are formed ``chunk_pairs`` at a time (default JOIN_CHUNK_PAIRS), each chunk
    cut to its fitting Pareto points before the next is formed, so the memory is bounded by one
    chunk plus the points kept, never the whole cross product (issue 26: a 2x2x2 mesh's join of two
    large factors allocated > 1 GiB at once). Exact: a point dominated within its chunk is
    dominated in the union, and the Pareto set of the union is that of the chunks' Pareto sets.
    ``limit`` (rows) and ``grid`` (bytes): the kept points are bounded by _coarsen (None: exact, and
    done by _join_exact: the same rows, faster)."""
    if limit is None:
        return _join_exact(a, b, size, cap, min_of, total_min, None,
                           JOIN_CHUNK_PAIRS if chunk_pairs is None else chunk_pairs)
    chunk = JOIN_CHUNK_PAIRS if chunk_pairs is None else max(int(chunk_pairs), 1)
    shared = [v for v in a.scope if v in b.scope]
    flat = lambda tab: (np.ravel_multi_index(tab.key[:, [tab.scope.index(v) for v in shared]].T, [size[v] for v in shared])
                        if shared else np.zeros(len(tab.t), dtype=np.int64))
    ga, gb = flat(a), flat(b)
    order_b = np.argsort(gb, kind="stable")
    start = np.searchsorted(gb[order_b], ga, side="left")
    count = np.searchsorted(gb[order_b], ga, side="right") - start
    ends = np.cumsum(count)                 # pairs of rows 0..i of a: ends[i]
    total = int(ends[-1]) if len(ends) else 0
    extra = [j for j, v in enumerate(b.scope) if v not in a.scope]
    scope = a.scope + [b.scope[j] for j in extra]
    placed = a.placed | b.placed
    room = cap - (total_min - sum(min_of[v] for v in placed))   # the most bytes a point may hold
    parts: list[_Table] = []
    kept = settled = 0      # rows in parts; rows of the last consolidated table
    err = a.err + b.err
    for p0 in range(0, total, chunk):
        pair = np.arange(p0, min(p0 + chunk, total), dtype=np.int64)
        ai = np.searchsorted(ends, pair, side="right")          # the row of a each pair belongs to
        bi = order_b[start[ai] + pair - (ends[ai] - count[ai])]
        m = a.m[ai] + b.m[bi]
        ok = np.nonzero(m <= room)[0]
        ai, bi = ai[ok], bi[ok]
        part = _Table(scope, np.column_stack([a.key[ai], b.key[bi][:, extra]]), a.t[ai] + b.t[bi], m[ok],
                      a.elim + b.elim, np.column_stack([a.choice[ai], b.choice[bi]]), placed, err)
        parts.append(_prune(part, size))
        kept += len(parts[-1].t)
        # the kept points stay bounded too: consolidated (one Pareto set) once they pass a chunk and
        # twice the last consolidated set, so a frontier of F rows costs O(F log F) prunes in all; at
        # every chunk (the first cut) a 20 GiB gpt3_2b6 block re-sorted its whole growing set per
        # chunk, quadratic: > 10 min on CI, 70 % of it in _prune
        if len(parts) > 1 and kept > max(chunk, 2 * settled):
            parts = [_coarsen(_prune(_concat(parts), size), size, limit, grid)]
            kept = settled = len(parts[0].t)
    if not parts:
        width = a.choice.shape[1] + b.choice.shape[1]
        return _Table(scope, np.zeros((0, len(scope)), dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64),
                      a.elim + b.elim, np.zeros((0, width), dtype=np.int64), placed, err)
    return _coarsen(parts[0] if len(parts) == 1 else _prune(_concat(parts), size), size, limit, grid)


def _concat(parts: list[_Table]) -> _Table:
    """Tables of one scope, rows stacked in order (the first duplicate stays first)."""
    p = parts[0]
    return _Table(p.scope, np.concatenate([x.key for x in parts]), np.concatenate([x.t for x in parts]),
                  np.concatenate([x.m for x in parts]), p.elim, np.concatenate([x.choice for x in parts]), p.placed,
                  max(x.err for x in parts))


def _prune(tab: _Table, size: dict) -> _Table:
    group = (np.ravel_multi_index(tab.key.T, [size[v] for v in tab.scope]) if tab.scope
             else np.zeros(len(tab.t), dtype=np.int64))
    sel = _pareto(group, tab.t, tab.m)
    return _Table(tab.scope, tab.key[sel], tab.t[sel], tab.m[sel], tab.elim, tab.choice[sel], tab.placed, tab.err)


def _frontier(red: Reduced, nbr, local: list[int], sigma: list[int], tau: list[int], cap: int,
              limit: int | None = None, grid: int = 1):
    """Pareto sets of one block keyed by (sigma state, tau state), both flattened (row-major over the
    boundary nodes' strategy counts), by variable elimination over Pareto-set factors (greedy order:
    the node whose factors join into the smallest table first). Returns (sigma_idx, tau_idx, time_s,
    bytes, choice) where choice[i, j] is the position (in red.keep) of ``local[j]``. ``cap``: the
    most bytes the block's nodes may take (budget minus the least the other blocks take). ``limit``:
    the most rows a factor keeps (_coarsen; None: exact), ``grid`` the bytes the nodes' are multiples of.
    Also returns err: every point's bytes exceed its true bytes by at most err (0 when exact)."""
    size = {n: len(red.cost[n]) for n in sigma + local}
    min_of = {n: int(red.mem[n].min()) for n in local}
    total_min = sum(min_of.values())
    inside = set(local) | set(sigma)
    ar = lambda n: np.arange(size[n])[:, None]
    tables = [_Table([s], ar(s), np.zeros(size[s]), np.zeros(size[s], dtype=np.int64)) for s in sigma]
    tables += [_Table([n], ar(n), red.cost[n].copy(), red.mem[n].copy(), placed={n}) for n in local]
    for n in local:
        for u, r in nbr.get(n, {}).items():          # r: rows u, columns n; each edge once
            if u in inside and (u in sigma or local.index(u) < local.index(n)):
                key = np.array(np.unravel_index(np.arange(r.size), r.shape)).T
                tables.append(_Table([u, n], key, r.ravel().copy(), np.zeros(r.size, dtype=np.int64)))
    join = lambda a, b: _join(a, b, size, cap, min_of, total_min, limit=limit, grid=grid)
    todo = [n for n in local if n not in tau]
    while todo:
        def width(v):
            scope = {u for tab in tables if v in tab.scope for u in tab.scope}
            return int(np.prod([size[u] for u in scope], dtype=np.int64)), local.index(v)
        v = min(todo, key=width)
        todo.remove(v)
        mine = [tab for tab in tables if v in tab.scope]
        tables = [tab for tab in tables if v not in tab.scope]
        acc = mine[0]
        if limit is None and len(mine) > 1:            # exact: v leaves the key as the last join forms
            for tab in mine[1:-1]:
                acc = join(acc, tab)
            tables.append(_join_exact(acc, mine[-1], size, cap, min_of, total_min, v, JOIN_CHUNK_PAIRS))
            continue
        for tab in mine[1:]:
            acc = join(acc, tab)
        j = acc.scope.index(v)                         # v leaves the key for the choice
        rest = [i for i in range(len(acc.scope)) if i != j]
        tables.append(_prune(_Table([acc.scope[i] for i in rest], acc.key[:, rest], acc.t, acc.m, acc.elim + [v],
                                    np.column_stack([acc.choice, acc.key[:, j]]), acc.placed, acc.err), size))
    acc = _Table([], np.zeros((1, 0), dtype=np.int64), np.zeros(1), np.zeros(1, dtype=np.int64))
    for tab in tables:
        acc = join(acc, tab)
    col = lambda nodes: (np.ravel_multi_index(acc.key[:, [acc.scope.index(u) for u in nodes]].T, [size[u] for u in nodes])
                         if nodes else np.zeros(len(acc.t), dtype=np.int64))
    choice = np.column_stack([acc.choice, acc.key])
    names = acc.elim + acc.scope
    return (col(sigma), col(tau), acc.t, acc.m, choice[:, [names.index(n) for n in local]]), acc.err


def _widths(red: Reduced, nbr, local: list[int], sigma: list[int], tau: list[int]) -> int:
    """The most keys (product of scope sizes) a factor of _frontier's elimination holds, same greedy
    order, from the scopes alone (no tables built)."""
    size = {n: len(red.cost[n]) for n in sigma + local}
    inside = set(local) | set(sigma)
    scopes = [{n} for n in local] + [{u, n} for n in local for u in nbr.get(n, {})
                                     if u in inside and (u in sigma or local.index(u) < local.index(n))]
    widest = 1
    todo = [n for n in local if n not in tau]
    while todo:
        def width(v):
            scope = {u for sc in scopes if v in sc for u in sc}
            return int(np.prod([size[u] for u in scope], dtype=np.int64)), local.index(v)
        v = min(todo, key=width)
        todo.remove(v)
        widest = max(widest, width(v)[0])
        merged = {u for sc in scopes if v in sc for u in sc} - {v}
        scopes = [sc for sc in scopes if v not in sc] + [merged]
    return max(widest, int(np.prod([size[u] for u in sigma + tau], dtype=np.int64)))


def _scalar(fronts, nstate: list[int], lam: float):
    """min sum(time + lam * bytes) over the chain of frontiers (one point per block, states matching):
    returns (that minimum, h, time, bytes of the minimiser) with h[b][tau] the minimum over blocks
    b+1.. given block b's out-state tau."""
    mats, picks = [], []
    seen: dict[tuple, tuple] = {}     # identical blocks share one frontier object: priced once
    for b, front in enumerate(fronts):
        f_sig, f_tau, f_t, f_m, _ = front
        n_sig, n_tau = (nstate[b - 1] if b else 1), nstate[b]
        hit = seen.get((id(front), n_sig, n_tau))
        if hit is not None:
            mats.append(hit[0])
            picks.append(hit[1])
            continue
        w, flat = f_t + lam * f_m, f_sig * n_tau + f_tau
        order = np.lexsort((w, flat))
        first = order[np.r_[True, flat[order][1:] != flat[order][:-1]]]     # per (sigma, tau) its best point
        mat, pick = np.full(n_sig * n_tau, np.inf), np.zeros(n_sig * n_tau, dtype=np.int64)
        mat[flat[first]], pick[flat[first]] = w[first], first
        mats.append(mat.reshape(n_sig, n_tau))
        picks.append(pick.reshape(n_sig, n_tau))
        seen[(id(front), n_sig, n_tau)] = (mats[-1], picks[-1])
    h = [np.zeros(nstate[-1])]
    for mat in mats[:0:-1]:
        h.insert(0, (mat + h[0][None, :]).min(axis=1))
    f, args = mats[0][0], []
    for mat in mats[1:]:
        tot = f[:, None] + mat
        args.append(tot.argmin(axis=0))
        f = tot.min(axis=0)
    tau = int(np.argmin(f))
    t = m = 0
    for b in range(len(fronts) - 1, -1, -1):
        sig = int(args[b - 1][tau]) if b else 0
        point = picks[b][sig, tau]
        t, m = t + fronts[b][2][point], m + int(fronts[b][3][point])
        tau = sig
    return float(f.min()), h, float(t), m


def _lagrange(fronts, nstate: list[int], rhs: int):
    """Lagrangian bounds for the chain DP: for any lam >= 0 and any completion that fits,
    time >= (time + lam * bytes) - lam * (bytes left), so a label (tau, t, m) of block b can lead to
    no better total than t + lam * (m - rhs) + h_lam[b][tau]; lam = 0 gives t + h_0[b][tau].
    lam* (the best such bound, the dual optimum) is found by the breakpoint iteration: the lam at
    which the last infeasible and the last feasible minimisers tie; a minimiser no better than that
    tie proves lam optimal (the dual is concave piecewise linear). Every minimiser that fits is a
    solution: the fastest is the incumbent. Returns (lam, h_lam, h_0, lower bound, incumbent), times
    in s."""
    _, h_0, t_lo, m_lo = _scalar(fronts, nstate, 0.0)
    if m_lo <= rhs:
        return 0.0, h_0, h_0, t_lo, t_lo
    spread = sum(float(f[2].max() - f[2].min()) for f in fronts if len(f[2]))
    lam = spread + 1.0                        # one byte outweighs every time difference: least bytes
    val, h, t_hi, m_hi = _scalar(fronts, nstate, lam)
    best = (val - lam * rhs, lam, h)
    ub = t_hi
    for _ in range(100):
        lam = (t_hi - t_lo) / (m_lo - m_hi)
        val, h, t, m = _scalar(fronts, nstate, lam)
        if val - lam * rhs > best[0]:
            best = (val - lam * rhs, lam, h)
        if val >= t_lo + lam * m_lo - 1e-12 * (abs(t_lo) + lam * m_lo):
            break                                 # nothing beats the tie: lam is the dual optimum
        if m <= rhs:
            t_hi, m_hi, ub = t, m, min(ub, t)
        else:
            t_lo, m_lo = t, m
    return best[1], best[2], h_0, best[0], ub


def _chain(fronts, rhs: int, bmin: list[int], bounds, theta: float):
    """The chain DP keeping only labels whose bound is <= theta. Labels (state, time, bytes);
    back[b] = (label of block b-1, frontier point of block b) per label. Returns (time of the best
    final label, index of it, back); (inf, -1, back) when no label survives."""
    lam, h_lam, h_0 = bounds
    state, t, m = np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(1, dtype=np.int64)
    back = []
    rest = sum(bmin)
    for b, (f_sig, f_tau, f_t, f_m, _) in enumerate(fronts):
        rest -= bmin[b]
        if t.size == 0:
            return np.inf, -1, back
        # join on the boundary state: states ascending, per state its labels in order, per label the
        # frontier points of that in-state in order (one vectorised pass, no loop over states)
        order_l = np.argsort(state, kind="stable")
        order_f = np.argsort(f_sig, kind="stable")
        sorted_f = f_sig[order_f]
        ls = state[order_l]
        start = np.searchsorted(sorted_f, ls, side="left")
        count = np.searchsorted(sorted_f, ls, side="right") - start
        li = np.repeat(order_l, count)
        offset = np.arange(len(li)) - np.repeat(np.cumsum(count) - count, count)
        fi = order_f[np.repeat(start, count) + offset]
        tc, mc, tau = t[li] + f_t[fi], m[li] + f_m[fi], f_tau[fi]
        # Drop labels with no completion that fits (bytes) or none at or under theta (time).
        ok = (mc + rest <= rhs) & (tc + h_0[b][tau] <= theta) & (tc + lam * (mc - rhs) + h_lam[b][tau] <= theta)
        ok = np.nonzero(ok)[0]
        sel = ok[_pareto(tau[ok], tc[ok], mc[ok])]
        state, t, m = tau[sel], tc[sel], mc[sel]
        back.append((li[sel], fi[sel]))
    if t.size == 0:
        return np.inf, -1, back
    at = int(np.argmin(t))
    return float(t[at]), at, back


#: frontiers across calls: signature -> (cap, frontier). MAP §5.3 solves one graph at up to 11
#: budgets; a block's frontier at a smaller cap is the larger cap's filtered to bytes <= cap (a
#: point Pareto-optimal among all combinations stays so among those under the cap, and one optimal
#: under the cap cannot be dominated by a combination that uses fewer bytes), so it is computed once.
_FRONTIERS: dict[bytes, tuple[int, tuple, int]] = {}
_FRONTIERS_MAX = 64


def _cached_frontier(sig: bytes, red, nbr, blk, sigma, tau, cap: int, limit: int | None = None, grid: int = 1):
    """(frontier, err) of one block; a rounded frontier (err > 0) filtered to a smaller cap keeps its
    bound: its bytes still over-estimate the true ones by at most err."""
    sig = sig + repr((limit, grid)).encode()
    hit = _FRONTIERS.get(sig)
    if hit is not None and hit[0] >= cap:
        keep = np.nonzero(hit[1][3] <= cap)[0]
        return tuple(a[keep] for a in hit[1]), hit[2]
    front, err = _frontier(red, nbr, blk, sigma, tau, cap, limit, grid)
    if len(_FRONTIERS) >= _FRONTIERS_MAX:
        _FRONTIERS.pop(next(iter(_FRONTIERS)))
    _FRONTIERS[sig] = (cap, front, err)
    return front, err


_FAST: list = []        # the last fastest choice (nodes, edges, choice or None): see _fastest


def solve_blocks(problem: IlpProblem) -> IlpSolution:
    """Eq. (1) on ``problem.blocks`` (see the module doc). Same contract as map_ilp.solve: the choice
    per node in original strategy indices, its time (s) and bytes recomputed from the input; status
    "optimal" or "infeasible" (then the smallest-memory choice, as solve reports it)."""
    if problem.blocks is None:
        raise ValueError("solve_blocks needs problem.blocks")
    min_choice = min_memory_choice(problem)
    t_min, min_mem = evaluate(problem, min_choice)
    if min_mem > problem.budget_bytes:
        return IlpSolution(min_choice, t_min, min_mem, "infeasible", min_mem)
    red = _reduced(problem)
    q = problem.memory_quantum_bytes
    if q > 0:   # nodes at q/16: a block of <= 16 free nodes is off by < q before its own rounding
        qn = max(q // 16, 1)
        red = copy.copy(red)     # the cached reduction stays exact
        red.mem = {n: -(-m // qn) * qn for n, m in red.mem.items()} if isinstance(red.mem, dict) else \
            [-(-m // qn) * qn for m in red.mem]
    nbr = _neighbours(red)
    rhs = problem.budget_bytes - sum(int(red.mem[n][0]) for n in red.fixed)
    blocks = [[n for n in blk if n not in red.fixed] for blk in problem.blocks]
    block_of = {n: b for b, blk in enumerate(blocks) for n in blk}
    taus = [[n for n in blk if any(block_of.get(u) == b + 1 for u in nbr.get(n, {}))]
            for b, blk in enumerate(blocks)]
    nstate = [int(np.prod([len(red.cost[n]) for n in tau], dtype=np.int64)) for tau in taus]
    for b, k in enumerate(nstate):
        if k > MAX_STATES:
            raise ValueError(f"block {b}: its out-boundary {[problem.nodes[n].name for n in taus[b]]} has {k} "
                             f"strategy combinations (> {MAX_STATES}); cut the chain where one node links the blocks")
    bmin = [sum(int(red.mem[n].min()) for n in blk) for blk in blocks]
    fast = _fastest(problem, red, nbr, blocks, taus, min_mem)
    if fast is not None:        # the budget does not bind: the time-only optimum is eq. (1)'s optimum
        return fast
    total_min = sum(bmin)
    cache: dict[bytes, tuple] = {}
    fronts, errs = [], []
    grid = max(q // 16, 1) if q > 0 else 1
    for b, blk in enumerate(blocks):
        sigma = taus[b - 1] if b else []
        cap = rhs - (total_min - bmin[b])
        sig = _signature(red, nbr, blk, sigma, taus[b])
        if sig not in cache and MAX_TABLE_ROWS is not None and _widths(red, nbr, blk, sigma, taus[b]) > MAX_TABLE_ROWS:
            return lagrangian(problem, blocks, taus, min_choice)     # a factor would hold more keys than rows
        if sig not in cache:
            try:
                cache[sig] = _cached_frontier(sig, red, nbr, blk, sigma, taus[b], cap, MAX_TABLE_ROWS, grid)
            except _TooLarge:
                return lagrangian(problem, blocks, taus, min_choice)
        fronts.append(cache[sig][0])
        errs.append(cache[sig][1])
    rounding = sum(errs)        # bytes the factor tables' rounding may have given away (0: exact)
    if q > 0:   # round each frontier point's bytes up (see IlpProblem.memory_quantum_bytes)
        rounded: dict[int, tuple] = {}     # one rounded frontier per distinct one (identity kept)
        for f in fronts:
            if id(f) not in rounded:
                rounded[id(f)] = (f[0], f[1], f[2], -(-f[3] // q) * q, f[4])
        fronts = [rounded[id(f)] for f in fronts]
        if any(len(f[2]) == 0 for f in fronts) or sum(int(f[3].min()) for f in fronts) > rhs:
            # rounding up made a (barely) feasible budget infeasible: solve it exactly
            return solve_blocks(dataclasses.replace(problem, memory_quantum_bytes=0))
    if any(len(f[2]) == 0 for f in fronts) or sum(int(f[3].min()) for f in fronts) > rhs:
        # only the factors' rounding (rounding > 0) loses every fitting point: the least-memory choice fits
        return IlpSolution(min_choice, t_min, min_mem, "rounded", min_mem, None, rounding)
    lam, h_lam, h_0, lb, ub = _lagrange(fronts, nstate, rhs)
    tol = 1e-9 * (abs(ub) + lam * rhs + 1e-12)      # far above float noise, far below any real difference
    # Fewer labels survive a lower threshold; a run whose best label is <= its threshold kept every
    # label of the optimum (their bounds are <= the optimum <= that label), so it is exact; the last
    # threshold is the incumbent's time, which its own labels always meet. Every accepted run returns
    # the same choice: each label on a path of optimal time survives it, labels are ordered by (state,
    # bytes) and duplicates resolve to the first candidate. Issue 22: 500 identical layers leave the
    # optimum (ub - lb) / 2500 above lb; at / 16 ~5000 labels per block (10 s), at / 1024 < 1 s.
    for frac in THETA_FRACTIONS:
        theta = lb + frac * (ub - lb) + tol
        best, at, back = _chain(fronts, rhs, bmin, (lam, h_lam, h_0), theta)
        if best <= theta:
            break
    if at < 0 and q > 0:
        return solve_blocks(dataclasses.replace(problem, memory_quantum_bytes=0))
    if at < 0:       # cannot happen: the incumbent's labels meet the last threshold
        raise AssertionError("block DP lost every label although a solution fits")
    choice = _walk_back(problem, red, blocks, fronts, back, at)
    tt, mm = evaluate(problem, choice)
    if rounding:     # optimal for its rounded bytes: no slower than the exact optimum under budget - rounding
        return IlpSolution(choice, tt, mm, "rounded", min_mem, None, rounding)
    return IlpSolution(choice, tt, mm, "optimal", min_mem, tt)


def _walk_back(problem: IlpProblem, red: Reduced, blocks, fronts, back, at: int) -> tuple[int, ...]:
    """The per-node choice (original strategy indices) of the final label ``at`` of :func:`_chain`."""
    choice = list(range(len(problem.nodes)))
    for n in red.fixed:
        choice[n] = int(red.keep[n][0])
    for b in range(len(blocks) - 1, -1, -1):
        prev, point = back[b][0][at], back[b][1][at]
        for n, p in zip(blocks[b], fronts[b][4][point]):
            choice[n] = int(red.keep[n][p])
        at = int(prev)
    return tuple(choice)


def _fastest(problem: IlpProblem, red: Reduced, nbr, blocks, taus, min_mem: int) -> IlpSolution | None:
    """Eq. (1) without its budget row (planners.map.fastest: min-sum elimination on dense tables);
    when that fastest choice's true bytes fit the budget it is eq. (1)'s optimum (relaxing a
    constraint cannot slow the optimum, and this point meets it), else None and the caller runs the
    Pareto DP. Issue 26: on a 3-D mesh the Pareto DP took 232 s for §5.3's unconstrained solve."""
    if _FAST and _FAST[0] is problem.nodes and _FAST[1] is problem.edges:
        choice = _FAST[2]        # §5.3 poses one graph at up to 11 budgets: the fastest choice is theirs
    else:
        pos = fastest_choice(red, nbr, blocks, taus, lambda blk, sigma, tau: _signature(red, nbr, blk, sigma, tau))
        choice = None
        if pos is not None:
            full = list(range(len(problem.nodes)))
            for n in red.fixed:
                full[n] = int(red.keep[n][0])
            for n, p in zip((n for blk in blocks for n in blk), pos):
                full[n] = int(red.keep[n][p])
            choice = tuple(full)
        tuples = isinstance(problem.nodes, tuple) and isinstance(problem.edges, tuple)
        _FAST[:] = [problem.nodes, problem.edges, choice] if tuples else []
    if choice is None:
        return None
    t, m = evaluate(problem, choice)
    if m > problem.budget_bytes:
        return None
    return IlpSolution(choice, t, m, "optimal", min_mem, t)
