"""CAPTURE profiling partitionings (Description 1) and M_i/M_a extraction, with a fake backend
whose peaks are additive: PM(a..b) = base + Σ w_l, so M_i(l) = base + w_l and M_a(l) = w_l."""
from __future__ import annotations

import pytest

from planners.capture.profile import (SCENARIO_DEGREES, extract, partitionings, profile_capture, profiling_hardware,
                                       runnable_scenarios)
from specs.result import DeviceResult, Result
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import make_hardware, make_model

BASE = 1000


@pytest.mark.parametrize("L,S", [(6, 4), (6, 3), (10, 4), (34, 16), (98, 8), (3, 3)])
def test_partitionings_isolate_every_layer_and_fit_the_mesh(L, S):
    runs = partitionings(L, S)
    assert len(runs) == len(set(runs))
    alone = set()
    for counts in runs:
        assert sum(counts) == L and min(counts) >= 1 and len(counts) <= S
        start = 0
        for n in counts:
            if n == 1:
                alone.add(start)
            start += n
    assert alone == set(range(L))
    assert len(runs) <= 2 * L + 2  # Description 1: about L + L/q


def test_extract_recovers_additive_memory():
    w = [5, 7, 11, 13, 17]
    pm = lambda a, b: BASE + sum(w[a:b])  # noqa: E731
    peaks = {}
    for counts in partitionings(len(w), 3):
        start = 0
        for n in counts:
            peaks[(start, start + n)] = pm(start, start + n)
            start += n
    assert extract(len(w), peaks) == [(BASE + x, x) for x in w]


def additive_backend(weights, calls):
    def backend(plan, model, hardware):
        calls.append(plan)
        devices = []
        for stage in plan.stages:
            per = BASE + sum(weights[stage.layer_start:stage.layer_stop]) * plan.training.samples_per_microbatch
            devices += [DeviceResult(device=d, capacity_bytes=1 << 40, peak_bytes=per // stage.dp // stage.tp)
                        for d in stage.devices]
        return Result(source="simulated", plan_id=plan.id, model=plan.model, hardware=plan.hardware,
                      devices=devices, iteration_time_s=1.0, samples_per_s=1.0, tflops_per_device=0.0)
    return backend


def test_profile_capture_all_scenarios_and_resume_after_interrupt():
    model, hw = make_model(num_layers=6), make_hardware(devices=4)
    training = TrainingSpec(global_batch=64, microbatch_size=2)
    weights = [100 * (i + 1) for i in range(6)]
    calls: list = []
    full = profile_capture(model, hw, training, ScheduleSpec(), additive_backend(weights, calls), "fake")
    # the target's 32 microbatches of 2: pp/tp profile microbatches 1 and 2 (the half, then the
    # target itself, as a quarter is not whole); dp2 needs even sizes (2, 4), dp4 multiples of 4
    assert full.runs == len(calls) and full.batch_sizes == [256, 128, 64, 32]
    assert {(s.scenario, s.batch_size) for s in full.scenarios} == {
        *((s, b) for s in ("pp", "tp2", "tp4") for b in (64, 32)), ("dp2", 128), ("dp2", 64), ("dp4", 256), ("dp4", 128)}
    assert all(p.training.num_microbatches == 32 for p in calls)  # as many in flight as the target
    pp = next(s for s in full.scenarios if s.scenario == "pp" and s.batch_size == 32)
    mb = pp.microbatch_size
    assert [x.M_a_bytes for x in pp.layers] == [w * mb for w in weights]
    assert all(len(s.layers) == 6 for s in full.scenarios)
    assert full.profiling_devices == 12  # 4-way needs 3 sub-meshes: the mesh is widened
    assert profiling_hardware(hw, 4).num_devices == 12 and profiling_hardware(hw, 1) is hw

    # interrupted after 7 runs: the log holds 7 records; a restart runs only the others
    log: dict = {}

    class Stop(Exception):
        pass

    def on_run(run, peaks, i, n):
        log[run.key] = peaks
        if len(log) == 7:
            raise Stop

    with pytest.raises(Stop):
        profile_capture(model, hw, training, ScheduleSpec(), additive_backend(weights, []), "fake", on_run=on_run)
    again: list = []
    resumed = profile_capture(model, hw, training, ScheduleSpec(), additive_backend(weights, again), "fake",
                              done=log)
    assert len(again) == full.runs - 7
    assert resumed.scenarios == full.scenarios


def test_default_profiling_batches_are_the_papers_half_and_quarter_when_whole():
    from planners.capture.profile import profiling_batches

    table1 = TrainingSpec(global_batch=1024, num_microbatches=32)  # CAPTURE Table I, GPT-3 6.7B
    batches, m = profiling_batches(None, None, table1, ["pp", "dp2", "dp4", "tp2", "tp4"])
    assert m == 32 and all(b == [512, 256] for b in batches.values())


def test_tp_scenarios_above_a_layers_max_tp_are_not_run():
    """A tp scenario runs every layer at its degree: with blocks capped at tp 2 (a LLaMA block's
    2 kv heads) the tp4 runs are left out (the executor refuses them: "tp 4 does not divide the 2
    kv heads"), tp2 and the rest are profiled, and the planner prices tp 4 as outside its space."""
    model = make_model(num_layers=6)
    capped = model.model_copy(update={"layers": [layer.model_copy(update={"max_tp": 2}) for layer in model.layers]})
    hw, training = make_hardware(devices=4), TrainingSpec(global_batch=64, microbatch_size=2)
    assert runnable_scenarios(model, list(SCENARIO_DEGREES)) == (list(SCENARIO_DEGREES), [])
    assert runnable_scenarios(capped, list(SCENARIO_DEGREES)) == (["pp", "dp2", "dp4", "tp2"], ["tp4"])
    calls: list = []
    prof = profile_capture(capped, hw, training, ScheduleSpec(), additive_backend([1] * 6, calls), "fake")
    assert max(p.stages[0].tp for p in calls) == 2
    assert {s.scenario for s in prof.scenarios} == {"pp", "dp2", "dp4", "tp2"}
