"""A MAP stage's rotor chain over node groups (MAP §5.2.2-§5.2.4, Algorithm 2): each layer's op
graph cut into runs of nodes (planners.map.linearise finds the cuts; a plan names them,
``StagePlan.node_groups``), each run one chain stage, priced exactly as simulator.sharded_layer
prices a whole layer. The planner (planners.map.linearise.linear_chain) and the simulator
(simulator.sharded.sharded_stage, a plan with node_groups) build the chain with
simulator.sharded.group_chain, so the simulated
memory and time of a plan are those of the chain rotor checkpointed.

* :func:`group_costs` prices each group as one chain stage exactly as
  simulator.sharded_layer.layer_cost prices a layer (same per-node sums, walked once over the
  layer), per group: times summed, transients maxed, a = the sink's output, a-bar = the group's
  saved bytes with the sink's output counted once as a^g. A group's input is the previous sink's
  output (a^{g-1} in Table 1): a reader saving it in the layout it arrives in saves a^{g-1},
  which a-bar^{g-1} holds (layer_cost's rule for x), so it is not counted again; read in another
  layout, the converted copy counts.
* simulator.sharded.group_chain is simulator.sharded.stage_chain with node groups as stages.
* :func:`plan_parts` reads a plan's node groups as node ranges of each layer's op graph.

Pure: no I/O, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from costs.rotor import Chain
from simulator.sharded_layer import (LayerCost, _Sums, _add_node, _input_layouts, _share, act_dtype_bytes,
                                     find_strategy)
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.op_graph import OpGraph
from specs.plan import LayerSharding, NodeGroup
from specs.sharding import Mesh, ShardingSpec

Parts = tuple[tuple[int, int], ...]


def group_costs(graph: OpGraph, groups: Parts, sharding: LayerSharding, mesh: Mesh,
                hardware: HardwareSpec, dtype: str, bytes_per_param: float, input_specs: dict[str, str],
                skip_params: frozenset[str] = frozenset(), param_layouts: dict[str, str] | None = None,
                accumulate_bytes_per_param: float = 0.0) -> list[LayerCost]:
    """Each node group of ``graph`` as one chain stage (module doc); arguments as layer_cost's.
    One group gives layer_cost's stage exactly."""
    by_name = {n.node: n for n in sharding.nodes}
    act_bytes = act_dtype_bytes(graph)
    sums = _Sums(_input_layouts(graph, input_specs), {})
    if param_layouts:
        sums.stored.update({k: ShardingSpec.parse(v) for k, v in param_layouts.items()})
    ms = mesh.shape
    out: list[LayerCost] = []
    for start, stop in groups:
        t0 = (sums.u_f, sums.u_b, sums.u_fc, sums.u_bc, sums.saved, sum(sums.params.values()), sums.grad_sync)
        c0 = len(sums.convs)
        sums.o_f = sums.o_b = sums.o_fc = sums.o_bc = 0.0     # transients: the group's own largest
        for node in graph.nodes[start:stop]:
            st = find_strategy(node, by_name[node.name], mesh, act_bytes, bytes_per_param)
            if start:   # a reader of a^{g-1} in the layout it arrives in saves a^{g-1} itself, which
                _not_saved_again(sums, node, st, graph.nodes[start - 1].name, ms)   # a-bar^{g-1} holds
            _add_node(sums, node, st, mesh, hardware, dtype, skip_params, act_bytes)
        elems = sum(sums.params.values()) - t0[5]
        u_b = sums.u_b - t0[1] + elems * accumulate_bytes_per_param / hardware.device.hbm_bytes_per_s
        sink = graph.nodes[stop - 1]
        if stop == len(graph.nodes) and graph.outputs:     # the layer's output (an embedding's add,
            sink = graph.node(graph.outputs[0])             # not the position slice after it)
        spec = sums.layout[sink.name]
        shape = sink.output_shapes[0] if sink.output_shapes else ()
        w_a = math.ceil(math.prod(shape) * sink.output_dtype_bytes[0] * _share(spec, shape, ms)) \
            if sink.output_dtype_bytes else 0
        saved = sums.saved - t0[4] - sink.fwd_in_output * _share(spec, shape, ms)
        w_abar = max(w_a, math.ceil(saved) + w_a)
        out.append(LayerCost(sums.u_f - t0[0], u_b, sums.u_fc - t0[2], sums.u_bc - t0[3], w_a, w_abar,
                             math.ceil(sums.o_f), math.ceil(sums.o_b), math.ceil(sums.o_fc), math.ceil(sums.o_bc),
                             elems, str(spec), sums.grad_sync - t0[6], tuple(sums.convs[c0:])))
    return out


