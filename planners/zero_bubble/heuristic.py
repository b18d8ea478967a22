"""The automatic pipeline schedule of Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024).

§2 splits each microbatch's backward on a stage into B (input gradient, on the critical path) and
W (weight gradient, free to move): F(s, k) waits for F(s-1, k) + T_comm, B(s, k) for B(s+1, k) +
T_comm (for F(p-1, k) on the last stage), W(s, k) for B(s, k). §3.1 "The heuristic algorithm"
builds one F/B/W order per stage, microbatch by microbatch, and keeps the shortest of the eight
runs over its three binary hyper-parameters. This is our own pure-Python rewrite of that
heuristic; its decisions, tie-breaks and the loop order over the hyper-parameters follow the
authors' code (``Graph.manual_order`` and ``initial_solution`` of their scheduler) exactly, except
where theirs fails: (1) a run that cannot fit the limit is skipped, not fatal; (2) a limit below one
microbatch's own peak, max(mem_f, mem_f + mem_b), is refused up front (theirs fails too for m >= 2,
and for m = 1 returns an order over the limit); (3) the warm-up rule marked below, which changes
only runs where theirs leaves a stage short of F passes or puts an F ahead of its upstream F (it
happens with per-stage costs or memory that differ).
Like theirs, a stage's first B is placed without a memory check: with mem_b > 0 an order may hold
up to max_mem + mem_b on a stage right after it; every later F and B waits for the limit.
"""
from __future__ import annotations

import math
from numbers import Real

F, B, W = 0, 1, 2
_LETTERS = "FBW"


class _CannotFit(Exception):
    """A run found no W left to free memory for the next F or B: ``stage`` needed ``held``."""

    def __init__(self, stage: int, held):
        super().__init__(stage, held)
        self.stage, self.held = stage, held


