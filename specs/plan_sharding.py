"""MAP's part of the plan (MAP §5-6): one strategy per operator group of each layer on a logical
mesh of the stage's devices, and rotor's checkpoint segments. ``specs.plan.StagePlan`` carries them
(``sharding``, ``checkpoint``); :func:`check_stage_sharding` is ``validate_plan``'s check of them
against the model's operator graphs. Types and pure functions only."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from specs._base import MAX_COUNT, Spec
from specs.hardware import MAX_DEVICES
from specs.model import ModelSpec
from specs.sharding import ShardingSpec


class NodeSharding(Spec):
    """One operator group's intra-op strategy (MAP §5.1): the layout each activation input is read in
    (aligned with the op graph node's ``inputs``), each parameter's layout (by its name in the
    layer module) and the output's. Layouts are sharding specs on the layer's mesh, one letter
    group per tensor dim: ``R`` replicated, ``S0`` split over mesh axis 0, ``S01`` over axes 0 and
    1 (specs.sharding; one-to-one with DTensor placements). The executor redistributes each input
    to its layout before the node runs; the simulator prices each conversion (MAP Algorithm 1)."""

    node: str = Field(min_length=1, description="op graph node (group head) name, e.g. 'linear'")
    inputs: list[str] = Field(default_factory=list)
    params: dict[str, str] = Field(default_factory=dict)
    output: str

    @model_validator(mode="after")
    def _parse(self) -> NodeSharding:
        for where, text in ([(f"inputs[{i}]", t) for i, t in enumerate(self.inputs)]
                            + [(f"params[{k!r}]", t) for k, t in self.params.items()] + [("output", self.output)]):
            try:
                ShardingSpec.parse(text)
            except ValueError as exc:
                raise ValueError(f"{where}: {text!r} is not a sharding spec ({exc}); use R / S<axes> per "
                                 "tensor dim, e.g. 'S0R' or 'RS01'") from None
        return self

    def max_axis(self) -> int:
        """The largest mesh axis any layout names (-1: all replicated)."""
        axes = [a for t in [*self.inputs, *self.params.values(), self.output] for a in ShardingSpec.parse(t).mesh_axes()]
        return max(axes, default=-1)


class LayerSharding(Spec):
    """A layer's MAP assignment: one strategy per operator group of its op graph
    (``ModelSpec.op_graphs[layers[layer].op_graph]``, trivial nodes merged), on the stage's devices
    viewed as a logical mesh of shape ``mesh`` (row-major, the last axis fastest: device
    ``devices[i]`` has coordinates ``unravel(i, mesh)``). Data parallelism is a split of the batch
    dim (S on dim 0), so a sharded stage has dp 1 and tp = its device count."""

    layer: int = Field(ge=0, lt=MAX_COUNT)
    mesh: list[Annotated[int, Field(ge=1, le=MAX_DEVICES)]] = Field(min_length=1, max_length=4)
    nodes: list[NodeSharding] = Field(min_length=1)

    @model_validator(mode="after")
    def _axes(self) -> LayerSharding:
        names = [n.node for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes: a node is listed twice: {sorted(n for n in names if names.count(n) > 1)}")
        for n in self.nodes:
            if n.max_axis() >= len(self.mesh):
                raise ValueError(f"nodes[{n.node!r}]: names mesh axis {n.max_axis()} but the mesh {self.mesh} has "
                                 f"{len(self.mesh)} axes")
        return self


class CheckpointSegment(Spec):
    """Layers [start, stop) (on a stage with ``StagePlan.node_groups``: node groups [start, stop) of
    that list) run under ``torch.utils.checkpoint`` when ``checkpointed`` (only the segment's input
    is kept; the forward is re-run in backward); ``children`` then tile [start, stop) and say how the recomputation is itself split (nested checkpoints). Rotor's
    solution (MAP §5.2, costs.rotor.Segment) in plan form."""

    start: int = Field(ge=0, lt=MAX_COUNT)
    stop: int = Field(ge=1, le=MAX_COUNT)
    checkpointed: bool = True
    children: list[CheckpointSegment] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tiles(self) -> CheckpointSegment:
        if self.stop <= self.start:
            raise ValueError(f"stop: {self.stop} must exceed start {self.start}")
        if self.children:
            if not self.checkpointed:
                raise ValueError(f"children: segment [{self.start}, {self.stop}) is not checkpointed; only a "
                                 "checkpointed segment's recomputation is split")
            check_tiling(self.children, self.start, self.stop, f"segment [{self.start}, {self.stop}).children")
        return self


class NodeGroup(Spec):
    """One stage of a MAP stage's checkpoint chain over node groups (MAP §5.2.2-§5.2.4, Algorithm 2;
    planners.map.linearise): a run of one layer's op-graph nodes, in graph order. A stage's groups
    (``StagePlan.node_groups``) list its layers in order, each layer's groups tiling its op graph,
    so a checkpoint segment over group indices may start and end inside a layer."""

    layer: int = Field(ge=0, lt=MAX_COUNT)
    nodes: list[str] = Field(min_length=1, description="op graph node names (group heads), in graph order")


def check_node_groups(groups: list[NodeGroup], start: int, stop: int, where: str = "node_groups") -> None:
    """``groups`` list every layer of [start, stop) in order (one or more groups each), no node twice
    in a layer."""
    want, seen = start, set()
    for g, grp in enumerate(groups):
        if grp.layer == want:
            want, seen = want + 1, set()
        elif grp.layer != want - 1 or g == 0:
            raise ValueError(f"{where}[{g}]: layer {grp.layer} out of order; the groups list the stage's layers "
                             f"[{start}, {stop}) in order, expected layer {want}"
                             + ("" if g == 0 else f" or {want - 1}"))
        if seen & set(grp.nodes) or len(set(grp.nodes)) != len(grp.nodes):
            raise ValueError(f"{where}[{g}]: a node of layer {grp.layer} is listed twice: {grp.nodes}")
        seen |= set(grp.nodes)
    if want != stop:
        raise ValueError(f"{where}: the groups end at layer {want - 1}; the stage's layers are [{start}, {stop})")


def check_tiling(segments: list[CheckpointSegment], start: int, stop: int, where: str) -> None:
    at = start
    for seg in segments:
        if seg.start != at:
            raise ValueError(f"{where}: segments must tile [{start}, {stop}) in order; [{seg.start}, {seg.stop}) "
                             f"starts at {seg.start}, expected {at}")
        at = seg.stop
    if at != stop:
        raise ValueError(f"{where}: segments end at {at}, expected {stop}")


def mixed_meshes(sharding: list[LayerSharding]) -> str | None:
    """Why a MAP stage's layers do not share one mesh shape (None: they do). The stage's devices are
    one logical mesh (MAP §5; the executor builds one DeviceMesh per stage, the simulator prices one)."""
    shapes: dict[tuple[int, ...], list[int]] = {}
    for s in sorted(sharding, key=lambda s: s.layer):
        shapes.setdefault(tuple(s.mesh), []).append(s.layer)
    if len(shapes) < 2:
        return None
    return ("a MAP stage's layers share one mesh (its devices are one logical mesh); this stage mixes "
            + ", ".join(f"{list(m)} (layers {ls})" for m, ls in shapes.items()))


def check_stage_sharding(i: int, stage, model: ModelSpec, microbatch: int, zero_stage: int, err) -> None:
    """A MAP stage's strategies name the nodes of each layer's op graph, with one valid layout per
    input and parameter for the traced shapes (MAP §4.3: a dim splits only over axes dividing it),
    all on one mesh shape."""
    if zero_stage:
        err("zero_stage", f"{zero_stage}: a MAP-sharded stage shards its states by its strategies; use 0")
    if (mixed := mixed_meshes(stage.sharding)) is not None:  # StagePlan refuses it too; a model_copy skips that
        err(f"stages[{i}].sharding", mixed)
        return
    mb = microbatch
    if model.op_graph_microbatch is not None and mb != model.op_graph_microbatch:
        err(f"stages[{i}].sharding", f"the op graphs were traced at microbatch {model.op_graph_microbatch}, the plan "
            f"uses {mb}; plan again (policy=map) for this batch")
        return
    if stage.node_groups is not None:   # each layer's groups are its op graph's nodes, in graph order
        for l in stage.layers:
            key = model.layers[l].op_graph
            if key is None or key not in model.op_graphs:
                continue   # the sharding check below names it
            mine = [n for grp in stage.node_groups if grp.layer == l for n in grp.nodes]
            order = [n.name for n in model.op_graphs[key].nodes]
            if mine != order:
                err(f"stages[{i}].node_groups[layer {l}]", f"the groups' nodes must be the op graph's in graph "
                    f"order {order}, got {mine}")
    for s in stage.sharding:
        where = f"stages[{i}].sharding[layer {s.layer}]"
        key = model.layers[s.layer].op_graph
        if key is None:
            err(where, f"layer {s.layer} ({model.layers[s.layer].name}) has no op graph (ModelSpec.op_graphs is "
                "filled for policy=map)")
            continue
        graph = model.op_graphs[key]
        nodes = {n.name: n for n in graph.nodes}
        listed = {n.node for n in s.nodes}
        if listed != set(nodes):
            err(where, f"nodes must be the op graph's: missing {sorted(set(nodes) - listed)}, unknown "
                f"{sorted(listed - set(nodes))}")
            continue
        mesh = tuple(s.mesh)
        for ns in s.nodes:
            node = nodes[ns.node]
            params = {p.name: p.shape for p in node.params}
            if len(ns.inputs) != len(node.inputs) or set(ns.params) != set(params):
                err(f"{where}.{ns.node}", f"needs {len(node.inputs)} input layouts and params {sorted(params)}, "
                    f"got {len(ns.inputs)} and {sorted(ns.params)}")
                continue
            shapes = ([(f"inputs[{k}]", t, sh) for k, (t, sh) in enumerate(zip(ns.inputs, node.input_shapes))]
                      + [(f"params[{n!r}]", t, params[n]) for n, t in ns.params.items()]
                      + [("output", ns.output, node.output_shapes[0])])
            for loc, text, shape in shapes:
                if not ShardingSpec.parse(text).valid_for(tuple(shape), mesh):
                    err(f"{where}.{ns.node}.{loc}", f"{text!r} does not fit shape {tuple(shape)} on mesh {list(mesh)} "
                        "(one letter group per dim; a split dim must divide by its axes' sizes)")


__all__ = ["CheckpointSegment", "LayerSharding", "NodeGroup", "NodeSharding", "check_node_groups", "check_stage_sharding",
           "check_tiling", "mixed_meshes"]
