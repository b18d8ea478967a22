"""simulator.stagecost caches stage costs across simulations (a bounded LRU): a search's
candidate plans differ in a stage or two, so the Engine reads the other stages' costs back. The
key is the stage itself plus a digest of everything else a stage's costs read (model, hardware,
the plan's other fields, every stage's layer range, devices and degrees). These tests pin the
invariant the key rests on: a stage's costs do not depend on other stages' memory actions or
offload, and a read-back equals computing it again."""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
from planners import make_plan
from planners.policy import BalancedPolicy
from simulator import simulate, stagecost
from specs import TrainingSpec
from specs.hardware import HardwareSpec
from specs.plan import D2DTarget, LayerMemory, MemoryAction, ScheduleSpec
from tests.conftest import conf


@pytest.fixture(scope="module")
def setup():
    hw = HardwareSpec.model_validate(conf("hardware", "dgx1"))
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp16")
    model = build_model(parse_model_config({**conf("model", "gpt_tiny"), "num_layers": 14}), training.act_dtype_bytes)
    assert model.tied_layers  # the LM head's tied copy: stage costs read another stage's layers
    plan = make_plan(BalancedPolicy(pp=8), model, hw, training, ScheduleSpec(kind="1f1b"))
    return model, hw, plan


def with_stage(plan, s, **update):
    stages = list(plan.stages)
    stages[s] = stages[s].model_copy(update=update)
    return plan.model_copy(update={"stages": stages})


def fresh(plan, model, hw):
    return [stagecost.stage_cost(plan, model, hw, s, st) for s, st in enumerate(plan.stages)]


def compacted(plan, model):
    """Stage 1 recomputes a layer, stage 2 swaps one to host and one to a peer, stage 3 streams
    its optimizer state: every kind of change a search makes."""
    s1, s2, s3 = plan.stages[1], plan.stages[2], plan.stages[3]
    plan = with_stage(plan, 1, memory=[LayerMemory(layer=s1.layer_start, action=MemoryAction.recompute)])
    plan = with_stage(plan, 2, memory=[
        LayerMemory(layer=s2.layer_start, action=MemoryAction.cpu_swap),
        LayerMemory(layer=s2.layer_start + 1, action=MemoryAction.d2d_swap, targets=[D2DTarget(device=7, weight=1.0)],
                    microbatch_period=2)])
    return with_stage(plan, 3, offload=s3.offload.model_copy(update={"optimizer_swap": True}))


def test_a_stage_does_not_read_other_stages_actions(setup):
    model, hw, plan = setup
    other = compacted(plan, model)
    a, b = fresh(plan, model, hw), fresh(other, model, hw)
    assert a[0] == b[0] and a[7] == b[7]  # the tied embedding's two stages: untouched by 1-3's changes
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]


def test_read_back_equals_computing_again(setup):
    model, hw, plan = setup
    stagecost._CACHE.clear()
    for p in (plan, compacted(plan, model), plan):
        assert stagecost.stage_costs(p, model, hw) == fresh(p, model, hw)
    # the second plan added three entries (stages 1-3), the third read every stage back
    assert len(stagecost._CACHE) == 8 + 3


def test_everything_else_is_in_the_key(setup):
    model, hw, plan = setup
    stagecost.stage_costs(plan, model, hw)
    slower = hw.model_copy(update={"device": hw.device.model_copy(update={"hbm_gbps": hw.device.hbm_gbps / 2})})
    bigger = plan.model_copy(update={"training": plan.training.model_copy(update={"microbatch_size": 4,
                                                                                   "global_batch": 32})})
    # the head's stage trades devices with stage 1 (NVLink to device 0, where device 7 is not): the
    # tied sync's link changes for stage 0 too
    moved = with_stage(with_stage(plan, 7, devices=plan.stages[1].devices), 1, devices=plan.stages[7].devices)
    for p, h in ((plan, slower), (bigger, hw), (moved, hw)):
        assert stagecost.stage_costs(p, model, h) == fresh(p, model, h)
    assert stagecost.cost_context(plan, model, hw) != stagecost.cost_context(moved, model, hw)
    assert fresh(plan, model, hw)[0] != fresh(moved, model, hw)[0]  # the case the shapes in the key are for


def test_simulation_is_the_same_with_a_cold_or_warm_cache(setup):
    model, hw, plan = setup
    plan = compacted(plan, model)
    stagecost._CACHE.clear()
    cold = simulate(plan, model, hw)
    warm = simulate(plan, model, hw)
    assert cold.result.model_dump_json() == warm.result.model_dump_json()
    assert cold.trace == warm.trace


def test_the_cache_is_bounded(setup, monkeypatch):
    model, hw, plan = setup
    monkeypatch.setattr(stagecost, "STAGE_COST_CACHE_SIZE", 3)
    stagecost._CACHE.clear()
    stagecost.stage_costs(plan, model, hw)
    stagecost.stage_costs(compacted(plan, model), model, hw)
    assert len(stagecost._CACHE) == 3
