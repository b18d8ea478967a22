"""The per-layer checkpoint tree respects planners.map.stage.MAX_NESTING on solve_stage's main path
(rotor.integrate's pick), not only on its fallback (stage.shallow): a plan serialises one JSON
level and the executor one torch.utils.checkpoint call per nesting level.

A gpt_tiny with 130 blocks (132 layers) on one local_cpu device, checkpointed per layer (no node
groups). At the per-layer chain's smallest budget rotor's tree recomputes layer by layer, one
level each, deeper than MAX_NESTING. solve_stage must not hand that tree to a plan: it reports
the stage as not fitting at that budget, with the smallest budget at which a holdable tree fits,
and at that budget it plans a tree no deeper than MAX_NESTING, which a plan validates and the
simulator prices (tests/unit/map/test_map_node_group_nesting.py: the same for node groups)."""
from __future__ import annotations


import pytest

from planners.map.plan import StageChoice
from planners.map.rotor import min_feasible_budget, solve
from planners.map.stage import MAX_NESTING, nesting, solve_stage
from planners.policy import MapPolicy
from simulator.sharded import sharded_stage
from specs.plan import Plan, ScheduleSpec, StagePlan, validate_plan
from tests.unit.map.test_map_linearise import tiny_stage

GIB = 1 << 30
BLOCKS = 130                  # > MAX_NESTING blocks: the minimum-budget tree nests one level per layer


@pytest.fixture(scope="module")
def deep():
    """(model, hardware, training, stage model, its per-layer chain) of the long gpt_tiny."""
    assert BLOCKS > MAX_NESTING
    model, hw, tr, sm, sh = tiny_stage(BLOCKS)
    return model, hw, tr, sm, sm.chain_of_shardings(list(sh.values()))


def _solve(sm, budget_bytes: int, budgets: int = 10):
    choice = StageChoice(stage=0, layers=(sm.layers.start, sm.layers.stop), devices=(0,), mesh=(1,))
    notes: list[str] = []
    policy = MapPolicy(memory_budget_gib=budget_bytes / GIB, budgets=budgets)
    shard, segs = solve_stage(sm, budget_bytes, policy, choice, None, notes)
    return choice, shard, segs, notes


def test_the_layer_tree_at_its_minimum_would_nest_too_deep(deep):
    """The case the bound is for: at the chain's minimum rotor's tree nests deeper than a plan holds."""
    *_, chain = deep
    assert len(chain) > MAX_NESTING
    assert nesting(solve(chain, min_feasible_budget(chain), find_min=False).segments) > MAX_NESTING


#: §5.3's ILP budgets B (1 + alpha)^k, k < budgets: with 10 none holds the 132 layers' activations the
#: ILP counts as kept, so solve_stage falls back to the least-memory strategies checkpointed within B;
#: with 30 the ILP admits a solution and rotor.integrate's pick is the too-deep tree (the main path)
PATHS = {"fallback": 10, "main": 30}


@pytest.mark.parametrize("path", PATHS)
def test_solve_stage_keeps_the_layer_tree_within_max_nesting(deep, path):
    model, hw, tr, sm, chain = deep
    tight = min_feasible_budget(chain)
    choice, shard, segs, notes = _solve(sm, tight, PATHS[path])
    # the main path re-solves with the too-deep per-layer trees screened out, and says so
    assert any("per-layer checkpoints nest deeper" in n for n in notes) == (path == "main")
    # not held at this budget: the smallest budget reported is one with a holdable tree, above it
    assert choice.min_budget_bytes > tight
    assert nesting(segs) <= MAX_NESTING
    assert any("deeper than" in n for n in notes)
    # at the reported budget the stage is planned, holdable, valid, and simulated on the same chain
    choice, shard, segs, notes = _solve(sm, choice.min_budget_bytes, PATHS[path])
    assert choice.min_budget_bytes == 0
    assert segs and 0 < nesting(segs) <= MAX_NESTING
    st = StagePlan(layer_start=0, layer_stop=model.num_layers, devices=[0], dp=1, tp=1, sharding=shard, mesh=[1],
                   checkpoint=segs)
    plan = validate_plan(Plan(planner="map", model=model.name, hardware=hw.name, num_devices=hw.num_devices,
                              training=tr, schedule=ScheduleSpec(), stages=[st]), model, hw)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert sharded_stage(plan, model, hw, plan.stages[0]).chain == chain
