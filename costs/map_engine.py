"""MAP's strategy engine (MAP §5.1; GSPMD §3.3): every assignment of mesh axes to an op's
splittable labels, costed in FLOPs, collective time and memory per device. The rules are in
``costs.map_strategies``' docstring; the labelled ops come from ``costs.map_ops``. Pure: no torch.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from costs.map_ops import LabelledOp
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
    #: forward HBM bytes one device moves in the node's memory-bound operators (issue 26: the
    #: element-wise traffic the closed forms charge, costs.layer_time._mem_s): see :func:`hbm_bytes`
    hbm_bytes: float = 0.0
    #: of ``u_bcomm``, the parameter-gradient all-reduces (the data-parallel part): a training
    #: iteration runs them once, overlapped with the backward (simulator.sharded.grad_sync_exposed_s),
    #: not once per microbatch
    grad_sync_s: float = 0.0


def spec_of(labels: str, axes_of: dict[str, tuple[int, ...]]) -> ShardingSpec:
    """The layout of a tensor labelled ``labels`` when label c is split over ``axes_of[c]``."""
    return ShardingSpec(tuple(axes_of.get(c, ()) for c in labels))


def share_of(spec: ShardingSpec, shape, mesh_shape) -> float:
    """The fraction of a tensor of ``shape`` one device holds in layout ``spec``."""
    n = math.prod(shape)
    return spec.local_numel(tuple(shape), mesh_shape) / n if n else 1.0


def assignments(op: LabelledOp, mesh: Mesh):
    """Every map mesh axis -> label (or none); size-1 axes split nothing."""
    labels = sorted(op.splittable)
    choices = [[None] + (labels if size > 1 else []) for size in mesh.shape]
    for pick in itertools.product(*choices):
        axes_of: dict[str, tuple[int, ...]] = {}
        for axis, lbl in enumerate(pick):
            if lbl is not None:
                axes_of[lbl] = axes_of.get(lbl, ()) + (axis,)
        yield axes_of


def engine_strategies(node: OpNode, op: LabelledOp, mesh: Mesh, dtype_bytes: int, bytes_per_param: float,
                      total_flops: float) -> list[Strategy]:
    """Every valid strategy of ``op`` (labelled ``node``) on ``mesh``, one per distinct name, in
    the order :func:`assignments` yields them."""
    ms = mesh.shape
    out: dict[str, Strategy] = {}
    for axes_of in assignments(op, mesh):
        in_specs = tuple(spec_of(lbl, axes_of) for lbl, _ in op.inputs)
        p_specs = tuple(spec_of(lbl, axes_of) for lbl, _ in op.params)
        o_lbl, o_shape = op.output
        o_spec = spec_of(o_lbl, axes_of)
        tensors = list(zip(in_specs, op.inputs)) + list(zip(p_specs, op.params)) + [(o_spec, op.output)]
        if not all(s.valid_for(tuple(shape), ms) for s, (_, shape) in tensors):
            continue
        used = [a for axes in axes_of.values() for a in axes]
        shards = math.prod(ms[a] for a in used)
        partial, u_f, o_f = _forward_comm(op, axes_of, o_spec, mesh, dtype_bytes)
        u_b, o_b = _backward_comm(op, axes_of, in_specs, p_specs, mesh, dtype_bytes)
        sync = sum(param_sync_s(sp, shape, used, mesh, dtype_bytes) for sp, (_, shape) in zip(p_specs, op.params))
        mem = _memory(node, in_specs, p_specs, o_spec, op, ms, bytes_per_param)
        name = ",".join(map(str, in_specs + p_specs)) + "->" + str(o_spec) + ("" if not partial else f"(AR{''.join(map(str, partial))})")
        out.setdefault(name, Strategy(name, in_specs, o_spec, p_specs, total_flops / shards, u_f + u_b, mem,
                                      u_f, u_b, o_f, o_b, hbm_bytes(node, op, in_specs, o_spec, ms), sync))
    return list(out.values())


def param_sync_s(spec: ShardingSpec, shape, used_axes, mesh: Mesh, dtype_bytes: int) -> float:
    """Seconds of one parameter's gradient all-reduce: its local gradient is partial over every
    axis the strategy splits (``used_axes``) that the parameter itself is not split over (GSPMD
    §3.3's partial-sum rule; over a batch axis this is data parallelism's all-reduce)."""
    axes = sorted(set(used_axes) - spec.mesh_axes())
    nbytes = spec.local_numel(tuple(shape), mesh.shape) * dtype_bytes
    return sum(mesh.all_reduce_s(a, nbytes) for a in axes)


def hbm_bytes(node: OpNode, op: LabelledOp, in_specs, o_spec: ShardingSpec, ms) -> float:
    """Forward HBM bytes one device moves in ``node``'s own operator outside GEMM kernels, each
    tensor at its local share, as the closed forms count them (costs.family_transformer's
    ``*_mem_bytes``):

    * GEMM kinds (linear, matmul, bmm, conv2d, MoE dispatch): none (their FLOPs are priced);
    * scaled-dot-product attention: the a·s_q·s_k scores' softmax (in + out) and the dropout of
      the probabilities (in + out, and a 1-byte mask), as Megatron's attention core runs them and
      ``attention_mem_bytes`` charges them (Korthikanti et al. 2022 §4.1 for the tensors); the
      Megatron side of the comparison is priced so, and one device runs one program;
    * a softmax cross-entropy (a loss): ~3 passes over its logits (max, exp-sum, loss) and the
      log-probabilities written (``head_layer``'s 4 x 4sV); other inputs (targets) read once;
    * an embedding lookup: its ids read, the gathered rows read and written (output-sized);
    * a view: none; anything else (layer norm, softmax, element-wise, reductions): every
      activation input read and the output written."""
    kind = node.kind
    if kind in ("linear", "matmul", "bmm", "conv2d", "moe_dispatch", "view"):
        return 0.0
    out_shape = tuple(op.output[1])
    out_db = node.output_dtype_bytes[0] if node.output_dtype_bytes else 0
    out_b = math.prod(out_shape) * out_db * share_of(o_spec, out_shape, ms) if out_shape or out_db else 0.0
    ins = [math.prod(s) * db * share_of(sp, s, ms)
           for sp, s, db in zip(in_specs, node.input_shapes, node.input_dtype_bytes)]
    if kind == "sdpa":
        q, k = node.input_shapes[0], node.input_shapes[1]
        scores = math.prod(q[:-1]) * k[-2] * share_of(in_specs[0], q, ms)
        return scores * (4 * node.input_dtype_bytes[0] + 1)
    if kind == "softmax" and "cross_entropy" in node.target:
        big = max(range(len(ins)), key=ins.__getitem__)
        return 4 * ins[big] + sum(ins) - ins[big] + out_b
    if kind == "embedding":
        return ins[0] + 2 * out_b
    return sum(ins) + out_b


def _forward_comm(op: LabelledOp, axes_of: dict[str, tuple[int, ...]], o_spec: ShardingSpec, mesh: Mesh,
                  dtype_bytes: int) -> tuple[list[int], float, float]:
    """Forward: partial sums over split labels the output lacks, all-reduced over their axes.
    Returns (those axes ascending, u_fcomm, o_fcomm)."""
    o_lbl, o_shape = op.output
    out_bytes = o_spec.local_numel(tuple(o_shape), mesh.shape) * dtype_bytes
    partial = sorted(a for lbl, axes in axes_of.items() if lbl not in o_lbl for a in axes)
    u_f = sum(mesh.all_reduce_s(a, out_bytes) for a in partial)
    o_f = out_bytes if partial else 0
    return partial, u_f, o_f


def _backward_comm(op: LabelledOp, axes_of: dict[str, tuple[int, ...]], in_specs, p_specs, mesh: Mesh,
                   dtype_bytes: int) -> tuple[float, float]:
    """Backward: dX is partial over split labels X lacks (differentiable inputs and every
    parameter), all-reduced over their axes. Returns (u_bcomm, o_bcomm)."""
    ms = mesh.shape
    u_b = o_b = 0.0
    grads = [(s, t) for (s, t), g in zip(zip(in_specs, op.inputs), op.grads) if g] + list(zip(p_specs, op.params))
    for spec, (lbl, shape) in grads:
        axes = sorted(a for l2, ax in axes_of.items() if l2 not in lbl for a in ax)
        nbytes = spec.local_numel(tuple(shape), ms) * dtype_bytes
        u_b += sum(mesh.all_reduce_s(a, nbytes) for a in axes)
        o_b = max(o_b, nbytes if axes else 0)
    return u_b, o_b


def _memory(node: OpNode, in_specs, p_specs, o_spec, op: LabelledOp, ms, bytes_per_param: float) -> float:
    shares = [share_of(s, shape, ms) for s, (_, shape) in zip(in_specs, op.inputs)]
    o_share = share_of(o_spec, op.output[1], ms)
    saved_in = node.fwd_in_inputs or (0,) * len(node.inputs)
    act = sum(b * sh for b, sh in zip(saved_in, shares))
    # internal saved tensors (LN mean/rstd, logsumexp, cross-entropy's log-probs) scale like the
    # largest activation input, or like the output when there is none
    big = max(range(len(shares)), key=lambda i: math.prod(op.inputs[i][1]), default=None)
    other_share = shares[big] if big is not None else o_share
    act += node.fwd_in_output * o_share + max(node.fwd_in_other, 0) * other_share
    params = sum(s.local_numel(tuple(shape), ms) for s, (_, shape) in zip(p_specs, op.params))
    return act + params * bytes_per_param

