"""Throughput-centric baseline (Alpa-like autostage): minimise iteration time over the same plan
space CAPTURE searches — contiguous layer groups on node sub-meshes with power-of-two dp or tp.

Two searches, chosen by the size of the problem:

* **exact** (small inputs, ≤ ``EXACT_TRANSITIONS`` stage configs to try): Alpa §5.2 minimises
  Σ_i t_i + (B − 1) · max_i t_i by enumerating t_max; here a dynamic program over (next layer,
  next GPU) keeps the Pareto front of (Σ work + p2p, max work, max gradient sync) per state. The
  iteration time (stagetable.evaluate) is monotone in all three, so the front contains the fastest
  plan. Memory is enforced inside the search, as Alpa discards stage configs that run out of
  memory: a stage's in-flight microbatches under 1F1B are min(1 + stages after it, m), and the
  suffix knows how many stages follow, so the front also keeps that count (fewer is never worse).
  Its cost is Θ(L² · N · degrees · front): GPT-3 175B on 32 GPUs took 220–395 s.
* **uniform** (at scale; NOT exact): every stage gets the same sub-mesh of g = N / p GPUs —
  a power of two within a node, or whole nodes (Alpa's (n, k) sub-meshes) — with each (dp, tp)
  split of it (TP inside a node). For each (p, dp, tp) the layer cut minimising the bottleneck
  stage under the memory limit is found by bisection on the bottleneck with a greedy feasibility
  check (each stage takes the longest run that fits; stage i+1 holds fewer microbatches than
  stage i, so the greedy is exact for this sub-problem when stage costs grow with their layers):
  O(divisors(N) · log₂(k) · p · log L · iterations) cost-table lookups, < 1 s for 175B on 1,024
  GPUs. Σ work is the same for every cut of one config, so the bottleneck is what the cut decides.

When no plan fits, the search returns the plan with the lowest peak it found (the "closest"),
and ``fits`` says so; planners/verdict.py turns that into advice.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from operator import itemgetter

from planners.baselines.stage_place import Placed
from planners.baselines.stagetable import StageTable
from specs.plan import Plan

#: the exact DP runs when Σ_layer (L − layer) · N · configs stays below this (~3 s on one core)
EXACT_TRANSITIONS = 60_000

#: progress(done, total): called by long searches; the shell may draw a bar (planners stay pure)
Progress = Callable[[int, int], None]


def _degrees(k: int) -> list[int]:
    return [1 << e for e in range(k.bit_length()) if (1 << e) <= k]


def _prune(front: list[tuple]) -> list[tuple]:
    """Keep (sum, max work, max sync, stage count, stages) entries no other entry matches or beats in sum, max
    work, max sync and number of stages (a shorter suffix leaves earlier stages fewer in flight).

    Entries arrive in sum order, so an entry is dropped iff an earlier kept one has max work,
    max sync and stage count all ≤ its own. Per stage count the kept (max work, max sync) pairs
    are held as a staircase (max work ascending, max sync strictly descending; a pair another
    pair of its count dominates is left out of the staircase, never out of the result), so the
    question is one bisection per count: the pairwise scan it replaces spent 250 of 330 s of
    policy=auto on capture_wresnet_1b_fig9."""
    from bisect import bisect_right

    front.sort(key=itemgetter(0, 1, 2, 3))  # C-level key (a lambda cost 25 s of 95 on wresnet)
    kept: list[tuple] = []
    stairs: dict[int, tuple[list[float], list[float]]] = {}
    for e in front:
        mx, sync, n = e[1], e[2], e[3]
        dominated = False
        for c, (mxs, syncs) in stairs.items():
            if c <= n:
                i = bisect_right(mxs, mx) - 1
                if i >= 0 and syncs[i] <= sync:
                    dominated = True
                    break
        if dominated:
            continue
        kept.append(e)
        mxs, syncs = stairs.setdefault(n, ([], []))
        i = bisect_right(mxs, mx)
        j = i
        while j < len(mxs) and syncs[j] >= sync:
            j += 1
        mxs[i:j], syncs[i:j] = [mx], [sync]
    return kept


def exact_transitions(table: StageTable, max_degree: int | None = None) -> int:
    """Stage configs the exact DP would try: Σ over layers of (L − layer) · N · configs."""
    L, k, total = table.model.num_layers, table.hardware.devices_per_node, table.hardware.num_devices
    configs = sum(1 if d == 1 else 2 for d in _degrees(k) if max_degree is None or d <= max_degree)
    return L * (L + 1) // 2 * total * configs


def candidates(table: StageTable, capacity_bytes: float = float("inf"), max_degree: int | None = None) -> list[list[Placed]]:
    """Plans on the Pareto front of (Σ stage work + p2p, max stage work, max sync) whose every
    stage fits in ``capacity_bytes`` (the exact DP; small inputs only, see EXACT_TRANSITIONS)."""
    L, k = table.model.num_layers, table.hardware.devices_per_node
    total = table.hardware.num_devices
    degrees = [d for d in _degrees(k) if max_degree is None or d <= max_degree]
    widest = max(degrees)

    @cache
    def front(layer: int, gpu: int) -> tuple:
        if layer == L or gpu == total:
            return ((0.0, 0.0, 0.0, 0, ()),) if layer == L and gpu == total else ()
        if (L - layer) * widest < total - gpu:
            return ()  # too few layers left to occupy the GPUs left
        out = []
        for stop in range(layer + 1, L + 1):
            for degree in degrees:
                if degree > k - gpu % k:
                    break
                for par in ("pp",) if degree == 1 else ("dp", "tp"):
                    here = Placed(layer, stop, par, degree, gpu)
                    cost = table.cost(here)
                    if cost is None:
                        continue
                    rest = front(stop, gpu + degree)
                    link = table.p2p_s(here, Placed(stop, stop + 1, "pp", 1, gpu + degree), cost.out_bytes) \
                        if stop < L and gpu + degree < total else 0.0
                    fits: dict[int, bool] = {}  # stages after -> fits (one peak per count, not per entry)
                    w, y = cost.work_s, cost.sync_s
                    # entries whose max work and sync this stage's own exceed become (·, w, y, n + 1):
                    # in `rest`'s sum order only those with fewer stages than every earlier one can
                    # survive _prune (exactly what _prune would drop, not built)
                    clamped_n = None
                    for s, mx, sync, n, stages in rest:
                        ok = fits.get(n)
                        if ok is None:
                            ok = fits[n] = table.peak_bytes(cost, n) <= capacity_bytes
                        if not ok:
                            continue
                        if mx <= w and sync <= y:
                            if clamped_n is not None and clamped_n <= n:
                                continue
                            clamped_n = n
                        out.append((s + cost.work_s + link, max(mx, cost.work_s), max(sync, cost.sync_s), n + 1,
                                    (here,) + stages))
        return tuple(_prune(out))

    plans = [list(entry[4]) for entry in front(0, 0)]
    front.cache_clear()
    return plans


# ---- the uniform search (at scale) -----------------------------------------------------------

def uniform_configs(table: StageTable, max_degree: int | None = None) -> list[tuple[int, str, int, int]]:
    """(p, parallelism, degree, tp) of every uniform pipeline: p stages of g = N / p GPUs each,
    g a power of two within a node (or the whole node) or a multiple of whole nodes, split into
    dp × tp with tp inside a node; dp must split the microbatch and tp respect every layer's max."""
    L, k, total = table.model.num_layers, table.hardware.devices_per_node, table.hardware.num_devices
    out = []
    for p in range(1, min(L, total) + 1):
        if total % p:
            continue
        g = total // p
        if max_degree is not None and g > max_degree:
            continue
        if g <= k and g & (g - 1) and g != k:
            continue
        if g > k and g % k:
            continue
        for tp in sorted({t for t in _degrees(min(g, k)) if g % t == 0} | ({k} if g % k == 0 else set())):
            dp = g // tp
            par = "pp" if g == 1 else "tp" if dp == 1 else "dp" if tp == 1 else "hybrid"
            if table.allowed(par, g, 0, L, tp):
                out.append((p, par, g, tp))
    return out


