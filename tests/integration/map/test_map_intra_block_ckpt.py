"""Checkpoint segments that cut inside a block (MAP §5.2.2-§5.2.4, Algorithm 2), executed:
executor.map_stage.MapStage.set_node_checkpoint runs rotor's tree over the linearised chain
(planners.map.linearise) by replaying each node group of a layer's exported graph, on a real
one-rank gloo DeviceMesh (DTensor), gpt_tiny in float64.

Against the same stage run without checkpoints: the loss and every gradient are equal bit for bit
(a recomputation replays the same ops on the same values in the same order), and the activation
bytes held when the forward ends, measured by executor.memtrack's dispatch-level tracker, fall.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from costs.rotor import Segment
from executor.map_stage import MapStage
from executor.memtrack import LiveTensorTracker
from executor.models import build_layers, make_batch
from planners.map.linearise import node_groups
from tests.integration.map.test_map_exec import CFG, TRAINING, make_plan, map_stage, model_spec, pick_megatron


#: ~30 s on one core (two stages built four times, float64)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A one-rank gloo world in this process (the stage's 1-device mesh)."""
    mine = not dist.is_initialized()
    if mine:
        store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    if mine:
        dist.destroy_process_group()


def _chain_stages(spec, layers: range) -> list[tuple[int, tuple[str, ...]]]:
    out = []
    for l in layers:
        graph = spec.op_graphs[spec.layers[l].op_graph]
        out += [(l, tuple(n.name for n in graph.nodes[a:b])) for a, b in node_groups(graph)]
    return out


def _run(world, segments=None, stages=None):
    """(loss, {param name: full gradient}, activation bytes live when the forward ends)."""
    plan = make_plan([map_stage(0, 6, [0], (1,), pick_megatron)])
    layers = build_layers(CFG, range(0, 6), "cpu", seed=0, dtype=torch.float64)
    stage = MapStage(plan, CFG, 0, layers, {0: 0}, {("tp", 0, 0): world}, "cpu", torch.float64)
    if segments is not None:
        stage.set_node_checkpoint(stages, segments)
    batch = make_batch(CFG, TRAINING.samples_per_microbatch, 0, dtype=torch.float64)
    tracker = LiveTensorTracker()
    with tracker:
        loss = stage.forward(None, batch)
        held = tracker.total_bytes
        loss.backward()
    grads = {f"{i}.{n}": p.grad.full_tensor() for i, _, mod in layers for n, p in mod.named_parameters()}
    return loss.detach(), grads, held


def test_checkpoints_cutting_inside_blocks_run_exactly(world):
    spec = model_spec(TRAINING)
    stages = _chain_stages(spec, range(0, 6))
    layer_of = [l for l, _ in stages]
    inside = [g for g in range(1, len(stages)) if layer_of[g] == layer_of[g - 1]]
    assert len(inside) >= 4                       # every block (and the head) cut by Algorithm 2
    n = len(stages)
    # segments starting and ending mid-block: block 1's MLP half .. block 3's attention half,
    # its recomputation split again at a mid-block cut (nested); the rest one checkpoint
    a, b = inside[0], inside[2]
    tree = (Segment(0, a, False),
            Segment(a, b, True, (Segment(a, inside[1], True), Segment(inside[1], b, False))),
            Segment(b, n, True))
    loss0, grads0, held0 = _run(world)
    loss1, grads1, held1 = _run(world, tree, stages)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for k in grads0:
        assert torch.equal(grads0[k], grads1[k]), k
    assert held1 < held0


def test_rotors_tree_over_the_linearised_chain_runs_exactly(world):
    """The planner's side end to end: the stage's chain over node groups (linear_chain, the
    plan's strategies), rotor's tree at the per-layer chain's smallest budget, which cuts inside a
    layer; executed, equal to the run without checkpoints and holding less."""
    from planners.map.linearise import linear_chain
    from planners.map.rotor import min_feasible_budget, solve
    from simulator.sharded_layer import stage_mesh
    from tests.conftest import LOCAL_CPU

    spec = model_spec(TRAINING)
    plan = make_plan([map_stage(0, 6, [0], (1,), pick_megatron)])
    shard = {sh.layer: sh for sh in plan.stages[0].sharding}
    mesh = stage_mesh(LOCAL_CPU, (0,), (1,))
    per_layer = linear_chain(spec, LOCAL_CPU, TRAINING, range(0, 6), mesh, shard, split=False).chain
    lin = linear_chain(spec, LOCAL_CPU, TRAINING, range(0, 6), mesh, shard)
    rot = solve(lin.chain, min_feasible_budget(per_layer))
    assert rot.feasible

    def starts(segs):
        return [x.start for x in segs if x.checkpointed] + [s for x in segs for s in starts(x.children)]
    assert any(lin.groups[s][1] > 0 for s in starts(rot.segments))      # a checkpoint opens mid-layer
    stages = []
    for l, a, b in lin.groups:
        graph = spec.op_graphs[spec.layers[l].op_graph]
        stages.append((l, tuple(n.name for n in graph.nodes[a:b])))
    loss0, grads0, held0 = _run(world)
    loss1, grads1, held1 = _run(world, rot.segments, stages)
    assert torch.equal(loss0, loss1)
    for k in grads0:
        assert torch.equal(grads0[k], grads1[k]), k
    assert held1 < held0
