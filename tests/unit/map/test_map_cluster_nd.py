"""Issue 26: the measured cluster (policy.cluster = a cluster.json) drives MAP's mesh; N-D meshes are
planned as detected (no fold to 2-D) and solved fast, exactly.

* planners/map/conv_table.py: one Dijkstra per source gives map_layout.convert's costs bit for bit;
* planners/map/fastest.py (the unconstrained eq. 1 by min-sum elimination, solve_blocks' first try)
  against brute force, and a binding budget still solved exactly by the Pareto DP;
* map_search on an 8-device machine plans the detected 2 x 2 x 2 mesh, the fast path's optimum
  equals the Pareto DP's on that real N-D problem;
* a cluster.json whose measured pairs group differently from the YAML's links changes the mesh
  and its per-axis prices; a malformed one is refused with the field named.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import planners.map.blocks as blocks_mod
from costs.map_layout import convert, valid_specs
from executor.op_graph import model_op_graphs
from costs.families import build_model, parse_model_config
from planners.layout import PlanningError
from planners.map.blocks import solve_blocks
from planners.map.cluster_file import check_cluster
from planners.map.conv_table import costs_from
from planners.map.fastest import fastest_choice
from planners.map.plan import _StageModel, map_search
from planners.map.problem import IlpProblem, Reduced
from planners.policy import MapPolicy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.sharding import Mesh, MeshAxis
from specs.training import TrainingSpec
from tests.unit.map.test_map_blocks import _brute, _chain

CONF = Path(__file__).resolve().parents[3] / "conf"


# ---- conversions: one Dijkstra per source == convert ------------------------------------------------

@pytest.mark.parametrize("shape, every", [((16, 64), 1), ((8, 16, 32), 9)])
def test_one_dijkstra_per_source_equals_convert_on_a_3d_mesh(shape, every):
    """Every source; every target of a matrix, every 9th of a 3-D tensor's 64 specs (convert's own
    per-pair search is what makes the full check slow)."""
    mesh = Mesh((MeshAxis(2, 1e-5, 10e9), MeshAxis(2, 5e-6, 20e9), MeshAxis(2, 3e-6, 300e9)))
    specs = valid_specs(shape, mesh.shape)
    assert len(specs) > 20
    for i, a in enumerate(specs):
        got = costs_from(a, shape, 2, mesh)
        assert set(got) == set(specs)
        for b in specs[i % every::every]:
            assert got[b] == convert(a, b, shape, 2, mesh).cost_s      # exact: the same float sums


# ---- the unconstrained solve against brute force ------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_fastest_choice_is_the_brute_force_minimum(seed):
    rng = random.Random(seed)
    nodes, edges, blocks = _chain(rng, identical=seed % 2 == 0)
    t, m = _brute(nodes, edges)
    roomy = IlpProblem(tuple(nodes), tuple(edges), int(m.max()), blocks)
    sol = solve_blocks(roomy)
    assert sol.status == "optimal"
    assert sol.time_s == pytest.approx(float(t.min()), rel=1e-12, abs=1e-12)
    # the elimination itself (not only the DP behind it) finds the minimum
    red = Reduced(roomy)
    nbr = blocks_mod._neighbours(red)
    free = [[n for n in blk if n not in red.fixed] for blk in blocks]
    owner = {n: b for b, blk in enumerate(free) for n in blk}
    taus = [[n for n in blk if any(owner.get(u) == b + 1 for u in nbr.get(n, {}))] for b, blk in enumerate(free)]
    pos = fastest_choice(red, nbr, free, taus, lambda blk, s, tau: blocks_mod._signature(red, nbr, blk, s, tau))
    choice = [0] * len(nodes)
    for n in red.fixed:
        choice[n] = int(red.keep[n][0])
    for n, p in zip((n for blk in free for n in blk), pos):
        choice[n] = int(red.keep[n][p])
    idx = np.ravel_multi_index(tuple(choice), [len(nd.costs_s) for nd in nodes])
    assert t[idx] == pytest.approx(float(t.min()), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_a_binding_budget_is_still_solved_exactly(seed):
    """Below the fastest choice's bytes the fast path must not answer; the Pareto DP does."""
    rng = random.Random(100 + seed)
    nodes, edges, blocks = _chain(rng, identical=seed % 2 == 1)
    t, m = _brute(nodes, edges)
    fastest_bytes = int(m[t <= t.min() + 1e-12].min())
    budget = (fastest_bytes + int(m.min())) // 2
    if budget >= fastest_bytes or budget < m.min():
        pytest.skip("no binding budget between the least bytes and the fastest choice's")
    sol = solve_blocks(IlpProblem(tuple(nodes), tuple(edges), budget, blocks))
    ok = m <= budget
    assert sol.memory_bytes <= budget
    assert sol.time_s == pytest.approx(float(t[ok].min()), rel=1e-12, abs=1e-12)
    assert sol.time_s > float(t.min()) + 1e-12        # the budget did bind


# ---- the planner on an N-D mesh ---------------------------------------------------------------------

def _hw(name: str) -> HardwareSpec:
    return HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text()))


@pytest.fixture(scope="module")
def tiny8():
    """gpt_tiny (fp32, microbatch 8) on MAP's testbed, map_8xa100: NVLink pairs, two NUMA halves."""
    cfg = parse_model_config(yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text()))
    model = build_model(cfg, 4)
    graphs, keys = model_op_graphs(cfg, 8, "fp32")
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 8,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    return model, _hw("map_8xa100"), TrainingSpec(global_batch=16, microbatch_size=8, precision="fp32")


