"""Throughput-centric baseline (Alpa-like autostage): minimise iteration time over the same plan
space CAPTURE searches — contiguous layer groups on node sub-meshes with power-of-two dp or tp.

Alpa §5.2 minimises Σ_i t_i + (B − 1) · max_i t_i by enumerating t_max; here a dynamic program over
(next layer, next GPU) keeps the Pareto front of (Σ work + p2p, max work, max gradient sync) per
state. The iteration time (stagetable.evaluate) is monotone in all three, so the front contains
the fastest plan. Memory is enforced inside the search, as Alpa discards stage configs that run
out of memory: a stage's in-flight microbatches under 1F1B are min(1 + stages after it, m), and
the suffix knows how many stages follow, so the front also keeps that count (fewer is never worse).
If no plan fits at all, the search runs again without the memory limit and returns the fastest.
"""
from __future__ import annotations

from functools import lru_cache

from planners.stagetable import Placed, StageTable
from specs.plan import Plan


def _degrees(k: int) -> list[int]:
    return [1 << e for e in range(k.bit_length()) if (1 << e) <= k]


def _prune(front: list[tuple]) -> list[tuple]:
    """Keep (sum, max work, max sync, stages) entries no other entry matches or beats in sum, max
    work, max sync and number of stages (a shorter suffix leaves earlier stages fewer in flight)."""
    front.sort(key=lambda e: (e[0], e[1], e[2], len(e[3])))
    kept: list[tuple] = []
    for e in front:
        if not any(k[1] <= e[1] and k[2] <= e[2] and len(k[3]) <= len(e[3]) for k in kept):
            kept.append(e)
    return kept


def candidates(table: StageTable, capacity_bytes: float = float("inf"), max_degree: int | None = None) -> list[list[Placed]]:
    """Plans on the Pareto front of (Σ stage work + p2p, max stage work, max sync) whose every
    stage fits in ``capacity_bytes``."""
    L, k = table.model.num_layers, table.hardware.devices_per_node
    total = table.hardware.num_devices
    degrees = [d for d in _degrees(k) if max_degree is None or d <= max_degree]

    @lru_cache(maxsize=None)
    def front(layer: int, gpu: int) -> tuple:
        if layer == L or gpu == total:
            return ((0.0, 0.0, 0.0, ()),) if layer == L and gpu == total else ()
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
                    for s, mx, sync, stages in rest:
                        if table.peak_bytes(cost, len(stages)) > capacity_bytes:
                            continue
                        out.append((s + cost.work_s + link, max(mx, cost.work_s), max(sync, cost.sync_s),
                                    (here,) + stages))
        return tuple(_prune(out))

    plans = [list(entry[3]) for entry in front(0, 0)]
    front.cache_clear()
    return plans


def best_throughput(table: StageTable, max_degree: int | None = None) -> tuple[list[Placed], float, list[int]]:
    """(stages, iteration time s, per-stage peak bytes) of the fastest plan that fits, else fastest."""
    plans = (candidates(table, table.hardware.device.memory_bytes, max_degree)
             or candidates(table, max_degree=max_degree))
    if not plans:
        raise ValueError("no plan in the search space")
    scored = [(*table.evaluate(stages), stages) for stages in plans]
    t, peaks, stages = min(scored, key=lambda e: (e[0], max(e[1])))
    return stages, t, peaks


def plan_throughput(policy, model, hardware, training, schedule) -> Plan:
    """policy=throughput: the fastest fitting plan, as a validated-shape Plan."""
    from planners.layout import PlanningError

    if schedule.virtual_stages > 1:
        raise PlanningError("policy=throughput plans non-interleaved schedules; use schedule=1f1b or gpipe")
    table = StageTable(model, hardware, training, schedule, recompute=policy.recompute)
    try:
        stages, _, _ = best_throughput(table, 1 if policy.pipeline_only else None)
    except ValueError as exc:
        raise PlanningError(f"policy=throughput: {exc}") from None
    return table.to_plan(stages, "throughput")
