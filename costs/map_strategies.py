"""Sharding strategy generators per operator (MAP §5.1; Alpa §4.2, GSPMD §3).

    for s in strategies(node, mesh, dtype_bytes=2, bytes_per_param=16):
        s.input_specs, s.param_specs, s.output_spec, s.flops_per_device, s.comm_s, s.memory_bytes

A node of ``specs.op_graph`` gets every SPMD strategy of its op family on an N-D mesh: each mesh
axis splits one tensor dim of the op or none (Alpa's "split i, j, k over any mesh axis and their
combinations"; a dim split over two axes takes them in ascending order, S01). Pure: no torch.

One engine covers the contraction-like families. An op is written as an einsum over labels
(linear ``...k,nk->...n``, matmul/bmm ``...mk,...kn->...mn``, embedding ``ab,vh->abh``, conv2d
``nc..,oc..->no..``, MoE ``gsec,gsh->egch``; layer norm, softmax, element-wise and reductions as
label maps of their dims); a strategy assigns mesh axes to the labels the family may split. Costs
(GSPMD §3.3's partial-sum rule, Megatron's f/g operators):

* ``flops_per_device`` = (fwd + bwd FLOPs) / product of the used axes' sizes (every split label
  divides the iteration space; an unused axis replicates the work).
* forward: a split label absent from the output (a contraction dim: k of a linear, the vocabulary
  of an embedding, a reduced dim) leaves a partial sum: all-reduce of the local output over
  those axes (Megatron's row-parallel g).
* backward: d(operand X) sums over the labels X lacks; where such a label is split the local dX
  is partial: all-reduce over those axes. For an activation input this is the column-parallel
  f (the out dim n is split, dX = dY·W^T sums over n); for a parameter it is the data-parallel
  gradient all-reduce (the batch labels are split, the weight lacks them).
* collectives use ``Mesh.all_reduce_s`` per axis (ring, alpha-beta), on ``dtype_bytes`` per element.
* ``memory_bytes`` (per device) = the node's ``fwd_in`` with each part divided as its tensor is
  (saved inputs by their spec, saved output and internal tensors by the output's / the largest
  input's) + local parameter elements x ``bytes_per_param`` (2 for bf16 weights alone, 16 for
  mixed-precision Adam with weights, gradients and optimizer states: ZeRO §3).
* MAP Table 2's per-phase pieces: ``u_fcomm``/``u_bcomm`` the forward/backward collective times;
  ``o_fcomm``/``o_bcomm`` the per-device bytes of the largest tensor a collective of that phase
  works on (live while it runs; 0 without communication).

Kinds without a generator here (``other``: topk, one_hot, cumsum, pooling) get the fully
replicated strategy only, which every node has.
"""
from __future__ import annotations

import itertools
import math
import string
from dataclasses import dataclass

from specs.op_graph import OpNode
from specs.sharding import Mesh, ShardingSpec


@dataclass(frozen=True)
class Strategy:
    """One intra-op strategy of a node (units: FLOPs, seconds, bytes per device)."""

    name: str
    input_specs: tuple[ShardingSpec, ...]
    output_spec: ShardingSpec
    param_specs: tuple[ShardingSpec, ...]
    flops_per_device: float
    comm_s: float
    memory_bytes: float
    u_fcomm: float
    u_bcomm: float
    o_fcomm: float
    o_bcomm: float


@dataclass(frozen=True)
class _Op:
    """An op as labelled tensors: per tensor its labels (one char per dim) and shape."""

    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]
    output: tuple[str, tuple[int, ...]]
    splittable: frozenset[str]
    grads: tuple[bool, ...]  # per input: differentiable (token ids and targets are not)


def _unsplit(n: int, taken: str) -> list[str]:
    """``n`` fresh labels outside ``taken`` for dims that may not be split (kernel, spatial,
    broadcast size-1 dims); they are never in ``splittable``."""
    pool = [c for c in string.ascii_uppercase + "0123456789!#$%&*+<=>?@^~" if c not in taken]
    return pool[:n]


def _letters(n: int, avoid: str = "") -> str:
    return "".join([c for c in string.ascii_lowercase if c not in avoid][:n])


# ---- label maps per family ---------------------------------------------------------------------

