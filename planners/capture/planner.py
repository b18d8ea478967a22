"""CAPTURE (capture.txt §III): predictor, layer merger and recommender over hybrid-parallel plans.

Pure: the predictor reads M_i / M_a statistics (from profiling, issue 5) handed in as data; the
recommender searches stage placements to minimise the predicted peak per-GPU memory.

Two searches over the same space, which must agree (tests compare them):
- :func:`recommend_exhaustive` — Algorithm 4: enumerate placements group by group, pruning
  stage configs whose prediction exceeds the best plan's peak (§III-C "Reducing the time").
- :func:`recommend` — exact dynamic programming over (next layer, next GPU). The objective,
  peak memory with the paper's tie-break (drop the highest GPU(s), compare the rest, repeat), is
  the *leximax* order on per-GPU predictions sorted high to low. Adding the same multiset to two
  vectors preserves their leximax order, so the best completion from (layer, GPU) does not depend
  on how that state was reached: optimal substructure holds and the DP is exact.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from planners.layout import PlanningError
from specs.plan import Plan

#: (layer_start, layer_stop, parallelism "pp" | "dp" | "tp", degree) -> predicted per-GPU bytes
Predictor = Callable[[int, int, str, int], float]


@dataclass(frozen=True)
class StageConfig:
    layer_start: int
    layer_stop: int
    parallelism: str  # "pp" (degree 1), "dp" or "tp"
    degree: int
    predicted_bytes: float


@dataclass(frozen=True)
class Recommendation:
    stages: tuple[StageConfig, ...]
    per_gpu_bytes: tuple[float, ...]  # in GPU order

    @property
    def peak_bytes(self) -> float:
        return max(self.per_gpu_bytes)

    @property
    def leximax(self) -> tuple[float, ...]:
        return tuple(sorted(self.per_gpu_bytes, reverse=True))


# ---- predictor (§III-B) -------------------------------------------------------------------------

def stage_prediction(m_i: list[float], m_a: list[float], start: int, stop: int) -> float:
    """M_p(l; l+n) = M_i(l) + Σ_{k=l+1}^{l+n} M_a(k)  (§III-B1)."""
    return m_i[start] + sum(m_a[start + 1:stop])


def line_at(x: tuple[float, float], y: tuple[float, float], at: float) -> float:
    """Straight line through two profiled batch sizes, sampled at the target (Description 2).

    Outside the profiled sizes the line is held to what a stage's memory can be, a fixed part plus
    a part proportional to the samples, both non-negative (issue 22: an unbounded line went below
    zero): peaks that fall as the microbatch grows (noise in the M_a differences) are not
    extrapolated downhill, the nearer profiled value is kept; below the sizes, a line whose fixed
    part would be negative is bounded by the proportional part through the nearer size."""
    (x0, x1), (y0, y1) = x, y
    line = y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    if x0 <= at <= x1:
        return line
    near_x, near_y = (x1, y1) if at > x1 else (x0, y0)
    if y1 < y0:
        return near_y
    return line if at > x1 else max(line, near_y * at / near_x)


def degree_at(d: tuple[int, int], y: tuple[float, float], degree: int) -> float:
    """The §III-B3 model, M = M_fixed + M_split / degree, through the two profiled degrees (2 and 4),
    sampled at ``degree``.

    Deviation (issue 22): the paper fits "a logarithmic function" y = a + b·ln(degree) to that
    model, which falls without bound (at 8 it gives M_fixed, at 16 less, then below zero: a 1-stage
    tp8 plan was predicted at -1.60 GiB and chosen for it). The model itself is fitted instead; it
    is exact where the data follow it and never negative: where the profiled peaks fall faster than
    1/degree (a negative fixed part, which no fixed + split sum explains), the fixed part is taken
    as 0, i.e. the split part alone through the larger profiled degree."""
    (d0, d1), (y0, y1) = d, y
    if math.isinf(y0) or math.isinf(y1):
        return math.inf  # a profiled degree outside the space (e.g. dp that cannot split the microbatch)
    split = (y0 - y1) / (1 / d0 - 1 / d1)
    fixed = y0 - split / d0
    if fixed < 0:
        return y1 * d1 / degree
    return fixed + split / degree


#: the largest degree CAPTURE profiles (§III-A): stages of higher degree are extrapolated (degree_at)
PROFILED_DEGREES = (2, 4)


@dataclass(frozen=True)
class CaptureStats:
    """M_i and M_a per layer for each profiled (scenario, size) — scenario "pp", "dp2", "dp4",
    "tp2", "tp4" — as the CAPTURE profiler (§III-A) records them. The size is the pipeline
    microbatch (samples): activation memory scales with it, so fitting over it is the paper's
    batch-size fit when the microbatch count is fixed (§III-A2) and stays right when the target
    runs another microbatch count than the profiling runs did."""

    m_i: dict[tuple[str, int], tuple[float, ...]]
    m_a: dict[tuple[str, int], tuple[float, ...]]

    def sizes(self, scenario: str) -> tuple[int, int] | None:
        """The two profiled sizes of ``scenario`` (None if it was not profiled)."""
        found = sorted({b for name, b in self.m_i if name == scenario})
        if not found:
            return None
        if len(found) != 2:
            raise PlanningError(f"policy.batch_sizes: CAPTURE fits each scenario's memory as a line in the batch "
                                f"size (§III-A2) from exactly two profiled batches; scenario {scenario} has {found}: "
                                "give two distinct sizes (or null for half and quarter of training.global_batch)")
        return found[0], found[1]

    @property
    def num_layers(self) -> int:
        return len(next(iter(self.m_i.values())))

    def predictor(self, target_microbatch: int) -> Predictor:
        """The §III-B predictor at the target's pipeline microbatch: profiled scenarios directly
        (straight line over the two profiled sizes, line_at); degrees above 4 by M_fixed +
        M_split / degree through 2 and 4 (degree_at)."""
        def scenario(name: str, start: int, stop: int) -> float:
            sizes = self.sizes(name)
            if sizes is None:
                return math.inf  # not profiled (e.g. a dp degree that cannot split the microbatch)
            lo, hi = sizes
            ys = tuple(stage_prediction(self.m_i[name, b], self.m_a[name, b], start, stop) for b in (lo, hi))
            return line_at((lo, hi), ys, target_microbatch)

        def predict(start: int, stop: int, parallelism: str, degree: int) -> float:
            if degree == 1:
                value = scenario("pp", start, stop)
            elif degree in PROFILED_DEGREES:
                value = scenario(f"{parallelism}{degree}", start, stop)
            else:
                ys = tuple(scenario(f"{parallelism}{d}", start, stop) for d in PROFILED_DEGREES)
                value = degree_at(PROFILED_DEGREES, ys, degree)
            # M_a are differences of measured peaks and may be negative; a stage holds no fewer than 0 bytes
            return max(value, 0.0)

        return predict


def merge_layers(m_i: list[float], m_a: list[float], target: int) -> tuple[list[float], list[float], list[tuple[int, int]]]:
    """Layer merger (§III-A3): repeatedly merge the adjacent pair whose merged M_i is lowest,
    M_i(l;l+1) = M_i(l) + M_a(l+1), M_a = M_a(l) + M_a(l+1), until ``target`` layers remain.
    Returns the merged M_i, M_a and each merged layer's original [start, stop)."""
    m_i, m_a = list(m_i), list(m_a)
    spans = [(i, i + 1) for i in range(len(m_i))]
    while len(m_i) > max(target, 1):
        j = min(range(len(m_i) - 1), key=lambda k: (m_i[k] + m_a[k + 1], k))
        m_i[j:j + 2] = [m_i[j] + m_a[j + 1]]
        m_a[j:j + 2] = [m_a[j] + m_a[j + 1]]
        spans[j:j + 2] = [(spans[j][0], spans[j + 1][1])]
    return m_i, m_a, spans


