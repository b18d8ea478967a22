"""The fast stage-table evaluator equals analytic.estimate; the throughput search finds the optimum."""
from __future__ import annotations

import random

import pytest

from simulator.analytic import estimate
from planners.baselines.stage_place import Placed
from planners.baselines.stagetable import StageTable
from planners.baselines.throughput import best_throughput, candidates
from specs import ScheduleKind, ScheduleSpec, TrainingSpec, validate_plan
from tests.conftest import make_hardware, make_model


def all_plans(L: int, nodes: int, k: int):
    """Every placement in the space, by brute force (small cases only)."""
    total = nodes * k

    def rec(layer, gpu):
        if layer == L and gpu == total:
            yield []
            return
        if layer == L or gpu == total:
            return
        for stop in range(layer + 1, L + 1):
            for degree in (1, 2, 4, 8):
                if degree > k - gpu % k:
                    break
                for par in ("pp",) if degree == 1 else ("dp", "tp"):
                    for rest in rec(stop, gpu + degree):
                        yield [Placed(layer, stop, par, degree, gpu), *rest]

    return rec(0, 0)


def varied_model(L: int, seed: int):
    rng = random.Random(seed)
    model = make_model(num_layers=L)
    layers = [l.model_copy(update={"fwd_flops_per_sample": rng.uniform(0.5e9, 4e9),
                                   "params": rng.randint(1, 8) * 1_000_000,
                                   "saved_bytes_per_sample": rng.randint(1, 8) << 20}) for l in model.layers]
    return model.model_copy(update={"layers": layers})


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "pipedream_async"])
def test_table_evaluation_equals_analytic_estimate(kind):
    model, hw = varied_model(6, 1), make_hardware(devices=4, nodes=2)
    table = StageTable(model, hw, TrainingSpec(global_batch=32, microbatch_size=4), ScheduleSpec(kind=ScheduleKind(kind)))
    rng = random.Random(0)
    plans = list(all_plans(6, 2, 4))
    for stages in rng.sample(plans, 25):
        t, peaks = table.evaluate(stages)
        plan = validate_plan(table.to_plan(stages, "test"), model, hw)
        res = estimate(plan, model, hw)
        assert t == pytest.approx(res.iteration_time_s, rel=1e-12)
        by_device = {d.device: d.peak_bytes for d in res.devices}
        for s, peak in zip(stages, peaks):
            assert all(by_device[g] == peak for g in range(s.gpu, s.gpu + s.degree))


@pytest.mark.parametrize("seed", range(4))
def test_throughput_search_finds_brute_force_optimum(seed):
    model, hw = varied_model(5, seed), make_hardware(devices=4, nodes=2, memory_bytes=1 << 40)
    table = StageTable(model, hw, TrainingSpec(global_batch=32, microbatch_size=4), ScheduleSpec())
    brute = min(table.evaluate(p)[0] for p in all_plans(5, 2, 4))
    stages, t, _ = best_throughput(table)
    assert t == pytest.approx(brute, rel=1e-12)
    assert len(candidates(table)) >= 1


def test_throughput_prefers_plans_that_fit():
    model = varied_model(5, 3)
    roomy = make_hardware(devices=4, nodes=2, memory_bytes=1 << 40)
    table = StageTable(model, roomy, TrainingSpec(global_batch=32, microbatch_size=4), ScheduleSpec())
    fastest, _, peaks = best_throughput(table)
    tight_bytes = max(peaks) - 1  # the fastest plan no longer fits
    tight = make_hardware(devices=4, nodes=2, memory_bytes=tight_bytes)
    stages, _, peaks2 = best_throughput(StageTable(model, tight, table.training, ScheduleSpec()))
    assert any(max(table.evaluate(p)[1]) <= tight_bytes for p in all_plans(5, 2, 4))  # a slower plan fits
    assert max(peaks2) <= tight_bytes


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "pipedream_async"])
@pytest.mark.parametrize("seed", range(3))
def test_memory_constrained_search_is_exact(kind, seed):
    model = varied_model(6, seed)
    roomy = make_hardware(devices=4, nodes=2, memory_bytes=1 << 40)
    sched = ScheduleSpec(kind=ScheduleKind(kind))
    training = TrainingSpec(global_batch=32, microbatch_size=4)
    evals = [StageTable(model, roomy, training, sched).evaluate(p) for p in all_plans(6, 2, 4)]
    cap = sorted(max(peaks) for _, peaks in evals)[len(evals) // 3]  # a third of all plans fit
    tight = make_hardware(devices=4, nodes=2, memory_bytes=cap)
    brute = min(t for t, peaks in evals if max(peaks) <= cap)
    _, t, peaks = best_throughput(StageTable(model, tight, training, sched))
    assert max(peaks) <= cap and t == pytest.approx(brute, rel=1e-12)