def _greedy_cut(table: StageTable, fns: list, work_cap: float, peak_cap: float) -> list[tuple[int, int]] | None:
    """Layer runs [start, stop) of stages 0..p−1 (``fns[i]``: stage i's (work, peak) functions from
    StageTable.stage_fn), each the longest run whose work and peak stay under the caps (found by
    bisection: both grow with the run), leaving one layer per later stage; None if not possible."""
    L, p, cuts, start = table.model.num_layers, len(fns), [], 0
    check_peak = peak_cap != float("inf")
    for i, (work, peak) in enumerate(fns):
        after = p - 1 - i

        def ok(stop: int, work=work, peak=peak, start=start, after=after) -> bool:
            w = work(start, stop)
            return w is not None and w <= work_cap and (not check_peak or peak(start, stop, after) <= peak_cap)

        if after == 0:
            if not ok(L):
                return None
            stop = L
        else:
            lo, hi = start + 1, L - after
            if not ok(lo):
                return None
            while lo < hi:  # largest stop in [lo, hi] that is ok
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
            stop = lo
        cuts.append((start, stop))
        start = stop
    return cuts


def _bisect(feasible: Callable[[float], list | None], hi: float, rel: float = 1e-6) -> list | None:
    """The plan at the smallest cap (within ``rel``) that ``feasible`` accepts, given it accepts hi."""
    best = feasible(hi)
    if best is None:
        return None
    lo = 0.0
    for _ in range(64):
        if hi - lo <= rel * hi:
            break
        mid = (lo + hi) / 2
        found = feasible(mid)
        if found is None:
            lo = mid
        else:
            hi, best = mid, found
    return best


