"""MAP Algorithm 2 in plans (issue 26): a stage's checkpoint tree over node groups
(StagePlan.node_groups, the CheckpointSegment indices then index those groups).

* the contract: plain JSON round trip; a plan without groups dumps as before (no key) and loads
  as over layers; errors name the field;
* the planner: at a budget where rotor's node-group chain wins (planners.map.rotor.integrate's
  alternative 1), map_search emits the groups, deterministically; with the groups switched off
  (planners.map.linearise.INTRA_BLOCK_CUTS) the same budget gives the per-layer plan;
* the simulator prices the plan's tree on the chain rotor solved: the chain is linear_chain's,
  and the walk's time and peak are rotor's.

gpt_tiny, sequence 256, microbatch 8, fp32, one local_cpu device (test_map_linearise's fixture)."""
from __future__ import annotations

import json

import pytest

from costs.rotor import simulate_peak
from planners.map import linearise
from planners.map.ilp import solve as solve_ilp
from planners.map.linearise import linear_chain
from planners.map.plan import map_search
from planners.map.rotor import integrate, min_feasible_budget
from planners.map.stage import segments
from planners.policy import MapPolicy
from simulator.sharded import sharded_stage, stage_pass, tied_grad_holds
from specs.plan import NodeGroup, Plan, ScheduleSpec, StagePlan, validate_plan
from tests.unit.map.test_map_linearise import gpt  # noqa: F401  (the module fixture)

GIB = 1 << 30


def _stage(sm, shard, lin, rot) -> StagePlan:
    return StagePlan(layer_start=sm.layers.start, layer_stop=sm.layers.stop, devices=[0], dp=1, tp=1,
                     sharding=[shard[l] for l in sm.layers], mesh=[1],
                     node_groups=lin.node_groups(sm.model), checkpoint=segments(rot.segments, 0))


def _plan(model, hw, tr, stages) -> Plan:
    return Plan(planner="map", model=model.name, hardware=hw.name, num_devices=hw.num_devices, training=tr,
                schedule=ScheduleSpec(), stages=stages)


@pytest.fixture(scope="module")
def won(gpt):  # noqa: F811
    """integrate with both chains at the per-layer chain's smallest budget (the node-group chain
    wins there, test_map_linearise): (budget, integrate's result, its node-group LinearChain)."""
    model, hw, tr, sm, _ = gpt

    def chains(sol):
        sh = {s.layer: s for s in sm.shardings(sol.choice)}
        return (linear_chain(model, hw, tr, sm.layers, sm.mesh, sh, split=False).chain,
                linear_chain(model, hw, tr, sm.layers, sm.mesh, sh).chain)

    tight = min_feasible_budget(chains(solve_ilp(sm.problem(1 << 40)))[0])
    res = integrate(sm.problem, chains, tight)
    assert res.alternative == 1
    sh = {s.layer: s for s in sm.shardings(res.ilp.choice)}
    return tight, res, linear_chain(model, hw, tr, sm.layers, sm.mesh, sh), sh


def test_node_group_plan_round_trips_json_and_simulates_to_rotors_peak_and_time(gpt, won):  # noqa: F811
    model, hw, tr, sm, _ = gpt
    budget, res, lin, shard = won
    plan = validate_plan(_plan(model, hw, tr, [_stage(sm, shard, lin, res.rotor)]), model, hw)
    text = plan.model_dump_json()
    assert Plan.model_validate_json(text) == plan
    groups = json.loads(text)["stages"][0]["node_groups"]
    assert len(groups) == len(lin.groups) > model.num_layers
    assert all(set(g) == {"layer", "nodes"} for g in groups)
    # some checkpoint segment starts inside a layer
    st = plan.stages[0]

    def starts(segs):
        return [g.start for g in segs if g.checkpointed] + [s for g in segs for s in starts(g.children)]
    assert any(st.node_groups[s].layer == st.node_groups[s - 1].layer for s in starts(st.checkpoint) if s)
    sh = sharded_stage(plan, model, hw, st)
    assert sh.chain == res.chain == lin.chain
    assert sh.layer_spans() == tuple(lin.layer_stages()[l] for l in sm.layers)   # per layer its groups
    run = stage_pass(res.chain, res.rotor.segments)
    assert sh.segments == res.rotor.segments
    # beside Table 1 the simulator holds the tied head's gradient (simulator.sharded.tied_grad_holds,
    # which rotor's DP does not see, planner and simulator alike): same times, the peak at most that more
    holds = tied_grad_holds(model, sm.layers, sm.mesh, shard)
    assert holds
    assert (sh.run.fwd_s, sh.run.bwd_s, sh.run.act_bytes) == (run.fwd_s, run.bwd_s, run.act_bytes)
    assert run.peak_bytes <= sh.run.peak_bytes <= run.peak_bytes + sum(b for _, _, b in holds)
    base = sh.chain.fixed_bytes + sh.chain.w_input
    assert run.peak_bytes + base == res.rotor.peak_bytes == simulate_peak(res.chain, res.rotor.sequence)
    assert res.rotor.peak_bytes <= budget
    assert run.fwd_s + run.bwd_s == pytest.approx(res.rotor.time_s, rel=1e-12)
    assert run.recompute_s == pytest.approx(res.rotor.recompute_s, rel=1e-9, abs=1e-15)


