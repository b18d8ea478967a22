"""MAP's views and folded chains (MAP §5.1): the layout a view's output takes from its input's
(:func:`map_view`), a view node's free strategies, and a merged node's core strategy carried
through its folded views and element-wise ops. The last step of ``costs.map_strategies``. Pure:
no torch.
"""
from __future__ import annotations

import math

from costs.map_engine import Strategy, assignments, param_sync_s, share_of, spec_of
from costs.map_ops import LabelledOp, align, letters
from specs.op_graph import OpNode
from specs.sharding import Mesh, ShardingSpec


def map_view(spec: ShardingSpec, in_shape, out_shape, perm: tuple[int, ...] = ()) -> ShardingSpec | None:
    """The layout of a view's output given its input's, or None when a split dim cannot pass
    (it would have to be gathered first). A permutation maps dims; a reshape maps a split dim
    to the first non-1 dim of its group of equal products when it is the group's leading dim."""
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if perm and len(perm) == len(in_shape) == len(out_shape):
        return ShardingSpec(tuple(spec.dims[p] for p in perm))
    if not spec.mesh_axes():
        return ShardingSpec.replicated(len(out_shape))
    if math.prod(in_shape) != math.prod(out_shape):
        # slice/select/expand: dims of equal size at equal positions keep their split
        if len(in_shape) != len(out_shape):
            return None
        if any(spec.dims[i] and in_shape[i] != out_shape[i] for i in range(len(in_shape))):
            return None
        return spec
    dims: list[tuple[int, ...]] = [()] * len(out_shape)
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        pi = in_shape[i] if i < len(in_shape) else 1
        pj = out_shape[j] if j < len(out_shape) else 1
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= out_shape[j]
        split = [d for d in gi if d < len(in_shape) and spec.dims[d]]
        if split:
            lead_in = next(d for d in gi if in_shape[d] != 1)
            lead_out = next((d for d in gj if d < len(out_shape) and out_shape[d] != 1), None)
            if split != [lead_in] or lead_out is None:
                return None
            dims[lead_out] = spec.dims[lead_in]
        i, j = gi[-1] + 1, gj[-1] + 1
    return ShardingSpec(tuple(dims))


def view_strategies(node: OpNode, mesh: Mesh, dtype_bytes: int, bpp: float) -> list[Strategy]:
    """A view moves no data: any input layout that maps through it, at no cost. A view of a
    parameter (the position table's slice) shards the parameter itself."""
    ms = mesh.shape
    src = node.input_shapes[0] if node.input_shapes else node.params[0].shape if node.params else None
    out_shape = node.output_shapes[0]
    if src is None:
        return [_plain(node, (), (), ShardingSpec.replicated(len(out_shape)), 0.0)]
    lx = letters(len(src))
    found = {}
    for axes_of in assignments(LabelledOp((), (), ("", ()), frozenset(lx), ()), mesh):
        spec = spec_of(lx, axes_of)
        if not spec.valid_for(tuple(src), ms):
            continue
        o = map_view(spec, src, out_shape, node.dims)
        if o is None or not o.valid_for(tuple(out_shape), ms):
            continue
        share = share_of(spec, src, ms)
        if node.input_shapes:
            ins = (spec,) + tuple(ShardingSpec.replicated(len(s)) for s in node.input_shapes[1:])
            mem = node.fwd_in * share
            s = _plain(node, ins, (), o, mem)
        else:
            s = _plain(node, (), (spec,), o, node.params[0].numel * share * bpp)
        found.setdefault(s.name, s)
    return list(found.values())


def _plain(node, ins, params, out, mem) -> Strategy:
    name = ",".join(map(str, tuple(ins) + tuple(params))) + "->" + str(out)
    return Strategy(name, tuple(ins), out, tuple(params), 0.0, 0.0, mem, 0.0, 0.0, 0.0, 0.0)


