"""``OffloadPolicy.stash_swap_layers`` (issue 24, MPress §II-D): PipeDream's stashed weight
versions of the listed layers wait in host memory. The plan refuses it where it means nothing."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from specs import Plan, ScheduleSpec, StagePlan, TrainingSpec
from specs.plan_memory import OffloadPolicy


def _plan(kind: str, stash: list[int], **offload) -> Plan:
    stages = [StagePlan(layer_start=0, layer_stop=2, devices=[0],
                        offload=OffloadPolicy(stash_swap_layers=stash, **offload)),
              StagePlan(layer_start=2, layer_stop=4, devices=[1])]
    return Plan(planner="test", model="toy", hardware="toyhw", num_devices=2,
                training=TrainingSpec(global_batch=4, num_microbatches=4),
                schedule=ScheduleSpec(kind=kind), stages=stages)


def test_pipedream_plan_takes_the_field_and_round_trips():
    plan = _plan("pipedream_async", [0, 1])
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert plan.stages[0].offload.stash_swap_layers == [0, 1]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_flushing_schedules_have_no_stashed_versions(kind):
    with pytest.raises(ValidationError, match=r"stages\[0\]\.offload\.stash_swap_layers: only PipeDream"):
        _plan(kind, [0])
    _plan(kind, [])  # the empty default is fine everywhere


def test_layers_outside_the_stage_or_listed_twice_are_refused():
    with pytest.raises(ValidationError, match=r"stash_swap_layers: layer 3 is outside this stage's layers \[0, 2\)"):
        _plan("pipedream_async", [3])
    with pytest.raises(ValidationError, match="stash_swap_layers: a layer is listed twice"):
        _plan("pipedream_async", [1, 1])


def test_a_host_home_for_the_weights_excludes_it():
    with pytest.raises(ValidationError, match="stash_swap_layers: a window or optimizer_on_cpu"):
        OffloadPolicy(stash_swap_layers=[0], optimizer_on_cpu=True)
    OffloadPolicy(stash_swap_layers=[0], optimizer_swap=True)  # MPress's optimizer swap combines with it
