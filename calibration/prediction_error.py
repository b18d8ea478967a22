"""Prediction error of per-device peak memory over random plans (CAPTURE §IV-B, Fig. 7 analogue).

Pure: plans are drawn from CAPTURE's plan space with a caller-supplied ``random.Random``, and the
statistics are computed from predicted and measured peaks handed in as numbers. Running plans
(executor), simulating them and writing files happen in ``benchmarks/prediction_error.py``.

The plan space is the recommender's (capture.py ``recommend_exhaustive``; §III-C): contiguous
layer groups in order, each on a power-of-two sub-mesh of one node, pure dp or pure tp (or
neither, degree 1), every layer placed and no GPU idle. Plans are drawn *uniformly* from that
space by counting completions from every (next layer, next GPU) state and choosing each stage
with probability proportional to its completions — a plain random walk would favour plans with
few stages. The paper samples "from the set of possible plans that the recommender generates"
(§IV-B) and leaves out plans predicted to run out of memory; here a plan is left out when the
caller's ``accept`` refuses it (``specs.validate_plan``: dp not dividing the microbatch, tp above
a layer's head count).

Errors are relative, ``(predicted − measured) / measured``: per device, and per plan on the
peak across the plan's devices (Fig. 7's "per-GPU" and "per-plan" error).
"""
from __future__ import annotations

import random
from functools import lru_cache
from typing import Callable

from pydantic import Field

from planners.baselines.stage_place import Placed
from specs._base import Spec

#: Fig. 7's error margins: 2 %, 5 %, 11 %
MARGINS = (0.02, 0.05, 0.11)


# ---- the plan space -------------------------------------------------------------------------------

def _degrees(free: int) -> list[int]:
    """Powers of two that fit in ``free`` GPUs left on the node (CAPTURE's degrees)."""
    return [1 << e for e in range(free.bit_length()) if (1 << e) <= free]


@lru_cache(maxsize=4096)
def _choices(layer: int, gpu: int, layers: int, k: int) -> tuple[Placed, ...]:
    """Every stage that can start at (layer, gpu): layers [layer, stop) on GPUs [gpu, gpu + d)."""
    free = k - gpu % k
    out = []
    for stop in range(layer + 1, layers + 1):
        for degree in _degrees(free):
            for par in ("pp",) if degree == 1 else ("dp", "tp"):
                out.append(Placed(layer, stop, par, degree, gpu))
    return tuple(out)


def count_plans(layers: int, nodes: int, k: int) -> int:
    """Number of plans in CAPTURE's space for ``layers`` layers on ``nodes`` × ``k`` GPUs."""
    return _counter(layers, nodes * k, k)(0, 0)


@lru_cache(maxsize=16)  # memoised pure function: one completion counter per space
def _counter(layers: int, total: int, k: int) -> Callable[[int, int], int]:
    @lru_cache(maxsize=None)
    def count(layer: int, gpu: int) -> int:
        if layer == layers or gpu == total:
            return 1 if layer == layers and gpu == total else 0
        return sum(count(s.stop, gpu + s.degree) for s in _choices(layer, gpu, layers, k))
    return count


def uniform_plan(rng: random.Random, layers: int, nodes: int, k: int) -> list[Placed]:
    """One plan drawn uniformly from CAPTURE's space (each plan has probability 1 / count_plans)."""
    total = nodes * k
    count = _counter(layers, total, k)
    if count(0, 0) == 0:
        raise ValueError(f"no plan places {layers} layers on {nodes} x {k} GPUs (more GPUs than layers?)")
    stages, layer, gpu = [], 0, 0
    while layer < layers:
        options = _choices(layer, gpu, layers, k)
        weights = [count(s.stop, gpu + s.degree) for s in options]
        pick = rng.randrange(sum(weights))
        for s, w in zip(options, weights):
            if pick < w:
                break
            pick -= w
        stages.append(s)
        layer, gpu = s.stop, gpu + s.degree
    return stages


def sample_plans(rng: random.Random, n: int, layers: int, nodes: int, k: int,
                 accept: Callable[[list[Placed]], bool] = lambda _: True,
                 max_draws: int | None = None) -> list[list[Placed]]:
    """Up to ``n`` distinct plans drawn uniformly from the plans ``accept`` keeps, in draw order.

    Stops early (returning fewer) when the space runs out or after ``max_draws`` draws
    (default 50·n + 100), so a small space never loops forever."""
    space = count_plans(layers, nodes, k)
    seen: set[tuple[Placed, ...]] = set()
    out: list[list[Placed]] = []
    draws = 0
    limit = max_draws if max_draws is not None else 50 * n + 100
    while len(out) < n and len(seen) < space and draws < limit:
        draws += 1
        plan = tuple(uniform_plan(rng, layers, nodes, k))
        if plan in seen:
            continue
        seen.add(plan)
        if accept(list(plan)):
            out.append(list(plan))
    return out


