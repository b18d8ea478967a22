"""policy.recompute_num_layers: Megatron's --recompute-method block --recompute-num-layers N, the
first N blocks of each stage (each model chunk) recomputed in full, the others kept; the simulator
prices the plan's per-layer actions, so the peak and the time sit between none and full."""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
from planners import PlanningError, make_plan, parse_policy
from simulator.analytic import estimate, iteration_time_s
from specs.hardware import HardwareSpec
from specs.plan import MemoryAction, ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf

MODEL = build_model(parse_model_config(conf("model", "gpt3_2b6")), 2)
HW = HardwareSpec.model_validate(conf("hardware", "dgx1"))
TRAINING = TrainingSpec(global_batch=32, microbatch_size=2, precision="fp16")


def plan_of(schedule="1f1b", virtual=1, **policy):
    return make_plan(parse_policy({"kind": "manual", "pp": 4, "dp": 2, **policy}), MODEL, HW, TRAINING,
                     ScheduleSpec(kind=schedule, virtual_stages=virtual))


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_first_n_blocks_of_each_stage(schedule, virtual):
    plan = plan_of(schedule, virtual, recompute="full", recompute_num_layers=2)
    full = plan_of(schedule, virtual, recompute="full")
    for st, st_full in zip(plan.stages, full.stages):
        blocks = [m.layer for m in st_full.memory]
        assert [m.layer for m in st.memory] == blocks[:2]
        assert all(m.action is MemoryAction.recompute for m in st.memory)


@pytest.mark.parametrize("middle", [{"recompute_num_layers": 2}, {"recompute_every": 2}],
                         ids=["first-2-of-each-stage", "every-2nd-block"])
def test_between_none_and_full(middle):
    plans = [plan_of(), plan_of(recompute="full", **middle), plan_of(recompute="full")]
    peaks = [max(d.peak_bytes for d in estimate(p, MODEL, HW).devices) for p in plans]
    times = [iteration_time_s(p, MODEL, HW) for p in plans]
    assert peaks[0] > peaks[1] > peaks[2]
    assert times[0] < times[1] < times[2]


def test_needs_full_recompute():
    with pytest.raises(PlanningError, match="policy.recompute_num_layers: .*needs policy.recompute=full"):
        plan_of(recompute="selective", recompute_num_layers=2)


# ---- policy.recompute_every: torchtitan's layer-level selective AC (selective_ac_option = k) ----

@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_every_kth_block_of_the_model(k, schedule, virtual):
    """Blocks k, 2k, ... of the whole model, counted from 1 across stage boundaries (torchtitan's
    wrapper counts blocks model-wide), whatever the stage or chunk holds them."""
    plan = plan_of(schedule, virtual, recompute="full", recompute_every=k)
    blocks = [m.layer for st in plan_of(schedule, virtual, recompute="full").stages for m in st.memory]
    got = sorted(m.layer for st in plan.stages for m in st.memory)
    assert got == sorted(b for n, b in enumerate(sorted(blocks), start=1) if n % k == 0)
    assert all(m.action is MemoryAction.recompute for st in plan.stages for m in st.memory)
    for st in plan.stages:
        assert all(st.layer_start <= m.layer < st.layer_stop for m in st.memory)


@pytest.mark.parametrize("policy,match", [
    ({"recompute": "selective", "recompute_every": 2}, "policy.recompute_every: .*needs policy.recompute=full"),
    ({"recompute": "full", "recompute_every": 2, "recompute_num_layers": 1}, "set one of the two"),
])
def test_every_refuses_what_it_cannot_mean(policy, match):
    with pytest.raises(PlanningError, match=match):
        plan_of(**policy)