def _floats(name: str, values, p: int, *, cost: bool) -> list:
    values = list(values)
    if len(values) != p:
        raise ValueError(f"{name}: expected {p} values (one per stage, p = len(cost_f)), got {len(values)}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Real) or math.isnan(v):
            raise ValueError(f"{name}[{i}] = {v!r}: expected a number")
        if cost and (not math.isfinite(v) or v < 0):
            raise ValueError(f"{name}[{i}] = {v!r}: costs must be finite and >= 0")
        if not cost and name != "max_mem" and not math.isfinite(v):
            raise ValueError(f"{name}[{i}] = {v!r}: expected a finite number")
    return [float(v) for v in values] if cost else values


def _costs(cost_f, cost_b, cost_w, cost_comm):
    cost_f = list(cost_f)
    if not cost_f:
        raise ValueError("cost_f: need at least one stage (p >= 1)")
    p = len(cost_f)
    out = [_floats(n, v, p, cost=True) for n, v in (("cost_f", cost_f), ("cost_b", cost_b), ("cost_w", cost_w))]
    if isinstance(cost_comm, bool) or not isinstance(cost_comm, Real) \
            or not math.isfinite(cost_comm) or cost_comm < 0:
        raise ValueError(f"cost_comm = {cost_comm!r}: must be a finite number >= 0")
    return p, out, float(cost_comm)


def _one_run(cf, cb, cw, comm, mf, mb, mw, cap, m, early_f, favour_b, greedy_w):
    """One run of the §3.1 heuristic for one setting of its three switches:
    ``early_f``: warm-up F may start though it delays the first B (authors' allow_bubble_before_first_b);
    ``favour_b``: a stage 2+ F ahead of the next may skip its F to keep the B chain busy (prioritize_b);
    ``greedy_w``: fill a wait shorter than the largest bubble so far with a W anyway (no_bubble_greedy).
    Returns (per-stage orders, end times end[kind][stage][microbatch], makespan)."""
    p = len(cf)
    cost, mem = (cf, cb, cw), (mf, mb, mw)
    done = [[0] * p for _ in range(3)]                            # passes of each kind placed per stage
    end = [[[0.0] * m for _ in range(p)] for _ in range(3)]       # 0 until placed, as in the authors' code
    free_at = [0.0] * p                                           # end of the stage's last placed pass
    held = [0] * p                                                # activation memory the stage holds
    bubble = [0.0] * p                                            # idle time since the stage's first F
    seq = [[] for _ in range(p)]

    def put(s, kind):
        k, c = done[kind][s], cost[kind][s]
        t = no_wait = free_at[s] + c
        if kind == F and s > 0:
            t = max(t, end[F][s - 1][k] + comm + c)
        if kind == B and s < p - 1:
            t = max(t, end[B][s + 1][k] + comm + c)
        if done[F][s] > 0:
            bubble[s] += t - no_wait
        free_at[s] = end[kind][s][k] = t
        held[s] += mem[kind][s]
        done[kind][s] += 1
        seq[s].append(_LETTERS[kind])

    def free_for(s, need):
        # §3.1 bullet 2: W passes also "recycle some memory when the memory limit is hit"
        while held[s] + need > cap[s]:
            if done[W][s] >= done[B][s]:
                raise _CannotFit(s, held[s] + need)
            put(s, W)

    def fill_wait(s, ready):
        # §3.1 bullet 2: W passes fill a wait (for the upstream F / downstream B) they fit in; a
        # shorter wait gets one W anyway when it would make the stage's cumulative bubble the
        # largest of all stages, otherwise only with greedy_w.
        while done[W][s] < done[B][s] and free_at[s] + cw[s] <= ready:
            put(s, W)
        if done[W][s] < done[B][s] and free_at[s] < ready:
            if ready - free_at[s] <= max(0, *bubble) - bubble[s]:
                if greedy_w:
                    put(s, W)
            else:
                put(s, W)

    # §3.1 bullet 1, warm-up: microbatch 0's F on every stage, then per stage as many more F as
    # the memory limit allows before its first B can start (early_f: one that delays it), then
    # microbatch 0's B from the last stage back.
    for s in range(p):
        put(s, F)
    extra, last_t = [0] * p, 0.0
    for s in range(p - 1, -1, -1):
        if s == p - 1:
            last_t = end[F][s][0] + cb[s]
            continue
        room, busy = held[s], free_at[s]
        while done[F][s] + extra[s] < m and room + mf[s] <= cap[s]:
            if (busy + cf[s] > last_t + comm) if early_f else (busy >= last_t + comm):
                break
            room, busy, extra[s] = room + mf[s], busy + cf[s], extra[s] + 1
        last_t = max(busy, last_t + comm) + cb[s]
    # §3.1 bullet 3: stage s keeps at least one F more than stage s+1, unless both run all m.
    # Change (3): the authors exempt a stage that runs all m whatever the stage before runs; its
    # later F then precede their upstream F, and the stage before never gets its last F.
    for s in range(1, p):
        while extra[s] > 0 and extra[s] >= extra[s - 1] and (
                done[F][s] + extra[s] < m or done[F][s - 1] + extra[s - 1] < m):
            extra[s] -= 1
    for s in range(p):
        for _ in range(extra[s]):
            put(s, F)
    for s in range(p - 1, -1, -1):
        put(s, B)

    # §3.1 bullet 2, steady state: per microbatch i one F per stage (first to last), then B(i)
    # from the last stage back, W passes filling waits and freeing memory before each.
    for i in range(1, m):
        want = [0] * p
        for s in range(p):
            if done[F][s] >= m:
                continue
            # §3.1 bullet 3: two F ahead of the next stage, favour_b skips this F if that idles less
            if favour_b and s + 1 < p and done[F][s] >= done[F][s + 1] + 2:
                next_fb = free_at[s + 1] + cf[s + 1] + cb[s + 1] + comm
                if free_at[s] >= next_fb:
                    continue
                w_cost, w_cnt, room = 0, 0, held[s] + mf[s]
                while room > cap[s] and done[W][s] + w_cnt < done[B][s]:
                    w_cost, room, w_cnt = w_cost + cw[s], room + mw[s], w_cnt + 1
                if free_at[s] + cf[s] + w_cost <= next_fb:
                    want[s] = 1
                    continue
                if next_fb - free_at[s] <= max(0, *bubble) - bubble[s]:
                    continue
            want[s] = 1
        for s in range(p - 2, -1, -1):   # a stage only adds an F when the next one does
            want[s] = min(want[s], want[s + 1])
        for s in range(p):
            if not want[s]:
                continue
            free_for(s, mf[s])
            if s > 0:
                fill_wait(s, end[F][s - 1][done[F][s]] + comm)
            put(s, F)
        for s in range(p - 1, -1, -1):
            if done[B][s] != i:
                raise RuntimeError(f"zb heuristic: stage {s} has {done[B][s]} B passes before B({s},{i})")
            free_for(s, mb[s])
            if s + 1 < p:
                fill_wait(s, end[B][s + 1][i] + comm)
            if s == 0 and done[F][s] == m:
                while done[W][s] < done[B][s]:
                    put(s, W)
            put(s, B)

    # §3.1 bullet 4: when F and B run out, the stage runs its remaining W passes.
    for s in range(p):
        while done[W][s] < m:
            put(s, W)
    for s in range(p):
        if done[F][s] != m:
            raise RuntimeError(f"zb heuristic: stage {s} got {done[F][s]} of {m} F passes")

    # §2 dependencies, checked on the end times (the authors' final assertions); never fires
    for s in range(p):
        for k in range(m):
            tf, tb, tw = end[F][s][k], end[B][s][k], end[W][s][k]
            bad = ("B" if tb < tf + cb[s] else "W" if tw < tb + cw[s]
                   else "F" if s > 0 and tf < end[F][s - 1][k] + comm + cf[s]
                   else "B" if s < p - 1 and tb < end[B][s + 1][k] + comm + cb[s] else None)
            if bad:
                raise RuntimeError(f"zb heuristic: pass {bad}({s},{k}) ends before its dependency allows")
    span = max(0, *(end[W][s][m - 1] - end[F][s][0] + cf[s] for s in range(p)))
    return ["".join(x) for x in seq], end, float(span)


def zb_orders(cost_f, cost_b, cost_w, cost_comm: float, mem_f, mem_b, mem_w, max_mem,
              m: int) -> tuple[list[str], float]:
    """Per pipeline stage (index 0..p-1, p = len(cost_f)) the pass order as a string over "FBW"
    (m of each letter; the k-th F/B/W of a stage is microbatch k), and the schedule's makespan
    (the reference's best_time) in the units of the costs."""
    p, (cf, cb, cw), comm = _costs(cost_f, cost_b, cost_w, cost_comm)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m = {m!r}: the number of microbatches must be an int >= 1")
    mf, mb, mw = (_floats(n, v, p, cost=False) for n, v in (("mem_f", mem_f), ("mem_b", mem_b), ("mem_w", mem_w)))
    cap = _floats("max_mem", max_mem, p, cost=False)
    for s in range(p):
        if mf[s] < 0:
            raise ValueError(f"mem_f[{s}] = {mf[s]!r}: a forward pass holds memory, expected >= 0")
        if abs(mf[s] + mb[s] + mw[s]) > 1e-9 * (abs(mf[s]) + abs(mb[s]) + abs(mw[s])):
            raise ValueError(f"mem_f[{s}] + mem_b[{s}] + mem_w[{s}] = {mf[s] + mb[s] + mw[s]!r}: "
                             "a microbatch's F, B and W memory deltas must sum to 0")
    need = [max(mf[s], mf[s] + mb[s]) for s in range(p)]   # one microbatch's own peak
    short = [s for s in range(p) if cap[s] < need[s]]
    if short:
        s = short[0]
        raise ValueError(f"max_mem[{s}] = {cap[s]!r} is below one microbatch's need on stage {s}, "
                         f"max(mem_f, mem_f + mem_b) = {need[s]!r}: no order fits (max_mem = {list(cap)!r})")
    best, closest = None, None
    # §3.1 bullet 3: grid search over the binary hyper-parameters (the paper names early_f and
    # favour_b; the authors' code adds greedy_w), in their loop order; on a tie the first best
    # stays. Change (1): a run that cannot fit max_mem is skipped.
    for early_f in (True, False):
        for favour_b in (True, False):
            for greedy_w in (True, False):
                try:
                    orders, _, span = _one_run(cf, cb, cw, comm, mf, mb, mw, cap, m, early_f, favour_b, greedy_w)
                except _CannotFit as e:
                    if closest is None or e.held - cap[e.stage] < closest.held - cap[closest.stage]:
                        closest = e
                    continue
                if best is None or span < best[1]:
                    best = (orders, span)
    if best is None:   # e.g. mem_b > 0: the warm-up fills the limit with F, leaving B no room
        s = closest.stage
        raise ValueError(f"the heuristic fits no order in max_mem = {list(cap)!r}: its closest run needed "
                         f"{closest.held!r} on stage {s} (limit {cap[s]!r}; one microbatch alone needs "
                         f"{need[s]!r}); raise the limit")
    return best


def order_makespan(orders: list[str], cost_f, cost_b, cost_w, cost_comm) -> float:
    """Time the per-stage ``orders`` as soon as possible under the §2 dependencies and return the
    longest stage span, end of its last pass minus start of its first (the heuristic's makespan).
    ValueError when the orders are malformed or deadlock."""
    p, (cf, cb, cw), comm = _costs(cost_f, cost_b, cost_w, cost_comm)
    orders = list(orders)
    if len(orders) != p:
        raise ValueError(f"orders: expected {p} strings (one per stage), got {len(orders)}")
    m = len(orders[0]) // 3 if orders and isinstance(orders[0], str) else 0
    for s, o in enumerate(orders):
        if not isinstance(o, str) or set(o) - set(_LETTERS) or any(o.count(c) != m for c in _LETTERS) or m < 1:
            raise ValueError(f"orders[{s}] = {o!r}: expected the same m >= 1 of each of F, B, W on every stage")
    cost = (cf, cb, cw)
    end = [[[None] * m for _ in range(p)] for _ in range(3)]
    done = [[0] * 3 for _ in range(p)]
    pos, free_at = [0] * p, [0.0] * p
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < 3 * m:
                kind = _LETTERS.index(orders[s][pos[s]])
                k, c = done[s][kind], cost[kind][s]
                dep = (end[F][s - 1][k] if kind == F and s > 0 else end[B][s + 1][k] if kind == B and s < p - 1
                       else end[F][s][k] if kind == B else end[B][s][k] if kind == W else 0.0)
                if dep is None:
                    break
                t = free_at[s] + c
                if (kind == F and s > 0) or (kind == B and s < p - 1):
                    t = max(t, dep + comm + c)
                free_at[s] = end[kind][s][k] = t
                done[s][kind] += 1
                pos[s] += 1
                moved = True
    stuck = [s for s in range(p) if pos[s] < 3 * m]
    if stuck:
        s = stuck[0]
        raise ValueError(f"orders deadlock: stage {s} waits at pass {pos[s]} ({orders[s][pos[s]]}) forever")
    # a stage's first pass is F(s, 0) and its last W(s, m-1) in any order that does not deadlock
    return float(max(0, *(end[W][s][m - 1] - end[F][s][0] + cf[s] for s in range(p))))
