"""Operator graph of one layer (MAP §4.1, §5.1): aten nodes with shapes, FLOPs and MAP's memory split.

``executor.op_graph.layer_graph`` traces a layer of ``executor.models`` to aten level on FakeTensor
and fills these types; ``costs.map_strategies`` enumerates sharding strategies per node; the
simulator and the MAP solver read them. Types and pure functions only (STYLE: no torch, no I/O);
``to_json`` / ``from_json`` give plain JSON.

Per node, all counts are for the traced microbatch (whole tensors, not per device):

* ``fwd_flops`` / ``bwd_flops``: ``torch.utils.flop_counter`` formulas of the aten ops the node's
  forward dispatches, and of the autograd functions its forward created, run in backward.
* MAP §4.1's memory split (bytes; definitions of how each is measured are in
  ``executor.op_graph``): ``fwd_in`` saved for backward by this node, ``fwd_tmp`` transient inside
  its forward, ``fwd_out`` new storage of its outputs (0 for a view), ``bwd_tmp`` transient inside
  its backward, ``bwd_out`` new storage of the gradients it hands to its producers.
* ``fwd_in`` is split into the bytes that are one of the node's activation inputs
  (``fwd_in_inputs``, aligned with ``inputs``), its output (``fwd_in_output``) and the rest
  (internal tensors: a layer norm's mean/rstd, attention's logsumexp); a strategy divides each
  part by the share of the tensor it belongs to.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from specs._base import Spec

Kind = Literal["linear", "matmul", "bmm", "embedding", "layer_norm", "softmax", "sdpa", "elementwise",
               "reduction", "view", "conv2d", "moe_dispatch", "other"]
#: kinds §5.1 folds into the compute node that produces their input
TRIVIAL_KINDS = frozenset({"view", "elementwise"})

Shape = tuple[int, ...]


class ParamRef(Spec):
    """A parameter a node reads: its name in the module (``attn.q.weight``), shape, element bytes."""

    name: str
    shape: Shape
    dtype_bytes: int = Field(ge=1, le=16)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class GraphInput(Spec):
    """A layer input: the previous layer's output (``x``) or a batch field (``batch_ids``)."""

    name: str
    shape: Shape
    dtype_bytes: int = Field(ge=1, le=16)
    requires_grad: bool


class OpNode(Spec):
    """One aten operator of the forward (or, after :func:`merge_trivial`, a compute node with the
    trivial ones folded into it: ``ops`` then lists the original nodes in execution order, the
    first being this node's own operator, and the totals here are their sums)."""

    name: str
    target: str                     # aten overload, e.g. "aten.linear.default"
    kind: Kind
    inputs: tuple[str, ...]         # activation inputs: producer node names or GraphInput names
    input_shapes: tuple[Shape, ...]
    input_dtype_bytes: tuple[int, ...]
    params: tuple[ParamRef, ...] = ()
    output_shapes: tuple[Shape, ...]
    output_dtype_bytes: tuple[int, ...]
    #: kind-specific dims: softmax/cross-entropy: the dim not to split; layer_norm: the normalised
    #: dims; reduction: the reduced dims; view (transpose/permute): the permutation
    dims: tuple[int, ...] = ()
    equation: str = ""              # einsum equation (moe_dispatch and einsum-based bmm)
    fwd_flops: float = Field(ge=0)
    bwd_flops: float = Field(ge=0)
    fwd_in: int = Field(ge=0)
    fwd_tmp: int = Field(ge=0)
    fwd_out: int = Field(ge=0)
    bwd_tmp: int = Field(ge=0)
    bwd_out: int = Field(ge=0)
    fwd_in_inputs: tuple[int, ...] = ()  # part of fwd_in that is inputs[i]'s storage
    fwd_in_output: int = Field(default=0, ge=0)
    ops: tuple[OpNode, ...] = ()

    @property
    def fwd_in_other(self) -> int:
        return self.fwd_in - sum(self.fwd_in_inputs) - self.fwd_in_output

    @property
    def param_numel(self) -> int:
        return sum(p.numel for p in self.params)