def _not_saved_again(sums: _Sums, node, st, source: str, ms: tuple[int, ...]) -> None:
    """layer_cost's rule for the layer input x (simulator.sharded_layer._add_inputs), applied to a
    group's input ``source``: a reader's saved part of it, read in the layout it arrives in, is
    that tensor, a^{g-1}, which the previous group's a-bar already holds (Table 1: B^g reads a^{g-1}
    from there); taken off before _add_node adds it."""
    for k, (src, shape) in enumerate(zip(node.inputs, node.input_shapes)):
        part = node.fwd_in_inputs[k] if k < len(node.fwd_in_inputs) else 0
        if src == source and part and sums.layout.get(src) == st.input_specs[k]:
            sums.saved -= part * _share(st.input_specs[k], shape, ms)


@dataclass(frozen=True)
class LinearChain:
    """The stage's chain over node groups: ``chain``'s stage g is node range ``groups[g]`` =
    (layer, start, stop) of that layer's op graph (graph order); ``costs`` per stage."""

    chain: Chain
    groups: tuple[tuple[int, int, int], ...]
    costs: tuple[LayerCost, ...]

    def layer_stages(self) -> dict[int, tuple[int, int]]:
        """Per layer: its chain stages [first, stop)."""
        out: dict[int, list[int]] = {}
        for g, (l, _, _) in enumerate(self.groups):
            out.setdefault(l, []).append(g)
        return {l: (v[0], v[-1] + 1) for l, v in out.items()}

    def node_groups(self, model: ModelSpec) -> list[NodeGroup]:
        """The chain's stages as a plan names them (StagePlan.node_groups)."""
        return [NodeGroup(layer=l, nodes=[n.name for n in _graph(model, l).nodes[a:b]]) for l, a, b in self.groups]


def _graph(model: ModelSpec, l: int) -> OpGraph:
    key = model.layers[l].op_graph
    if key is None or key not in model.op_graphs:
        raise ValueError(f"node_groups: layer {l} ({model.layers[l].name}) has no op graph (ModelSpec.op_graphs)")
    return model.op_graphs[key]


def plan_parts(model: ModelSpec, groups: list[NodeGroup], layers: range) -> dict[int, Parts]:
    """A plan's node groups (StagePlan.node_groups) as node ranges [start, stop) of each layer's op
    graph (ValueError naming the group when a layer's groups are not its nodes in graph order)."""
    out: dict[int, Parts] = {}
    for l in layers:
        names = [n.name for n in _graph(model, l).nodes]
        mine = [(g, grp) for g, grp in enumerate(groups) if grp.layer == l]
        at, parts = 0, []
        for g, grp in mine:
            if names[at:at + len(grp.nodes)] != list(grp.nodes):
                raise ValueError(f"node_groups[{g}]: layer {l}'s groups must be its op graph's nodes in graph "
                                 f"order; expected {names[at:at + len(grp.nodes)]}, got {grp.nodes}")
            parts.append((at, at + len(grp.nodes)))
            at += len(grp.nodes)
        if at != len(names) or not parts:
            raise ValueError(f"node_groups: layer {l}'s groups cover {at} of its {len(names)} op graph nodes")
        out[l] = tuple(parts)
    return out


def group_holds(model: ModelSpec, layers: range, chain: LinearChain, layer_holds: tuple[tuple[int, int, int], ...],
                skips: dict[int, frozenset[str]]) -> tuple[tuple[int, int, int], ...]:
    """simulator.sharded.tied_grad_holds' (reader, owner, bytes) (stage layer indices) on the chain
    over node groups: the reader is the group holding the first node that reads the tied copy
    (``skips``: per layer, simulator.sharded.tied_skip; its backward makes the gradient), the owner
    the owner layer's first group (its backward ends the layer's; the owner's gradient is in by then)."""
    stages = chain.layer_stages()
    out = []
    for r, o, b in layer_holds:
        l = r + layers.start
        nodes = _graph(model, l).nodes
        at = next((k for k, n in enumerate(nodes) if any(p.name in skips.get(l, ()) for p in n.params)), 0)
        g = next(g for g in range(*stages[l]) if chain.groups[g][1] <= at < chain.groups[g][2])
        out.append((g, stages[o + layers.start][0], b))
    return tuple(out)


__all__ = ["LinearChain", "Parts", "group_costs", "group_holds", "plan_parts"]
