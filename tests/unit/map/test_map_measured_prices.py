"""Issue 26: a MAP plan planned on a measured cluster (policy.cluster, MAP §4.2) is simulated on the
measured per-axis prices it carries (StagePlan.mesh_axes -> simulator.sharded.plan_mesh), not on
the hardware YAML's links; §5.3's ILP budgets form a grid around B (planners.map.rotor.budget_grid);
the detected N-D mesh is weighed against its 2-D fold; MAP's summary prints sizes in their unit.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from costs.families import build_model, parse_model_config
from executor.op_graph import model_op_graphs
from planners.map.cluster import hardware_matrices
from planners.map.plan import fold_mesh, map_search, mesh_prices, summary_lines
from planners.map.rotor import BELOW_STEPS, budget_grid
from planners.policy import MapPolicy
from simulator import simulate
from simulator.sharded import plan_mesh, sharded_stage
from simulator.sharded_layer import stage_mesh
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.plan_stage import MeshAxisPrice, StagePlan
from specs.sharding import mesh_lines
from specs.training import TrainingSpec

CONF = Path(__file__).resolve().parents[3] / "conf"
GIB = 1 << 30


def _hw(name: str) -> HardwareSpec:
    return HardwareSpec.model_validate(yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text()))


@pytest.fixture(scope="module")
def tiny8():
    """gpt_tiny (fp32, microbatch 8) on MAP's testbed, map_8xa100 (detected 2 x 2 x 2)."""
    cfg = parse_model_config(yaml.safe_load((CONF / "model" / "gpt_tiny.yaml").read_text()))
    model = build_model(cfg, 4)
    graphs, keys = model_op_graphs(cfg, 8, "fp32")
    model = model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": 8,
                                     "layers": [l.model_copy(update={"op_graph": k}) for l, k in zip(model.layers, keys)]})
    return model, _hw("map_8xa100"), TrainingSpec(global_batch=16, microbatch_size=8, precision="fp32")


#: the 4 x 2 fold of map_8xa100's mesh (a tight budget on the 2 x 2 x 2 one makes the block DP's
#: Pareto tables of gpt_tiny too large for a unit test); the budget is 0.5 x the unconstrained
#: plan's simulated peak, so that the plan shards (an unconstrained gpt_tiny replicates everything; at
#: 0.6 a replicated plan checkpointed inside its blocks, MAP Algorithm 2, fits)
MESH = [4, 2]


@pytest.fixture(scope="module")
def tight_gib(tiny8) -> float:
    model, hw, tr = tiny8
    free = map_search(MapPolicy(mesh=MESH), model, hw, tr, ScheduleSpec())
    return max(free.peak_bytes) * 0.5 / GIB


@pytest.fixture(scope="module")
def yaml_plan(tiny8, tight_gib):
    model, hw, tr = tiny8
    out = map_search(MapPolicy(mesh=MESH, memory_budget_gib=tight_gib), model, hw, tr, ScheduleSpec())
    assert out.fits
    return out


def _with_axes(plan, axes):
    st = plan.stages[0].model_copy(update={"mesh_axes": axes})
    return plan.model_copy(update={"stages": [StagePlan.model_validate(st.model_dump())]})


def _communicates(plan, model, hw) -> float:
    """Seconds of the stage's collectives and conversions per microbatch (0: nothing to price)."""
    sh = sharded_stage(plan, model, hw, plan.stages[0])
    return sum(c.u_fcomm + c.u_bcomm for c in sh.costs) + sh.grad_sync_s


# ---- the simulator prices what the plan carries -------------------------------------------------------

