"""CAPTURE's predictor outside the profiled range (issue 22): ``policy=capture`` on a DGX-1 printed
``CAPTURE peak 9.10 GiB (predicted -1.60 GiB)``. Degrees above 4 were a logarithm through the two
profiled degrees, which falls without bound; the batch line could fall too. No prediction may be
negative, and an extrapolated one is said to be."""
from __future__ import annotations

import math

import pytest

from planners.capture.planner import CaptureStats, degree_at, line_at, predict_devices, predicted_degrees
from planning import planner_lines
from specs.plan import Plan, StagePlan
from specs.training import TrainingSpec
from tests.conftest import make_hardware

GIB = float(1 << 30)
SCENARIOS = ("pp", "dp2", "dp4", "tp2", "tp4")


def one_layer_stats(memory) -> CaptureStats:
    """One layer whose M_i at (scenario, microbatch) is ``memory(parallelism, degree, microbatch)``."""
    m_i, m_a = {}, {}
    for sc in SCENARIOS:
        par, degree = ("pp", 1) if sc == "pp" else (sc[:2], int(sc[2:]))
        for b in (1, 2):
            m_i[sc, b] = (memory(par, degree, b),)
            m_a[sc, b] = (0.0,)
    return CaptureStats(m_i=m_i, m_a=m_a)


def test_a_fixed_part_plus_a_part_split_over_the_degree_is_extrapolated_exactly():
    # CAPTURE §III-B3's own model: M = M_fixed + M_split / degree. A log through degrees 2 and 4
    # gave M_fixed at 8 (an underestimate) and a negative number at 16.
    fixed, split = 1 * GIB, 16 * GIB
    stats = one_layer_stats(lambda par, d, b: fixed + split * b / 2 / d)
    predict = stats.predictor(2)
    for degree in (2, 4, 8, 16, 64):
        assert predict(0, 1, "tp", degree) == pytest.approx(fixed + split / degree)
        assert predict(0, 1, "dp", degree) == pytest.approx(fixed + split / degree)


def test_memory_falling_faster_than_one_over_the_degree_never_extrapolates_below_zero():
    # 12 GiB at tp2, 4 GiB at tp4: no fixed + split/degree explains it (the fixed part would be
    # -4 GiB); the split part alone through the 4-way point is what is left, 16 GiB / degree
    assert degree_at((2, 4), (12 * GIB, 4 * GIB), 8) == pytest.approx(2 * GIB)
    assert degree_at((2, 4), (12 * GIB, 4 * GIB), 16) == pytest.approx(1 * GIB)
    for degree in (8, 16, 32, 1024):
        assert degree_at((2, 4), (12 * GIB, 4 * GIB), degree) > 0
    assert degree_at((2, 4), (math.inf, 4 * GIB), 8) == math.inf  # a degree not profiled stays out


def test_memory_that_grows_with_the_degree_stays_below_its_fixed_part():
    y2, y4 = 4 * GIB, 5 * GIB  # e.g. per-replica buffers that grow with the group
    assert y4 < degree_at((2, 4), (y2, y4), 8) < 2 * y4 - y2


def test_the_batch_line_never_falls_below_zero_or_below_the_larger_profiled_size():
    # profiled peaks that fall as the microbatch grows (noise) are not extrapolated downhill
    assert line_at((1, 2), (5 * GIB, 4 * GIB), 8) == pytest.approx(4 * GIB)
    # a line through two sizes above the target, extrapolated down, would cross zero: its fixed
    # part is negative, so the part proportional to the samples through the nearer size bounds it
    assert line_at((4, 8), (1 * GIB, 5 * GIB), 1) == pytest.approx(0.25 * GIB)
    assert line_at((4, 8), (10, 18), 16) == pytest.approx(34)  # the rising line is unchanged


def test_a_one_stage_tp8_plan_is_predicted_positive_and_said_to_be_extrapolated():
    # the shape: tp4 a bit under half of tp2, so the old log fit went below zero at 8
    stats = one_layer_stats(lambda par, d, b: {1: 20.0, 2: 9.0, 4: 3.0}[d] * GIB * b)
    hw = make_hardware(devices=8)
    plan = Plan(planner="capture", model="toy", hardware=hw.name, num_devices=8,
                training=TrainingSpec(global_batch=8, microbatch_size=2),
                stages=[StagePlan(layer_start=0, layer_stop=1, devices=list(range(8)), dp=1, tp=8)])
    predicted = predict_devices(plan, stats)
    assert min(predicted.values()) > 0
    assert predicted_degrees(plan) == {"tp": [8]}
    report = {"capture": {"peak_bytes": 9.1 * GIB, "predicted_peak_bytes": max(predicted.values()),
                          "predicted_extrapolated": predicted_degrees(plan), "samples_per_s": 6.1,
                          "stages": [[0, 1, 1, 8]], "oom_devices": 0, "over_bytes": 0},
              "throughput": {"peak_bytes": 18.4 * GIB, "samples_per_s": 25.9, "stages": [[0, 1, 2, 1]] * 4,
                             "oom_devices": 0, "over_bytes": 0},
              "peak_reduction_pct": 50.5, "throughput_loss_pct": 76.4, "source": "simulated"}
    line = planner_lines(report, hw, "planners.json").splitlines()[0]
    assert "-" not in line.split("predicted")[1].split(")")[0]
    assert "extrapolated" in line and "tp 8" in line
