"""MAP-sharded stages executed on DTensor (executor.map_exec, MAP §6) vs the single-process reference.

gpt_tiny on 4 (or 2) gloo ranks: every node of every layer gets a strategy from
costs.map_strategies (seeded random choices, a Megatron-like and a pure data-parallel
assignment), the plan runs through the executor (plan -> DeviceMesh -> exported graph on DTensors
-> rotor's checkpoint segments), and the loss, last-step gradients and updated weights must equal
train_reference's to the reduction-order tolerance of tests.conftest (float64, as
test_executor_numerics: the tolerance follows from the longest sum, not from float32 rounding).
Also checks that DTensor's sharding propagation gives every group the output layout the plan
says (``mismatches`` empty), since the simulator prices exactly those layouts.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from executor.launch import launch
from executor.op_graph import model_op_graphs
from executor.reference import train_reference
from costs.map_strategies import strategies
from costs.families import build_model
from specs.plan import CheckpointSegment, LayerSharding, NodeSharding, Plan, ScheduleSpec, StagePlan, validate_plan
from specs.sharding import Mesh, MeshAxis
from specs.training import TrainingSpec
from tests.conftest import GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol

#: every test here spawns gloo ranks (pyproject.toml: multi-process executor runs are slow)
pytestmark = pytest.mark.slow

CFG, HW = GPT_TINY, LOCAL_CPU
#: 4 samples per microbatch: the batch dim splits over a whole 2x2 mesh (pure data parallelism)
TRAINING = TrainingSpec(global_batch=8, microbatch_size=4, precision="fp32")
STEPS = 2
_GRAPHS: dict[int, tuple] = {}


def op_graphs(microbatch: int):
    """({key: merged op graph}, key per layer) at ``microbatch`` samples (traced once per module)."""
    if microbatch not in _GRAPHS:
        _GRAPHS[microbatch] = model_op_graphs(CFG, microbatch, "fp32")
    return _GRAPHS[microbatch]


def model_spec(training: TrainingSpec):
    """gpt_tiny's ModelSpec with its op graphs (what policy=map fills), for validate_plan."""
    graphs, keys = op_graphs(training.samples_per_microbatch)
    spec = build_model(CFG, training.act_dtype_bytes)
    layers = [layer.model_copy(update={"op_graph": key}) for layer, key in zip(spec.layers, keys)]
    return spec.model_copy(update={"layers": layers, "op_graphs": graphs,
                                   "op_graph_microbatch": training.samples_per_microbatch})


def _axes(spec) -> int:
    return len(spec.mesh_axes())


def pick_random(seed: int):
    rng = random.Random(seed)
    return lambda layer, node, found: rng.choice(found)


def pick_data_parallel(layer, node, found):
    """Batch dim split over every axis, parameters replicated (ZeRO-less DP as MAP strategies)."""
    def score(s):
        lead = s.input_specs[0] if s.input_specs else s.output_spec
        batch_axes = len(lead.dims[0]) if lead.dims else 0
        out_other = sum(len(axes) for axes in s.output_spec.dims[1:])
        return (batch_axes, -sum(_axes(p) for p in s.param_specs), -out_other)
    return max(found, key=score)


def pick_megatron(layer, node, found):
    """Parameters split over the last mesh axis where a strategy allows (Megatron's tensor
    parallelism), the batch over the others (data parallelism)."""
    def score(s):
        ndim = max([a for x in s.input_specs + s.param_specs + (s.output_spec,) for a in x.mesh_axes()], default=-1)
        lead = s.input_specs[0] if s.input_specs else s.output_spec
        batch = set(lead.dims[0]) if lead.dims else set()
        on_last = sum(1 for p in s.param_specs if p.mesh_axes() and max(p.mesh_axes()) == ndim)
        return (on_last, len(batch), -ndim)
    return max(found, key=score)


def shardings(layers: range, mesh_shape: tuple[int, ...], pick, training: TrainingSpec) -> list[LayerSharding]:
    graphs, keys = op_graphs(training.samples_per_microbatch)
    mesh = Mesh(tuple(MeshAxis(n, 1e-5, 1e9) for n in mesh_shape))
    out = []
    for layer in layers:
        nodes = []
        for node in graphs[keys[layer]].nodes:
            s = pick(layer, node, strategies(node, mesh, training.act_dtype_bytes))
            nodes.append(NodeSharding(node=node.name, inputs=[str(x) for x in s.input_specs],
                                      params={p.name: str(x) for p, x in zip(node.params, s.param_specs)},
                                      output=str(s.output_spec)))
        out.append(LayerSharding(layer=layer, mesh=list(mesh_shape), nodes=nodes))
    return out


def map_stage(start: int, stop: int, devices: list[int], mesh_shape, pick, training=TRAINING,
              checkpoint: list[CheckpointSegment] | None = None) -> StagePlan:
    return StagePlan(layer_start=start, layer_stop=stop, devices=devices, dp=1, tp=len(devices),
                     sharding=shardings(range(start, stop), tuple(mesh_shape), pick, training),
                     checkpoint=checkpoint or [])


def make_plan(stages: list[StagePlan], training=TRAINING, schedule: str = "1f1b") -> Plan:
    plan = Plan(planner="manual", model=CFG.name, hardware=HW.name, num_devices=HW.num_devices,
                training=training, schedule=ScheduleSpec(kind=schedule), stages=stages)
    return validate_plan(plan, model_spec(training), HW)


def run(plan: Plan, dtype: str = "float64", iterations: int = STEPS, memory_iteration=None, timeout_s: float = 120):
    opts = {"iterations": iterations, "collect": True, "memory_iteration": memory_iteration,
            "track_memory": memory_iteration is not None, "fault": None, "seed": 0, "device": "cpu", "threads": 1,
            "capacity_bytes": None, "dtype": dtype, "map_stats": True}
    return launch(plan, CFG, opts, timeout_s)


