"""Any model under MAP (issue 26): a user's own ``nn.Module`` (family torch_module), traced,
given per-operator strategies on a 4-rank mesh and EXECUTED on DTensor by executor.map_exec,
against the single-process reference in float64 (tests.conftest's reorder tolerance).

* tests/byom_models.py's ``whole``: a tied embedding/head, rotary and bool causal-mask buffers,
  pieces cut by torch's splitter that pass tuples (export names their leaves x_0, x_1, ...);
* docs/examples/resnet18.py (narrow, small images): convolutions split by channels (a partial sum)
  and BatchNorm, which DTensor has no rule for: it runs replicated, its running statistics
  written back into the module's buffers.

Strategies: Megatron-like (parameters split over the mesh where a strategy allows), so operators
ARE sharded — asserted from the plan, not assumed."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from costs.families import build_model, parse_model_config
from costs.map_strategies import strategies
from executor import user_model
from executor.launch import launch
from executor.op_graph import model_op_graphs
from executor.reference import longest_reduction, train_reference
from specs.model import LayerKind, LayerSpec, ModelSpec
from specs.plan import LayerSharding, NodeSharding, Plan, ScheduleSpec, StagePlan, validate_plan
from specs.sharding import Mesh, MeshAxis
from specs.training import TrainingSpec
from tests.conftest import LOCAL_CPU, conf, reorder_rtol

pytestmark = pytest.mark.slow  # spawns gloo ranks

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"
#: 4 samples per microbatch, 2 microbatches: the batch can split over the whole mesh
TRAINING = TrainingSpec(global_batch=8, microbatch_size=4, precision="fp32")
STEPS = 2
TINY_LM = {"family": "torch_module", "name": "tiny_rope_map", "factory": "tests.byom_models:whole",
           "kwargs": {"vocab": 64, "d": 16, "s": 8, "n": 2},
           "split_points": ["blocks.0", "blocks.1", "head"]}
RESNET = {"family": "torch_module", "name": "resnet18_map", "factory": "resnet18:build",
          "kwargs": {"width": 4, "classes": 10, "image": 8}, "split_points": ["layer.2", "layer.4", "layer.6"]}


def pick_sharded(layer, node, found):
    """The strategy splitting the most parameter dims over the mesh (Megatron-like), then the
    most activation dims: operators end up sharded wherever MAP's strategy table allows."""
    def score(s):
        return (sum(len(p.mesh_axes()) for p in s.param_specs), len(s.output_spec.mesh_axes()))
    return max(found, key=score)


def map_plan(cfg, mesh_shape=(4,)) -> tuple[Plan, int]:
    """One MAP stage over all layers on 4 ranks; (plan, number of sharded nodes)."""
    mb = TRAINING.samples_per_microbatch
    graphs, keys = model_op_graphs(cfg, mb, "fp32")
    if cfg.family == "torch_module":
        names = [name for name, _ in user_model.layers(cfg)]
        spec = ModelSpec(name=cfg.name, family="torch_module", act_dtype_bytes=4, layers=[
            LayerSpec(name=n, kind=LayerKind.generic, params=1, fwd_flops_per_sample=1.0,
                      saved_bytes_per_sample=1, output_bytes_per_sample=1, max_tp=1) for n in names])
    else:
        spec = build_model(cfg, TRAINING.act_dtype_bytes)
    spec = spec.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": mb, "layers": [
        layer.model_copy(update={"op_graph": k}) for layer, k in zip(spec.layers, keys)]})
    mesh = Mesh(tuple(MeshAxis(n, 1e-5, 1e9) for n in mesh_shape))
    layers, sharded = [], 0
    for i, key in enumerate(keys):
        nodes = []
        for node in graphs[key].nodes:
            s = pick_sharded(i, node, strategies(node, mesh, TRAINING.act_dtype_bytes))
            ns = NodeSharding(node=node.name, inputs=[str(x) for x in s.input_specs],
                              params={p.name: str(x) for p, x in zip(node.params, s.param_specs)},
                              output=str(s.output_spec))
            sharded += any("S" in t for t in [ns.output, *ns.inputs, *ns.params.values()])
            nodes.append(ns)
        layers.append(LayerSharding(layer=i, mesh=list(mesh_shape), nodes=nodes))
    plan = Plan(planner="manual", model=cfg.name, hardware=LOCAL_CPU.name, num_devices=LOCAL_CPU.num_devices,
                training=TRAINING, schedule=ScheduleSpec(kind="1f1b"),
                stages=[StagePlan(layer_start=0, layer_stop=len(keys), devices=[0, 1, 2, 3], dp=1, tp=4,
                                  sharding=layers)])
    return validate_plan(plan, spec, LOCAL_CPU), sharded


def run(plan: Plan, cfg):
    opts = {"iterations": STEPS, "collect": True, "memory_iteration": None, "track_memory": False, "fault": None,
            "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None, "dtype": "float64", "map_stats": True}
    return launch(plan, cfg, opts, 240)


def assert_matches(out, ref: dict, tol: float) -> dict:
    assert out.failure is None, out.failure
    np.testing.assert_allclose(out.losses, ref["losses"], rtol=tol)
    got_p = {k: v for rep in out.reports.values() for k, v in rep["params"].items()}
    got_g = {k: v for rep in out.reports.values() for k, v in rep["grads"].items()}
    assert sorted(got_p) == sorted(ref["params"])
    for got, want in ((got_g, ref["grads"]), (got_p, ref["params"])):
        scale = max(float(np.abs(v).max()) for v in want.values())
        for key, w in want.items():
            np.testing.assert_allclose(got[key], w, rtol=tol, atol=tol * scale, err_msg=key)
    return next(iter(out.reports.values())).get("map", {})


def test_user_lm_with_ties_and_buffers_runs_sharded_and_matches_reference():
    cfg = parse_model_config(TINY_LM)
    plan, sharded = map_plan(cfg)
    assert sharded > 0
    ref = train_reference(cfg, TRAINING, STEPS, dtype=torch.float64)
    # longest sum: the vocabulary softmax / d, or a weight gradient over every token of the batch
    assert_matches(run(plan, cfg), ref, reorder_rtol(max(64, TRAINING.global_batch * 8)))


def test_plain_torch_resnet_with_batchnorm_runs_sharded_and_matches_reference():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # spawned ranks inherit sys.path
    cfg = parse_model_config(RESNET)
    plan, sharded = map_plan(cfg)
    assert sharded > 0
    ref = train_reference(cfg, TRAINING, STEPS, dtype=torch.float64)
    # longest sum: BatchNorm statistics / weight gradients over every pixel of the batch
    stats = assert_matches(run(plan, cfg), ref, reorder_rtol(TRAINING.global_batch * 8 * 8 * 9 * 32))
    assert stats, "the MAP stage reported its propagation stats"


@pytest.mark.parametrize("name", ["wresnet_tiny", "moe_tiny"])
def test_memwalls_wide_resnet_and_moe_run_sharded_and_match_reference(name):
    """memwall's own Wide-ResNet (BatchNorm: replicated) and MoE (expert einsums) under MAP."""
    cfg = parse_model_config(conf("model", name))
    plan, sharded = map_plan(cfg)
    assert sharded > 0
    ref = train_reference(cfg, TRAINING, STEPS, dtype=torch.float64)
    assert_matches(run(plan, cfg), ref, reorder_rtol(longest_reduction(cfg, TRAINING)))