def uniform_plans(table: StageTable, capacity_bytes: float, max_degree: int | None = None,
                  progress: Progress | None = None, lowest_peak: bool = False,
                  prune: bool = True) -> list[list[Placed]]:
    """For every uniform config, the cut with the smallest bottleneck stage that fits in
    ``capacity_bytes`` — or, with ``lowest_peak``, the cut with the lowest peak (no limit).

    Branch and bound (exact relative to this search): configs run in the order of a lower bound
    on their objective — iteration time ≥ W + (m − 1) · W / p (1F1B, GPipe) or m · W / p
    (PipeDream) with W the whole model's work on that config, since the stages' work sums to W;
    peak ≥ (the whole model's static + one microbatch's activation bytes) / p — and a config whose
    bound cannot beat the best plan found so far is skipped. ``prune=False`` keeps every config's
    cut (policy=auto compacts layouts this search discards: a slower one may fit after actions)."""
    L, m = table.model.num_layers, table.training.microbatches
    async_ = table.schedule.kind.value == "pipedream_async"
    ranked = []
    for p, par, g, tp in uniform_configs(table, max_degree):
        fns = [table.stage_fn(par, g, i * g, tp) for i in range(p)]
        whole = table.cost(Placed(0, L, par, g, 0, tp))
        if fns[0][1] is None or whole is None:
            continue  # dp does not split the microbatch, or tp exceeds some layer's max
        works = [work(0, L) for work, _ in fns[:max(1, table.hardware.devices_per_node // g)]]
        if lowest_peak:
            bound = (whole.static_bytes + whole.act_bytes) / p  # Σ peaks ≥ Σ static + Σ act
        else:
            w = min(works)
            bound = m * w / p if async_ else w + (m - 1) * w / p
        ranked.append((bound * (1 - 1e-9), p, par, g, tp, fns, max(works)))
    ranked.sort(key=lambda e: e[0])
    plans, best = [], float("inf")
    for n, (bound, p, par, g, tp, fns, whole) in enumerate(ranked):
        if progress is not None:
            progress(n, len(ranked))
        if prune and bound >= best:
            continue
        if lowest_peak:
            hi = 2.0 * fns[0][1](0, L, p - 1) + 2.0 ** 30  # above any stage's peak, boundary buffers included
            # within 0.1 % of this config's lowest peak: closeness, not speed, is what is reported
            cuts = _bisect(lambda cap, fns=fns: _greedy_cut(table, fns, float("inf"), cap), hi, rel=1e-3)
        else:
            cuts = _bisect(lambda cap, fns=fns: _greedy_cut(table, fns, cap, capacity_bytes), whole * 1.01 + 1e-12)
        if cuts is None:
            continue
        stages = [Placed(a, b, par, g, i * g, tp) for i, (a, b) in enumerate(cuts)]
        t, peaks = table.evaluate(stages)
        best = min(best, max(peaks) if lowest_peak else t)
        plans.append(stages)
    if progress is not None:
        progress(len(ranked), len(ranked))
    return plans


# ---- the planner -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Search:
    """The throughput search's answer: the fastest plan that fits, else the lowest-peak plan."""

    stages: list[Placed]
    iteration_time_s: float
    peaks: list[int]          # per stage, bytes per device
    fits: bool
    exact: bool               # found by the exact DP (else the uniform search)


def search_throughput(table: StageTable, max_degree: int | None = None,
                      progress: Progress | None = None) -> Search:
    """Fastest fitting plan (exact DP on small inputs, uniform search at scale); if none fits, the
    plan with the lowest peak among those both searches produce without the limit."""
    capacity = table.hardware.device.memory_bytes
    exact = exact_transitions(table, max_degree) <= EXACT_TRANSITIONS
    plans = candidates(table, capacity, max_degree) if exact else uniform_plans(table, capacity, max_degree, progress)
    if plans:
        scored = [(*table.evaluate(stages), stages) for stages in plans]
        t, peaks, stages = min(scored, key=lambda e: (e[0], max(e[1])))
        return Search(stages, t, peaks, True, exact)
    closest = uniform_plans(table, capacity, max_degree, progress, lowest_peak=True)
    if exact:
        closest += candidates(table, max_degree=max_degree)
    if not closest:
        raise ValueError("no plan in the search space")
    scored = [(*table.evaluate(stages), stages) for stages in closest]
    t, peaks, stages = min(scored, key=lambda e: (max(e[1]), e[0]))
    return Search(stages, t, peaks, False, exact)


def best_throughput(table: StageTable, max_degree: int | None = None,
                    progress: Progress | None = None) -> tuple[list[Placed], float, list[int]]:
    """(stages, iteration time s, per-stage peak bytes) of the fastest plan that fits, else of the
    plan with the lowest peak."""
    found = search_throughput(table, max_degree, progress)
    return found.stages, found.iteration_time_s, found.peaks


def plan_throughput(policy, model, hardware, training, schedule, progress: Progress | None = None) -> Plan:
    """policy=throughput: the fastest fitting plan (else the closest), as a validated-shape Plan."""
    from planners.layout import PlanningError

    if schedule.virtual_stages > 1:
        raise PlanningError("policy=throughput plans non-interleaved schedules; use schedule=1f1b or gpipe")
    table = StageTable(model, hardware, training, schedule, recompute=policy.recompute)
    try:
        stages, _, _ = best_throughput(table, 1 if policy.pipeline_only else None, progress)
    except ValueError as exc:
        raise PlanningError(
            f"policy=throughput: {exc} (every stage needs ≥ 1 layer and data parallelism must split the "
            f"microbatch of {training.samples_per_microbatch} samples; raise training.microbatch_size or "
            "use fewer devices)") from None
    return table.to_plan(stages, "throughput")