# ---- checks ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference() -> dict:
    import torch

    return train_reference(CFG, TRAINING, STEPS, dtype=torch.float64)


def assert_matches(out, ref: dict) -> dict:
    """Loss, last-step gradients and updated weights vs the reference (test_executor_numerics'
    rule: float64, relative tolerance from the longest reduction, absolute floor tol x largest
    value); returns stage -> {"mismatches", "reductions"} of the MAP stages (rank reports)."""
    assert out.failure is None, out.failure
    tol = reorder_rtol(longest_reduction(CFG, TRAINING))
    np.testing.assert_allclose(out.losses, ref["losses"], rtol=tol)
    got_p = {k: v for rep in out.reports.values() for k, v in rep["params"].items()}
    got_g = {k: v for rep in out.reports.values() for k, v in rep["grads"].items()}
    assert sorted(got_p) == sorted(ref["params"])
    for got, want in ((got_g, ref["grads"]), (got_p, ref["params"])):
        scale = max(float(np.abs(v).max()) for v in want.values())
        for key, w in want.items():
            np.testing.assert_allclose(got[key], w, rtol=tol, atol=tol * scale, err_msg=key)
    stats: dict = {}
    for rep in out.reports.values():
        for stage, s in rep.get("map", {}).items():
            stats.setdefault(stage, s)
            assert s == stats[stage], "every rank of a stage sees the same propagation"
    return stats


ALL = [0, 1, 2, 3]


def test_data_parallel_on_2x2_mesh(reference):
    """The batch split over both axes, weights replicated: DTensor keeps every planned layout; the
    only pending sum is the loss's mean over the batch (its planned all-reduce)."""
    plan = make_plan([map_stage(0, 6, ALL, (2, 2), pick_data_parallel)])
    stats = assert_matches(run(plan), reference)
    assert stats[0]["mismatches"] == {}
    assert set(stats[0]["reductions"]) == {"5.cross_entropy_loss"}


def test_megatron_like_on_2x2_mesh_with_nested_checkpoints(reference):
    """Weights split over axis 1, batch over axis 0, and rotor-style segments: the embedding
    plain, blocks 1-4 checkpointed with their recomputation split in two (one nested
    checkpoint, one plain), the head checkpointed alone."""
    seg = [CheckpointSegment(start=0, stop=1, checkpointed=False),
           CheckpointSegment(start=1, stop=5, children=[CheckpointSegment(start=1, stop=3),
                                                        CheckpointSegment(start=3, stop=5, checkpointed=False)]),
           CheckpointSegment(start=5, stop=6)]
    plan = make_plan([map_stage(0, 6, ALL, (2, 2), pick_megatron, checkpoint=seg)])
    stats = assert_matches(run(plan), reference)
    assert stats[0]["mismatches"] == {}


def planned_reductions(layers: range, mesh_shape, seed: int) -> dict[str, tuple[int, ...]]:
    """{"layer.node": mesh axes} of the all-reduces pick_random(seed)'s strategies include (the
    "(AR..)" suffix: a split contraction / reduced dim): where the executor must settle a sum."""
    chosen: dict[str, tuple[int, ...]] = {}
    pick = pick_random(seed)

    def record(layer, node, found):
        s = pick(layer, node, found)
        if "(AR" in s.name:
            chosen[f"{layer}.{node.name}"] = tuple(int(c) for c in s.name.split("(AR", 1)[1].rstrip(")"))
        return s
    shardings(layers, tuple(mesh_shape), record, TRAINING)
    return chosen


def test_random_strategies_on_a_line_of_4(reference):
    """Seeded random strategies per node on mesh [4]: many redistributions between groups; every
    group's output has its planned layout, and the partial sums are settled exactly where the
    strategies price an all-reduce (a linear's split contraction right after the linear, before
    its folded bias / residual add / GELU; the loss's mean)."""
    plan = make_plan([map_stage(0, 6, ALL, (4,), pick_random(0))])
    stats = assert_matches(run(plan), reference)
    assert stats[0]["mismatches"] == {}
    assert {k: tuple(v) for k, v in stats[0]["reductions"].items()} == planned_reductions(range(0, 6), (4,), 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_strategies_on_2x2_mesh(reference, seed):
    """Seeded random strategies on a 2x2 mesh: dims split over both axes (S01), the sequence dim of
    a linear's input among them (seed 0: DTensor's own linear flattens (b, s) and cannot unflatten
    that; map_exec runs linears on the local shards) and the embedding's vocabulary (seed 1:
    DTensor's _MaskPartial cannot; map_exec looks up locally). All equal the reference, no group
    leaves DTensor in another layout than planned, and the sums are settled where planned."""
    plan = make_plan([map_stage(0, 6, ALL, (2, 2), pick_random(seed))])
    stats = assert_matches(run(plan), reference)
    assert stats[0]["mismatches"] == {}
    assert {k: tuple(v) for k, v in stats[0]["reductions"].items()} == planned_reductions(range(0, 6), (2, 2), seed)


def test_two_stage_pipeline_with_a_map_stage(reference):
    """Stage 0 (embedding + 2 blocks) MAP-sharded on 2 ranks, stage 1 plain data-parallel on the
    other 2: boundary tensors leave the MAP stage whole, and the tied embedding (a DTensor on
    stage 0, a plain copy on stage 1) gets the summed gradient in its own layout."""
    rest = StagePlan(layer_start=3, layer_stop=6, devices=[2, 3], dp=2)
    plan = make_plan([map_stage(0, 3, [0, 1], (2,), pick_random(3)), rest])
    stats = assert_matches(run(plan), reference)
    assert stats[0]["mismatches"] == {}
