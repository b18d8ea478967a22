"""A MAP-sharded stage (``StagePlan.sharding``) as one rank runs it: the stage's DeviceMesh, its
layers as executor.map_exec.ShardedLayer, run through rotor's checkpoint segments (MAP §5.2, §6:
the generator packages each checkpoint block's nodes into a function under
``torch.utils.checkpoint``; here a block is a run of layers, nested as rotor's tree says, or
(:meth:`MapStage.set_node_checkpoint`) a run of node groups, Algorithm 2's, that may start and end
inside a layer: the exported graph's nodes of each group are replayed as ShardedLayer.forward
replays a whole layer)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from executor.map_exec import ShardedLayer
from executor.map_layout import _replicate
from executor.map_trace import MapPlanError, _export
from executor.models import output_shapes
from specs.plan import CheckpointSegment, StagePlan
from specs.sharding import Mesh, MeshAxis


def stage_mesh_shape(st: StagePlan) -> tuple[int, ...]:
    """The one mesh shape all layers of a MAP stage share (one DeviceMesh per stage)."""
    shapes = {tuple(s.mesh) for s in st.sharding}
    if len(shapes) != 1:
        raise MapPlanError(f"a MAP stage's layers must share one mesh shape (one DeviceMesh per stage); "
                           f"layers {st.layer_start}..{st.layer_stop - 1} use {sorted(shapes)}")
    shape = shapes.pop()
    if math.prod(shape) != len(st.devices):
        raise MapPlanError(f"mesh {list(shape)} has {math.prod(shape)} devices, the stage {len(st.devices)}")
    return shape


def build_mesh(st: StagePlan, index: int, rank_of: dict[int, int], groups: dict, device_type: str):
    """The stage's DeviceMesh from the groups topology.process_groups made: a 1-D mesh is the
    stage's "tp" group (tp = all its devices); an N-D one takes the ("map", stage, axis) group
    along each axis that holds this rank (``DeviceMesh.from_group`` creates no new group, so
    nothing collective happens here and other stages' ranks need not take part)."""
    from torch.distributed.device_mesh import DeviceMesh

    shape = stage_mesh_shape(st)
    ranks = torch.tensor([rank_of[d] for d in st.devices], dtype=torch.int).reshape(shape)
    if len(shape) == 1:
        return DeviceMesh.from_group(groups[("tp", index, 0)], device_type)
    dim_groups = [groups[("map", index, axis)] for axis in range(len(shape))]
    return DeviceMesh.from_group(dim_groups, device_type, mesh=ranks,
                                 mesh_dim_names=tuple(f"map{axis}" for axis in range(len(shape))))


class MapStage:
    """A stage's layers as ShardedLayers on one mesh, run through rotor's checkpoint segments."""

    def __init__(self, plan, cfg, index: int, layers: list, rank_of: dict, groups: dict, device_type: str,
                 dtype: torch.dtype):
        st = plan.stages[index]
        self.stage, self.mesh = st, build_mesh(st, index, rank_of, groups, device_type)
        self.stats: dict[str, dict] = {"mismatches": {}, "reductions": {}}
        self.node_plan: _NodePlan | None = None      # set_node_checkpoint: segments cutting inside layers
        shared: dict[int, nn.Parameter] = {}
        # identical layers (a GPT's blocks: type, input shape, parameter shapes) share one trace,
        # as executor.op_graph.model_op_graphs shares their op graph
        traces: dict[tuple, object] = {}
        shapes = output_shapes(cfg)
        self.layers: dict[int, ShardedLayer] = {}
        # conversions take the path the planner priced: on the per-axis prices the plan carries
        # (StagePlan.mesh_axes, a measured cluster); without them every axis alike
        # (executor.map_layout.uniform_price_mesh)
        price_mesh = None if st.mesh_axes is None else Mesh(tuple(
            MeshAxis(a.size, a.alpha_s, math.inf if a.beta_bytes_per_s is None else a.beta_bytes_per_s)
            for a in st.mesh_axes))
        mb = plan.training.samples_per_microbatch
        for i, _, mod in layers:
            key = (type(mod).__name__, shapes[i - 1] if i else None,
                   tuple((n, tuple(p.shape)) for n, p in mod.named_parameters()),
                   tuple(getattr(m, "code", "") for m in mod.modules() if isinstance(m, torch.fx.GraphModule)))
            if key not in traces:
                traces[key] = _export(cfg, i, mb, dtype)
            self.layers[i] = ShardedLayer(i, mod, st.sharding_of(i), self.mesh, traces[key], shared, self.stats,
                                          price_mesh=price_mesh)
        if st.node_groups is not None:   # the plan's checkpoint tree is over node groups (MAP Algorithm 2)
            self.set_node_checkpoint([(g.layer, tuple(g.nodes)) for g in st.node_groups], st.checkpoint or [
                CheckpointSegment(start=0, stop=len(st.node_groups), checkpointed=False)])
        # a user model's tied weights (user_model.TiedGrads): tied layers all in this stage share
        # one (DTensor) Parameter on the stage's mesh, whose gradient is already the sum: nothing
        # to sync (every rank of the tie's group is in this stage). Ties across MAP stages are
        # refused before running (executor.measure._map_unsupported)
        ties = groups.get("tied_grads")
        if ties is not None:
            for g, group in enumerate(ties.tied):
                if g in ties.copies and all(i in st.layers for i, _ in group):
                    del ties.copies[g]

    @property
    def mismatches(self) -> dict:
        return self.stats["mismatches"]

    def forward(self, x, batch: dict):
        """The stage's output for input ``x`` (None on the first stage) as a plain tensor."""
        segments = self.stage.checkpoint or [CheckpointSegment(start=self.stage.layer_start, stop=self.stage.layer_stop,
                                                               checkpointed=False)]
        from torch.utils._pytree import tree_map

        if self.node_plan is not None:
            y = self._chain(self.node_plan.segments, (None, x), batch)[1]
        else:
            y = self._run(segments, x, batch)
        rep = [_replicate()] * self.mesh.ndim  # a user layer's output may be any pytree
        return tree_map(lambda t: t.redistribute(self.mesh, rep).to_local() if hasattr(t, "placements") else t, y)

    def _run(self, segments: list[CheckpointSegment], y, batch: dict):
        for seg in segments:
            if seg.checkpointed:
                # only the segment's input is saved; the children split its recomputation (rotor)
                y = checkpoint(self._segment, seg, y, batch, use_reentrant=False)
            else:
                y = self._layers(seg.start, seg.stop, y, batch)
        return y

    def _segment(self, seg: CheckpointSegment, y, batch: dict):
        if seg.children:
            return self._run(seg.children, y, batch)
        return self._layers(seg.start, seg.stop, y, batch)

    def _layers(self, start: int, stop: int, y, batch: dict):
        for i in range(start, stop):
            y = self.layers[i](y, batch)
        return y

    # ---- checkpoint segments that cut inside a layer (MAP §5.2.2-§5.2.4, Algorithm 2) ------------

    def set_node_checkpoint(self, stages: list[tuple[int, tuple[str, ...]]], segments) -> None:
        """Run the stage as rotor's chain over node groups (planners.map.linearise): ``stages``
        per chain stage (layer, the planned op-graph node names of that group, in graph order),
        tiling each layer of the stage; ``segments`` (costs.rotor.Segment) over chain-stage
        indices (or the plan's CheckpointSegments over StagePlan.node_groups, set from the plan
        when it carries node_groups)."""
        self.node_plan = _NodePlan(self.layers, stages, tuple(segments))

    def _chain(self, segments, state: tuple, batch: dict) -> tuple:
        for seg in segments:
            if seg.checkpointed:
                # only the segment's input state is saved: at a cut inside a layer, the one
                # differentiable tensor Algorithm 2 lets cross it (and non-differentiable values)
                state = checkpoint(self._chain_segment, seg, batch, *state, use_reentrant=False)
            else:
                state = self._chain_stages(seg.start, seg.stop, state, batch)
        return state

    def _chain_segment(self, seg, batch: dict, *state):
        if seg.children:
            return self._chain(seg.children, state, batch)
        return self._chain_stages(seg.start, seg.stop, state, batch)

    def _chain_stages(self, start: int, stop: int, state: tuple, batch: dict) -> tuple:
        """State between chain stages: (None, y) at a layer boundary (the layer output), else
        (names, *values): the FX values of the current layer still read later."""
        plan = self.node_plan
        for g in range(start, stop):
            layer = self.layers[plan.layer[g]]
            names, vals = state[0], state[1:]
            env = layer.bind({}, vals[0], batch) if plan.first[g] else layer.bind(dict(zip(names, vals)))
            _run_nodes(layer, env, plan.nodes[g], plan.drop[g])
            if plan.last[g]:
                out = next(n for n in layer.gm.graph.nodes if n.op == "output")
                outs = [env[a.name] if isinstance(a, torch.fx.Node) else a for a in tree_flatten(out.args)[0]]
                state = (None, layer._outputs(outs))
            else:
                state = (plan.live[g], *(env[n] for n in plan.live[g]))
        return state


def _run_nodes(layer: ShardedLayer, env: dict, nodes: list, drop: dict) -> None:
    """executor.map_exec.ShardedLayer.forward's loop over ``nodes`` (a node group range of the
    layer's exported graph); ``drop``: node -> values its run frees (last reader in this order,
    not read after the range)."""
    counters: dict[str | None, list[int]] = {}
    for n in nodes:
        layer._step(n, env, counters)  # ShardedLayer.forward's body for one node
        for a in drop.get(n.name, ()):
            env.pop(a, None)


class _NodePlan:
    """MapStage.set_node_checkpoint's chain: per chain stage g its layer, its exported-graph
    nodes (in graph order), whether it opens / closes its layer, the values live after it, and
    the values each node frees. A node outside every group (an ``arange``) runs with the first
    group that reads it; a group whose nodes read a later group's value is refused."""

    def __init__(self, layers: dict, stages: list[tuple[int, tuple[str, ...]]], segments: tuple) -> None:
        self.segments = segments
        self.layer = [l for l, _ in stages]
        self.first = [g == 0 or stages[g - 1][0] != l for g, (l, _) in enumerate(stages)]
        self.last = [g == len(stages) - 1 or stages[g + 1][0] != l for g, (l, _) in enumerate(stages)]
        self.nodes, self.live, self.drop = [], [], []
        for l in dict.fromkeys(self.layer):
            mine = [g for g, (k, _) in enumerate(stages) if k == l]
            layer = layers[l]
            stage_of = {head: i for i, g in enumerate(mine) for head in stages[g][1]}
            fx = [n for n in layer.gm.graph.nodes if n.op not in ("placeholder", "output")]
            if set(stage_of) != set(layer.last_op):
                raise MapPlanError(f"layer {l}: the node groups name {sorted(stage_of)}, the plan's groups are "
                                   f"{sorted(layer.last_op)}")
            owner: dict[str, int] = {}
            for n in reversed(fx):       # an ungrouped node: with its first reader (the last group: none)
                head = layer.group_of.get(n.name)
                owner[n.name] = stage_of[head] if head is not None else min(
                    (owner[u.name] for u in n.users if u.name in owner), default=len(mine) - 1)
            for n in fx:
                if any(owner.get(a.name, -1) > owner[n.name] for a in n.all_input_nodes):
                    raise MapPlanError(f"layer {l}: node {n.name} reads a value of a later node group; "
                                       "these groups do not cut the layer's exported graph")
            out_node = next(n for n in layer.gm.graph.nodes if n.op == "output")
            order = sorted(fx, key=lambda n: owner[n.name])           # stable: graph order within a group
            keep = {a.name for a in out_node.all_input_nodes}
            for i in range(len(mine)):
                run = [n for n in order if owner[n.name] == i]
                later = {a.name for n in order if owner[n.name] > i for a in n.all_input_nodes}
                if i < len(mine) - 1:    # what the layer's output reads crosses every cut too (a user
                    later |= keep        # piece passing an input on, hf_gpt2's x_1: KeyError without)
                live = tuple(sorted(v for v in later if owner.get(v, -1) <= i and v in _values(layer, fx)))
                last_read: dict[str, str] = {}
                for n in run:
                    for a in n.all_input_nodes:
                        last_read[a.name] = n.name
                drop: dict[str, list[str]] = {}
                for a, n in last_read.items():
                    if a not in later and a not in keep:
                        drop.setdefault(n, []).append(a)
                self.nodes.append(run)
                self.live.append(live)
                self.drop.append(drop)


def _values(layer: ShardedLayer, fx: list) -> set[str]:
    """Names a chain state carries: computed values and the user inputs (not parameters, buffers
    or constants, which every stage binds itself)."""
    return {n.name for n in fx} | {name for name, kind, _ in layer.placeholders if kind == "USER_INPUT"}




__all__ = ["MapStage", "build_mesh", "stage_mesh_shape"]
