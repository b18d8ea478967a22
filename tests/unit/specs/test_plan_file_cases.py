"""Plan files that crashed, hung or were silently wrong (issue #22), each refused naming the field:
deep nesting, a MAP stage on two meshes, a window on a tp stage, an offload on a MAP stage,
non-ASCII mesh axes, repeated keys (one strict reader for the shell and the executor)."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from reports.outputs import load_plan, read_json_strict
from specs import OffloadPolicy, Plan, PlanError, StagePlan, TrainingSpec, validate_plan
from specs.plan import LayerSharding, NodeSharding
from specs.plan_file import MAX_JSON_DEPTH, json_depth, loads_strict, parse_plan
from specs.sharding import ShardingSpec
from tests.conftest import make_hardware, make_model

MODEL = make_model(num_layers=4)
HW = make_hardware(devices=8)


def plan_of(stages, zero_stage: int = 0) -> Plan:
    return Plan(planner="test", model="toy", hardware="toyhw", num_devices=8, zero_stage=zero_stage,
                training=TrainingSpec(global_batch=16, microbatch_size=4), stages=stages)


def layer_sharding(layer: int, mesh: list[int]) -> LayerSharding:
    return LayerSharding(layer=layer, mesh=mesh, nodes=[NodeSharding(node="linear", inputs=["RR"],
                                                                    params={"weight": "RR"}, output="RR")])


def map_stage(meshes: list[list[int]], **kw) -> dict:
    """A MAP stage over layers 0..len(meshes) on devices 0-3 (one sharding per layer), as JSON."""
    return {"layer_start": 0, "layer_stop": len(meshes), "devices": [0, 1, 2, 3], "dp": 1, "tp": 4,
            "sharding": [layer_sharding(i, m).model_dump(mode="json") for i, m in enumerate(meshes)], **kw}


def write(tmp_path, text: str):
    path = tmp_path / "plan.json"
    path.write_text(text, encoding="utf-8")
    return path


# ---- a) nesting 1,000 deep: a ValueError naming the depth, not RecursionError ------------------

@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deep_nesting_is_refused_before_the_parser_recurses(tmp_path, depth):
    path = write(tmp_path, '{"stages": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ValueError, match=rf"plan.json: nested {depth + 1} levels deep.*at most {MAX_JSON_DEPTH}"):
        read_json_strict(path)
    with pytest.raises(ValueError, match="nested"):
        load_plan(path)


def test_depth_ignores_brackets_in_strings_and_counts_objects():
    assert json_depth('{"a": "[[[[{{{{\\"]]"}') == 1
    assert json_depth('[{"a": [1, {"b": []}]}]') == 5
    assert json_depth("3") == 0
    deep = '["' + "[" * 500 + '"]'  # a string full of brackets is not nesting
    assert loads_strict(deep) == ["[" * 500]


def test_a_real_plan_is_far_below_the_bound():
    plan = plan_of([StagePlan(layer_start=0, layer_stop=4, devices=[0])])
    assert json_depth(plan.model_dump_json()) < MAX_JSON_DEPTH // 4


# ---- b) a MAP stage whose layers sit on different meshes ------------------------------------------

def test_map_stage_on_two_meshes_is_refused_at_load(tmp_path):
    stage = map_stage([[4], [2, 2], [4], [4]])
    path = write(tmp_path, json.dumps(plan_of([StagePlan(layer_start=0, layer_stop=4, devices=[0])])
                                      .model_dump(mode="json") | {"stages": [stage]}))
    with pytest.raises(ValidationError, match=r"sharding: a MAP stage's layers share one mesh.*\[2, 2\] \(layers \[1\]\)"):
        load_plan(path)


def test_map_stage_on_two_meshes_is_refused_by_validate_plan():
    """A stage built without validation (model_copy, as planners do) still gets the field named."""
    good = StagePlan.model_validate(map_stage([[4], [4], [4], [4]]))
    mixed = good.model_copy(update={"sharding": [layer_sharding(0, [4]), layer_sharding(1, [2, 2]),
                                                 layer_sharding(2, [4]), layer_sharding(3, [4])]})
    plan = plan_of([good]).model_copy(update={"stages": [mixed]})
    with pytest.raises(PlanError) as err:
        validate_plan(plan, MODEL, HW)
    loc, msg = err.value.errors[0]
    assert loc == "stages[0].sharding" and "one mesh" in msg


# ---- c) a window on a stage with tp > 1 -------------------------------------------------------------

def test_window_on_a_tensor_parallel_stage_streams_its_shards():
    """Issue 22 refused it (resident_step_s went negative: "Negative delay"); issue 25 streams each
    rank's shard (costs.window): the plan validates and simulates, with a positive device step."""
    from simulator import simulate

    stages = [StagePlan(layer_start=0, layer_stop=2, devices=[0, 1], tp=2),
              StagePlan(layer_start=2, layer_stop=4, devices=[2, 3], tp=2, offload=OffloadPolicy(window_layers=1))]
    plan = validate_plan(plan_of(stages), MODEL, HW)
    result = simulate(plan, MODEL, HW, trace=False).result
    assert result.iteration_time_s > 0 and not any(d.oom for d in result.devices)
    # tp 1 stays accepted (STRONGHOLD's own plans)
    ok = [StagePlan(layer_start=0, layer_stop=4, devices=[0], offload=OffloadPolicy(window_layers=2))]
    validate_plan(plan_of(ok), MODEL, HW)


