"""Issue 22: the shortcuts that make policy=map fast on repeated layers change no answer. The block
DP's threshold schedule returns the same choice whichever threshold succeeds (MAP eq. 1, exact);
identical layers are priced once by stage_chain and their shardings validated once; map_search
reports its phases; a checkpoint tree too deep for a plan is avoided."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import yaml

import planners.map.blocks as blocks
import planners.map.plan as map_plan
import planners.map.rotor as rotor
import simulator.sharded as sharded
from costs.rotor import Chain
from planners.map.ilp import solve
from planners.map.problem import IlpEdge, IlpNode, IlpProblem
from planners.map.stage import MAX_NESTING, PHASES, nesting, shallow

CONF = Path(__file__).resolve().parents[4] / "conf"


def _repeated(rng: random.Random, n_blocks: int) -> tuple[list, list, tuple]:
    """A chain of n identical blocks (3 nodes, 2-3 strategies) between a different first and last
    block, with an edge inside each block and one into the next (the transformer case)."""
    def block():
        nodes = [IlpNode("x", tuple(round(rng.uniform(0.1, 2.0), 4) for _ in range(k)),
                         tuple(rng.randint(1, 40) * 1024 for _ in range(k))) for k in (rng.randint(2, 3) for _ in range(3))]
        mats = [tuple(tuple(round(rng.uniform(0, 1.0), 4) for _ in range(len(nodes[j + 1].costs_s)))
                      for _ in range(len(nodes[j].costs_s))) for j in range(2)]
        return nodes, mats
    first, mid, last = block(), block(), block()
    specs = [first] + [mid] * (n_blocks - 2) + [last]
    nodes, edges = [], []
    for b, (bn, mats) in enumerate(specs):
        base = 3 * b
        nodes += [dataclasses.replace(nd, name=f"b{b}n{i}") for i, nd in enumerate(bn)]
        edges += [IlpEdge(base, base + 1, mats[0]), IlpEdge(base + 1, base + 2, mats[1])]
        if b:
            prev = specs[b - 1][0]
            edges.append(IlpEdge(base - 1, base, tuple(tuple(0.05 * ((i + j) % 3) for j in range(len(bn[0].costs_s)))
                                                       for i in range(len(prev[2].costs_s)))))
    return nodes, edges, tuple(tuple(range(3 * b, 3 * b + 3)) for b in range(n_blocks))


@pytest.mark.parametrize("seed", range(8))
def test_block_dp_choice_does_not_depend_on_the_threshold_schedule(seed, monkeypatch):
    rng = random.Random(seed)
    nodes, edges, blks = _repeated(rng, rng.randint(12, 30))
    lo = sum(min(nd.memory_bytes) for nd in nodes)
    hi = sum(max(nd.memory_bytes) for nd in nodes)
    for frac in (0.05, 0.3, 0.7):
        budget = int(lo + frac * (hi - lo))
        for q in (0, budget // 1024):
            problem = IlpProblem(tuple(nodes), tuple(edges), budget, blks, memory_quantum_bytes=q)
            got = {}
            for schedule in (blocks.THETA_FRACTIONS, (1 / 16, 1 / 4, 1.0), (1.0,)):
                monkeypatch.setattr(blocks, "THETA_FRACTIONS", schedule)
                blocks._FRONTIERS.clear()
                got[schedule] = blocks.solve_blocks(problem)
            first = next(iter(got.values()))
            assert all(s.choice == first.choice and s.time_s == first.time_s for s in got.values())
            if q == 0:      # exact: HiGHS's optimum
                assert first.time_s == pytest.approx(solve(problem, method="ilp").time_s, rel=1e-9)


@pytest.fixture(scope="module")
def tiny():
    from costs.families import build_model, parse_model_config
    from executor.op_graph import model_op_graphs
    from specs.hardware import HardwareSpec
    from specs.training import TrainingSpec

    data = yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text()) | {"num_layers": 10}
    cfg = parse_model_config(data)
    model = build_model(cfg, 4)
    graphs, keys = model_op_graphs(cfg, 4, "fp32")
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 4,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    hw = HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / "local_cpu.yaml").read_text()))
    return model, hw, TrainingSpec(global_batch=8, microbatch_size=4, precision="fp32")


def test_repeated_layers_priced_once_equal_priced_each(tiny, monkeypatch):
    from planners.policy import MapPolicy
    from specs.plan import ScheduleSpec

    model, hw, tr = tiny
    phases = []
    out = map_plan.map_search(MapPolicy(budgets=3, refine=1), model, hw, tr, ScheduleSpec(),
                              phase=lambda name, s: phases.append((name, s)))
    names = [n for n, _ in phases]
    assert names[:2] == list(PHASES[:2]) and names[2:5] == list(PHASES[2:])
    assert len(names) == 2 + 3 * len(out.rounds) and all(s >= 0 for _, s in phases)
    stage = out.plan.stages[0]
    shardings = {s.layer: s for s in stage.sharding}
    layers = range(stage.layer_start, stage.layer_stop)
    mesh = sharded.stage_mesh(hw, tuple(stage.devices), sharded.stage_layout(stage))
    once = sharded.stage_chain(model, hw, tr, layers, mesh, shardings)
    monkeypatch.setattr(sharded, "_sharding_key", lambda sh: object())     # every layer priced afresh
    each = sharded.stage_chain(model, hw, tr, layers, mesh, shardings)
    assert once == each
    # the shardings validated once per distinct layer and copied equal those built for each layer
    sm = map_plan._StageModel(model, hw, tr, layers, tuple(stage.devices), tuple(stage.sharding[0].mesh))
    sm.build()
    choice = tuple(0 for _ in sm.nodes)
    cached = sm.shardings(choice)
    monkeypatch.setattr(sm, "_made", type("NoCache", (dict,), {"__setitem__": lambda self, k, v: None})())
    fresh = sm.shardings(choice)
    assert [s.model_dump() for s in cached] == [s.model_dump() for s in fresh]


def test_a_checkpoint_tree_too_deep_for_a_plan_is_avoided():
    L = 200
    one = lambda v: (v,) * L
    chain = Chain(u_f=one(1.0), u_b=one(2.0), u_fcomm=one(0.0), u_bcomm=one(0.0), w_a=one(10), w_abar=one(30),
                  w_delta=one(10), o_f=one(0), o_b=one(0), o_fcomm=one(0), o_bcomm=one(0), w_input=10, fixed_bytes=0)
    need = rotor.min_feasible_budget(chain, 500)
    deepest = rotor.solve(chain, need, 500, find_min=False)
    assert nesting(deepest.segments) > MAX_NESTING          # the minimum recomputes layer by layer
    rot, at = shallow(chain, need, 500)
    assert rot.feasible and at > need and nesting(rot.segments) <= MAX_NESTING and rot.peak_bytes <= at
