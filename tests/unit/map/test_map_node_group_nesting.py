"""MAP Algorithm 2's checkpoint tree over node groups respects planners.map.stage.MAX_NESTING like
the per-layer tree (issue 26): a plan serialises one JSON level and the executor one
torch.utils.checkpoint call per nesting level.

A gpt_tiny with 130 blocks (132 layers, 263 node groups: each block cuts at its first residual
add) on one local_cpu device. At the node-group chain's smallest budget only that chain fits (the
per-layer chain needs more), and rotor's tree there recomputes block by block, 130 levels deep.
solve_stage must not hand that tree to a plan: it reports the stage as not fitting at that
budget, with the smallest budget at which a holdable tree over the groups fits, and at that
budget it plans the groups with a tree no deeper than MAX_NESTING, which a plan validates and the
simulator prices on the same chain."""
from __future__ import annotations


import pytest

from planners.map.linearise import linear_chain
from planners.map.plan import StageChoice
from planners.map.rotor import min_feasible_budget, solve
from planners.map.stage import MAX_NESTING, nesting, solve_stage
from planners.policy import MapPolicy
from simulator.sharded import sharded_stage
from specs.plan import Plan, ScheduleSpec, StagePlan, validate_plan
from tests.unit.map.test_map_linearise import tiny_stage

GIB = 1 << 30
BLOCKS = 130                  # > MAX_NESTING blocks: the minimum-budget tree nests one level per block


@pytest.fixture(scope="module")
def deep():
    """(model, hardware, training, stage model, per-layer chain, group chain) of the long gpt_tiny."""
    assert BLOCKS > MAX_NESTING
    model, hw, tr, sm, sh = tiny_stage(BLOCKS)
    return (model, hw, tr, sm, linear_chain(model, hw, tr, sm.layers, sm.mesh, sh, split=False).chain,
            linear_chain(model, hw, tr, sm.layers, sm.mesh, sh).chain)


def _solve(sm, budget_bytes: int):
    choice = StageChoice(stage=0, layers=(sm.layers.start, sm.layers.stop), devices=(0,), mesh=(1,))
    groups, notes = [], []
    shard, segs = solve_stage(sm, budget_bytes, MapPolicy(memory_budget_gib=budget_bytes / GIB), choice, None, notes,
                              None, groups)
    return choice, shard, segs, groups, notes


def test_the_group_tree_at_its_minimum_would_nest_too_deep(deep):
    """The case the bound is for: at the group chain's minimum only it fits, 130 levels deep."""
    *_, per_layer, groups = deep
    assert len(groups) > len(per_layer) > MAX_NESTING
    tight = min_feasible_budget(groups)
    assert tight < min_feasible_budget(per_layer)
    assert not solve(per_layer, tight, find_min=False).feasible
    assert nesting(solve(groups, tight, find_min=False).segments) > MAX_NESTING


def test_solve_stage_keeps_the_group_tree_within_max_nesting(deep):
    model, hw, tr, sm, per_layer, groups = deep
    tight = min_feasible_budget(groups)
    choice, shard, segs, got, notes = _solve(sm, tight)
    # not held at this budget: the smallest budget reported is one with a holdable tree, above it,
    # and below the per-layer chain's minimum (the groups still save memory)
    assert tight < choice.min_budget_bytes < min_feasible_budget(per_layer)
    assert got and nesting(segs) <= MAX_NESTING
    assert any("deeper than" in n for n in notes)
    # at the reported budget the stage is planned over node groups, holdable, valid, simulated
    choice, shard, segs, got, notes = _solve(sm, choice.min_budget_bytes)
    assert choice.min_budget_bytes == 0
    assert got and len(got) == len(groups) and 0 < nesting(segs) <= MAX_NESTING
    st = StagePlan(layer_start=0, layer_stop=model.num_layers, devices=[0], dp=1, tp=1, sharding=shard, mesh=[1],
                   node_groups=got, checkpoint=segs)
    plan = validate_plan(Plan(planner="map", model=model.name, hardware=hw.name, num_devices=hw.num_devices,
                              training=tr, schedule=ScheduleSpec(), stages=[st]), model, hw)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert sharded_stage(plan, model, hw, plan.stages[0]).chain == groups
