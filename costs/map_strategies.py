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
* ``grad_sync_s`` (issue 26): the part of ``u_bcomm`` that all-reduces parameter gradients (a
  folded op's parameters included). A training iteration runs it once, overlapped with the
  backward (simulator.sharded), not once per microbatch as the rest of ``u_bcomm``.
* ``hbm_bytes`` (issue 26): forward bytes one device moves through HBM in the node's operators
  outside GEMM kernels -- layer norms, softmax and loss passes, the attention core's scores, and
  every folded element-wise op (GeLU, residual add, cast) -- each tensor at its local share
  (``costs.map_engine.hbm_bytes``, ``costs.map_views.through_folded``), as the closed forms count
  them (``costs.layer_time._mem_s``).

Kinds without a generator here (``other``: topk, one_hot, cumsum, pooling) get the fully
replicated strategy only, which every node has.

The steps live in their own modules: ``costs.map_ops`` labels each op family as an einsum,
``costs.map_engine`` enumerates and costs the axis assignments, ``costs.map_views`` carries
layouts through views and folded chains; :func:`strategies` here puts them together.
"""
from __future__ import annotations

from costs.map_engine import Strategy, engine_strategies
from costs.map_ops import core_op
from costs.map_views import map_view, through_folded, view_strategies
from specs.op_graph import OpNode
from specs.sharding import Mesh

__all__ = ["Strategy", "map_view", "strategies"]


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
        found = view_strategies(core, mesh, dtype_bytes, bpp)
    else:
        found = engine_strategies(core, core_op(node), mesh, dtype_bytes, bpp, node.fwd_flops + node.bwd_flops)
    if node.ops:
        found = [s for s in (through_folded(node, s, mesh, dtype_bytes) for s in found) if s is not None]
    found.sort(key=lambda s: (s.output_spec.mesh_axes() != set() or any(x.mesh_axes() for x in s.input_specs + s.param_specs), s.name))
    rep = [s for s in found if not any(x.mesh_axes() for x in s.input_specs + s.param_specs + (s.output_spec,))]
    assert rep, f"{node.name}: no replicated strategy"
    return found