class OpGraph(Spec):
    """The forward operator graph of one layer, in execution (topological) order."""

    layer: str
    module: str
    inputs: tuple[GraphInput, ...]
    nodes: tuple[OpNode, ...]
    outputs: tuple[str, ...]

    def node(self, name: str) -> OpNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"op graph {self.layer}: no node {name!r}")

    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) between nodes (graph inputs are not nodes)."""
        names = {n.name for n in self.nodes}
        return [(i, n.name) for n in self.nodes for i in dict.fromkeys(n.inputs) if i in names and i != n.name]

    def params(self) -> dict[str, ParamRef]:
        """Unique parameters by name (a weight two nodes read counts once)."""
        out: dict[str, ParamRef] = {}
        for n in self.nodes:
            for p in n.params:
                out.setdefault(p.name, p)
        return out

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params().values())

    def total(self, field: str) -> float:
        """Sum of a per-node count (``fwd_flops``, ``fwd_in``, ...) over the graph."""
        return sum(getattr(n, field) for n in self.nodes)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> OpGraph:
        return cls.model_validate_json(text)


_SUMMED = ("fwd_flops", "bwd_flops", "fwd_in", "fwd_tmp", "fwd_out", "bwd_tmp", "bwd_out")


def _fold(core: OpNode, node: OpNode, rep: dict[str, str]) -> OpNode:
    """``core`` with ``node`` folded in: counts summed, ``node``'s other inputs become inputs of
    the group, its output the group's output."""
    ops = core.ops or (core,)
    node = node.model_copy(update={"inputs": tuple(rep.get(i, i) for i in node.inputs)})
    inputs, shapes, dbytes = list(core.inputs), list(core.input_shapes), list(core.input_dtype_bytes)
    fin = list(core.fwd_in_inputs) or [0] * len(inputs)
    for name, shape, db, saved in zip(node.inputs, node.input_shapes, node.input_dtype_bytes,
                                      node.fwd_in_inputs or (0,) * len(node.inputs)):
        if name == core.name:  # the group's own intermediate: its saved bytes stay "other"
            continue
        inputs.append(name)
        shapes.append(shape)
        dbytes.append(db)
        fin.append(saved)
    update = {f: getattr(core, f) + getattr(node, f) for f in _SUMMED}
    update.update(inputs=tuple(inputs), input_shapes=tuple(shapes), input_dtype_bytes=tuple(dbytes),
                  fwd_in_inputs=tuple(fin), params=core.params + node.params,
                  output_shapes=node.output_shapes, output_dtype_bytes=node.output_dtype_bytes,
                  # the core's saved output is an intermediate of the group now; the folded node's is the output
                  fwd_in_output=node.fwd_in_output, ops=ops + (node,))
    return core.model_copy(update=update)


def merge_trivial(graph: OpGraph) -> OpGraph:
    """MAP §5.1: fold computationally trivial nodes (views, getitem, element-wise) into the node
    that produces their input, so the ILP has one decision per compute node.

    A trivial node is folded into the producer of its latest-produced input when it is that
    producer's only consumer (otherwise the producer's raw output would still feed other nodes
    and could not take the group's output layout); chains fold repeatedly (linear -> view ->
    transpose). Consumers of a folded node read the group. Sums of FLOPs and of every byte count
    over the graph are unchanged; edges between groups are the original edges between them."""
    consumers: dict[str, int] = {}
    for n in graph.nodes:
        for i in dict.fromkeys(n.inputs):
            consumers[i] = consumers.get(i, 0) + 1
    rep: dict[str, str] = {}          # folded node -> its group's name
    groups: dict[str, OpNode] = {}    # insertion order = execution order of the group heads
    order = {n.name: k for k, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        # producers whose group is headed by a compute node (a view of a parameter, such as the
        # position table's slice, heads no group)
        producers = [i for i in n.inputs if i in order and groups[rep.get(i, i)].kind not in TRIVIAL_KINDS]
        if n.kind in TRIVIAL_KINDS and producers:
            src = max(producers, key=order.__getitem__)
            if consumers.get(src, 0) == 1:
                head = rep.get(src, src)
                groups[head] = _fold(groups[head], n, rep)
                rep[n.name] = head
                continue
        groups[n.name] = n.model_copy(update={"inputs": tuple(rep.get(i, i) for i in n.inputs)})
    nodes = tuple(groups.values())
    return graph.model_copy(update={"nodes": nodes, "outputs": tuple(rep.get(o, o) for o in graph.outputs)})


__all__ = ["GraphInput", "Kind", "OpGraph", "OpNode", "ParamRef", "TRIVIAL_KINDS", "merge_trivial"]
