"""Mutated plan.json files end in a valid plan with a finite estimate, or a PlanError /
ValidationError naming the field -- never another exception, never a hang (issue #10)."""
from __future__ import annotations

import copy
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from planners import make_plan, parse_policy
from simulator.analytic import estimate
from reports.outputs import load_plan
from specs import ScheduleKind, ScheduleSpec, TrainingSpec
from specs.plan import Plan, PlanError, validate_plan
from tests.conftest import deadline, make_hardware, make_model

MODEL = make_model(num_layers=8)
#: NVLink pairs 0-1, 2-3, 4-5, 6-7; PCIe otherwise (so D2D targets can be peers of one device only)
HW = make_hardware(devices=8, nvlink_pairs=((0, 1), (2, 3), (4, 5), (6, 7)))
TRAINING = TrainingSpec(global_batch=16, microbatch_size=4)


def base(kind: str = "1f1b", pp: int = 4, dp: int = 2, v: int = 1) -> dict:
    policy = parse_policy({"kind": "even", "pp": pp, "dp": dp})
    plan = make_plan(policy, MODEL, HW, TRAINING, ScheduleSpec(kind=ScheduleKind(kind), virtual_stages=v))
    return json.loads(plan.model_dump_json())


BASES = [base(), base("gpipe", 8, 1), base("interleaved_1f1b", 2, 4, v=2), base("pipedream_async", 2, 4)]



def check(plan: dict | str, tmp_path) -> Plan | None:
    """The property: load + validate + estimate, each input ends in a Plan with a finite, positive
    estimate or a PlanError/ValidationError/JSON ValueError; returns the plan if accepted."""
    path = tmp_path / "plan.json"
    path.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    with deadline(120):  # a hang guard (validate_plan once looped forever), not a speed goal
        try:
            accepted = validate_plan(load_plan(path), MODEL, HW)
        except (ValidationError, PlanError):
            return None
        except ValueError as exc:  # bad JSON (duplicate keys, NaN): named by load_plan
            assert "plan.json" in str(exc), exc
            return None
        result = estimate(accepted, MODEL, HW)
    # what was accepted obeys the rules, checked here independently of validate_plan
    assert accepted.schema_version == 1 and accepted.training.global_batch <= 2**40
    assert [s.layer_start for s in accepted.stages[1:]] == [s.layer_stop for s in accepted.stages[:-1]]
    assert accepted.stages[0].layer_start == 0 and accepted.stages[-1].layer_stop == MODEL.num_layers
    for stage in accepted.stages:
        for item in stage.memory:
            devices = [t.device for t in item.targets]
            assert len(set(devices)) == len(devices)
            assert all(HW.is_peer(d, t) for t in devices for d in stage.devices)
            assert all(1e-6 <= t.weight <= 1e6 for t in item.targets)
    for name in ("iteration_time_s", "samples_per_s", "tflops_per_device"):
        assert math.isfinite(getattr(result, name)), (name, result)
    assert result.iteration_time_s > 0 and result.samples_per_s > 0
    assert result.tflops_per_device <= HW.device.flops_per_s(accepted.training.precision.value) / 1e12 * 1.001
    return accepted


# ---- the failures issue #10 listed, as regression tests ----------------------------------------

def rejected_at(plan: dict, field: str, tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with deadline(10), pytest.raises((ValidationError, PlanError)) as err:
        validate_plan(load_plan(path), MODEL, HW)
    assert field in str(err.value), str(err.value)


def test_interleaved_plan_with_fewer_stages_than_virtual_stages(tmp_path):
    p = copy.deepcopy(BASES[0])
    p["schedule"] = {"kind": "interleaved_1f1b", "virtual_stages": 8}  # 4 stages < 8 (was ZeroDivisionError)
    rejected_at(p, "virtual_stages", tmp_path)


@pytest.mark.parametrize("weight", [math.inf, 1e-300, 1e300, math.nan, 0, -1])
def test_d2d_weight_must_be_finite_and_sane(weight, tmp_path):
    p = copy.deepcopy(BASES[1])  # gpipe, 8 stages of 1 device: stage 0 on device 0, peer 1
    p["stages"][0]["memory"] = [{"layer": 0, "action": "d2d_swap", "targets": [{"device": 1, "weight": weight}]}]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(p))
    with pytest.raises((ValidationError, ValueError), match="weight|NaN|Infinity"):
        load_plan(path)


def test_d2d_with_a_good_weight_is_accepted(tmp_path):
    p = copy.deepcopy(BASES[1])  # gpipe, 8 stages of 1 device: stage 0 on device 0, peer 1
    p["stages"][0]["memory"] = [{"layer": 0, "action": "d2d_swap", "targets": [{"device": 1, "weight": 2.0}]}]
    assert check(p, tmp_path) is not None


def test_layer_stop_2_pow_64_is_rejected_fast(tmp_path):
    p = copy.deepcopy(BASES[0])
    p["stages"][-1]["layer_stop"] = 2**64  # validate_plan looped over 2**64 layers
    rejected_at(p, "layer_stop", tmp_path)
    p["stages"][-1]["layer_stop"] = 2**40  # within the type's bound, past the model: still no loop
    rejected_at(p, "layer_stop", tmp_path)