def _linear(node: OpNode) -> _Op:
    x = node.input_shapes[0]
    batch = _letters(len(x) - 1, "kn")
    out = (batch + "n", node.ops[0].output_shapes[0] if node.ops else node.output_shapes[0])
    params = tuple(("nk" if len(p.shape) == 2 else "n", p.shape) for p in node.params)
    return _Op(((batch + "k", x),), params, out, frozenset(batch + "kn"), (True,))


def _matmul(node: OpNode, out_shape) -> _Op:
    shapes = list(node.input_shapes) + [p.shape for p in node.params]
    idx = [i for i, s in enumerate(shapes) if len(s) >= 2][-2:]
    if len(idx) < 2:
        return _replicated_op(node, out_shape)
    nb = len(out_shape) - 2
    batch = _letters(nb, "mkn")

    def lab(shape, tail):
        lead = len(shape) - 2
        labels = list(batch[nb - lead:]) if lead else []
        # a broadcast (size-1) batch dim of one operand is not the batch label
        for i in range(lead):
            if shape[i] == 1 and out_shape[nb - lead + i] != 1:
                labels[i] = _unsplit(1, batch + "mkn" + "".join(labels))[0]
        return "".join(labels) + tail

    labelled = {idx[0]: lab(shapes[idx[0]], "mk"), idx[1]: lab(shapes[idx[1]], "kn")}
    n_in = len(node.input_shapes)
    tensors = [(labelled.get(i, "n" if len(s) == 1 else _unsplit(len(s), "mkn" + batch)), s)
               for i, s in enumerate(shapes)]  # addmm's bias: the out dim n
    return _Op(tuple(tensors[:n_in]), tuple(tensors[n_in:]), (batch + "mn", out_shape),
               frozenset(batch + "mkn"), (True,) * n_in)


def _einsum(node: OpNode, out_shape) -> _Op:
    lhs, out = node.equation.replace(" ", "").split("->")
    labels = lhs.split(",")
    shapes = list(node.input_shapes) + [p.shape for p in node.params]  # activations first (MoEFFN's order)
    n_in = len(node.input_shapes)
    tensors = list(zip(labels, shapes))
    return _Op(tuple(tensors[:n_in]), tuple(tensors[n_in:]), (out, out_shape),
               frozenset(c for c in lhs if c.isalpha()), (True,) * n_in)


def _embedding(node: OpNode, out_shape) -> _Op:
    ids = node.input_shapes[0]
    batch = _letters(len(ids), "vh")
    w = node.params[0].shape
    return _Op(((batch, ids),), (("vh", w),), (batch + "h", out_shape), frozenset(batch + "vh"), (False,))


def _conv2d(node: OpNode, out_shape) -> _Op:
    x = node.input_shapes[0]
    fixed = _unsplit(6, "nco")
    params = [("oc" + fixed[4] + fixed[5], p.shape) if len(p.shape) == 4 else ("o", p.shape) for p in node.params]
    return _Op((("nc" + fixed[0] + fixed[1], x),), tuple(params), ("no" + fixed[2] + fixed[3], out_shape),
               frozenset("nco"), (True,))


def _sdpa(node: OpNode, out_shape) -> _Op:
    # batch and heads only (Megatron's attention split): q·k^T contracts d, the softmax runs over keys
    ins = tuple((("ba" + "q" + "d") if i == 0 else "bakd", s) for i, s in enumerate(node.input_shapes))
    return _Op(ins, (), ("baqd", out_shape), frozenset("ba"), (True,) * len(ins))


def _same_dims(node: OpNode, out_shape, keep: set[int]) -> _Op:
    """Output labelled like the first input; ``keep`` dims never split. Other inputs and the
    parameters are aligned (broadcasting from the right; a targets vector by its prefix)."""
    x = node.input_shapes[0] if node.input_shapes else out_shape
    lx = _letters(len(x))
    ins = [(lx, x)] + [(_align(lx, x, s), s) for s in node.input_shapes[1:]]
    if node.kind == "layer_norm" and node.target.endswith("batch_norm.default"):
        params = tuple(("b" if len(x) > 1 else lx, p.shape) for p in node.params)  # per channel
    else:
        params = tuple((_align(lx, x, p.shape), p.shape) for p in node.params)
    out = lx if tuple(out_shape) == tuple(x) else _align(lx, x, out_shape) if out_shape else ""
    grads = tuple([True] + [node.kind != "softmax"] * (len(ins) - 1))  # cross-entropy targets: no grad
    return _Op(tuple(ins), params, (out, out_shape), frozenset(lx[i] for i in range(len(x)) if i not in keep), grads)