def test_carried_prices_4x_slower_give_a_slower_simulated_iteration(tiny8, yaml_plan):
    """The same plan (strategies, checkpoints) with the YAML's per-axis prices carried explicitly
    simulates bit for bit as without them; with every bandwidth divided by 4 and every latency times
    4 it is slower (a simulator that ignored mesh_axes would give the same time)."""
    model, hw, _ = tiny8
    yaml_mesh = stage_mesh(hw, tuple(yaml_plan.plan.stages[0].devices), tuple(MESH))
    assert yaml_plan.plan.stages[0].mesh_axes == mesh_prices(yaml_mesh)  # planned on the YAML: its prices carried
    plan = _with_axes(yaml_plan.plan, None)                     # and without them: the simulator reads the YAML
    assert _communicates(plan, model, hw) > 0                   # the plan's collectives are what is priced
    base = simulate(plan, model, hw).result.iteration_time_s
    same = _with_axes(plan, mesh_prices(yaml_mesh))
    assert simulate(same, model, hw).result.iteration_time_s == base
    slow = _with_axes(plan, [MeshAxisPrice(size=a.size, alpha_s=a.alpha_s * 4, beta_bytes_per_s=a.beta_bytes_per_s / 4)
                             for a in mesh_prices(yaml_mesh)])
    assert plan_mesh(hw, slow.stages[0]).axes[0].beta_bytes_per_s == yaml_mesh.axes[0].beta_bytes_per_s / 4
    assert simulate(slow, model, hw).result.iteration_time_s > base


