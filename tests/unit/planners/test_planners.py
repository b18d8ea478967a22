"""Baseline planners: valid plans, sensible splits, errors that name the knob to turn."""
from __future__ import annotations

import itertools

import pytest

from planners import PlanningError, make_plan, parse_policy
from planners.baselines.partition import balanced_split
from planners.layout import even_split
from specs import MemoryAction, ScheduleKind, ScheduleSpec, TrainingSpec
from tests.conftest import make_hardware, make_model


def test_even_uses_every_device(model, hardware, training):
    plan = make_plan(parse_policy({"kind": "even"}), model, hardware, training, ScheduleSpec())
    assert [s.num_layers for s in plan.stages] == [1] * 8
    assert plan.used_devices() == list(range(8))


def test_even_split_puts_extra_layers_in_the_middle():
    assert even_split(10, 4) == [2, 3, 3, 2]
    assert sum(even_split(34, 8)) == 34 and max(even_split(34, 8)) - min(even_split(34, 8)) == 1


def test_balanced_split_is_optimal_against_brute_force():
    costs = [1.0, 7.0, 2.0, 2.0, 9.0, 1.0, 3.0, 4.0]
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in itertools.combinations(range(1, len(costs)), 3)
    )
    counts = balanced_split(costs, 4)
    bounds = list(itertools.accumulate(counts))
    got = max(sum(costs[a:b]) for a, b in zip([0, *bounds], bounds))
    assert got == best and sum(counts) == len(costs) and min(counts) >= 1


def test_balanced_moves_layers_away_from_a_heavy_head(hardware, training):
    model = make_model(num_layers=8)
    heavy = model.layers[-1].model_copy(update={"fwd_flops_per_sample": 5e9})
    model = model.model_copy(update={"layers": [*model.layers[:-1], heavy]})
    plan = make_plan(parse_policy({"kind": "balanced", "pp": 4, "dp": 2}), model, hardware, training, ScheduleSpec())
    assert plan.stages[-1].num_layers == 1  # the heavy head gets a stage of its own


def test_manual_megatron_style_with_recompute(training):
    hardware = make_hardware(devices=8, nodes=2)
    plan = make_plan(parse_policy({"kind": "manual", "pp": 2, "tp": 4, "dp": 2, "recompute": "full"}),
                     make_model(num_layers=8), hardware, training, ScheduleSpec())
    assert [s.devices for s in plan.stages] == [list(range(8)), list(range(8, 16))]
    assert all(s.tp == 4 and s.dp == 2 for s in plan.stages)
    assert all(s.action_of(l).action is MemoryAction.recompute for s in plan.stages for l in s.layers)


def test_manual_degrees_must_cover_devices(model, hardware, training):
    with pytest.raises(PlanningError, match=r"policy.pp \(2\) x policy.dp \(1\) x policy.tp \(1\) = 2 must equal the 8"):
        make_plan(parse_policy({"kind": "manual", "pp": 2}), model, hardware, training, ScheduleSpec())


def test_manual_layers_per_stage(model, hardware):
    training = TrainingSpec(global_batch=16, microbatch_size=4)
    plan = make_plan(parse_policy({"kind": "manual", "pp": 2, "dp": 4, "layers_per_stage": [3, 5]}),
                     model, hardware, training, ScheduleSpec())
    assert [s.num_layers for s in plan.stages] == [3, 5]
    with pytest.raises(PlanningError, match="layers_per_stage"):
        make_plan(parse_policy({"kind": "manual", "pp": 2, "dp": 4, "layers_per_stage": [3, 4]}),
                  model, hardware, training, ScheduleSpec())


def test_interleaved_places_chunk_j_on_group_j_mod_p(model, hardware, training):
    sched = ScheduleSpec(kind=ScheduleKind.interleaved_1f1b, virtual_stages=2)
    plan = make_plan(parse_policy({"kind": "even", "pp": 4, "dp": 2}), model, hardware, training, sched)
    assert len(plan.stages) == 8
    assert all(plan.stages[j].devices == plan.stages[j % 4].devices for j in range(8))


def test_too_many_stages_says_what_to_do(hardware, training):
    with pytest.raises(PlanningError, match="lower policy.pp"):
        make_plan(parse_policy({"kind": "even", "pp": 8}), make_model(num_layers=4), hardware, training,
                  ScheduleSpec())


def test_default_depth_falls_back_to_data_parallel(hardware, training):
    plan = make_plan(parse_policy({"kind": "even"}), make_model(num_layers=6), hardware, training, ScheduleSpec())
    assert len(plan.stages) == 4 and all(s.dp == 2 for s in plan.stages)
    assert plan.used_devices() == list(range(8))


def test_dp_not_dividing_microbatch_names_training(model, hardware):
    with pytest.raises(PlanningError, match="training.microbatch_size"):
        make_plan(parse_policy({"kind": "even", "dp": 4, "pp": 2}), model, hardware,
                  TrainingSpec(global_batch=12, microbatch_size=2), ScheduleSpec())