def describe(stages: list[Placed]) -> str:
    """'0-1:pp@0 | 1-4:tp2@1 | 4-6:pp@3' — layers [start-stop), kind+degree, first GPU."""
    return " | ".join(f"{s.start}-{s.stop}:{s.parallelism}{s.degree if s.degree > 1 else ''}@{s.gpu}" for s in stages)


# ---- statistics -----------------------------------------------------------------------------------

def relative_error(predicted: float, measured: float) -> float:
    """(predicted − measured) / measured; positive = over-predicted. ``measured`` must be > 0."""
    if measured <= 0:
        raise ValueError(f"measured peak must be positive, got {measured}")
    return (predicted - measured) / measured


def plan_errors(predicted: dict[int, float], measured: dict[int, float]) -> tuple[list[float], float]:
    """(per-device errors in device order, per-plan error of the peaks) for one plan.

    Both maps are ``{device: peak bytes}`` over the same devices; a device missing from
    ``predicted`` is an error (a predictor must cover every device the plan uses)."""
    missing = sorted(set(measured) - set(predicted))
    if missing:
        raise ValueError(f"no prediction for devices {missing}")
    per_device = [relative_error(predicted[d], measured[d]) for d in sorted(measured)]
    per_plan = relative_error(max(predicted[d] for d in measured), max(measured.values()))
    return per_device, per_plan


def shares(errors: list[float], margins: tuple[float, ...] = MARGINS) -> dict[str, float]:
    """Share of |error| ≤ each margin, keyed '2%', '5%', '11%' (0.0 each for no errors)."""
    n = len(errors)
    return {f"{round(m * 100):d}%": (sum(abs(e) <= m + 1e-12 for e in errors) / n if n else 0.0) for m in margins}


class PlanMeasurement(Spec):
    """One sampled plan: its stages, the measured peak per device, each predictor's prediction."""

    plan_id: str
    stages: str = Field(description="describe(): layers, parallelism+degree, first GPU per stage")
    devices: list[int]
    measured_bytes: list[int] = Field(description="measured peak per device, in ``devices`` order")
    predicted_bytes: dict[str, list[float]] = Field(description="predictor -> peak per device, ``devices`` order")


class PredictorErrors(Spec):
    """Fig. 7 for one predictor: relative errors and the shares within 2 / 5 / 11 %."""

    per_device_errors: list[float]
    per_plan_errors: list[float]
    per_device_shares: dict[str, float]
    per_plan_shares: dict[str, float]
    per_device_mean_abs: float = Field(description="mean |error| per device")
    per_device_bias: float = Field(description="mean signed error per device (+ = over-predicted)")


class PredictionErrorReport(Spec):
    model: str
    hardware: str
    schedule: str
    global_batch: int
    num_microbatches: int
    profile_backend: str = Field(description="what ran CAPTURE's profiling plans (executor | simulator)")
    measured_by: str = "executor"
    plan_space: int = Field(description="plans in CAPTURE's space before validation")
    plans: list[PlanMeasurement]
    predictors: dict[str, PredictorErrors]


def predictor_errors(plans: list[PlanMeasurement], predictor: str) -> PredictorErrors:
    per_device, per_plan = [], []
    for p in plans:
        pred = dict(zip(p.devices, p.predicted_bytes[predictor]))
        dev, peak = plan_errors(pred, dict(zip(p.devices, p.measured_bytes)))
        per_device += dev
        per_plan.append(peak)
    n = len(per_device)
    return PredictorErrors(
        per_device_errors=per_device, per_plan_errors=per_plan,
        per_device_shares=shares(per_device), per_plan_shares=shares(per_plan),
        per_device_mean_abs=sum(map(abs, per_device)) / n if n else 0.0,
        per_device_bias=sum(per_device) / n if n else 0.0)


def build_report(plans: list[PlanMeasurement], **info) -> PredictionErrorReport:
    """The report over ``plans`` for every predictor they all carry; ``info``: the header fields."""
    names = sorted(set.intersection(*(set(p.predicted_bytes) for p in plans))) if plans else []
    return PredictionErrorReport(plans=plans, predictors={n: predictor_errors(plans, n) for n in names}, **info)


def shares_table(report: PredictionErrorReport) -> str:
    """Fixed-width table: one row per (predictor, per-device | per-plan), shares in %."""
    margins = [f"{round(m * 100):d}%" for m in MARGINS]
    head = f"{'predictor':<10} {'level':<10} {'n':>4} " + " ".join(f"{'<=' + m:>7}" for m in margins) + \
        f" {'mean|e|':>8} {'bias':>7}"
    rows = [head]
    for name, e in report.predictors.items():
        for level, errs, sh in (("per-device", e.per_device_errors, e.per_device_shares),
                                ("per-plan", e.per_plan_errors, e.per_plan_shares)):
            mean_abs = sum(map(abs, errs)) / len(errs) if errs else 0.0
            bias = sum(errs) / len(errs) if errs else 0.0
            rows.append(f"{name:<10} {level:<10} {len(errs):>4} " + " ".join(f"{100 * sh[m]:>6.1f}%" for m in margins)
                        + f" {100 * mean_abs:>7.1f}% {100 * bias:>+6.1f}%")
    return "\n".join(rows)
