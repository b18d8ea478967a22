"""The reduced graph's helpers shared by planners.map.blocks (the exact block DP) and
planners.map.blocks_bound (its bounded fallback): the cached reduction of one IlpProblem, each
node's neighbour matrices, and a block's frontier signature; and the block DP's factors (_Table),
their Pareto prune and their exact join (_join_exact; blocks._join adds the bounded, rounded one).
Pure: no I/O.
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


def _pareto(group: np.ndarray, t: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Indices of the points that no other point of the same group beats (no slower and no larger,
    one of them strictly); duplicates keep the first. Returned sorted by group, then bytes."""
    sel = _pareto_tied(group, t, m, None)
    return sel[np.lexsort((m[sel], group[sel]))]


def _pareto_tied(group: np.ndarray, t: np.ndarray, m: np.ndarray, tie: np.ndarray | None) -> np.ndarray:
    """_pareto's points (unsorted) when exact duplicates keep the least ``tie`` (None: the first row).
    Sorted by (group, time, bytes, tie), a point stays iff its bytes are below every earlier point's
    of its group (an earlier one is no slower; with no more bytes, or as the same point with a smaller
    tie, it beats this one). One stable sort, no float ranks (np.unique cost as much as the sort):
    bytes are integers, packed under the group for one running minimum over all groups."""
    if t.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((m, t, group) if tie is None else (tie, m, t, group))
    g, mm = group[order].astype(np.int64), m[order].astype(np.int64)
    lo = int(mm.min())
    span = int(mm.max()) - lo + 1
    if (int(g.max()) + 1) * (span + 1) >= 1 << 62:       # no room to pack: dense ranks of the bytes
        mm, lo, span = np.unique(mm, return_inverse=True)[1].ravel().astype(np.int64), 0, len(mm) + 1
    # earlier groups shifted above every later one: the running minimum before i is that of i's group
    val = (int(g.max()) - g) * (span + 1) + (mm - lo)
    before = np.minimum.accumulate(np.concatenate(([np.iinfo(np.int64).max], val[:-1])))
    return order[val < before]


class _Table:
    """A factor of the variable elimination: per assignment of ``scope`` (rows of ``key``, positions
    in red.keep) a Pareto set of (time_s, bytes) points, flattened into rows; ``choice`` holds each
    point's positions of the nodes already eliminated (``elim``); ``placed`` the nodes whose bytes
    ``m`` includes."""

    def __init__(self, scope, key, t, m, elim=(), choice=None, placed=frozenset(), err=0):
        self.scope, self.key, self.t, self.m = list(scope), key, t, m
        self.elim, self.placed = list(elim), frozenset(placed)
        self.choice = np.zeros((len(t), 0), dtype=np.int64) if choice is None else choice
        self.err = int(err)     # bytes: every row's m exceeds its true bytes by at most this (_coarsen)


