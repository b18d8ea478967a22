"""A STRONGHOLD window on one stage of another planner's plan (planners/stronghold/stage_window.py).

policy=auto lays out a pipeline and asks for a window on the stage that does not fit (here stage
0 of GPT 5.3B on two 32 GiB V100s: 51 GiB with full recompute); the rest of the plan must stay as
it was, the windowed stage must fit the capacity asked for, in the analytic model and in the
simulator, and the window must be the one policy=stronghold picks for such a stage.
"""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
from planners import parse_policy
from planners.baselines.partition import plan_balanced
from planners.policy import BalancedPolicy
from planners.stronghold.planner import stronghold_search, with_window
from planners.stronghold.stage_window import window_blockers, window_stage
from planners.verdict import peaks
from simulator import simulate
from specs.hardware import HardwareSpec
from specs.plan import (LayerMemory, LayerSharding, MemoryAction, NodeSharding, ScheduleKind, ScheduleSpec,
                        validate_plan)
from specs.training import TrainingSpec
from tests.conftest import conf

GIB = 1 << 30
V100 = HardwareSpec.model_validate(conf("hardware", "v100_single"))
TRAINING = TrainingSpec(global_batch=32, microbatch_size=8, precision="fp16")


def two_v100(**host):
    hw = V100.model_copy(update={"devices_per_node": 2})
    return hw.model_copy(update={"host": hw.host.model_copy(update=host)}) if host else hw


@pytest.fixture(scope="module")
def gpt_5b3():
    return build_model(parse_model_config(conf("model", "gpt_5b3")))


def pipeline(model, hw, pp=2, dp=1, tp=1, schedule="1f1b"):
    return plan_balanced(BalancedPolicy(pp=pp, dp=dp, tp=tp, recompute="full"), model, hw, TRAINING,
                         ScheduleSpec(kind=schedule))


def stage0_peak(plan, model) -> int:
    return peaks(plan, model)[plan.stages[0].devices[0]]


def assert_only_stage0_changed(before, after):
    assert after.model_dump(exclude={"stages"}) == before.model_dump(exclude={"stages"})
    assert [s.model_dump_json() for s in after.stages[1:]] == [s.model_dump_json() for s in before.stages[1:]]
    a, b = after.stages[0], before.stages[0]
    assert a.model_dump(exclude={"offload"}) == b.model_dump(exclude={"offload"})  # layers, devices, recompute


@pytest.mark.parametrize("cap_gib", [32, 20])  # the device's memory, and a user's budget below it
def test_window_fits_stage0_in_the_capacity_and_leaves_the_rest_alone(gpt_5b3, cap_gib):
    hw = two_v100()
    plan = pipeline(gpt_5b3, hw)
    cap = cap_gib * GIB
    assert stage0_peak(plan, gpt_5b3) > hw.device.memory_bytes  # does not fit, even with full recompute
    sw = window_stage(plan, gpt_5b3, hw, 0, cap)
    assert sw is not None and sw.fits and sw.host_fits, sw.reason
    validate_plan(sw.plan, gpt_5b3, hw)
    assert_only_stage0_changed(plan, sw.plan)
    off = sw.plan.stages[0].offload
    # the embedding (Fig. 3) and the first working window (§III-E1: min(w, n - w) of the n streamable layers)
    n = plan.stages[0].num_layers - 1
    keep = min(sw.window_layers, n - sw.window_layers)
    assert off.window_layers == sw.window_layers and off.resident_layers == list(range(keep + 1))
    assert not off.nvme and not off.optimizer_on_cpu  # 755 GiB of host RAM hold the streamed state
    assert stage0_peak(sw.plan, gpt_5b3) == sw.price.peak_bytes <= cap
    sim = simulate(sw.plan, gpt_5b3, hw, trace=False).result
    dev0 = next(d for d in sim.devices if d.device == 0)
    assert not dev0.oom and dev0.peak_bytes <= cap
    assert f"window {sw.window_layers} of" in sw.reason


def test_the_window_is_the_one_policy_stronghold_picks():
    """On STRONGHOLD's own single-stage plan (its §V 1.7B GPT on a V100) the window asked for stage
    0 is the one the stronghold planner chooses, and the plan is the same."""
    model = build_model(parse_model_config(conf("model", "stronghold_gpt_l20")))
    training = TrainingSpec(global_batch=8, microbatch_size=8, precision="fp16", mixed_bytes_per_param=16)
    outcome = stronghold_search(parse_policy({"kind": "stronghold", "pp": 1}), model, V100, training, ScheduleSpec())
    bare = with_window(outcome.plan, 0, None, [], False)
    sw = window_stage(bare, model, V100, 0, V100.device.memory_bytes)
    assert sw.window_layers == outcome.stages[0].window
    assert sw.plan == outcome.plan