# ---- the plan space (§III-C) -------------------------------------------------------------------

def _degrees(k: int) -> list[int]:
    """Powers of two up to the node's GPU count k (CAPTURE limits degrees to powers of 2)."""
    return [1 << e for e in range(k.bit_length()) if (1 << e) <= k]


def _configs(predict: Predictor, start: int, stop: int, free_on_node: int, k: int):
    for degree in _degrees(k):
        if degree > free_on_node:
            break
        for par in ("pp",) if degree == 1 else ("dp", "tp"):
            yield StageConfig(start, stop, par, degree, predict(start, stop, par, degree))


def _finish(stages: list[StageConfig]) -> Recommendation:
    per_gpu = tuple(s.predicted_bytes for s in stages for _ in range(s.degree))
    return Recommendation(tuple(stages), per_gpu)


def recommend_exhaustive(predict: Predictor, num_layers: int, nodes: int, gpus_per_node: int) -> Recommendation:
    """Algorithm 4 with pruning: depth-first placement of layer groups, in order, onto the GPUs
    node by node; the degrees on a node's sub-mesh sum to its GPU count and no GPU stays idle."""
    k, total = gpus_per_node, nodes * gpus_per_node
    best: list[Recommendation | None] = [None]

    def place(layer: int, gpu: int, stages: list[StageConfig]) -> None:
        if layer == num_layers or gpu == total:
            if layer == num_layers and gpu == total:
                rec = _finish(stages)
                if best[0] is None or rec.leximax < best[0].leximax:
                    best[0] = rec
            return
        free = k - gpu % k
        for stop in range(layer + 1, num_layers + 1):
            for cfg in _configs(predict, layer, stop, free, k):
                if best[0] is not None and cfg.predicted_bytes > best[0].peak_bytes:
                    continue  # prune: this config alone exceeds the best plan's peak (§III-C)
                if num_layers - stop < (0 if gpu + cfg.degree == total else 1):
                    continue  # GPUs left but no layers for them
                stages.append(cfg)
                place(stop, gpu + cfg.degree, stages)
                stages.pop()

    place(0, 0, [])
    if best[0] is None:
        raise ValueError(f"no plan places {num_layers} layers on {nodes} x {gpus_per_node} GPUs")
    return best[0]