def test_the_detected_3d_mesh_is_planned_unfolded(tiny8):
    """map_8xa100's links group as 2 x 2 x 2 (planners.map.cluster); the plan keeps all three axes."""
    model, hw, tr = tiny8
    out = map_search(MapPolicy(), model, hw, tr, ScheduleSpec())
    (stage,) = out.plan.stages
    assert [list(s.mesh) for s in stage.sharding] == [[2, 2, 2]] * model.num_layers
    assert tuple(out.stages[0].mesh) == (2, 2, 2)
    assert out.stages[0].mesh_source.startswith("hardware")
    # per-operator strategy counts are reported, and a linear on 3 axes has more than on 2
    assert max(out.stages[0].strategies_per_node.values()) > 25


def test_a_real_3d_layer_is_solved_to_the_brute_force_optimum(tiny8):
    """gpt_tiny's last layer (layer norm, the vocabulary linear, flatten, loss) on the 2 x 2 x 2 mesh:
    27 x 27 x 8 x 8 strategy choices, few enough to enumerate. At a roomy budget (the fast path) and
    at a binding one (the Pareto DP), the block solver returns the enumerated optimum."""
    model, hw, tr = tiny8
    last = model.num_layers - 1
    sm = _StageModel(model, hw, tr, range(last, last + 1), tuple(range(8)), (2, 2, 2))
    sm.build()
    probe = sm.problem(1)
    assert 1000 < np.prod([len(nd.costs_s) for nd in probe.nodes]) < 200_000
    t, m = _brute(probe.nodes, probe.edges)
    fastest_bytes = int(m[t <= t.min() * (1 + 1e-12)].min())
    assert int(m.min()) < fastest_bytes        # so the second budget below binds
    for budget in (int(m.max()), (fastest_bytes + int(m.min())) // 2):
        problem = IlpProblem(probe.nodes, probe.edges, budget, probe.blocks)
        sol = solve_blocks(problem)
        ok = m <= budget
        assert sol.memory_bytes <= budget
        assert sol.time_s == pytest.approx(float(t[ok].min()), rel=1e-12)


# ---- policy.cluster -------------------------------------------------------------------------------------

def _cluster(beta_of, alpha_s: float = 2e-5, n: int = 8) -> dict:
    beta = [[0.0 if i == j else beta_of(i, j) for j in range(n)] for i in range(n)]
    alpha = [[0.0 if i == j else alpha_s for j in range(n)] for i in range(n)]
    return {"devices": list(range(n)), "beta_bytes_per_s": beta, "alpha_s": alpha}


def test_a_measured_cluster_that_groups_differently_changes_the_mesh(tiny8, tmp_path):
    """The YAML says NVLink pairs in two NUMA halves (2 x 2 x 2); the 'measured' file says the halves
    are 4-device cliques at 50 GB/s joined at 5 GB/s: a 2 x 4 mesh. Ignoring the file keeps 2 x 2 x 2."""
    model, hw, tr = tiny8
    data = _cluster(lambda i, j: 50e9 if i // 4 == j // 4 else 5e9)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    out = map_search(MapPolicy(cluster=str(path)), model, hw, tr, ScheduleSpec())
    assert tuple(out.stages[0].mesh) == (2, 4)
    assert [list(s.mesh) for s in out.plan.stages[0].sharding][0] == [2, 4]
    assert out.stages[0].mesh_source == f"cluster {path}"
    assert [a["beta_bytes_per_s"] for a in out.stages[0].axes] == [5e9, 50e9]
    # a measured per-axis all-reduce fit replaces the pair estimate of that axis
    data["axis_allreduce"] = [{"shape": [2, 4], "devices": list(range(8)), "axis": 1, "size": 4,
                               "busbw_bytes_per_s": 31e9, "alpha_s": 7e-6}]
    path.write_text(json.dumps(data))
    out = map_search(MapPolicy(cluster=str(path)), model, hw, tr, ScheduleSpec())
    assert out.stages[0].axes[1] == {"size": 4, "alpha_s": 7e-6, "beta_bytes_per_s": 31e9}
    assert out.stages[0].axes[0]["beta_bytes_per_s"] == 5e9


@pytest.mark.parametrize("field, damage", [
    ("beta_bytes_per_s", lambda d: d.pop("beta_bytes_per_s")),
    ("beta_bytes_per_s[1][2]", lambda d: d["beta_bytes_per_s"][1].__setitem__(2, -3.0)),
    ("alpha_s", lambda d: d.__setitem__("alpha_s", [[0.0] * 8] * 7)),
    ("devices", lambda d: d.__setitem__("devices", [0, 0, 1, 2, 3, 4, 5, 6])),
    ("axis_allreduce[0].busbw_bytes_per_s", lambda d: d.__setitem__("axis_allreduce", [
        {"shape": [8], "devices": list(range(8)), "axis": 0, "busbw_bytes_per_s": 0, "alpha_s": 0.0}])),
])
def test_a_malformed_cluster_file_is_refused_by_field_name(tiny8, tmp_path, field, damage):
    model, hw, tr = tiny8
    data = _cluster(lambda i, j: 20e9)
    check_cluster(data)                                  # the undamaged file is accepted
    damage(data)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanningError, match=re.escape(f"field '{field}'")):
        map_search(MapPolicy(cluster=str(path)), model, hw, tr, ScheduleSpec())
