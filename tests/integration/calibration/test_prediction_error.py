"""Prediction-error report (CAPTURE Fig. 7 analogue): random plans of gpt_tiny on local_cpu,
measured by the executor, predicted by the simulator and by CAPTURE's predictor.

The first tests check the pure pieces against closed forms (plan count, uniform sampling,
shares); the last runs real gloo ranks (~20 s on 2 cores)."""
from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from planners.capture.planner import predict_devices, stats_from_profile
from planners.capture.profile import profile_capture
from calibration.prediction_error import (
    PlanMeasurement, PredictionErrorReport, build_report, count_plans, describe, plan_errors, sample_plans, shares,
    uniform_plan,
)
from planners.baselines.stagetable import StageTable
from specs import HardwareSpec, ScheduleSpec, TrainingSpec
from costs.families import build_model, parse_model_config
from specs.plan import PlanError, validate_plan

CONF = Path(__file__).resolve().parents[3] / "conf"


def capture_space_size(layers: int) -> int:
    """Plans on one node of 4 GPUs, by degree sequence (aligned powers of two): [4] and [2,2] in dp
    or tp, [2,1,1], [1,2,1], [1,1,2] with 2 kinds each, [1,1,1,1]; s stages split the layers
    C(L−1, s−1) ways."""
    c = lambda s: math.comb(layers - 1, s - 1)  # noqa: E731
    return 2 * c(1) + 4 * c(2) + 3 * 2 * c(3) + c(4)


@pytest.mark.parametrize("layers", [4, 6, 9])
def test_plan_space_size_matches_the_closed_form(layers):
    assert count_plans(layers, 1, 4) == capture_space_size(layers)
    assert count_plans(5, 1, 2) == 5 + 1  # one 2-way stage (dp or tp), or a pp split at 4 places


def test_plans_are_drawn_uniformly_not_by_a_random_walk():
    # 92 plans for 6 layers on 4 GPUs; a walk choosing the degree first would give the two
    # single-stage plans (dp4, tp4) a third of all draws instead of 2/92.
    rng = random.Random(1)
    draws = Counter(tuple(uniform_plan(rng, 6, 1, 4)) for _ in range(9200))
    assert len(draws) == 92
    assert 50 <= min(draws.values()) and max(draws.values()) <= 150  # expected 100 each, sd 10
    for plan in draws:
        assert plan[0].start == 0 and plan[-1].stop == 6 and sum(s.degree for s in plan) == 4
        assert all(a.stop == b.start and a.gpu + a.degree == b.gpu for a, b in zip(plan, plan[1:]))


def test_sampling_is_distinct_respects_accept_and_stops_when_the_space_runs_out():
    no_tp4 = lambda st: not any(s.parallelism == "tp" and s.degree == 4 for s in st)  # noqa: E731
    plans = sample_plans(random.Random(0), 500, 6, 1, 4, no_tp4)
    assert len(plans) == 91 and len({tuple(p) for p in plans}) == 91
    assert all(no_tp4(p) for p in plans)


def test_errors_and_shares():
    per_device, per_plan = plan_errors({0: 102.0, 1: 90.0}, {0: 100.0, 1: 100.0})
    assert per_device == pytest.approx([0.02, -0.10])
    assert per_plan == pytest.approx(0.02)  # peaks: 102 predicted vs 100 measured
    assert shares([0.01, -0.02, 0.04, -0.10, 0.5]) == {"2%": 0.4, "5%": 0.6, "11%": 0.8}
    with pytest.raises(ValueError, match="no prediction for devices \\[1\\]"):
        plan_errors({0: 1.0}, {0: 1.0, 1: 1.0})


def load(group: str, name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))