#: stage configs the exact DP may try before plan_capture merges layers first (~3 s on one core)
DP_TRANSITIONS = 250_000


def dp_transitions(num_layers: int, nodes: int, gpus_per_node: int) -> int:
    """Stage configs the exact DP tries: Σ over layers of (L − layer) · N · configs."""
    configs = sum(1 if d == 1 else 2 for d in _degrees(gpus_per_node))
    return num_layers * (num_layers + 1) // 2 * nodes * gpus_per_node * configs


#: plans Algorithm 4 (policy.search=exhaustive) may walk before plan_capture refuses it (12 layers on 4 x 4
#: GPUs: 3.7M, under a second with its pruning; 13: 11M, seconds; 34 layers: 2e12, hours)
EXHAUSTIVE_PLANS = 5_000_000


def exhaustive_plans(num_layers: int, nodes: int, gpus_per_node: int) -> int:
    """Complete placements Algorithm 4 enumerates before pruning (recommend_exhaustive's leaves)."""
    k, total = gpus_per_node, nodes * gpus_per_node
    count = [[0] * (total + 1) for _ in range(num_layers + 1)]  # count[layer][gpu]: ways to finish
    count[num_layers][total] = 1
    for layer in range(num_layers - 1, -1, -1):
        for gpu in range(total - 1, -1, -1):
            free = k - gpu % k
            count[layer][gpu] = sum(count[stop][gpu + d] * (1 if d == 1 else 2)
                                    for stop in range(layer + 1, num_layers + 1) for d in _degrees(k) if d <= free)
    return count[0][0]