def _join_exact(a: _Table, b: _Table, size: dict, cap: int, min_of: dict, total_min: int, drop: int | None,
                chunk_pairs: int) -> _Table:
    """_join without rounding (drop None), or with node ``drop`` eliminated as the pairs are formed
    (the last join of _frontier's elimination step; issue 26: on a 2x2x2 mesh that joined factor, with
    ``drop`` in its key, held 14 M rows, and joining then pruning it took 100 s): then equal, row for
    row, to ``_prune`` of _join's table with ``drop``'s column moved from the key to the choice.
    Streamed like _join, on row indices: a chunk's pairs that a kept point of the same key beats (no
    more bytes, strictly faster) are dropped before any sort, the rest pruned per key (without
    ``drop``), and keys and choices gathered only for the points kept at the end. Ties: _join keeps
    the first pair of equal points per key, the elimination prune then the least ``drop`` strategy, so
    a pair's tie is (drop's strategy, pair index)."""
    chunk = max(int(chunk_pairs), 1)
    shared = [v for v in a.scope if v in b.scope]
    flat = lambda tab: (np.ravel_multi_index(tab.key[:, [tab.scope.index(v) for v in shared]].T, [size[v] for v in shared])
                        if shared else np.zeros(len(tab.t), dtype=np.int64))
    ga, gb = flat(a), flat(b)
    order_b = np.argsort(gb, kind="stable")
    start = np.searchsorted(gb[order_b], ga, side="left")
    count = np.searchsorted(gb[order_b], ga, side="right") - start
    ends = np.cumsum(count)
    total = int(ends[-1]) if len(ends) else 0
    extra = [j for j, v in enumerate(b.scope) if v not in a.scope]
    scope = a.scope + [b.scope[j] for j in extra]
    out = [v for v in scope if v != drop]       # the result's key
    placed = a.placed | b.placed
    room = cap - (total_min - sum(min_of[v] for v in placed))
    dims = [size[v] for v in out]
    mult = {v: int(np.prod(dims[i + 1:], dtype=np.int64)) for i, v in enumerate(out)}
    # per row of a and of b its share of the remaining key's flat index and of drop's strategy
    part = lambda tab, cols: sum((tab.key[:, j].astype(np.int64) * mult[tab.scope[j]] for j in cols
                                  if tab.scope[j] != drop), np.zeros(len(tab.t), dtype=np.int64))
    ka, kb = part(a, range(len(a.scope))), part(b, extra)
    va = a.key[:, a.scope.index(drop)].astype(np.int64) if drop in a.scope else np.zeros(len(a.t), dtype=np.int64)
    vb = b.key[:, b.scope.index(drop)].astype(np.int64) if drop in scope and drop not in a.scope else \
        np.zeros(len(b.t), dtype=np.int64)
    m_lo = int(a.m.min(initial=0)) + int(b.m.min(initial=0))
    m_span = int(a.m.max(initial=0)) + int(b.m.max(initial=0)) - m_lo + 1
    screen = int(np.prod(dims, dtype=np.int64)) * m_span < 1 << 62       # kept points searchable by one int
    if size.get(drop, 1) * (total + 1) >= 1 << 62:
        raise OverflowError(f"_join_exact: {total} pairs x {size.get(drop, 1)} strategies overflow the tie index")
    names = ("g", "t", "m", "tie", "ai", "bi")
    kept = {f: np.zeros(0, dtype=float if f == "t" else np.int64) for f in names}
    sb = order_b if drop is None and not extra and len(a.t) and bool(np.all(np.diff(ka) > 0)) else None
    shift = sb is not None and _staircases(gb[sb], b.t[sb], b.m[sb])
    if shift:
        # b's nodes all in a's, a one row per key, b's rows per key a staircase (bytes up, time down):
        # a row's pairs are b's staircase shifted, so no pairs of two rows compete and a pair is beaten
        # only when the shift rounds its time to its predecessor's: no sort (issue 26, 9 s -> 1 s)
        kept = _shifted(a, b, sb, start, count, ends, total, room, chunk)
    pending, waiting = [], 0
    z_key = np.zeros(0, dtype=np.int64)

    def merge(parts):
        cat = {f: np.concatenate([p[f] for p in parts]) for f in names}
        sel = _pareto_tied(cat["g"], cat["t"], cat["m"], cat["tie"])
        sel = sel[np.lexsort((cat["m"][sel], cat["g"][sel]))]        # by key, then bytes (as _prune)
        return {f: x[sel] for f, x in cat.items()}

    for p0 in range(0, 0 if shift else total, chunk):
        p1 = min(p0 + chunk, total)
        r0 = int(np.searchsorted(ends, p0, side="right"))            # rows r0..r1-1 of a own the chunk
        r1 = int(np.searchsorted(ends, p1 - 1, side="right")) + 1
        first = int(ends[r0] - count[r0])
        ai = np.repeat(np.arange(r0, r1), count[r0:r1])[p0 - first:p1 - first]
        pair = np.arange(p0, p1, dtype=np.int64)
        bi = order_b[start[ai] + pair - (ends[ai] - count[ai])]
        m = a.m[ai] + b.m[bi]
        ok = np.nonzero(m <= room)[0]
        ai, bi, m, pair = ai[ok], bi[ok], m[ok], pair[ok]
        t, g = a.t[ai] + b.t[bi], ka[ai] + kb[bi]
        if screen and len(z_key):      # beaten by a kept point: the last one of its key with no more bytes
            at = np.searchsorted(z_key, g * m_span + (m - m_lo), side="right") - 1
            hit = np.maximum(at, 0)
            ok = np.nonzero(~((at >= 0) & (kept["g"][hit] == g) & (kept["t"][hit] < t)))[0]
            ai, bi, m, pair, t, g = ai[ok], bi[ok], m[ok], pair[ok], t[ok], g[ok]
        tie = (va[ai] + vb[bi]) * (total + 1) + pair
        sel = _pareto_tied(g, t, m, tie)
        pending.append({"g": g[sel], "t": t[sel], "m": m[sel], "tie": tie[sel], "ai": ai[sel], "bi": bi[sel]})
        waiting += len(sel)
        if waiting > max(len(kept["t"]) // 2, 1 << 14):    # merged geometrically: O(F log F) in all
            kept, pending, waiting = merge([kept] + pending), [], 0
            z_key = kept["g"] * m_span + (kept["m"] - m_lo)
    if pending:
        kept = merge([kept] + pending)
    ai, bi = kept["ai"], kept["bi"]
    key = np.column_stack([a.key[ai], b.key[bi][:, extra]]).astype(np.int64, copy=False)
    choice = np.column_stack([a.choice[ai], b.choice[bi]]).astype(np.int64, copy=False)
    if drop is None:
        return _Table(scope, key, kept["t"], kept["m"], a.elim + b.elim, choice, placed, a.err + b.err)
    j = scope.index(drop)
    return _Table(out, key[:, [i for i in range(len(scope)) if i != j]], kept["t"], kept["m"],
                  a.elim + b.elim + [drop], np.column_stack([choice, key[:, j]]), placed, a.err + b.err)


def _staircases(group: np.ndarray, t: np.ndarray, m: np.ndarray) -> bool:
    """Whether each group's rows (consecutive) have bytes strictly up and time strictly down."""
    same = group[1:] == group[:-1]
    return bool(np.all(~same | ((m[1:] > m[:-1]) & (t[1:] < t[:-1]))))


def _shifted(a: _Table, b: _Table, order_b, start, count, ends, total: int, room: int, chunk: int) -> dict:
    """_join_exact's kept points when a has one row per key (keys ascending), b's nodes are all a's and
    b's rows per key (in ``order_b``) are a staircase: per row of a, the fitting pairs in pair order
    whose time is below the previous pair's (adding a's time to a falling time can only tie it)."""
    sel_a, sel_b = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for p0 in range(0, total, chunk):
        p1 = min(p0 + chunk, total)
        r0 = int(np.searchsorted(ends, p0, side="right"))
        r1 = int(np.searchsorted(ends, p1 - 1, side="right")) + 1
        first = int(ends[r0] - count[r0])
        ai = np.repeat(np.arange(r0, r1), count[r0:r1])[p0 - first:p1 - first]
        pos = start[ai] + np.arange(p0, p1, dtype=np.int64) - (ends[ai] - count[ai])
        bi = order_b[pos]
        head = pos == start[ai]
        t = a.t[ai] + b.t[bi]
        before = a.t[ai] + b.t[order_b[np.where(head, pos, pos - 1)]]       # the previous pair's time
        ok = np.nonzero((a.m[ai] + b.m[bi] <= room) & (head | (t < before)))[0]
        sel_a.append(ai[ok])
        sel_b.append(bi[ok])
    ai, bi = np.concatenate(sel_a), np.concatenate(sel_b)
    return {"t": a.t[ai] + b.t[bi], "m": a.m[ai] + b.m[bi], "ai": ai, "bi": bi}
