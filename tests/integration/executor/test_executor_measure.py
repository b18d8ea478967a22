"""execute(): a measured Result in the shared schema, with per-rank peaks whose static part is the
closed form (fp32 Adam: 4 B weights + 4 B grads + 8 B m, v per parameter) and whose activations
follow the schedule (1F1B holds min(p - i, m) microbatches on stage i, GPipe all m)."""
from __future__ import annotations


import pytest

from executor import execute
from executor.single import run_stage_alone
from planners import make_plan, parse_policy
from costs.families import build_model
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU
from specs.plan import ScheduleSpec
from specs.result import Result
from specs.training import TrainingSpec

pytestmark = pytest.mark.slow



CFG, HW = GPT_TINY, LOCAL_CPU
SPEC = build_model(CFG, 4)
TRAINING = CPU_TRAINING


def measured(schedule: str) -> tuple:
    plan = make_plan(parse_policy({"kind": "even", "pp": 4}), SPEC, HW, TRAINING, ScheduleSpec(kind=schedule))
    return plan, execute(plan, CFG, HW, iterations=2, warmup=1, timeout_s=120, device="cpu")


@pytest.fixture(scope="module")
def one_f_one_b():
    return measured("1f1b")


@pytest.fixture(scope="module")
def gpipe():
    return measured("gpipe")


def test_result_is_a_measured_result_of_the_plan(one_f_one_b):
    plan, result = one_f_one_b
    assert result.failure is None
    assert Result.model_validate_json(result.model_dump_json()) == result
    assert result.source == "measured" and result.plan_id == plan.id
    assert [(d.device, d.rank) for d in result.devices] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert result.iteration_time_s > 0
    assert result.samples_per_s == pytest.approx(TRAINING.global_batch / result.iteration_time_s)
    assert result.tflops_per_device > 0


def test_static_memory_is_the_fp32_adam_closed_form(one_f_one_b):
    plan, result = one_f_one_b
    for dev in result.devices:
        stage = plan.stages[dev.stages[0]]
        params = sum(SPEC.layers[i].params for i in stage.layers)
        b = dev.breakdown
        assert b.parameters_bytes == 4 * params
        assert b.gradients_bytes == 4 * params
        assert b.optimizer_bytes >= 8 * params  # m and v (+ step counters, step temporaries)
        assert dev.peak_bytes == b.total_bytes  # the breakdown is taken at the peak


def test_1f1b_holds_fewer_microbatches_than_gpipe(one_f_one_b, gpipe):
    _, ofob = one_f_one_b
    _, gpipe = gpipe
    assert gpipe.failure is None
    acts = lambda r, d: r.devices[d].breakdown.activations_bytes  # noqa: E731
    # block stages 1 and 2: 1F1B keeps 3 and 2 of 4 microbatches, GPipe all 4
    assert acts(ofob, 1) < acts(gpipe, 1) and acts(ofob, 2) < acts(gpipe, 2)
    assert acts(ofob, 2) < acts(ofob, 1)
    # what GPipe holds beyond 1F1B is the microbatches 1F1B has not taken in yet (4 - 3 on stage 1,
    # 4 - 2 on stage 2) times what one microbatch holds there (the symbolic profile of these
    # modules), give or take the released outputs still in flight at each schedule's peak: gloo
    # completes a send once its receive is posted, so how many are in flight depends on timing: at
    # most the m microbatches of GPipe's stage plus the p - i that 1F1B's stage i has in flight
    from executor.profile_symbolic import profile_model
    import costs.activations
    from specs.profile import apply_profile

    plan, _ = one_f_one_b
    traced = apply_profile(SPEC, profile_model(CFG, microbatch=TRAINING.samples_per_microbatch, dtype="fp32"))
    for stage, fewer in ((1, 1), (2, 2)):
        st = plan.stages[stage]
        per_mb = costs.activations.stage_activation_bytes(traced, plan, st)
        m = plan.training.microbatches
        in_flight = (m + len(plan.stages) - stage) * costs.activations.sent_output_bytes(traced, plan, st)
        diff = acts(gpipe, stage) - acts(ofob, stage)
        assert abs(diff - fewer * per_mb) <= in_flight, (stage, diff, fewer * per_mb, in_flight)


def test_a_stage_alone_holds_what_it_holds_in_the_pipeline(gpipe):
    plan, result = gpipe
    for stage in range(4):
        alone = run_stage_alone(plan, CFG, stage, iterations=2)
        # GPipe: no send buffer outlives its microbatch's forward, so the two runs coincide
        assert alone["peak_bytes"] == pytest.approx(result.devices[stage].peak_bytes, rel=0.02), stage


def test_sent_buffers_are_freed_during_the_iteration():
    # 16 microbatches of 1F1B: if sent activations/gradients lived until the iteration's end the
    # pipelined stages would hold ~16 extra boundary tensors; they must match the stage alone
    training = TrainingSpec(global_batch=32, microbatch_size=2, precision="fp32")
    plan = make_plan(parse_policy({"kind": "even", "pp": 4}), SPEC, HW, training, ScheduleSpec(kind="1f1b"))
    result = execute(plan, CFG, HW, iterations=1, warmup=1, timeout_s=120, device="cpu")
    assert result.failure is None
    for stage in range(4):
        alone = run_stage_alone(plan, CFG, stage, iterations=2)["peak_bytes"]
        assert result.devices[stage].peak_bytes == pytest.approx(alone, rel=0.03), stage
