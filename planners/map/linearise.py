"""MAP §5.2.2-§5.2.4, Algorithm 2: each layer's operator graph linearised into node groups, so
rotor's chain (MAP §5.2.1) has node groups as its stages and a checkpoint segment may start or
end inside a layer (a GPT block splits at its first residual add: attention half, MLP half).

* :func:`node_groups` is Algorithm 2 on one layer's op graph (specs.op_graph, graph order =
  a topological order): nodes are appended to the current group; a node ends its group when,
  after it consumed its parents, the dependency pool is empty (no earlier tensor is still read
  later, so its output is the only one crossing the cut). Common nodes (§5.2.3, Lemma 5.4: the
  non-differentiable batch fields, and nodes all of whose parents are common) take no part in the
  pool. Two departures, both for a *layer's* graph rather than the whole model's: the layer input
  ``x`` (a differentiable placeholder, the previous layer's output) is tracked in the pool like a
  node (a residual reads it at the block's end, so no cut may pass over it), and the layer's
  outputs count as one more reader each (a cut may not leave an output behind). ``is_sink``'s
  in-place / communication test is vacuous here: the graphs are merge_trivial's (§5.1 folds in-
  place and element-wise ops into their producer) and communication nodes are not graph nodes
  (Table 2 adds their cost to the group that issues them).
* :func:`group_costs` prices each group as one chain stage exactly as
  simulator.sharded_layer.layer_cost prices a layer (same per-node sums, walked once over the
  layer), per group: times summed, transients maxed, a = the sink's output, a-bar = the group's
  saved bytes with the sink's output counted once as a^g. A group's input is the previous sink's
  output (a^{g-1} in Table 1): a reader saving it in the layout it arrives in saves a^{g-1},
  which a-bar^{g-1} holds (layer_cost's rule for x), so it is not counted again; read in another
  layout, the converted copy counts. So with every group stored (F_all) the groups hold what the
  layer holds (the finer chain is not cheaper by accounting; tests/unit/map/test_map_linearise.py).
* :func:`linear_chain` is simulator.sharded.stage_chain with node groups as stages.

INTRA_BLOCK_CUTS: whether the planner may hand such cuts to the executor. Off, and nothing reads
it on: the plan's checkpoint tree (specs.plan.CheckpointSegment) names layers only, the executor
(executor.map_stage) checkpoints runs of whole layers, and planners.map.stage solves the per-layer
chain. This module prices the finer chain (benchmarks/map_linearise.py compares both under §5.3);
executing a segment that ends inside a layer (torch.utils.checkpoint over a node range of
executor.map_exec's replayed graph) is not done. Pure: no I/O, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from costs.rotor import Chain
from simulator.sharded import (_op_graph, _replicate_output, _sharding_key, _tied_layouts,
                               accumulate_bytes_per_param, chain_of, tied_skip)
from simulator.sharded_layer import (LayerCost, _Sums, _add_node, _input_layouts, _share, act_dtype_bytes,
                                     find_strategy)
import costs.activations
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.op_graph import OpGraph
from specs.plan import LayerSharding
from specs.sharding import Mesh, ShardingSpec
from specs.training import TrainingSpec

#: the planner emits intra-layer checkpoint cuts for execution (see the module doc): off, not executed yet
INTRA_BLOCK_CUTS = False


def common_nodes(graph: OpGraph) -> frozenset[str]:
    """§5.2.3, Definition 5.3 / Lemma 5.4: the graph inputs that need no gradient (token ids,
    labels, masks) and every node all of whose activation inputs are common (vacuously one that
    reads parameters only, a position table's slice)."""
    common = {gi.name for gi in graph.inputs if not gi.requires_grad}
    for n in graph.nodes:
        if all(i in common for i in n.inputs):
            common.add(n.name)
    return frozenset(common)


def node_groups(graph: OpGraph) -> tuple[tuple[int, int], ...]:
    """Algorithm 2 (module doc): the node ranges [start, stop) of ``graph.nodes`` that are the
    linearised chain's stages, in order, tiling the graph. One range when the graph has no inner
    cut, or when its output is not its last node (then no cut is taken: the chain's a^g must be
    the layer output at the end)."""
    nodes = graph.nodes
    if not nodes:
        return ()
    common = common_nodes(graph)
    readers: dict[str, int] = {}
    for n in nodes:
        for i in dict.fromkeys(n.inputs):
            if i not in common:
                readers[i] = readers.get(i, 0) + 1
    for o in graph.outputs:
        readers[o] = readers.get(o, 0) + 1
    if graph.outputs and graph.outputs[0] != nodes[-1].name:
        return ((0, len(nodes)),)
    # the differentiable placeholders (x) are live from the start (see the module doc)
    pool = {gi.name: readers[gi.name] for gi in graph.inputs if gi.name not in common and gi.name in readers}
    groups, start = [], 0
    for k, n in enumerate(nodes):
        for p in dict.fromkeys(n.inputs):
            if p in pool:
                pool[p] -= 1
                if pool[p] == 0:
                    del pool[p]
        if not pool and n.name not in common and k < len(nodes) - 1:
            groups.append((start, k + 1))
            start = k + 1
        if n.name not in common and readers.get(n.name, 0):
            pool[n.name] = readers[n.name]
    groups.append((start, len(nodes)))
    return tuple(groups)


def group_costs(graph: OpGraph, groups: tuple[tuple[int, int], ...], sharding: LayerSharding, mesh: Mesh,
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
                             elems, str(spec), sums.grad_sync - t0[6]))
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