def through_folded(node: OpNode, s: Strategy, mesh: Mesh, dtype_bytes: int) -> Strategy | None:
    """Carry strategy ``s`` of a merged node's core op through its folded ops."""
    ms = mesh.shape
    spec, shape = s.output_spec, node.ops[0].output_shapes[0]
    extra_in: list[ShardingSpec] = []
    extra_p: list[ShardingSpec] = []
    mem = s.memory_bytes
    traffic = s.hbm_bytes
    for op in node.ops[1:]:
        # the folded op's input from the group, and its other inputs
        k = op.inputs.index(node.name) if node.name in op.inputs else 0
        out_shape = op.output_shapes[0]
        saved = op.fwd_in_inputs or (0,) * len(op.inputs)
        if op.kind == "view":
            mem += saved[k] * share_of(spec, shape, ms) if saved else 0
            spec = map_view(spec, shape, out_shape, op.dims)
            if spec is None:
                return None
        else:
            n_in = len(extra_in)
            folded = _fold_elementwise(op, k, spec, shape, mem, ms, extra_in, extra_p)
            if folded is None:
                return None
            # issue 26: a folded element-wise op reads its inputs and writes its output (each at
            # its local share), as the closed forms' bias-GeLU / bias-dropout-add / cast do
            others = iter(extra_in[n_in:])
            traffic += sum(math.prod(sh) * db * share_of(spec if i == k else next(others), sh, ms)
                           for i, (sh, db) in enumerate(zip(op.input_shapes, op.input_dtype_bytes)))
            spec, mem = folded
            traffic += math.prod(out_shape) * op.output_dtype_bytes[0] * share_of(spec, out_shape, ms)
        shape = out_shape
        mem += op.fwd_in_output * share_of(spec, shape, ms) + max(op.fwd_in_other, 0) * share_of(spec, shape, ms)
        if not spec.valid_for(tuple(shape), ms):
            return None
    ins = s.input_specs + tuple(extra_in)
    if len(ins) != len(node.inputs) or not all(x.valid_for(tuple(sh), ms) for x, sh in zip(ins, node.input_shapes)):
        return None
    params = s.param_specs + tuple(extra_p)
    name = s.name.split("->")[0] + "->" + str(spec) + ("(" + s.name.split("(", 1)[1] if "(AR" in s.name else "")
    # a folded op's parameter (a bias after a matmul) is partial over the axes the core splits
    # that it is not split over, like the core's own (costs.map_engine.param_sync_s)
    used = set().union(*(x.mesh_axes() for x in s.input_specs + s.param_specs + (s.output_spec,)))
    folded_p = [p for op in node.ops[1:] for p in op.params]
    sync = sum(param_sync_s(sp, p.shape, used, mesh, dtype_bytes) for sp, p in zip(extra_p, folded_p))
    return Strategy(name, ins, spec, params, s.flops_per_device, s.comm_s + sync, mem,
                    s.u_fcomm, s.u_bcomm + sync, s.o_fcomm, s.o_bcomm, traffic, s.grad_sync_s + sync)


def _fold_elementwise(op: OpNode, k: int, spec: ShardingSpec, shape, mem: float, ms,
                      extra_in: list[ShardingSpec], extra_p: list[ShardingSpec]) -> tuple[ShardingSpec, float] | None:
    """One folded element-wise op: every tensor aligned with its output, broadcasting from the
    right. Appends its other inputs' and its parameters' layouts to ``extra_in``/``extra_p``;
    returns (the output's layout, ``mem`` plus its saved inputs), or None when the split cannot
    carry over."""
    out_shape = op.output_shapes[0]
    saved = op.fwd_in_inputs or (0,) * len(op.inputs)
    lo = letters(len(out_shape))
    lbl_in = align(lo, out_shape, shape)
    if len(lbl_in) != len(shape):
        return None
    axes_of = {c: spec.dims[i] for i, c in enumerate(lbl_in) if spec.dims[i] and c in lo}
    if sum(len(a) for a in axes_of.values()) != len(spec.mesh_axes()):
        return None  # a split size-1 (broadcast) dim cannot carry over
    new = spec_of(lo, axes_of)
    mem += saved[k] * share_of(spec, shape, ms) if saved else 0
    for i, (other, oshape) in enumerate(zip(op.inputs, op.input_shapes)):
        if i == k:
            continue
        es = spec_of(align(lo, out_shape, oshape), axes_of)
        extra_in.append(es)
        mem += saved[i] * share_of(es, oshape, ms)
    for p in op.params:
        extra_p.append(spec_of(align(lo, out_shape, p.shape), axes_of))
    return new, mem
