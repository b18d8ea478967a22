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
* simulator.sharded_groups.group_costs (re-exported here) prices each group as one chain stage
  exactly as simulator.sharded_layer.layer_cost prices a layer; with every group stored (F_all)
  the groups hold what the layer holds (the finer chain is not cheaper by accounting;
  tests/unit/map/test_map_linearise.py).
* :func:`linear_chain` is simulator.sharded.group_chain over these groups: the chain rotor
  checkpoints, and the one the simulator rebuilds from a plan's ``StagePlan.node_groups``.

INTRA_BLOCK_CUTS: whether planners.map.stage.solve_stage offers rotor this chain beside the
per-layer one for each ILP solution (planners.map.rotor.integrate's alternatives). When the
node-group chain wins, the plan carries it (``StagePlan.node_groups``, the checkpoint segments
index those groups), the simulator prices that chain (simulator.sharded.sharded_stage) and the
executor runs it (executor.map_stage.MapStage.set_node_checkpoint). Pure: no I/O, no torch.
"""
from __future__ import annotations

from simulator.sharded import group_chain
from simulator.sharded_groups import LinearChain, group_costs
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.op_graph import OpGraph
from specs.plan import LayerSharding
from specs.sharding import Mesh
from specs.training import TrainingSpec

#: the planner offers rotor the chain over node groups and emits its cuts when it wins (module doc)
INTRA_BLOCK_CUTS = True


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
    def refine(parts, cs, into, price):     # keep the cuts whose live set is no larger than at the layer's ends
        if len(parts) < 2:
            return parts, cs
        limit = max(into, cs[-1].w_a)
        keep = [parts[0][0]] + [b for (_, b), c in zip(parts[:-1], cs[:-1]) if c.w_a <= limit]
        chosen = tuple(zip(keep, keep[1:] + [parts[-1][1]]))
        return (parts, cs) if chosen == parts else (chosen, price(chosen))

    return group_chain(model, hardware, training, layers, mesh, shardings,
                       (lambda l, graph: node_groups(graph)) if split else (lambda l, graph: ((0, len(graph.nodes)),)),
                       refine)


__all__ = ["INTRA_BLOCK_CUTS", "LinearChain", "common_nodes", "group_costs", "linear_chain", "node_groups"]