@pytest.mark.slow
def test_fig7_report_for_executor_measured_plans(tmp_path):
    from executor import execute
    from simulator import simulate
    from reports.outputs import write_prediction_error

    cfg = parse_model_config(load("model", "gpt_tiny"))
    model = build_model(cfg, 4)  # the executor trains in fp32
    hw = HardwareSpec.model_validate(load("hardware", "local_cpu"))
    training = TrainingSpec(global_batch=32, num_microbatches=4, precision="fp32")
    schedule = ScheduleSpec(kind="gpipe")
    cap = profile_capture(model, hw, training, schedule,
                          lambda p, m, h: simulate(validate_plan(p, m, h), m, h).result, "simulator")
    stats = stats_from_profile(cap)
    table = StageTable(model, hw, training, schedule)

    def valid(stages) -> bool:
        try:
            validate_plan(table.to_plan(stages, "random"), model, hw)
            return True
        except PlanError:
            return False

    records = []
    for stages in sample_plans(random.Random(7), 3, model.num_layers, hw.nodes, hw.devices_per_node, valid):
        plan = table.to_plan(stages, "random")
        measured = execute(plan, cfg, hw, iterations=1, warmup=1, timeout_s=240)
        assert measured.failure is None, measured.failure
        meas = {d.device: d.peak_bytes for d in measured.devices}
        sim = {d.device: d.peak_bytes for d in simulate(plan, model, hw).result.devices}
        cpt = predict_devices(plan, stats)
        devices = sorted(meas)
        records.append(PlanMeasurement(
            plan_id=plan.id, stages=describe(stages), devices=devices, measured_bytes=[meas[d] for d in devices],
            predicted_bytes={"simulator": [float(sim[d]) for d in devices],
                             "capture": [float(cpt[d]) for d in devices]}))
    report = build_report(records, model=model.name, hardware=hw.name, schedule="gpipe", global_batch=32,
                          num_microbatches=4, profile_backend="simulator", measured_by="executor",
                          plan_space=count_plans(6, 1, 4))

    assert set(report.predictors) == {"capture", "simulator"}
    for name, e in report.predictors.items():
        assert len(e.per_device_errors) == 12 and len(e.per_plan_errors) == 3
        for sh in (e.per_device_shares, e.per_plan_shares):
            assert list(sh) == ["2%", "5%", "11%"] and 0 <= sh["2%"] <= sh["5%"] <= sh["11%"] <= 1
    # CAPTURE profiled with the simulator composes stage predictions (M_i + Σ M_a, a line over
    # batch) that must reproduce the simulator's plan peak: its per-plan error is the simulator's.
    for p in report.plans:
        assert max(p.predicted_bytes["capture"]) == pytest.approx(max(p.predicted_bytes["simulator"]), rel=0.03)
    # On this machine the closed-form activation bytes over-count what the executor keeps (static
    # bytes match exactly), so the simulator over-predicts every plan's peak (+14..+26 % on 20 plans,
    # never under): a plan it says fits, fits. Fig. 7's "within 11 %" is not met here (see the note).
    sim = report.predictors["simulator"]
    assert all(0.0 < e < 0.40 for e in sim.per_plan_errors), sim.per_plan_errors

    written = write_prediction_error(tmp_path, report)
    assert [p.name for p in written] == ["prediction_error.json", "prediction_error.png"]
    again = PredictionErrorReport.model_validate_json((tmp_path / "prediction_error.json").read_text())
    assert again.predictors["simulator"].per_device_shares == sim.per_device_shares
    assert (tmp_path / "prediction_error.png").read_bytes()[:4] == b"\x89PNG"


def test_benchmark_script_caches_the_profile_and_resumes_measurements(tmp_path, capsys):
    import runpy

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "prediction_error.py"
    main = runpy.run_path(str(script), run_name="prediction_error_bench")["main"]
    args = ["--plans", "4", "--backend", "simulator", "--out", str(tmp_path / "out"),
            "--profile-cache", str(tmp_path / "cache")]
    first = main(args)
    out = capsys.readouterr().out
    assert "[profile 60/60]" in out and "4 distinct valid plans" in out
    assert out.strip().splitlines()[-1] == "simulator_within_11pct=1.000 capture_within_11pct=" + \
        f"{first['report'].predictors['capture'].per_device_shares['11%']:.3f}"
    assert len((tmp_path / "out" / "measurements.jsonl").read_text().splitlines()) == 4
    again = main(args)
    out = capsys.readouterr().out
    assert "cached: skipping the profiling runs" in out and "[profile 1/" not in out
    assert len((tmp_path / "out" / "measurements.jsonl").read_text().splitlines()) == 4  # nothing re-measured
    assert again["report"].predictors == first["report"].predictors
