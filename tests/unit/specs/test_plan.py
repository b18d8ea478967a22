"""Plan IR: validation names the offending field; plans round-trip through JSON exactly."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from specs import (
    D2DTarget, LayerMemory, MemoryAction, OffloadPolicy, Plan, PlanError, ScheduleKind, ScheduleSpec,
    StagePlan, TrainingSpec, validate_plan,
)
from tests.conftest import make_hardware, make_model


def plan_of(stages, schedule=None, training=None, num_devices=8) -> Plan:
    return Plan(planner="test", model="toy", hardware="toyhw", num_devices=num_devices,
                training=training or TrainingSpec(global_batch=16, microbatch_size=2),
                schedule=schedule or ScheduleSpec(), stages=stages)


def four_stages(**kw) -> list[StagePlan]:
    return [StagePlan(layer_start=2 * i, layer_stop=2 * i + 2, devices=[2 * i, 2 * i + 1], dp=2, **kw)
            for i in range(4)]


def fields(exc: PlanError) -> list[str]:
    return [loc for loc, _ in exc.errors]


def test_valid_plan_round_trips_json_exactly(model, hardware):
    plan = plan_of(four_stages())
    validate_plan(plan, model, hardware)
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan and again.model_dump_json() == plan.model_dump_json()
    assert again.id == plan.id


def test_plan_id_changes_with_content_not_planner_name():
    a = plan_of(four_stages())
    assert a.model_copy(update={"planner": "other"}).id == a.id
    assert plan_of(four_stages(), schedule=ScheduleSpec(kind=ScheduleKind.gpipe)).id != a.id


@pytest.mark.parametrize("start,what", [(3, "gap"), (1, "overlaps")])
def test_layers_gap_or_overlap_named(model, hardware, start, what):
    stages = four_stages()
    stages[1] = stages[1].model_copy(update={"layer_start": start})
    with pytest.raises(PlanError) as err:
        validate_plan(plan_of(stages), model, hardware)
    assert "stages[1].layer_start" in fields(err.value)
    assert what in str(err.value)


def test_layers_missing_at_end_named(hardware):
    with pytest.raises(PlanError) as err:
        validate_plan(plan_of(four_stages()), make_model(num_layers=10), hardware)
    assert "stages[3].layer_stop" in fields(err.value)


def test_out_of_order_stage_rejected():
    with pytest.raises(ValidationError, match="layer_stop"):
        StagePlan(layer_start=4, layer_stop=2, devices=[0])


def test_device_not_in_hardware_named(model):
    with pytest.raises(PlanError) as err:
        validate_plan(plan_of(four_stages(), num_devices=6), model, make_hardware(devices=6))
    assert "stages[3].devices[0]" in fields(err.value)
    assert "not in hardware" in str(err.value)


def test_device_shared_by_two_stages_rejected(model, hardware):
    stages = four_stages()
    stages[2] = stages[2].model_copy(update={"devices": [2, 5]})
    with pytest.raises(PlanError) as err:
        validate_plan(plan_of(stages), model, hardware)
    assert "stages[2].devices" in fields(err.value) and "already used by stage 1" in str(err.value)


def test_interleaved_chunks_may_share_their_group(model, hardware):
    stages = [StagePlan(layer_start=i, layer_stop=i + 1, devices=[2 * (i % 4), 2 * (i % 4) + 1], dp=2)
              for i in range(8)]
    inter = ScheduleSpec(kind=ScheduleKind.interleaved_1f1b, virtual_stages=2)
    validate_plan(plan_of(stages, schedule=inter), model, hardware)
    with pytest.raises(PlanError) as err:  # same layout without interleaving shares devices illegally
        validate_plan(plan_of(stages), model, hardware)
    assert "stages[4].devices" in fields(err.value)


def test_degrees_must_match_device_count():
    with pytest.raises(ValidationError) as err:
        StagePlan(layer_start=0, layer_stop=2, devices=[0, 1, 2], dp=2, tp=1)
    assert "devices" in str(err.value) and "dp (2) x tp (1)" in str(err.value)


def test_d2d_target_without_link_named(model, hardware):
    # toy hardware: NVLink only on pairs (0,1) and (2,3); device 6 is reached over PCIe from 0/1
    swap = LayerMemory(layer=0, action=MemoryAction.d2d_swap, targets=[D2DTarget(device=6, weight=1.0)])
    stages = [StagePlan(layer_start=0, layer_stop=4, devices=[0], memory=[swap]),
              StagePlan(layer_start=4, layer_stop=8, devices=[2])]
    with pytest.raises(PlanError) as err:
        validate_plan(plan_of(stages), model, hardware)
    assert "stages[0].memory[0].targets[0].device" in fields(err.value)
    assert "no NVLink" in str(err.value)
    ok = swap.model_copy(update={"targets": [D2DTarget(device=1, weight=1.0)]})
    validate_plan(plan_of([stages[0].model_copy(update={"memory": [ok]}), stages[1]]), model, hardware)


def test_d2d_needs_targets_and_only_d2d_takes_them():
    with pytest.raises(ValidationError, match="targets"):
        LayerMemory(layer=0, action=MemoryAction.d2d_swap)
    with pytest.raises(ValidationError, match="targets"):
        LayerMemory(layer=0, action=MemoryAction.recompute, targets=[D2DTarget(device=1, weight=1)])


def test_window_larger_than_stage_named():
    with pytest.raises(ValidationError) as err:
        StagePlan(layer_start=0, layer_stop=2, devices=[0], offload=OffloadPolicy(window_layers=3))
    assert "offload.window_layers" in str(err.value)


def test_memory_action_outside_stage_named():
    with pytest.raises(ValidationError, match="memory: layer 5 is outside"):
        StagePlan(layer_start=0, layer_stop=2, devices=[0],
                  memory=[LayerMemory(layer=5, action=MemoryAction.recompute)])


def test_dp_must_divide_microbatch(model, hardware):
    stages = four_stages()
    plan = plan_of(stages, training=TrainingSpec(global_batch=15, microbatch_size=3))
    with pytest.raises(PlanError) as err:
        validate_plan(plan, model, hardware)
    assert "stages[0].dp" in fields(err.value)


def test_unknown_field_rejected():
    with pytest.raises(ValidationError, match="extra"):
        StagePlan.model_validate({"layer_start": 0, "layer_stop": 1, "devices": [0], "dq": 2})


def test_training_batch_rules():
    assert TrainingSpec(global_batch=64, num_microbatches=8).samples_per_microbatch == 8
    with pytest.raises(ValidationError, match="microbatch_size"):
        TrainingSpec(global_batch=10, microbatch_size=3)
    with pytest.raises(ValidationError, match="mixed_bytes_per_param"):
        TrainingSpec(global_batch=8, microbatch_size=1, mixed_bytes_per_param=17)


@pytest.mark.parametrize("precision,bpp,optimizer,total", [
    ("fp16", 16, "adam", 16), ("bf16", 18, "adam", 18), ("fp32", 16, "adam", 16), ("fp16", 16, "sgd", 12),
])
def test_bytes_per_param_closed_forms(precision, bpp, optimizer, total):
    t = TrainingSpec(global_batch=8, microbatch_size=1, precision=precision, mixed_bytes_per_param=bpp,
                     optimizer=optimizer)
    assert sum(t.bytes_per_param()) == total