def test_a_plan_from_a_4x_slower_cluster_carries_and_is_simulated_on_its_prices(tiny8, tight_gib, tmp_path):
    """cluster.json = the YAML's links with every pair 4 x slower (same grouping). The plan
    carries the file's per-axis prices (as map.json reports them), map_search's iteration is the
    simulator's on that plan, and the same plan priced on the YAML instead is faster."""
    model, hw, tr = tiny8
    beta, alpha = hardware_matrices(hw, list(range(8)))
    data = {"devices": list(range(8)), "beta_bytes_per_s": [[b / 4 for b in row] for row in beta],
            "alpha_s": [[a * 4 for a in row] for row in alpha]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    out = map_search(MapPolicy(cluster=str(path), mesh=MESH, memory_budget_gib=tight_gib), model, hw, tr, ScheduleSpec())
    st = out.plan.stages[0]
    assert [a.model_dump() for a in st.mesh_axes] == [
        {"size": a["size"], "alpha_s": a["alpha_s"], "beta_bytes_per_s": a["beta_bytes_per_s"]} for a in out.stages[0].axes]
    # per axis the file's slowest pair along it (planners.map.cluster_file): 4 x below the YAML's
    slowest = [min(beta[i][j] for line in mesh_lines(list(range(8)), tuple(MESH), k) for i in line for j in line if i != j)
               for k in range(len(MESH))]
    assert [a.beta_bytes_per_s for a in st.mesh_axes] == [b / 4 for b in slowest]
    # a JSON round trip keeps them (plain JSON: no infinities)
    again = type(out.plan).model_validate_json(out.plan.model_dump_json())
    assert again.stages[0].mesh_axes == st.mesh_axes
    measured = simulate(out.plan, model, hw).result.iteration_time_s
    assert out.iteration_s == measured
    assert _communicates(out.plan, model, hw) > 0
    on_yaml = simulate(_with_axes(out.plan, None), model, hw).result.iteration_time_s
    assert measured > on_yaml


@pytest.mark.parametrize("axes, field", [
    ([MeshAxisPrice(size=4, alpha_s=1e-5, beta_bytes_per_s=1e10)], "mesh_axes"),            # 1 price, 2 axes
    ([MeshAxisPrice(size=2, alpha_s=1e-5, beta_bytes_per_s=1e10),
      MeshAxisPrice(size=4, alpha_s=1e-5, beta_bytes_per_s=1e10)], "mesh_axes"),           # sizes not the mesh's
])
def test_mesh_axes_must_match_the_stage_mesh(yaml_plan, axes, field):
    st = yaml_plan.plan.stages[0]
    with pytest.raises(ValidationError, match=field):
        StagePlan.model_validate({**st.model_dump(), "mesh_axes": [a.model_dump() for a in axes]})


@pytest.mark.parametrize("raw", [
    {"size": 2, "alpha_s": 1e-5, "beta_bytes_per_s": None},            # a real axis needs its bandwidth
    {"size": 2, "alpha_s": -1.0, "beta_bytes_per_s": 1e10},
    {"size": 2, "alpha_s": 1e-5, "beta_bytes_per_s": 0.0},
    {"size": 2, "alpha_s": 1e-5, "beta_bytes_per_s": math.inf},
])
def test_a_bad_axis_price_is_refused(raw):
    with pytest.raises(ValidationError):
        MeshAxisPrice.model_validate(raw)
    MeshAxisPrice(size=1, alpha_s=0.0, beta_bytes_per_s=None)      # a size-1 axis has no collective


def test_a_stage_without_sharding_carries_no_mesh_prices():
    with pytest.raises(ValidationError, match="logical mesh"):
        StagePlan(layer_start=0, layer_stop=1, devices=[0, 1], dp=2, tp=1,
                  mesh_axes=[MeshAxisPrice(size=2, alpha_s=0.0, beta_bytes_per_s=1e9)])


# ---- §5.3's budgets as a grid around B; the 2-D fold ---------------------------------------------------

def test_the_budget_grid_reaches_below_the_budget():
    B = 40 * GIB
    grid = budget_grid(B, 0.25, 3, 5)
    assert [k for k, _ in grid] == [0, 1, 2, -1, -2, -3, -4, -5]
    assert [b for _, b in grid[:3]] == [int(B * 1.25 ** k) for k in range(3)]   # §5.3 as printed
    below = [b for k, b in grid if k < 0]
    assert all(x > y for x, y in zip([B] + below, below))                        # strictly under B, falling
    assert below[BELOW_STEPS - 1] == int(B / 1.25)                               # one (1 + alpha) step


def test_the_fold_joins_the_slower_axes_and_keeps_the_fastest():
    hw = _hw("map_8xa100")
    order = tuple(range(8))
    shape, devs, mesh, source = fold_mesh((2, 2, 2), order, hw, None)
    assert (shape, devs, source) == ((4, 2), order, "hardware")
    assert mesh == stage_mesh(hw, order, (4, 2))
    assert fold_mesh((4, 2), order, hw, None) is None and fold_mesh((2, 1, 4), order, hw, None) is None


def test_the_detected_mesh_and_its_fold_are_both_solved_and_the_faster_kept(tiny8):
    model, hw, tr = tiny8
    out = map_search(MapPolicy(), model, hw, tr, ScheduleSpec())
    det, fold = out.meshes
    assert (det["mesh"], fold["mesh"]) == ([[2, 2, 2]], [[4, 2]])
    kept = det if det.get("kept") else fold
    assert sum("kept" in m for m in out.meshes) == 1
    assert kept["iteration_s"] == out.iteration_s == min(det["iteration_s"], fold["iteration_s"])
    assert list(out.stages[0].mesh) == kept["mesh"][0]
    assert any(line.startswith("mesh: detected 2x2x2") for line in summary_lines(out))
    # a fixed policy.mesh is planned as given: no fold
    assert map_search(MapPolicy(mesh=[2, 2, 2], budgets=2), model, hw, tr, ScheduleSpec()).meshes == []


# ---- units -----------------------------------------------------------------------------------------

def test_summary_prints_budget_and_peak_in_the_unit_their_size_needs(tiny8):
    """gpt_tiny under a 300 MiB budget: the summary says MiB (not '0.29 GiB')."""
    model, hw, tr = tiny8
    out = map_search(MapPolicy(mesh=[8], memory_budget_gib=300 / 1024, budgets=2), model, hw, tr, ScheduleSpec())
    line = next(l for l in summary_lines(out) if l.startswith("map: budget"))
    assert line.startswith("map: budget 300.00 MiB per device; simulated peak ")
    assert max(out.peak_bytes) < GIB and " MiB; iteration" in line, line