def test_a_budget_below_one_slot_gives_the_smallest_window_and_says_it_does_not_fit(gpt_5b3):
    hw = two_v100()
    plan = pipeline(gpt_5b3, hw)
    sw = window_stage(plan, gpt_5b3, hw, 0, 4 * GIB)
    assert sw.window_layers == 1 and not sw.fits
    assert sw.price.peak_bytes > 4 * GIB and "even one slot" in sw.reason


def test_host_ram_left_sends_the_optimizer_state_to_nvme(gpt_5b3):
    hw = two_v100()
    plan = pipeline(gpt_5b3, hw)
    sw = window_stage(plan, gpt_5b3, hw, 0, 32 * GIB, host_bytes_left=20 * GIB)
    assert sw.nvme and sw.plan.stages[0].offload.nvme and sw.host_fits
    assert sw.host_bytes <= 20 * GIB < sw.host_bytes + sw.nvme_bytes  # §III-G: RAM short, the drive takes it
    assert "NVMe" in sw.reason
    validate_plan(sw.plan, gpt_5b3, hw)
    off = window_stage(plan, gpt_5b3, hw, 0, 32 * GIB, nvme="off", host_bytes_left=20 * GIB)
    assert not off.nvme and not off.host_fits and "host short" in off.reason
    no_drive = window_stage(plan, gpt_5b3, two_v100(nvme_bytes=0), 0, 32 * GIB, host_bytes_left=20 * GIB)
    assert not no_drive.nvme and not no_drive.host_fits  # auto moves state only to a drive that exists


def one_device_map_stage(stage):
    return stage.model_copy(update={"sharding": [
        LayerSharding(layer=i, mesh=[1], nodes=[NodeSharding(node="linear", inputs=["RR"], params={"weight": "RR"},
                                                             output="RR")]) for i in stage.layers]})


@pytest.mark.parametrize("case,field", [
    ("zero1", "zero_stage"), ("cpu_swap", "stages[0].memory"),
    ("interleaved", "schedule"), ("pipedream", "schedule"), ("map", "stages[0].sharding"), ("one_streamed", "stages[0]"),
])
def test_blockers_name_the_field(gpt_5b3, case, field):
    hw = two_v100()
    plan = pipeline(gpt_5b3, hw)
    st = plan.stages[0]
    if case == "zero1":
        plan = plan.model_copy(update={"zero_stage": 1})
    elif case == "cpu_swap":
        memory = [m if m.layer != 3 else LayerMemory(layer=3, action=MemoryAction.cpu_swap) for m in st.memory]
        plan = plan.model_copy(update={"stages": [st.model_copy(update={"memory": memory}), *plan.stages[1:]]})
    elif case == "interleaved":
        plan = plan.model_copy(update={"schedule": ScheduleSpec(kind=ScheduleKind.interleaved_1f1b, virtual_stages=2)})
    elif case == "pipedream":
        plan = plan.model_copy(update={"schedule": ScheduleSpec(kind=ScheduleKind.pipedream_async)})
    elif case == "map":
        plan = plan.model_copy(update={"stages": [one_device_map_stage(st), *plan.stages[1:]]})
    elif case == "one_streamed":  # the embedding (resident) and one block
        plan = plan.model_copy(update={"stages": [st.model_copy(update={"layer_stop": 2, "memory": st.memory[:1]}),
                                                  *plan.stages[1:]]})
    why = window_blockers(plan, 0, gpt_5b3)
    assert why is not None and why.startswith(field), why
    assert window_stage(plan, gpt_5b3, hw, 0, 32 * GIB) is None


@pytest.mark.parametrize("degree", ["dp", "tp"])
def test_dp_and_tp_stages_take_a_window(gpt_5b3, degree):
    """Issue 25: a stage of two dp replicas or two tp ranks is windowed as policy=stronghold
    windows its layouts (each replica its own window, a tp rank its shard); the window fits and
    every other field of the plan is as it was (tests/unit/auto/test_auto_dp_tp_windows.py
    checks the host all-reduce's price and the shard's slot)."""
    hw = V100.model_copy(update={"devices_per_node": 4})
    plan = pipeline(gpt_5b3, hw, **{degree: 2})
    assert window_blockers(plan, 0, gpt_5b3) is None
    sw = window_stage(plan, gpt_5b3, hw, 0, 32 * GIB)
    assert sw is not None and sw.fits and sw.host_fits, sw.reason
    validate_plan(sw.plan, gpt_5b3, hw)
    assert_only_stage0_changed(plan, sw.plan)


def test_recompute_does_not_block(gpt_5b3):
    plan = pipeline(gpt_5b3, two_v100())
    assert any(m.action is MemoryAction.recompute for m in plan.stages[0].memory)
    assert window_blockers(plan, 0, gpt_5b3) is None
