"""The FX nodes of one layer's exported graph as specs.op_graph.OpNode records (MAP §4.1): each
aten op's kind (what a sharding strategy is chosen by), its kind-specific dims, activation inputs
and parameters with shapes, and the costs executor.op_graph_replay measured for it. A node with
no tensor output, or one that reads buffers only, is not a node (§5.1). executor.map_exec groups
the same nodes (its own records, costs left at 0) to match a plan's names."""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from executor.op_graph_replay import _Replay
from specs.op_graph import OpNode, ParamRef

_KIND = {
    "linear": "linear", "addmm": "matmul", "mm": "matmul", "matmul": "matmul", "bmm": "bmm",
    "baddbmm": "bmm", "embedding": "embedding", "layer_norm": "layer_norm",
    "native_layer_norm": "layer_norm", "batch_norm": "layer_norm", "softmax": "softmax",
    "_softmax": "softmax", "log_softmax": "softmax", "cross_entropy_loss": "softmax",
    "scaled_dot_product_attention": "sdpa", "conv2d": "conv2d", "convolution": "conv2d",
    "sum": "reduction", "mean": "reduction", "amax": "reduction", "amin": "reduction",
}
_ELEMENTWISE = {"add", "sub", "mul", "div", "gelu", "relu", "silu", "tanh", "sigmoid", "exp", "neg",
                "pow", "rsqrt", "sqrt", "dropout", "to", "_to_copy", "clone", "where", "lt", "gt",
                "le", "ge", "eq", "ne", "clamp", "abs", "erf", "type_as", "add_", "mul_", "relu_"}
#: views (each output element is one input element; aten schema ``Tensor(a) self -> Tensor(a)``)
#: and copies of them; the CompositeImplicit ones (numpy_T: Falcon's ``x @ self.weight.T``, mT,
#: swapaxes, movedim, expand_as, ...) stay in a non-strict export's graph under their own names
_VIEW = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "unsqueeze", "squeeze",
         "flatten", "expand", "slice", "select", "getitem", "contiguous", "alias", "detach",
         "split", "chunk", "unflatten", "narrow", "as_strided",
         "numpy_T", "mT", "mH", "adjoint", "matrix_H", "swapaxes", "swapdims", "movedim", "moveaxis",
         "expand_as", "broadcast_to", "view_as", "reshape_as", "ravel", "_reshape_alias", "unfold",
         "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit", "unbind", "diagonal",
         "positive", "resolve_conj", "resolve_neg", "conj", "lift_fresh", "view_as_real", "view_as_complex"}


def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._overloadpacket.__name__}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _kind(node: torch.fx.Node) -> str:
    base = node.target._overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) \
        else getattr(node.target, "__name__", "")
    if base == "einsum":
        stack = node.meta.get("nn_module_stack") or {}
        in_moe = any("MoE" in str(cls) for _, cls in stack.values())
        return "moe_dispatch" if in_moe else "bmm"
    if base in _KIND:
        return _KIND[base]
    if base in _ELEMENTWISE:
        return "elementwise"
    if base in _VIEW:
        return "view"
    return "other"


def _dims(node: torch.fx.Node, kind: str, in_ndim: int) -> tuple[int, ...]:
    """Kind-specific dims (see specs.op_graph.OpNode.dims), normalised to be >= 0."""
    base = node.target._overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) else ""
    args = node.args
    norm = lambda ds: tuple(sorted(d % in_ndim for d in ds))  # noqa: E731
    if kind == "softmax":
        return (1,) if base == "cross_entropy_loss" else norm([args[1]])
    if kind == "layer_norm":
        if base == "batch_norm":  # statistics over batch and space; per-replica over a split batch (as DDP)
            return (2, 3) if in_ndim == 4 else ()
        return tuple(range(in_ndim - len(args[1]), in_ndim))
    if kind == "reduction":
        ds = args[1] if len(args) > 1 and args[1] is not None else range(in_ndim)
        return norm([ds] if isinstance(ds, int) else ds)
    if base in ("transpose", "swapaxes", "swapdims", "mT", "mH", "adjoint", "matrix_H", "t") and in_ndim >= 2:
        perm = list(range(in_ndim))
        a, b = (args[1] % in_ndim, args[2] % in_ndim) if len(args) > 2 else (in_ndim - 2, in_ndim - 1)
        perm[a], perm[b] = perm[b], perm[a]
        return tuple(perm)
    if base == "permute":
        return tuple(d % in_ndim for d in args[1])
    if base == "numpy_T":  # reverses every dim
        return tuple(reversed(range(in_ndim)))
    if base in ("movedim", "moveaxis") and len(args) >= 3:
        src, dst = ([a] if isinstance(a, int) else list(a) for a in args[1:3])
        perm = [None] * in_ndim
        for a, b in zip(src, dst):
            perm[b % in_ndim] = a % in_ndim
        rest = iter(d for d in range(in_ndim) if d not in {a % in_ndim for a in src})
        return tuple(next(rest) if p is None else p for p in perm)
    if base == "t":  # of a 1-D tensor: itself
        return (0,)
    return ()