def _elementwise(node: OpNode, out_shape) -> _Op:
    lo = _letters(len(out_shape))
    ins = tuple((_align(lo, out_shape, s), s) for s in node.input_shapes)
    params = tuple((_align(lo, out_shape, p.shape), p.shape) for p in node.params)
    return _Op(ins, params, (lo, out_shape), frozenset(lo), (True,) * len(ins))


def _reduction(node: OpNode, out_shape) -> _Op:
    x = node.input_shapes[0]
    lx = _letters(len(x))
    kept = "".join(c for i, c in enumerate(lx) if i not in node.dims)
    out = kept if len(out_shape) == len(kept) else \
        "".join(c if i not in node.dims else _unsplit(len(x), lx)[i] for i, c in enumerate(lx))
    return _Op(((lx, x),), (), (out, out_shape), frozenset(lx), (True,))


def _replicated_op(node: OpNode, out_shape) -> _Op:
    ins = tuple((_unsplit(len(s), ""), s) for s in node.input_shapes)
    params = tuple((_unsplit(len(p.shape), ""), p.shape) for p in node.params)
    return _Op(ins, params, (_unsplit(len(out_shape), ""), out_shape), frozenset(), (True,) * len(ins))


def _align(labels: str, shape, other) -> str:
    """Labels of ``other`` against a tensor labelled ``labels``: numpy broadcasting from the right
    (equal sizes share the label, a size-1 dim gets an unsplittable one); when the shapes do not
    broadcast, a prefix of equal sizes (a targets vector against logits)."""
    other = tuple(other)
    fresh = iter(_unsplit(len(other), labels))
    right = len(other) <= len(shape) and all(o in (1, s) for o, s in zip(reversed(other), reversed(shape)))
    if right:
        off = len(shape) - len(other)
        return "".join(labels[off + i] if o == shape[off + i] else next(fresh) for i, o in enumerate(other))
    if other == tuple(shape[:len(other)]):
        return labels[:len(other)]
    return "".join(next(fresh) for _ in other)


# ---- the engine ----------------------------------------------------------------------------------

def _spec(labels: str, axes_of: dict[str, tuple[int, ...]]) -> ShardingSpec:
    return ShardingSpec(tuple(axes_of.get(c, ()) for c in labels))


def _share(spec: ShardingSpec, shape, mesh_shape) -> float:
    n = math.prod(shape)
    return spec.local_numel(tuple(shape), mesh_shape) / n if n else 1.0


def _assignments(op: _Op, mesh: Mesh):
    """Every map mesh axis -> label (or none); size-1 axes split nothing."""
    labels = sorted(op.splittable)
    choices = [[None] + (labels if size > 1 else []) for size in mesh.shape]
    for pick in itertools.product(*choices):
        axes_of: dict[str, tuple[int, ...]] = {}
        for axis, lbl in enumerate(pick):
            if lbl is not None:
                axes_of[lbl] = axes_of.get(lbl, ()) + (axis,)
        yield axes_of


