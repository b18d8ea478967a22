"""A MAP-sharded stage (``StagePlan.sharding``) as one rank runs it: the stage's DeviceMesh, its
layers as executor.map_exec.ShardedLayer, run through rotor's checkpoint segments (MAP §5.2, §6:
the generator packages each checkpoint block's nodes into a function under
``torch.utils.checkpoint``; here a block is a run of layers, nested as rotor's tree says)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from executor.map_exec import ShardedLayer
from executor.map_layout import _replicate
from executor.map_trace import MapPlanError, _export
from executor.models import output_shapes
from specs.plan import CheckpointSegment, StagePlan


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
        shared: dict[int, nn.Parameter] = {}
        # identical layers (a GPT's blocks: type, input shape, parameter shapes) share one trace,
        # as executor.op_graph.model_op_graphs shares their op graph
        traces: dict[tuple, object] = {}
        shapes = output_shapes(cfg)
        self.layers: dict[int, ShardedLayer] = {}
        mb = plan.training.samples_per_microbatch
        for i, _, mod in layers:
            key = (type(mod).__name__, shapes[i - 1] if i else None,
                   tuple((n, tuple(p.shape)) for n, p in mod.named_parameters()),
                   tuple(getattr(m, "code", "") for m in mod.modules() if isinstance(m, torch.fx.GraphModule)))
            if key not in traces:
                traces[key] = _export(cfg, i, mb, dtype)
            self.layers[i] = ShardedLayer(i, mod, st.sharding_of(i), self.mesh, traces[key], shared, self.stats)
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




__all__ = ["MapStage", "build_mesh", "stage_mesh_shape"]