def test_unknown_policy_kind_lists_allowed():
    with pytest.raises(Exception) as err:
        parse_policy({"kind": "greedy"})
    assert all(k in str(err.value) for k in ("even", "balanced", "manual", "auto"))


def test_auto_through_the_registry_is_no_slower_than_balanced(model, hardware, training):
    """policy=auto through make_plan (planners/auto, issue 23): a valid plan, written down as auto's,
    that simulates no slower than policy=balanced's (one of the singles auto compares with)."""
    from simulator import simulate

    auto = make_plan(parse_policy({"kind": "auto", "singles": ["balanced"]}), model, hardware, training, ScheduleSpec())
    balanced = make_plan(parse_policy({"kind": "balanced"}), model, hardware, training, ScheduleSpec())
    assert auto.planner == "auto"
    times = [simulate(p, model, hardware, trace=False).result.iteration_time_s for p in (auto, balanced)]
    assert times[0] <= times[1]


def test_capture_without_a_profile_says_how_to_get_one(model, hardware, training):
    with pytest.raises(PlanningError, match="mode=profile policy=capture"):
        make_plan(parse_policy({"kind": "capture"}), model, hardware, training, ScheduleSpec())


# ---- Megatron's layout (issue #11): blocks evenly, embedding first, head last --------------------

def _gpt(blocks: int):
    from costs.families import build_model, parse_model_config

    return build_model(parse_model_config(dict(family="gpt", name="g", num_layers=blocks, hidden=64, heads=4,
                                               seq_len=32, vocab=256)))


@pytest.mark.parametrize("kind", ["manual", "even"])
def test_default_split_is_megatrons_layout(kind):
    """128 blocks on pp=64 (the 1T model of Narayanan et al. 2021): 2 blocks on every stage, the
    embedding beside the first two, the head beside the last two."""
    model = _gpt(128)
    hw = make_hardware(devices=64, nvlink_pairs=())
    training = TrainingSpec(global_batch=64, microbatch_size=1)
    plan = make_plan(parse_policy({"kind": kind, "pp": 64}), model, hw, training, ScheduleSpec())
    blocks = [sum(model.layers[i].kind.value == "transformer_block" for i in s.layers) for s in plan.stages]
    assert blocks == [2] * 64
    assert plan.stages[0].layer_start == 0 and model.layers[0].kind.value == "embedding"
    assert [s.num_layers for s in plan.stages] == [3] + [2] * 62 + [3]


def test_megatron_layout_interleaved_and_uneven():
    model, hw = _gpt(12), make_hardware(devices=2, nvlink_pairs=())
    training = TrainingSpec(global_batch=8, microbatch_size=1)
    plan = make_plan(parse_policy({"kind": "manual", "pp": 2}), model, hw, training,
                     ScheduleSpec(kind="interleaved_1f1b", virtual_stages=3))
    assert [s.num_layers for s in plan.stages] == [3, 2, 2, 2, 2, 3]  # embed in chunk 0, head in chunk 5
    uneven = make_plan(parse_policy({"kind": "manual", "pp": 2}), _gpt(13), make_hardware(devices=2), training,
                       ScheduleSpec(kind="interleaved_1f1b", virtual_stages=2))
    # 13 blocks over 4 chunks: the extra block in a middle chunk, never in the first (most in flight)
    assert [s.num_layers for s in uneven.stages] == [4, 4, 3, 4]


def test_explicit_layers_per_stage_still_wins():
    model, hw = _gpt(4), make_hardware(devices=2)
    plan = make_plan(parse_policy({"kind": "manual", "pp": 2, "layers_per_stage": [1, 5]}), model, hw,
                     TrainingSpec(global_batch=8, microbatch_size=1), ScheduleSpec())
    assert [s.num_layers for s in plan.stages] == [1, 5]


@pytest.mark.parametrize("kind", ["interleaved_1f1b", "zbv", "dualpipev"])
def test_one_stage_per_device_planners_refuse_several_chunks_per_device(model, hardware, training, kind):
    """MPress's stage->device mapping and CAPTURE's profiling runs place one stage per device
    (group); a schedule with several chunks per device is a one-line error naming the schedule,
    not an internal error from the mapping's distinct-devices check (fuzz_inputs found both)."""
    from planners.capture.planner import capture_schedule_check

    schedule = ScheduleSpec(kind=kind, virtual_stages=2)
    with pytest.raises(PlanningError, match=f"policy=mpress plans one stage per device.*schedule {kind}"):
        make_plan(parse_policy({"kind": "mpress"}), model, hardware, training, schedule)
    with pytest.raises(PlanningError, match=f"schedule {kind} places 2 chunks"):
        capture_schedule_check(schedule)
