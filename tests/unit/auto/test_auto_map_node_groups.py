"""policy=auto's MAP stages (planners/auto/map_mix.py) checkpoint over node groups where that wins
(MAP §5.2.2-§5.2.4, Algorithm 2; issue 26), as policy=map's stages do.

gpt_tiny at sequence 256, microbatch 8, fp32 (8 samples per microbatch: the saved activations are
several times the parameter state, so the budget moves the checkpoint tree), on local_cpu's 4
ranks: a pp2 base of two dp2 stages, whose second stage map_mix replaces by MAP's sharding of the
same 2 devices. Checked:

* at budgets between the node-group chain's minimum and the per-layer chain's, the MAP stage
  carries StagePlan.node_groups, validates, simulates on the chain rotor solved, and its stage
  runs faster than the same solve restricted to the per-layer chain
  (planners.map.linearise.INTRA_BLOCK_CUTS off); at a roomy budget the per-layer chain wins and
  the stage is exactly the per-layer one;
* auto_search offers such a stage: its "+ MAP sharding" candidate carries node groups and a fresh
  simulation agrees with it (on gpt_tiny auto's dp4 plan stays faster, so the winner has none).
"""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
from executor.op_graph import model_op_graphs
from planners.auto import map_mix
from planners.auto.realise import simulated_candidate
from planners.auto.search import auto_search
from planners.layout import PlanningError
from planners.map import linearise
from planners.map.ilp import solve as solve_ilp
from planners.map.linearise import linear_chain
from planners.map.plan import _StageModel, choose_mesh
from planners.map.rotor import min_feasible_budget
from planners.policy import AutoPolicy
from simulator.sharded import sharded_stage
from specs.plan import Plan, ScheduleSpec, StagePlan, validate_plan
from specs.training import TrainingSpec
from tests.conftest import LOCAL_CPU, conf
from tests.unit.auto.auto_cases import simulated_fit

MB = 8
TRAINING = TrainingSpec(global_batch=4 * MB, microbatch_size=MB, precision="fp32")
ONE_F_ONE_B = ScheduleSpec(kind="1f1b")


@pytest.fixture(scope="module")
def setup():
    """(model with op graphs, the pp2 x dp2 base plan, the MAP stage model of its stage 1)."""
    cfg = parse_model_config(conf("model", "gpt_tiny") | {"seq_len": 256})
    graphs, keys = model_op_graphs(cfg, MB, "fp32")
    model = build_model(cfg, TRAINING.act_dtype_bytes)
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": MB,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    half = model.num_layers // 2
    base = validate_plan(Plan(planner="manual", model=model.name, hardware=LOCAL_CPU.name, num_devices=4,
                              training=TRAINING, schedule=ONE_F_ONE_B,
                              stages=[StagePlan(layer_start=0, layer_stop=half, devices=[0, 1], dp=2, tp=1),
                                      StagePlan(layer_start=half, layer_stop=model.num_layers, devices=[2, 3],
                                                dp=2, tp=1)]), model, LOCAL_CPU)
    shape, order = choose_mesh(None, LOCAL_CPU, (2, 3))
    sm = _StageModel(model, LOCAL_CPU, TRAINING, range(half, model.num_layers), order, shape)
    sm.build()
    return model, base, sm


def _chains(sm):
    """(per-layer chain, node-group chain) of the stage's unconstrained strategies."""
    sh = {s.layer: s for s in sm.shardings(solve_ilp(sm.problem(1 << 40)).choice)}
    return (linear_chain(sm.model, sm.hardware, sm.training, sm.layers, sm.mesh, sh, split=False).chain,
            linear_chain(sm.model, sm.hardware, sm.training, sm.layers, sm.mesh, sh).chain)


def _stage_s(plan: Plan, model, s: int) -> float:
    run = sharded_stage(plan, model, LOCAL_CPU, plan.stages[s]).run
    return run.fwd_s + run.bwd_s


def test_a_mixed_map_stage_checkpoints_over_node_groups_where_they_win(setup, monkeypatch):
    model, base, sm = setup
    per_layer, groups = _chains(sm)
    low, high = min_feasible_budget(groups), min_feasible_budget(per_layer)
    assert low < high          # the groups fit a smaller budget (test_map_linearise)
    seen = set()
    for budget in (int(low * 1.05), int(low * 1.1), 4 * high):
        on = map_mix._sharded_stage(base, 1, model, LOCAL_CPU, budget)
        with monkeypatch.context() as m:
            m.setattr(linearise, "INTRA_BLOCK_CUTS", False)
            try:
                off = map_mix._sharded_stage(base, 1, model, LOCAL_CPU, budget)
            except PlanningError:
                off = None     # the per-layer chain of no strategy choice fits
        seen.add(on.node_groups is not None)
        if on.node_groups is None:      # the per-layer chain won: the stage is exactly the per-layer one
            assert off is not None and on == off
            continue
        assert len(on.node_groups) > on.num_layers and on.checkpoint[-1].stop == len(on.node_groups)
        mixed = simulated_candidate("mixed", map_mix._with_stage(base, 1, on), model, LOCAL_CPU, budget)
        assert mixed.plan.stages[0] == base.stages[0] and mixed.plan.stages[1].node_groups == on.node_groups
        shard = {s.layer: s for s in on.sharding}
        assert (sharded_stage(mixed.plan, model, LOCAL_CPU, mixed.plan.stages[1]).chain
                == linear_chain(model, LOCAL_CPU, TRAINING, sm.layers, sm.mesh, shard).chain)
        assert Plan.model_validate_json(mixed.plan.model_dump_json()) == mixed.plan
        if off is not None:             # rotor's pick: the group tree is the faster stage
            assert _stage_s(mixed.plan, model, 1) < _stage_s(map_mix._with_stage(base, 1, off), model, 1)
    assert seen == {True, False}


def test_auto_search_offers_a_map_stage_over_node_groups(setup):
    model, _, _ = setup
    policy = AutoPolicy(singles=["balanced"], microbatch_sizes=[MB], memory_budget_gib=20 / 1024)
    out = auto_search(policy, model, LOCAL_CPU, TRAINING, ONE_F_ONE_B)
    mixed = [c for c in out.everything if "MAP sharding" in c.how]
    grouped = [c for c in mixed if any(st.node_groups for st in c.plan.stages)]
    assert grouped, [c.how for c in mixed]
    for c in grouped:
        fits, time_s, _ = simulated_fit(c.plan, model, LOCAL_CPU, out.capacity_bytes)
        assert fits == c.fits and time_s == pytest.approx(c.time_s, rel=1e-9)