def linear_chain(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, layers: range, mesh: Mesh,
                 shardings: dict[int, LayerSharding], split: bool = True) -> LinearChain:
    """simulator.sharded.stage_chain with each layer's node groups (:func:`node_groups`) as stages
    (``split`` False: one stage per layer, the per-layer chain, for comparison: equal to
    stage_chain's). Of Algorithm 2's cuts a layer keeps those whose crossing tensor (per device)
    is no larger than the layer's input or output, the live sets at its own boundaries: rotor's
    Table 1 keeps a stored stage's input until its backward, so a cut at a larger tensor (a GPT
    head's logits, 50257 wide, between the head's linear and its loss) would hold it where the
    whole layer frees it once converted, and the finer chain would cost more memory stored
    than the layer does. A GPT block keeps its cut at the first residual add."""
    w_b, g_b, o_b = training.bytes_per_param()
    bpp = float(w_b + g_b + o_b)
    acc = accumulate_bytes_per_param(training)
    costs_: list[LayerCost] = []
    groups: list[tuple[int, int, int]] = []
    prev: dict[str, str] = {}
    graph = None
    seen: dict[tuple, tuple] = {}
    into = costs.activations.layer_input_bytes(model, layers.start, training.samples_per_microbatch)
    for l in layers:
        graph = _op_graph(model, l)
        skip = tied_skip(model, layers, l, graph)
        ins = {"x": prev["x"]} if "x" in prev and any(gi.name == "x" for gi in graph.inputs) else {}
        tied = _tied_layouts(model, shardings, l, graph, skip)
        parts = node_groups(graph) if split else ((0, len(graph.nodes)),)
        key = (model.layers[l].op_graph, _sharding_key(shardings[l]), tuple(ins.items()), skip,
               tuple(sorted(tied.items())), parts, into)
        hit = seen.get(key)
        if hit is None:
            price = lambda p: group_costs(graph, p, shardings[l], mesh, hardware, training.precision.value,  # noqa: E731
                                          bpp, ins, skip, tied, acc)
            cs = price(parts)
            if len(parts) > 1:   # keep the cuts whose live set is no larger than at the layer's ends
                limit = max(into, cs[-1].w_a)
                keep = [parts[0][0]] + [b for (_, b), c in zip(parts[:-1], cs[:-1]) if c.w_a <= limit]
                chosen = tuple(zip(keep, keep[1:] + [parts[-1][1]]))
                if chosen != parts:
                    parts, cs = chosen, price(chosen)
            hit = seen[key] = (parts, cs)
        parts, cs = hit
        into = cs[-1].w_a
        costs_.extend(cs)
        groups.extend((l, a, b) for a, b in parts)
        prev = {"x": cs[-1].output_spec}
    _replicate_output(costs_, graph, mesh)
    fixed = sum(c.param_elems for c in costs_) * (w_b + g_b + o_b)
    input_bytes = costs.activations.layer_input_bytes(model, layers.start, training.samples_per_microbatch)
    chain = chain_of(costs_, fixed, input_bytes, input_bytes if layers.start > 0 else 0)
    return LinearChain(chain, tuple(groups), tuple(costs_))


__all__ = ["INTRA_BLOCK_CUTS", "LinearChain", "common_nodes", "group_costs", "linear_chain", "node_groups"]