def recommend(predict: Predictor, num_layers: int, nodes: int, gpus_per_node: int) -> Recommendation:
    """Exact DP over (next layer, next GPU) for the same objective as Algorithm 4 (leximax).
    O(L² · N · configs · N): plan_capture merges layers first when that is too many (DP_TRANSITIONS)."""
    k, total = gpus_per_node, nodes * gpus_per_node
    if num_layers < nodes:
        raise ValueError(f"no plan places {num_layers} layers on {nodes} x {gpus_per_node} GPUs: every stage lies "
                         f"within one node and holds at least one layer, so {num_layers} layers occupy at most "
                         f"{num_layers} nodes")
    table: dict[tuple[int, int, int], float] = {}

    def pred(start: int, stop: int, par: str, degree: int) -> float:
        key = (start, stop, degree if par != "tp" else -degree)
        if key not in table:
            table[key] = predict(start, stop, par, degree)
        return table[key]

    @cache
    def best(layer: int, gpu: int) -> tuple[tuple[float, ...], tuple[StageConfig, ...]] | None:
        if layer == num_layers or gpu == total:
            return ((), ()) if layer == num_layers and gpu == total else None
        if num_layers - layer < (total - gpu + k - 1) // k:
            return None  # fewer layers left than the stages the GPUs left need
        found = None
        free = k - gpu % k
        for degree in _degrees(k):
            if degree > free:
                break
            # the GPUs after this stage need at least ⌈left / k⌉ more stages of ≥ 1 layer each
            last = num_layers - (total - gpu - degree + k - 1) // k
            for stop in range(layer + 1, last + 1):
                rest = best(stop, gpu + degree)
                if rest is None:
                    continue
                for par in ("pp",) if degree == 1 else ("dp", "tp"):
                    value = pred(layer, stop, par, degree)
                    if found is not None and value > found[0][0]:
                        continue  # cannot beat the incumbent's peak
                    tail = rest[0]
                    at = bisect_left([-v for v in tail], -value) if tail else 0  # tail is sorted high to low
                    vec = tail[:at] + (value,) * degree + tail[at:]
                    if found is None or vec < found[0]:
                        found = (vec, (StageConfig(layer, stop, par, degree, value),) + rest[1])
        return found

    result = best(0, 0)
    best.cache_clear()
    if result is None:
        raise ValueError(f"no plan places {num_layers} layers on {nodes} x {gpus_per_node} GPUs")
    return _finish(list(result[1]))


# ---- from profile.json to plans ------------------------------------------------------------------

def stats_from_profile(capture) -> CaptureStats:
    """CaptureStats from a ``specs.profile.CaptureProfile`` (profile.json's ``capture`` section)."""
    m_i, m_a = {}, {}
    for sc in capture.scenarios:
        ordered = sorted(sc.layers, key=lambda s: s.layer)
        m_i[sc.scenario, sc.microbatch_size] = tuple(float(s.M_i_bytes) for s in ordered)
        m_a[sc.scenario, sc.microbatch_size] = tuple(float(s.M_a_bytes) for s in ordered)
    return CaptureStats(m_i=m_i, m_a=m_a)


def merged_stats(stats: CaptureStats, target_layers: int) -> tuple[CaptureStats, list[tuple[int, int]]]:
    """Layer merger (§III-A3) decided on the pipeline-only statistics at the larger batch, then
    applied with the same spans to every scenario: M_i(span) = M_i(first) + Σ M_a(rest),
    M_a(span) = Σ M_a."""
    _, hi = stats.sizes("pp")
    _, _, spans = merge_layers(list(stats.m_i["pp", hi]), list(stats.m_a["pp", hi]), target_layers)
    m_i = {k: tuple(stage_prediction(v, stats.m_a[k], a, b) for a, b in spans) for k, v in stats.m_i.items()}
    m_a = {k: tuple(sum(v[a:b]) for a, b in spans) for k, v in stats.m_a.items()}
    return CaptureStats(m_i=m_i, m_a=m_a), spans