def _engine(node: OpNode, op: _Op, mesh: Mesh, dtype_bytes: int, bytes_per_param: float,
            total_flops: float) -> list[Strategy]:
    ms = mesh.shape
    out: dict[str, Strategy] = {}
    for axes_of in _assignments(op, mesh):
        in_specs = tuple(_spec(lbl, axes_of) for lbl, _ in op.inputs)
        p_specs = tuple(_spec(lbl, axes_of) for lbl, _ in op.params)
        o_lbl, o_shape = op.output
        o_spec = _spec(o_lbl, axes_of)
        tensors = list(zip(in_specs, op.inputs)) + list(zip(p_specs, op.params)) + [(o_spec, op.output)]
        if not all(s.valid_for(tuple(shape), ms) for s, (_, shape) in tensors):
            continue
        used = [a for axes in axes_of.values() for a in axes]
        shards = math.prod(ms[a] for a in used)
        # forward: partial sums over split labels the output lacks
        out_bytes = o_spec.local_numel(tuple(o_shape), ms) * dtype_bytes
        partial = sorted(a for lbl, axes in axes_of.items() if lbl not in o_lbl for a in axes)
        u_f = sum(mesh.all_reduce_s(a, out_bytes) for a in partial)
        o_f = out_bytes if partial else 0
        # backward: dX is partial over split labels X lacks
        u_b = o_b = 0.0
        grads = [(s, t) for (s, t), g in zip(zip(in_specs, op.inputs), op.grads) if g] + list(zip(p_specs, op.params))
        for spec, (lbl, shape) in grads:
            axes = sorted(a for l2, ax in axes_of.items() if l2 not in lbl for a in ax)
            nbytes = spec.local_numel(tuple(shape), ms) * dtype_bytes
            u_b += sum(mesh.all_reduce_s(a, nbytes) for a in axes)
            o_b = max(o_b, nbytes if axes else 0)
        mem = _memory(node, in_specs, p_specs, o_spec, op, ms, bytes_per_param)
        name = ",".join(map(str, in_specs + p_specs)) + "->" + str(o_spec) + ("" if not partial else f"(AR{''.join(map(str, partial))})")
        out.setdefault(name, Strategy(name, in_specs, o_spec, p_specs, total_flops / shards, u_f + u_b, mem,
                                      u_f, u_b, o_f, o_b))
    return list(out.values())


def _memory(node: OpNode, in_specs, p_specs, o_spec, op: _Op, ms, bytes_per_param: float) -> float:
    shares = [_share(s, shape, ms) for s, (_, shape) in zip(in_specs, op.inputs)]
    o_share = _share(o_spec, op.output[1], ms)
    saved_in = node.fwd_in_inputs or (0,) * len(node.inputs)
    act = sum(b * sh for b, sh in zip(saved_in, shares))
    # internal saved tensors (LN mean/rstd, logsumexp, cross-entropy's log-probs) scale like the
    # largest activation input, or like the output when there is none
    big = max(range(len(shares)), key=lambda i: math.prod(op.inputs[i][1]), default=None)
    other_share = shares[big] if big is not None else o_share
    act += node.fwd_in_output * o_share + max(node.fwd_in_other, 0) * other_share
    params = sum(s.local_numel(tuple(shape), ms) for s, (_, shape) in zip(p_specs, op.params))
    return act + params * bytes_per_param


_GENERATORS = {
    "matmul": _matmul, "bmm": lambda n, o: _einsum(n, o) if n.equation else _matmul(n, o),
    "moe_dispatch": _einsum, "embedding": _embedding, "conv2d": _conv2d, "sdpa": _sdpa,
    "layer_norm": lambda n, o: _same_dims(n, o, set(n.dims)),
    "softmax": lambda n, o: _same_dims(n, o, set(n.dims)),
    "elementwise": _elementwise, "reduction": _reduction,
}


def _core_op(node: OpNode) -> _Op:
    core = node.ops[0] if node.ops else node
    out_shape = core.output_shapes[0] if core.output_shapes else ()
    if core.kind == "linear" and core.params:
        return _linear(core)
    gen = _GENERATORS.get(core.kind)
    if gen is None or (core.kind != "view" and not core.input_shapes and core.kind != "embedding"):
        return _replicated_op(core, out_shape)
    return gen(core, out_shape)


def strategies(node: OpNode, mesh: Mesh, dtype_bytes: int, bytes_per_param: float | None = None) -> list[Strategy]:
    """Every valid SPMD strategy of ``node`` on ``mesh`` (the fully replicated one first).

    ``dtype_bytes``: bytes per element of the activations and gradients the collectives move;
    ``bytes_per_param``: bytes per parameter element a device holds (weights only by default,
    e.g. 16 for mixed-precision Adam). A node merged by ``merge_trivial`` gets its core op's
    strategies with the output layout carried through the folded views and element-wise ops
    (a strategy whose layout cannot pass a view is dropped)."""
    bpp = float(dtype_bytes if bytes_per_param is None else bytes_per_param)
    core = node.ops[0] if node.ops else node
    if core.kind == "view":
        found = _view_strategies(core, mesh, dtype_bytes, bpp)
    else:
        found = _engine(core, _core_op(node), mesh, dtype_bytes, bpp, node.fwd_flops + node.bwd_flops)
    if node.ops:
        found = [s for s in (_through(node, s, mesh, dtype_bytes) for s in found) if s is not None]
    found.sort(key=lambda s: (s.output_spec.mesh_axes() != set() or any(x.mesh_axes() for x in s.input_specs + s.param_specs), s.name))
    rep = [s for s in found if not any(x.mesh_axes() for x in s.input_specs + s.param_specs + (s.output_spec,))]
    assert rep, f"{node.name}: no replicated strategy"
    return found


