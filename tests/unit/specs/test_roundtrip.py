"""Plans and results round-trip through JSON exactly, for any planner output."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from planners import make_plan, parse_policy
from simulator.analytic import estimate
from specs import Plan, Result, ScheduleKind, ScheduleSpec, TrainingSpec
from tests.conftest import make_hardware, make_model


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(8, 24),
    pp=st.sampled_from([1, 2, 4]),
    dp=st.sampled_from([1, 2]),
    kind=st.sampled_from(["even", "balanced", "manual"]),
    schedule=st.sampled_from(["gpipe", "1f1b", "pipedream_async"]),
    recompute=st.sampled_from(["none", "full"]),
    zero=st.integers(0, 3),
    precision=st.sampled_from(["fp32", "fp16", "bf16"]),
)
def test_plan_and_result_round_trip(layers, pp, dp, kind, schedule, recompute, zero, precision):
    hw = make_hardware(devices=pp * dp * 2)
    model = make_model(num_layers=layers)
    policy = parse_policy({"kind": kind, "pp": pp * 2, "dp": dp, "recompute": recompute, "zero_stage": zero})
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision=precision)
    plan = make_plan(policy, model, hw, training, ScheduleSpec(kind=ScheduleKind(schedule)))
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    result = estimate(plan, model, hw)
    again = Result.model_validate_json(result.model_dump_json())
    assert again == result and again.model_dump_json() == result.model_dump_json()
    assert result.plan_id == plan.id