@pytest.mark.parametrize("version", [0, 2, 999])
def test_schema_version_must_be_current(version, tmp_path):
    rejected_at({**BASES[0], "schema_version": version}, "schema_version", tmp_path)


def test_the_same_d2d_target_1000_times_is_rejected(tmp_path):
    p = copy.deepcopy(BASES[1])
    p["stages"][0]["memory"] = [{"layer": 0, "action": "d2d_swap", "targets": [{"device": 1, "weight": 1.0}] * 1000}]
    rejected_at(p, "targets", tmp_path)


def test_d2d_target_must_be_a_peer_of_every_device_of_the_stage(tmp_path):
    # a dp=2 stage on devices [0, 2]: device 1 is an NVLink peer of 0 only (was accepted: any())
    p = base("1f1b", 4, 2)
    p["stages"][0]["devices"], p["stages"][1]["devices"] = [0, 2], [1, 3]
    p["stages"][2]["devices"], p["stages"][3]["devices"] = [4, 6], [5, 7]
    assert check(p, tmp_path) is not None  # the rearranged plan itself is fine
    p["stages"][0]["memory"] = [{"layer": 0, "action": "d2d_swap", "targets": [{"device": 1, "weight": 1.0}]}]
    rejected_at(p, "stages[0].memory[0].targets[0].device", tmp_path)


def test_global_batch_2_pow_64_is_rejected(tmp_path):
    p = copy.deepcopy(BASES[0])
    p["training"]["global_batch"] = 2**64
    rejected_at(p, "global_batch", tmp_path)


def test_duplicate_json_keys_are_rejected(tmp_path):
    text = '{"planner": "someone-else", ' + json.dumps(BASES[0])[1:]
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="'planner' appears twice"):
        load_plan(path)


def test_a_precision_the_device_lacks_is_a_plan_error(tmp_path):
    hw = make_hardware(devices=8).model_copy(deep=True)
    dev = hw.device.model_copy(update={"peak_tflops": {"fp32": 10.0, "fp16": 100.0}})
    hw = hw.model_copy(update={"device": dev})
    p = copy.deepcopy(BASES[0])
    p["training"]["precision"] = "bf16"
    with pytest.raises(PlanError, match=r"training.precision.*no bf16.*fp32, fp16"):
        validate_plan(Plan.model_validate(p), MODEL, hw)
    p["training"]["precision"] = "fp32"
    validate_plan(Plan.model_validate(p), MODEL, hw)


# ---- random mutations, drawn afresh on every run ----------------------------------------------

BAD = [0, -1, 1, 2, 3, 7, 2**31, 2**40, 2**40 + 1, 2**64, math.inf, -math.inf, math.nan, 1e300, 1e-300, 0.5,
       "x", "", None, True, [], {}]


def leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, path + (k,))
    elif isinstance(node, list):
        yield path, node
        for i, v in enumerate(node):
            yield from leaves(v, path + (i,))
    else:
        yield path, node


def at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@st.composite
def mutated_plans(draw):
    p = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 5))
        spots = list(leaves(p))
        path, value = draw(st.sampled_from(spots))
        if not path:
            continue
        parent = at(p, path[:-1])
        stages = p.get("stages")
        if kind in (3, 5) and not (isinstance(stages, list) and stages and all(isinstance(x, dict) for x in stages)):
            kind = 0  # the stages list itself was mutated away
        if kind <= 1:  # any field to an absurd or nearby value
            parent[path[-1]] = draw(st.sampled_from(BAD + ([value + 1, value - 1] if type(value) is int else [])))
        elif kind == 2:  # drop or duplicate a list entry
            if isinstance(value, list) and value:
                i = draw(st.integers(0, len(value) - 1))
                value.insert(i, copy.deepcopy(value[i])) if draw(st.booleans()) else value.pop(i)
        elif kind == 3:  # a D2D swap on a stage with random targets
            s = draw(st.integers(0, len(stages) - 1))
            stage = stages[s]
            layer = stage["layer_start"] if isinstance(stage.get("layer_start"), int) else 0
            targets = draw(st.lists(st.fixed_dictionaries({
                "device": st.integers(-1, 9), "weight": st.sampled_from([1.0, 0.5, 4.0, math.inf, 1e-300, 1e300, 0.0])}),
                min_size=1, max_size=4))
            stage["memory"] = [{"layer": layer, "action": draw(st.sampled_from(["d2d_swap", "keep", "recompute"])),
                                "targets": targets}]
        elif kind == 4:
            p["schedule"] = {"kind": draw(st.sampled_from([k.value for k in ScheduleKind])),
                             "virtual_stages": draw(st.sampled_from([1, 2, 3, 4, 8, 2**64]))}
        else:  # kind 5: a STRONGHOLD offload policy, sane or not
            stage = stages[draw(st.integers(0, len(stages) - 1))]
            stage["offload"] = {"window_layers": draw(st.sampled_from([None, 1, 2, 0, 2**64])),
                                "optimizer_on_cpu": draw(st.booleans()), "nvme": draw(st.booleans())}
    if draw(st.integers(0, 9)) == 0:  # a key given twice
        return '{"planner": "dup", ' + json.dumps(p)[1:]
    return p


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(plan=mutated_plans())
def test_mutated_plans_end_in_a_plan_or_a_field_error(plan, tmp_path):
    check(plan, tmp_path)