# ---- views and folded chains ---------------------------------------------------------------------

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


def _view_strategies(node: OpNode, mesh: Mesh, dtype_bytes: int, bpp: float) -> list[Strategy]:
    """A view moves no data: any input layout that maps through it, at no cost. A view of a
    parameter (the position table's slice) shards the parameter itself."""
    ms = mesh.shape
    src = node.input_shapes[0] if node.input_shapes else node.params[0].shape if node.params else None
    out_shape = node.output_shapes[0]
    if src is None:
        return [_plain(node, (), (), ShardingSpec.replicated(len(out_shape)), 0.0)]
    lx = _letters(len(src))
    found = {}
    for axes_of in _assignments(_Op((), (), ("", ()), frozenset(lx), ()), mesh):
        spec = _spec(lx, axes_of)
        if not spec.valid_for(tuple(src), ms):
            continue
        o = map_view(spec, src, out_shape, node.dims)
        if o is None or not o.valid_for(tuple(out_shape), ms):
            continue
        share = _share(spec, src, ms)
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


def _through(node: OpNode, s: Strategy, mesh: Mesh, dtype_bytes: int) -> Strategy | None:
    """Carry strategy ``s`` of a merged node's core op through its folded ops."""
    ms = mesh.shape
    spec, shape = s.output_spec, node.ops[0].output_shapes[0]
    extra_in: list[ShardingSpec] = []
    extra_p: list[ShardingSpec] = []
    mem = s.memory_bytes
    for op in node.ops[1:]:
        # the folded op's input from the group, and its other inputs
        k = op.inputs.index(node.name) if node.name in op.inputs else 0
        out_shape = op.output_shapes[0]
        saved = op.fwd_in_inputs or (0,) * len(op.inputs)
        if op.kind == "view":
            mem += saved[k] * _share(spec, shape, ms) if saved else 0
            spec = map_view(spec, shape, out_shape, op.dims)
            if spec is None:
                return None
        else:  # element-wise: every tensor aligned with the output, broadcasting from the right
            lo = _letters(len(out_shape))
            lbl_in = _align(lo, out_shape, shape)
            if len(lbl_in) != len(shape):
                return None
            axes_of = {c: spec.dims[i] for i, c in enumerate(lbl_in) if spec.dims[i] and c in lo}
            if sum(len(a) for a in axes_of.values()) != len(spec.mesh_axes()):
                return None  # a split size-1 (broadcast) dim cannot carry over
            new = _spec(lo, axes_of)
            mem += saved[k] * _share(spec, shape, ms) if saved else 0
            for i, (other, oshape) in enumerate(zip(op.inputs, op.input_shapes)):
                if i == k:
                    continue
                es = _spec(_align(lo, out_shape, oshape), axes_of)
                extra_in.append(es)
                mem += saved[i] * _share(es, oshape, ms)
            for p in op.params:
                extra_p.append(_spec(_align(lo, out_shape, p.shape), axes_of))
            spec = new
        shape = out_shape
        mem += op.fwd_in_output * _share(spec, shape, ms) + max(op.fwd_in_other, 0) * _share(spec, shape, ms)
        if not spec.valid_for(tuple(shape), ms):
            return None
    ins = s.input_specs + tuple(extra_in)
    if len(ins) != len(node.inputs) or not all(x.valid_for(tuple(sh), ms) for x, sh in zip(ins, node.input_shapes)):
        return None
    params = s.param_specs + tuple(extra_p)
    name = s.name.split("->")[0] + "->" + str(spec) + ("(" + s.name.split("(", 1)[1] if "(AR" in s.name else "")
    return Strategy(name, ins, spec, params, s.flops_per_device, s.comm_s, mem,
                    s.u_fcomm, s.u_bcomm, s.o_fcomm, s.o_bcomm)


__all__ = ["Strategy", "map_view", "strategies"]