def _meta_shape(a, user: torch.fx.Node | None = None) -> tuple:
    """(shape, element bytes) of node ``a``'s value; of the element a getitem ``user`` reads when
    ``a`` returns several tensors (topk's values and indices), else of its first tensor."""
    v = a.meta.get("val")
    if isinstance(v, (tuple, list)):
        pick = user.args[1] if user is not None and user.target is operator.getitem else 0
        v = v[pick] if isinstance(v[pick], torch.Tensor) else next(t for t in v if isinstance(t, torch.Tensor))
    return tuple(v.shape), v.element_size()


def _nodes(gm, replay: _Replay, state: dict, bwd: dict, param_of: dict, user_names: list) -> list[OpNode]:
    out: list[OpNode] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        rec = replay.rec[n.name]
        vals = [v for v in tree_flatten(n.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        tensor_args = [a for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)]
        acts = [a for a in tensor_args if a.name not in param_of and (a.op == "call_function" or a.name in user_names)]
        prm = [a for a in tensor_args if a.name in param_of]
        saved = state["saved"].get(n.name, [])
        b = bwd.get(n.name, {})
        if not vals or not (acts or prm):
            # no tensor out, or reads buffers only (num_batches_tracked += 1): not a node (§5.1)
            assert rec["fwd_flops"] == 0 and not saved and not b.get("bwd_flops"), n.name
            continue
        # saved storages that are an activation input's / the output's (by storage identity)
        in_keys = [rec["in_keys"].get(a.name) for a in acts]
        saved_in = [0] * len(acts)
        saved_out = other = 0
        for key, nbytes in saved:
            if key in in_keys:
                saved_in[in_keys.index(key)] += nbytes
            elif key in rec["out_keys"]:
                saved_out += nbytes
            else:
                other += nbytes
        kind = _kind(n)
        # a view of a parameter (weight.T) permutes the parameter's dims
        in_shape = _meta_shape((acts or prm)[0], n)[0] if acts or prm else ()
        out.append(OpNode(
            name=n.name, target=_target_name(n.target), kind=kind,
            inputs=tuple(a.name for a in acts),
            input_shapes=tuple(_meta_shape(a, n)[0] for a in acts),
            input_dtype_bytes=tuple(_meta_shape(a, n)[1] for a in acts),
            params=tuple(ParamRef(name=param_of[a.name], shape=_meta_shape(a)[0], dtype_bytes=_meta_shape(a)[1])
                         for a in prm),
            output_shapes=tuple(tuple(v.shape) for v in vals),
            output_dtype_bytes=tuple(v.element_size() for v in vals),
            dims=_dims(n, kind, len(in_shape)),
            equation=n.args[0] if kind in ("moe_dispatch", "bmm") and isinstance(n.args[0], str) else "",
            fwd_flops=rec["fwd_flops"], bwd_flops=float(b.get("bwd_flops", 0.0)),
            fwd_in=sum(nb for _, nb in saved), fwd_tmp=rec["fwd_tmp"], fwd_out=rec["fwd_out"],
            bwd_tmp=b.get("bwd_tmp", 0), bwd_out=b.get("bwd_out", 0),
            fwd_in_inputs=tuple(saved_in), fwd_in_output=saved_out))
    return out
