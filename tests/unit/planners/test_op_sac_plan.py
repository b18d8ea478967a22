"""policy.recompute=op_sac (torchtitan's op-level selective AC, MemoryAction.op_sac): planned on the
LLaMA blocks that price it, refused by name where it is not modelled, and priced by the simulator
and the analytic estimate between no recompute and full recompute."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from costs.families import build_model, parse_model_config
from planners import PlanningError, make_plan, parse_policy
from simulator import simulate
from simulator.analytic import estimate
from specs import validate_plan
from specs.hardware import HardwareSpec
from specs.plan import MemoryAction, Plan, ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"
HW = HardwareSpec.model_validate(conf("hardware", "h100_node"))
TRAINING = TrainingSpec(global_batch=32, microbatch_size=4, precision="bf16")


def _model(name="llama3_8b", **update):
    return build_model(parse_model_config({**conf("model", name), **update}), 2)


def plan_of(model, **policy):
    return make_plan(parse_policy({"kind": "manual", "pp": 2, "dp": 4, **policy}), model, HW, TRAINING,
                     ScheduleSpec(kind="1f1b"))


def test_every_block_and_nothing_else():
    model = _model()
    plan = plan_of(model, recompute="op_sac")
    got = [(m.layer, m.action) for st in plan.stages for m in st.memory]
    blocks = [i for i, layer in enumerate(model.layers) if layer.kind.value == "transformer_block"]
    assert got == [(i, MemoryAction.op_sac) for i in blocks]


@pytest.mark.parametrize("estimator", ["analytic", "simulator"])
@pytest.mark.parametrize("parallel", [{}, {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2, "sequence_parallel": True}],
                         ids=["dp", "tp", "tp-sp"])
def test_between_none_and_full(estimator, parallel):
    """Peak: fewer bytes than keeping everything, more than full recompute; time: a partial forward
    re-run, so more than none and less than full (both estimators, with and without tensor and
    sequence parallelism)."""
    model = _model()
    plans = [plan_of(model, **parallel), plan_of(model, recompute="op_sac", **parallel),
             plan_of(model, recompute="full", **parallel)]
    if estimator == "analytic":
        results = [estimate(p, model, HW) for p in plans]
    else:
        results = [simulate(p, model, HW).result for p in plans]
    peaks = [max(d.peak_bytes for d in r.devices) for r in results]
    times = [r.iteration_time_s for r in results]
    assert peaks[0] > peaks[1] > peaks[2]
    assert times[0] < times[1] < times[2]


@pytest.mark.parametrize("update,policy,match", [
    ({}, {"recompute": "op_sac", "cp": 2, "dp": 2}, "op_sac is modelled at cp 1"),
    ({"flash_attention": False}, {"recompute": "op_sac"}, "op_sac .* has none"),
])
def test_planner_refuses_what_is_not_modelled(update, policy, match):
    with pytest.raises(PlanningError, match=match):
        plan_of(_model(**update), **policy)


def test_gpt_is_refused_by_the_planner():
    with pytest.raises(PlanningError, match="op_sac .* has none"):
        plan_of(build_model(parse_model_config(conf("model", "gpt3_2b6")), 2), recompute="op_sac")


def test_validate_plan_names_the_layer_and_the_cp():
    """A plan file asking op_sac on the embedding, or on a block of a cp 2 stage, is refused with the
    field path (the planner never emits either)."""
    model = _model()
    plan = plan_of(model, recompute="op_sac").model_dump(mode="json")
    bad = dict(plan)
    bad["stages"] = [dict(st) for st in plan["stages"]]
    bad["stages"][0]["memory"] = [{"layer": 0, "action": "op_sac"}]
    with pytest.raises(ValueError, match=r"stages\[0\]\.memory\[0\]\.action.*no op-level checkpointing costs"):
        validate_plan(Plan.model_validate(bad), model, HW)
    cp_plan = plan_of(model, recompute="full", cp=2, dp=2).model_dump(mode="json")
    for st in cp_plan["stages"]:
        st["memory"] = [{**m, "action": "op_sac"} for m in st["memory"]]
    with pytest.raises(ValueError, match="op_sac: with cp 2"):
        validate_plan(Plan.model_validate(cp_plan), model, HW)


def test_autos_move_takes_full_recompute_to_op_sac_where_it_is_modelled():
    """planners.auto.knobs.op_sac: the fully recomputed LLaMA blocks of cp-1 stages become op_sac
    (tp 2 too); a cp 2 plan has nothing to change (None); zb_h1 and zbv are not offered on an op_sac plan
    (the split backward does not run it); the report names the recompute op_sac."""
    from planners.auto.candidate import knobs
    from planners.auto.knobs import op_sac, zb_h1
    model = _model()
    full = plan_of(model, recompute="full")
    moved = op_sac(model)(full)
    assert [(m.layer, m.action) for st in moved.stages for m in st.memory] == \
        [(m.layer, MemoryAction.op_sac) for st in full.stages for m in st.memory]
    validate_plan(moved, model, HW)
    assert knobs(moved, model)["recompute"] == "op_sac"
    assert op_sac(model)(plan_of(model, recompute="full", tp=2, dp=2)) is not None
    assert op_sac(model)(plan_of(model, recompute="full", cp=2, dp=2)) is None
    assert zb_h1(full) is not None and zb_h1(moved) is None


@pytest.mark.parametrize("estimator", ["analytic", "simulator"])
def test_a_user_models_profiled_layers(estimator):
    """A user's model (family torch_module: Hugging Face transformers' Llama, docs/examples) takes
    op_sac from its symbolic profile (``op_sac_bytes``, ``op_sac_rerun_flops``: executor.op_sac.Mirror):
    every layer gets it, and it lands between no recompute and full recompute in memory and time,
    its re-run priced."""
    from executor.profile_symbolic import profile_model
    from specs.profile import model_from_profile

    pytest.importorskip("transformers")
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    cfg = parse_model_config({**yaml.safe_load((EXAMPLES / "model" / "hf_llama.yaml").read_text()),
                              "kwargs": {"seq_len": 128}})
    model = model_from_profile(profile_model(cfg, microbatch=2, dtype="fp32"))
    assert all(layer.has_op_sac for layer in model.layers)
    assert any(0 < layer.op_sac_rerun_flops_per_sample < layer.fwd_flops_per_sample for layer in model.layers)
    hw = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")
    plans = [make_plan(parse_policy({"kind": "manual", "pp": 2, "dp": 2, "recompute": r}), model, hw, training,
                       ScheduleSpec(kind="1f1b")) for r in ("none", "op_sac", "full")]
    assert [(m.layer, m.action) for st in plans[1].stages for m in st.memory] == \
        [(i, MemoryAction.op_sac) for i in range(model.num_layers)]
    run = (lambda p: estimate(p, model, hw)) if estimator == "analytic" else (lambda p: simulate(p, model, hw).result)
    results = [run(p) for p in plans]
    peaks = [max(d.peak_bytes for d in r.devices) for r in results]
    times = [r.iteration_time_s for r in results]
    assert peaks[0] > peaks[1] > peaks[2]
    assert times[0] < times[1] < times[2]


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_held_bytes_and_recompute_comm(sp):
    """At tp 2 (costs.activations.op_sac_held_per_sample): q, v, the kernel's outputs and gate halve,
    down's row-parallel partial sum stays whole, the input halves only under sequence parallelism,
    which also holds the two reduce-scatter outputs torchtitan's list saves; the re-run forward
    repeats proj's all-reduce, or under sequence parallelism the two all-gathers, and the backward
    no longer re-gathers."""
    from costs.activations import layer_saved_bytes
    from costs.layer_time import op_sac_recompute_comm_s, sp_regather_s
    model = _model()
    spec = model.layers[1]
    s, h, act = 8192, 4096, 2
    inp = s * h * act
    split = spec.op_sac_tp_sharded_bytes_per_sample
    want = split / 2 + inp + (3 * inp / 2 if sp else inp)
    assert layer_saved_bytes(spec, 1, 2, sp=sp, op_sac=True) == want
    assert layer_saved_bytes(spec, 1, 1, op_sac=True) == spec.op_sac_bytes_per_sample == split + 2 * inp
    plan = plan_of(model, recompute="op_sac", tp=2, dp=2, sequence_parallel=sp)
    stage = plan.stages[0]
    comm = op_sac_recompute_comm_s(model, plan, HW, stage, 1)
    assert comm > 0 and sp_regather_s(model, plan, HW, stage, 1) == 0.0
