"""Tracing a layer for a MAP-sharded stage (MAP §4.1, §5.1; executor.map_exec runs it): the layer
exported as the planner's op graph was (executor.op_graph.export_layer, so node names match the
plan's), and its FX nodes grouped with ``specs.op_graph.merge_trivial`` into the groups whose
heads the plan names."""
from __future__ import annotations

import torch
from torch.export.graph_signature import TensorArgument
from torch.utils._pytree import tree_flatten

from specs.op_graph import OpGraph, OpNode, ParamRef, merge_trivial


class MapPlanError(ValueError):
    """The plan's sharding does not fit the traced layer (names, inputs, shapes)."""


def _export(cfg, index: int, microbatch: int, dtype: torch.dtype):
    """``torch.export`` of layer ``index`` at the microbatch's global shapes, traced as the
    planner's op graph was (executor.op_graph.export_layer), so node names match the plan's."""
    from executor.op_graph import export_layer

    return export_layer(cfg, index, microbatch, dtype)


def _groups(ep) -> tuple[OpGraph, dict[str, str]]:
    """The merged op graph of an export (node names, kinds and activation inputs as
    executor.op_graph_nodes._nodes records them; costs left at 0) and FX node -> group head."""
    from executor.op_graph_nodes import _kind, _meta_shape, _target_name

    gm, sig = ep.graph_module, ep.graph_signature
    param_of = {s.arg.name: s.target for s in sig.input_specs if s.kind.name == "PARAMETER"}
    user = {s.arg.name for s in sig.input_specs if s.kind.name == "USER_INPUT" and isinstance(s.arg, TensorArgument)}
    nodes = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        vals = [v for v in tree_flatten(n.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        args = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)]
        acts = [a for a in args if a.name not in param_of and (a.op == "call_function" or a.name in user)]
        prm = [a for a in args if a.name in param_of]
        if not vals or not (acts or prm):  # executor.op_graph_nodes._nodes: not a node (MAP §5.1)
            continue
        shape = lambda a: _meta_shape(a, n)  # noqa: E731
        nodes.append(OpNode(
            name=n.name, target=_target_name(n.target), kind=_kind(n), inputs=tuple(a.name for a in acts),
            input_shapes=tuple(shape(a)[0] for a in acts), input_dtype_bytes=tuple(shape(a)[1] for a in acts),
            params=tuple(ParamRef(name=param_of[a.name], shape=_meta_shape(a)[0], dtype_bytes=_meta_shape(a)[1])
                         for a in prm),
            output_shapes=tuple(tuple(v.shape) for v in vals), output_dtype_bytes=tuple(v.element_size() for v in vals),
            fwd_flops=0, bwd_flops=0, fwd_in=0, fwd_tmp=0, fwd_out=0, bwd_tmp=0, bwd_out=0))
    merged = merge_trivial(OpGraph(layer="layer", module="", inputs=(), nodes=tuple(nodes), outputs=()))
    group_of = {op.name: g.name for g in merged.nodes for op in (g.ops or (g,))}
    return merged, group_of