def stage_kind(dp: int, tp: int) -> tuple[str, int]:
    """A stage's (parallelism, degree) in CAPTURE's space: pure dp, pure tp, or neither."""
    if dp > 1 and tp > 1:
        raise ValueError(f"CAPTURE stage configs are data- or tensor-parallel, not both (dp={dp}, tp={tp})")
    return ("dp", dp) if dp > 1 else ("tp", tp) if tp > 1 else ("pp", 1)


def predicted_degrees(plan) -> dict[str, list[int]]:
    """The degrees of ``plan``'s stages that CAPTURE's predictor extrapolates (above the profiled
    2 and 4: degree_at), per parallelism ("dp"/"tp"); empty when every stage was profiled."""
    out: dict[str, set[int]] = {}
    for stage in plan.stages:
        par, degree = stage_kind(stage.dp, stage.tp)
        if degree > max(PROFILED_DEGREES):
            out.setdefault(par, set()).add(degree)
    return {par: sorted(ds) for par, ds in sorted(out.items())}


def predict_devices(plan, stats: CaptureStats) -> dict[int, float]:
    """CAPTURE's per-device peak prediction for any plan in its space (Fig. 7's predictor)."""
    predict = stats.predictor(plan.training.samples_per_microbatch)
    out: dict[int, float] = {}
    for stage in plan.stages:
        par, degree = stage_kind(stage.dp, stage.tp)
        value = predict(stage.layer_start, stage.layer_stop, par, degree)
        for d in stage.devices:
            out[d] = out.get(d, 0.0) + value
    return out


def capture_schedule_check(schedule) -> None:
    """PlanningError for a schedule with several chunks per device (interleaved 1F1B, a V): CAPTURE's
    stages are contiguous layer ranges, one per device group (§III-B), and its profiling runs too."""
    if schedule.virtual_stages > 1:
        raise PlanningError(f"CAPTURE profiles and plans one stage per device group (non-interleaved schedules); "
                            f"schedule {schedule.kind.value} places {schedule.virtual_stages} chunks on each: use "
                            "schedule=1f1b, gpipe, zb_h1 or pipedream_async")


def capture_space_check(model, hardware) -> None:
    """PlanningError when CAPTURE's space has no plan at all — every stage lies within one node and
    holds ≥ 1 layer, so L layers occupy at most L nodes (GPT-3 175B's 98 layers on 128 nodes) — or
    when even the fewest layers that can fill the nodes are too many for the exact DP. Cheap:
    run.py calls it before profiling."""

    if model.num_layers < hardware.nodes:
        raise PlanningError(
            f"CAPTURE's plan space puts every stage within one node with at least one layer, so model "
            f"{model.name!r} ({model.num_layers} layers) cannot occupy the {hardware.nodes} nodes of "
            f"{hardware.name!r}; use fewer nodes (hardware.nodes) or policy=throughput, whose stages may span "
            "whole nodes")
    k, nodes = hardware.devices_per_node, hardware.nodes
    if dp_transitions(nodes, nodes, k) > DP_TRANSITIONS:
        raise PlanningError(
            f"CAPTURE's exact search over {hardware.num_devices} GPUs needs at least {nodes} (merged) layers, "
            f"{dp_transitions(nodes, nodes, k):,} stage configs to try — too many to search in seconds; use fewer "
            "nodes (hardware.nodes) or policy=throughput")