def test_a_plan_over_layers_dumps_and_loads_as_before(gpt, won):  # noqa: F811
    model, hw, tr, sm, _ = gpt
    _, res, lin, shard = won
    st = _stage(sm, shard, lin, res.rotor).model_copy(update={"node_groups": None, "checkpoint": []})
    dumped = json.loads(st.model_dump_json())
    assert "node_groups" not in dumped
    assert StagePlan.model_validate(dumped).node_groups is None


def test_errors_name_the_field(gpt, won):  # noqa: F811
    model, hw, tr, sm, _ = gpt
    _, res, lin, shard = won
    good = _stage(sm, shard, lin, res.rotor)
    data = json.loads(good.model_dump_json())
    swapped = json.loads(json.dumps(data))
    swapped["node_groups"][0], swapped["node_groups"][-1] = swapped["node_groups"][-1], swapped["node_groups"][0]
    with pytest.raises(ValueError, match=r"node_groups\[0\]: layer"):
        StagePlan.model_validate(swapped)
    short = json.loads(json.dumps(data))
    short["checkpoint"] = [{"start": 0, "stop": len(lin.groups) - 1, "checkpointed": False}]
    with pytest.raises(ValueError, match=r"checkpoint \(over node_groups\)"):
        StagePlan.model_validate(short)
    # the groups of layer 1 with their order inside the layer changed: validate_plan names the layer
    bad = json.loads(json.dumps(data))
    g1 = [g for g in bad["node_groups"] if g["layer"] == 1]
    assert len(g1) == 2
    g1[0]["nodes"], g1[1]["nodes"] = g1[1]["nodes"], g1[0]["nodes"]
    plan = _plan(model, hw, tr, [StagePlan.model_validate(bad)])
    with pytest.raises(ValueError, match=r"stages\[0\]\.node_groups\[layer 1\]"):
        validate_plan(plan, model, hw)
    with pytest.raises(ValueError, match="nodes"):
        NodeGroup(layer=0, nodes=[])


def test_map_search_emits_the_groups_when_they_win(gpt, won, monkeypatch):  # noqa: F811
    model, hw, tr, sm, _ = gpt
    budget = won[0]
    pol = MapPolicy(memory_budget_gib=budget / GIB)
    a, b = map_search(pol, model, hw, tr, ScheduleSpec()), map_search(pol, model, hw, tr, ScheduleSpec())
    st = a.plan.stages[0]
    assert st.node_groups is not None and len(st.node_groups) > model.num_layers
    assert a.plan.model_dump_json() == b.plan.model_dump_json()          # deterministic
    # the simulated stage is the chain rotor solved for the plan's strategies
    shard = {s.layer: s for s in st.sharding}
    lin = linear_chain(model, hw, tr, sm.layers, sm.mesh, shard)
    assert [g.model_dump() for g in st.node_groups] == [g.model_dump() for g in lin.node_groups(model)]
    assert sharded_stage(a.plan, model, hw, st).chain == lin.chain
    assert any("node groups" in n for n in a.notes)
    # switched off: the per-layer plan, segments over layers, and no slower than ...
    monkeypatch.setattr(linearise, "INTRA_BLOCK_CUTS", False)
    off = map_search(pol, model, hw, tr, ScheduleSpec())
    assert off.plan.stages[0].node_groups is None
    assert off.plan.stages[0].checkpoint[-1].stop == model.num_layers
    # ... the node-group plan, which is faster where it wins (rotor's pick, simulated)
    assert a.iteration_s < off.iteration_s