# ---- d) an offload on a MAP stage (was accepted and ignored) ------------------------------------------

@pytest.mark.parametrize("offload,field", [({"optimizer_swap": True}, "optimizer_swap"),
                                           ({"optimizer_on_cpu": True}, "optimizer_on_cpu"),
                                           ({"optimizer_on_cpu": True, "nvme": True}, "optimizer_on_cpu"),
                                           ({"window_layers": 1}, "window_layers")])
def test_offload_on_a_map_stage_is_refused(offload, field):
    with pytest.raises(ValidationError, match=rf"offload\.{field}: a MAP-sharded stage keeps"):
        StagePlan.model_validate(map_stage([[4]] * 4, offload=offload))


# ---- e) non-ASCII digits as mesh axes -----------------------------------------------------------------

@pytest.mark.parametrize("text", ["S\uff10R", "RS\u0661", "S0\uff11"])
def test_sharding_spec_axes_are_ascii_digits(text):
    with pytest.raises(ValueError, match="expected one R or S<axes>"):
        ShardingSpec.parse(text)
    with pytest.raises(ValidationError, match="is not a sharding spec"):
        NodeSharding(node="linear", inputs=[text], output="RR")
    assert ShardingSpec.parse("S01R").dims == ((0, 1), ())


# ---- f) repeated keys: the shell and the executor read one file the same way ----------------------------

def test_repeated_keys_are_refused_by_the_one_strict_reader(tmp_path):
    plan = plan_of([StagePlan(layer_start=0, layer_stop=4, devices=[0])])
    text = plan.model_dump_json().replace('"zero_stage":0', '"zero_stage":3,"zero_stage":0')
    assert text != plan.model_dump_json()
    with pytest.raises(ValueError, match="'zero_stage' appears twice"):
        parse_plan(text)
    with pytest.raises(ValueError, match="plan.json: key 'zero_stage' appears twice"):
        load_plan(write(tmp_path, text))
    with pytest.raises(ValueError, match="NaN is not a JSON number"):
        loads_strict('{"a": NaN}')
    assert parse_plan(plan.model_dump_json()) == plan


def test_the_executor_reads_plans_model_and_hardware_strictly(tmp_path):
    from executor.torchrun import InputError, load_inputs

    plan = plan_of([StagePlan(layer_start=0, layer_stop=4, devices=[0])])
    (tmp_path / "model.json").write_text('{"family": "gpt", "name": "m", "num_layers": 2, "hidden": 64, '
                                         '"heads": 4, "seq_len": 16, "vocab": 64}')  # a gpt_tiny-like config
    (tmp_path / "hardware.json").write_text(HW.model_dump_json())
    good = tmp_path / "plan.json"
    good.write_text(plan.model_dump_json())
    files = (good, tmp_path / "model.json", tmp_path / "hardware.json")
    loaded, _, hw = load_inputs(*files)
    assert loaded == plan and hw == HW
    for i, name in enumerate(("plan", "model config", "hardware spec")):
        bad = tmp_path / f"bad_{i}.json"
        text = files[i].read_text()
        bad.write_text(text[:-1] + ', "name": "x", "name": "y"}' if i else
                       text.replace('"zero_stage":0', '"zero_stage":3,"zero_stage":0'))
        args = list(files)
        args[i] = bad
        with pytest.raises(InputError, match=rf"not a valid {name}: .*appears twice"):
            load_inputs(*args)