def recommend_for(stats: CaptureStats, policy, model, hardware, training) -> tuple[Recommendation, list[tuple[int, int]]]:
    """The recommender on ``stats`` for this model, hardware and batch: (recommendation over merged
    layers, each merged layer's original [start, stop)). Merges layers (§III-A3) to policy.merge_layers,
    or — when the exact DP would try more than DP_TRANSITIONS stage configs — to the most layers it
    may (exact on the merged layers; the search space is then coarser, not the search)."""

    spans = [(i, i + 1) for i in range(model.num_layers)]
    target = policy.merge_layers
    k, nodes = hardware.devices_per_node, hardware.nodes
    capture_space_check(model, hardware)
    if target is not None and target < min(nodes, model.num_layers):
        raise PlanningError(f"policy.merge_layers: {target} merged layers cannot occupy the {nodes} nodes of "
                            f"{hardware.name!r} (CAPTURE's stages lie within one node and hold at least one layer); "
                            f"use at least {nodes}, or null")
    if dp_transitions(min(target or model.num_layers, model.num_layers), nodes, k) > DP_TRANSITIONS:
        # At scale the exact DP (O(L² · N)) is too slow: merge layers first with CAPTURE's own layer
        # merger (§III-A3) to the most layers the search budget allows. Exact on the merged layers only.
        target = max(n for n in range(1, model.num_layers + 1) if n == 1 or dp_transitions(n, nodes, k) <= DP_TRANSITIONS)
    if target is not None and target < model.num_layers:
        stats, spans = merged_stats(stats, target)
    base = stats.predictor(training.samples_per_microbatch)
    per_mb = training.samples_per_microbatch

    def predict(start: int, stop: int, par: str, degree: int) -> float:
        layers = model.layers[spans[start][0]:spans[stop - 1][1]]
        if degree > 1 and (policy.pipeline_only
                           or (par == "dp" and per_mb % degree)
                           or (par == "tp" and any(l.max_tp is not None and degree > l.max_tp for l in layers))):
            return math.inf  # outside the plan space for this model and batch
        return base(start, stop, par, degree)

    if policy.search == "exhaustive" and (plans := exhaustive_plans(len(spans), nodes, k)) > EXHAUSTIVE_PLANS:
        most = max([n for n in range(nodes, len(spans)) if exhaustive_plans(n, nodes, k) <= EXHAUSTIVE_PLANS],
                   default=None)
        raise PlanningError(f"policy.search: exhaustive (Algorithm 4) would walk {plans:.3g} plans of {len(spans)} "
                            f"layers on {hardware.num_devices} GPUs, too many to search; use search=exact (the DP "
                            "finds the same optimum)" + (f" or policy.merge_layers <= {most}" if most else ""))
    search = recommend if policy.search == "exact" else recommend_exhaustive
    rec = search(predict, len(spans), hardware.nodes, hardware.devices_per_node)
    if math.isinf(rec.peak_bytes):
        raise PlanningError(f"no CAPTURE plan for {model.name} on {hardware.name}: every placement needs a stage "
                            "config outside the space (raise training.microbatch_size or allow hybrid parallelism)")
    return rec, spans


def plan_capture(policy, model, hardware, training, schedule, profile) -> Plan:
    """policy=capture: the recommender's plan (lowest predicted peak, paper's tie-break) from the
    CAPTURE statistics in ``profile`` (a specs.profile.Profile with its ``capture`` section)."""
    from planners.layout import recompute_actions
    from specs.plan import Plan, StagePlan

    if profile is None or profile.capture is None:
        raise PlanningError("policy=capture needs a CAPTURE profile (python -m run mode=profile policy=capture ...); "
                            "run.py profiles first when it has none")
    capture_schedule_check(schedule)
    stats = stats_from_profile(profile.capture)
    if stats.num_layers != model.num_layers:
        raise PlanningError(f"the CAPTURE profile has {stats.num_layers} layers, model {model.name!r} {model.num_layers}")
    rec, spans = recommend_for(stats, policy, model, hardware, training)
    stages, gpu = [], 0
    for cfg in rec.stages:
        a, b = spans[cfg.layer_start][0], spans[cfg.layer_stop - 1][1]
        dp, tp = (cfg.degree, 1) if cfg.parallelism == "dp" else (1, cfg.degree)
        stages.append(StagePlan(layer_start=a, layer_stop=b, devices=list(range(gpu, gpu + cfg.degree)), dp=dp, tp=tp,
                                memory=recompute_actions(model, a, b, policy.recompute)))
        gpu += cfg.degree
    return Plan(planner="capture", model=model.name, hardware=hardware.name, num_devices=hardware.num_devices,
                training=training, schedule=schedule, stages=stages)
