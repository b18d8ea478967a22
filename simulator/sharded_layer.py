"""Costs of one MAP-sharded layer (MAP §5.1-5.2): its mesh, each operator group's strategy and
compute, and the layer as one stage of MAP's rotor chain (costs.rotor.Chain, Table 1-2
quantities); simulator.sharded assembles a stage from them. Shared by the MAP planner and the
simulator.

A layer's plan (specs.plan.LayerSharding) names one strategy per operator group of its op graph
(specs.op_graph). Here each named strategy is found among ``costs.map_strategies``' generated
ones (so the planner's ILP and the simulator price the same object):

* u_f / u_b: per-node compute on the device's share: each GEMM kernel on its local shape on
  costs.gemm's roofline (as the closed forms price theirs), plus the HBM traffic of every
  operator outside GEMM kernels, folded element-wise ops included (Strategy.hbm_bytes; the
  backward BWD_MEM_FACTOR times it), plus per-operator framework overhead, plus (backward) the
  gradient accumulation of the stored parameters (issue 26: the one-device program costs what the
  closed form charges, within 2 %);
* u_fcomm / u_bcomm: the strategies' collectives (partial sums, eq. 1's c_v) -- except the
  parameter-gradient all-reduces, which run once per iteration (LayerCost.grad_sync_s,
  simulator.sharded.grad_sync_exposed_s) -- plus the layout
  conversions on the edges (Algorithm 1, costs.map_layout.convert; eq. 1's R_uv): forward
  src -> dst, and in backward the gradient back dst -> src (DTensor's redistribute backward);
* w_a / w_delta: the layer output's local bytes; w_abar: what the backward needs (MAP §4.1's
  fwd_in per node, scaled by the local share of the tensor each part belongs to), the output
  included, the layer input excluded (that is a^{l-1}, the previous stage's);
* o_f / o_b: the largest transient (fwd_tmp, bwd_tmp + bwd_out) of one node, by share;
  o_fcomm / o_bcomm: the largest collective / conversion buffer.

Pure: no I/O, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from costs.map_layout import convert
from costs.rotor import Chain, Segment, sequence_of
from costs.map_engine import param_sync_s
from costs.map_strategies import Strategy, strategies
from costs import gemm
from costs.collectives import allreduce_link
from costs.layer_time import BWD_MEM_FACTOR
from specs.hardware import HardwareSpec
from specs.op_graph import OpGraph, OpNode
from specs.plan import LayerSharding, NodeSharding
from specs.sharding import Mesh, MeshAxis, ShardingSpec, mesh_lines


#: kinds whose FLOPs run as GEMM kernels (priced on the device's GEMM efficiency curve)
GEMM_KINDS = frozenset({"linear", "matmul", "bmm", "sdpa", "conv2d", "moe_dispatch"})


def stage_mesh(hardware: HardwareSpec, devices: tuple[int, ...], shape: tuple[int, ...]) -> Mesh:
    """The stage's devices as a mesh of ``shape`` (row-major, last axis fastest). Each axis is priced
    by its slowest ring (costs.collectives.allreduce_link: the collective's bus bandwidth and per-step
    latency), as MAP §4.2 prices an axis by its slowest pair."""
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh {list(shape)} has {math.prod(shape)} devices, the stage {len(devices)}")
    axes = []
    for k, size in enumerate(shape):
        if size == 1:
            axes.append(MeshAxis(1, 0.0, math.inf))
            continue
        worst_bw, worst_lat = math.inf, 0.0
        for ring in mesh_lines(list(devices), shape, k):  # one ring per line of the axis
            link = allreduce_link(hardware, ring)
            lat = link.collective_latency_s if link.collective_latency_s is not None else link.latency_s
            worst_bw, worst_lat = min(worst_bw, link.total_bw_gbps * 1e9), max(worst_lat, lat)
        axes.append(MeshAxis(size, worst_lat, worst_bw))
    return Mesh(tuple(axes))


def node_compute_s(node: OpNode, strategy: Strategy, mesh: Mesh, hardware: HardwareSpec,
                   dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of ``node``'s own compute on one device under ``strategy``.
    Per operator of the node, each pass pays ``op_overhead_s`` plus ``dtensor_op_overhead_s``: the
    executor runs every operator of a MAP stage on DTensors (executor.map_exec), whose dispatch
    (sharding propagation, wrapping) is host work on top of the plain framework cost."""
    dev = hardware.device
    overhead = max(len(node.ops), 1) * (dev.op_overhead_s + dev.dtensor_op_overhead_s)
    # memory-bound work (issue 26): every operator of the group outside GEMM kernels moves its
    # tensors' local shares through HBM (costs.map_engine.hbm_bytes, the folded ops'
    # in costs.map_views.through_folded), as the closed forms charge it (costs.layer_time._mem_s);
    # the backward moves BWD_MEM_FACTOR times that (grad in, saved, grad out)
    mem = strategy.hbm_bytes / dev.hbm_bytes_per_s
    fwd, bwd = mem, BWD_MEM_FACTOR * mem
    shapes = gemm_shapes(node, strategy, mesh.shape) if node.kind in GEMM_KINDS else None
    if shapes:
        # each GEMM on its local shape, on costs.gemm's roofline as the closed forms price theirs
        # (costs.gemm.gemms_fwd_s / gemms_bwd_s: the same kernels, the same curve)
        for sh in shapes:
            fwd += gemm.gemm_time_s(dev, dtype, *sh)
            bwd += sum(gemm.gemm_time_s(dev, dtype, *g) for g in gemm.backward_shapes(sh))
    elif node.kind in GEMM_KINDS and node.fwd_flops > 0:
        rate = dev.peak_tflops[dtype] * 1e12
        # the generator's flops_per_device is forward + backward over the devices sharing the work
        share = strategy.flops_per_device / (node.fwd_flops + node.bwd_flops)
        f, b = node.fwd_flops * share, node.bwd_flops * share
        fwd += f / (rate * gemm.efficiency(dev, dtype, f)) if f > 0 else 0.0
        # backward: two GEMMs (data and weight gradient) of about the forward's size each
        bwd += b / (rate * gemm.efficiency(dev, dtype, b / 2)) if b > 0 else 0.0
    return fwd + overhead, bwd + overhead


def gemm_shapes(node: OpNode, strategy: Strategy, ms: tuple[int, ...]) -> list[tuple[int, int, int, int]] | None:
    """The (m, n, k, batch) local shapes of the GEMM kernels ``node``'s core operator runs under
    ``strategy`` (costs.gemm.rank_shape's convention): a linear one (b·s x k)·(k x n); a matmul its
    two last dims with the leading ones as the batch; scaled-dot-product attention the scores
    Q·Kᵀ and the product with V, one per (sample, head) (``attention_gemms``). None for the
    kinds priced by FLOPs alone (convolutions, einsum contractions, MoE dispatch) and for shapes
    these rules do not cover."""
    core = node.ops[0] if node.ops else node
    ins = [sp.local_shape(tuple(sh), ms) for sp, sh in zip(strategy.input_specs, core.input_shapes)]
    prm = [sp.local_shape(tuple(p.shape), ms) for sp, p in zip(strategy.param_specs, core.params)]
    if core.kind == "linear" and ins and prm and len(prm[0]) == 2 and ins[0]:
        x, w = ins[0], prm[0]
        return [(math.prod(x[:-1]), w[0], x[-1], 1)]
    if core.kind in ("matmul", "bmm") and not core.equation:
        ops = [t for t in ins + prm if len(t) >= 2][-2:]
        if len(ops) < 2:
            return None
        a, b = ops
        return [(a[-2], b[-1], a[-1], max(math.prod(a[:-2]), math.prod(b[:-2])))]
    if core.kind == "sdpa" and len(ins) >= 3 and all(len(t) == 4 for t in ins[:3]):
        q, k, v = ins[:3]
        batch = q[0] * q[1]
        return [(q[2], k[2], q[3], batch), (q[2], v[3], k[2], batch)]
    return None


def _key(spec: ShardingSpec) -> str:
    return str(spec)


@lru_cache(maxsize=4096)
def _strategies(node: OpNode, mesh: Mesh, dtype_bytes: int, bytes_per_param: float) -> dict[tuple, Strategy]:
    out: dict[tuple, Strategy] = {}
    for s in strategies(node, mesh, dtype_bytes, bytes_per_param):
        key = (tuple(map(_key, s.input_specs)), tuple(map(_key, s.param_specs)), _key(s.output_spec))
        out.setdefault(key, s)
    return out


def find_strategy(node: OpNode, ns: NodeSharding, mesh: Mesh, dtype_bytes: int, bytes_per_param: float) -> Strategy:
    """The generated strategy of ``node`` the plan names (ValueError: none matches)."""
    params = tuple(ns.params.get(p.name, "") for p in node.params)
    key = (tuple(str(ShardingSpec.parse(t)) for t in ns.inputs),
           tuple(str(ShardingSpec.parse(t)) for t in params), str(ShardingSpec.parse(ns.output)))
    found = _strategies(node, mesh, dtype_bytes, bytes_per_param).get(key)
    if found is None:
        raise ValueError(f"node {node.name!r}: inputs {list(key[0])}, params {list(key[1])} -> {key[2]} is not a "
                         f"strategy MAP's generator gives for a {node.kind} on mesh {list(mesh.shape)}")
    return found


def act_dtype_bytes(graph: OpGraph) -> int:
    """Bytes per element of the activations (and their gradients) the layer's collectives move: its
    differentiable input's (``x``), else its output's. Not ``graph.inputs[0]``: a first layer's
    inputs are token ids (int64), which no collective of its strategies moves."""
    for gi in graph.inputs:
        if gi.requires_grad:
            return gi.dtype_bytes
    out = next((n for n in graph.nodes if n.name == graph.outputs[0]), None) if graph.outputs else None
    if out is not None and out.output_dtype_bytes:
        return out.output_dtype_bytes[0]
    return graph.inputs[0].dtype_bytes if graph.inputs else 4


def _share(spec: ShardingSpec, shape, mesh_shape) -> float:
    n = math.prod(shape)
    return spec.local_numel(tuple(shape), mesh_shape) / n if n else 1.0


@dataclass(frozen=True)
class LayerCost:
    """One layer as a rotor chain stage (seconds, bytes per device), plus its parameter elements
    stored on a device (a tied copy read from its owner is not stored) and the output's layout."""

    u_f: float
    u_b: float
    u_fcomm: float
    u_bcomm: float
    w_a: int
    w_abar: int
    o_f: int
    o_b: int
    o_fcomm: int
    o_bcomm: int
    param_elems: int
    output_spec: str
    #: the parameter-gradient all-reduces of the stored parameters (seconds, once per iteration:
    #: not in u_bcomm; simulator.sharded overlaps them with the last microbatch's backward)
    grad_sync_s: float = 0.0
    #: the layout conversions inside the layer (Algorithm 1) in graph order, (what, src, dst,
    #: forward s, backward s) each, ``what`` "<node> in<k>" / "<node> <param>" as executor.map_layout
    #: names the executed ones; their seconds are part of u_fcomm / u_bcomm (:func:`conversion_slices`
    #: lays them out in a pass for the trace; issue 26)
    conversions: tuple[tuple[str, str, str, float, float], ...] = ()




@dataclass
class _Sums:
    """layer_cost's running state over the graph's nodes (graph order): each tensor's layout, each
    parameter's stored layout and stored elements, and the chain quantities summed or maxed."""

    layout: dict[str, ShardingSpec]
    stored: dict[str, ShardingSpec]
    params: dict[str, int] = field(default_factory=dict)
    u_f: float = 0.0
    u_b: float = 0.0
    u_fc: float = 0.0
    u_bc: float = 0.0
    saved: float = 0.0
    o_f: float = 0.0
    o_b: float = 0.0
    o_fc: float = 0.0
    o_bc: float = 0.0
    grad_sync: float = 0.0
    convs: list[tuple[str, str, str, float, float]] = field(default_factory=list)

    def redistribute(self, src: ShardingSpec, dst: ShardingSpec, shape: tuple, dtype_bytes: int, mesh: Mesh,
                     what: str = "") -> None:
        """A layout conversion (Algorithm 1): src -> dst in forward, the gradient back in backward;
        ``what`` names it ("<node> in<k>" / "<node> <param>", :attr:`LayerCost.conversions`)."""
        fwd = convert(src, dst, shape, dtype_bytes, mesh)
        back = convert(dst, src, shape, dtype_bytes, mesh)
        self.u_fc, self.u_bc = self.u_fc + fwd.cost_s, self.u_bc + back.cost_s
        self.convs.append((what, str(src), str(dst), fwd.cost_s, back.cost_s))
        # the bytes live while each runs: an all-gather off dim 0 holds its staging buffer and the cat
        # output at once (costs.map_layout.step_work_bytes; issue 26: a recomputed block's backward)
        self.o_fc = max(self.o_fc, fwd.peak_bytes, fwd.work_bytes)
        self.o_bc = max(self.o_bc, back.peak_bytes, back.work_bytes)


def layer_cost(graph: OpGraph, sharding: LayerSharding, mesh: Mesh, hardware: HardwareSpec, dtype: str,
               bytes_per_param: float, input_specs: dict[str, str], skip_params: frozenset[str] = frozenset(),
               param_layouts: dict[str, str] | None = None, accumulate_bytes_per_param: float = 0.0) -> LayerCost:
    """``input_specs``: layout of each graph input as it arrives (the previous layer's output
    layout for ``x``; batch fields arrive replicated when absent). ``skip_params``: parameters
    this layer reads but does not store (a tied copy: its owner stores it); ``param_layouts``:
    the layout such a parameter is stored in (its owner's), when known.

    A parameter is stored once, in the layout of the first node that reads it (executor.map_exec
    distributes it so); a node reading it in another layout gets a differentiable redistribute
    (its gradient converts back), priced like an activation conversion (Algorithm 1).

    ``accumulate_bytes_per_param``: HBM bytes per stored parameter element that adding a
    microbatch's gradient into the accumulated one moves in each backward (the closed forms'
    ``costs.layer_time.accumulate_bytes_per_param``; 0 by default)."""
    by_name = {n.node: n for n in sharding.nodes}
    missing = [n.name for n in graph.nodes if n.name not in by_name]
    if missing:
        raise ValueError(f"layer {sharding.layer}: no strategy for op graph nodes {missing}")
    act_bytes = act_dtype_bytes(graph)
    sums = _Sums(_input_layouts(graph, input_specs),
                 {k: ShardingSpec.parse(v) for k, v in (param_layouts or {}).items()})
    for node in graph.nodes:
        st = find_strategy(node, by_name[node.name], mesh, act_bytes, bytes_per_param)
        _add_node(sums, node, st, mesh, hardware, dtype, skip_params, act_bytes)
    sums.u_b += sum(sums.params.values()) * accumulate_bytes_per_param / hardware.device.hbm_bytes_per_s
    return _layer_of(sums, graph, mesh.shape)


def _input_layouts(graph: OpGraph, input_specs: dict[str, str]) -> dict[str, ShardingSpec]:
    """Each graph input's layout as it arrives (replicated unless ``input_specs`` names it)."""
    layout: dict[str, ShardingSpec] = {}
    for gi in graph.inputs:
        layout[gi.name] = ShardingSpec.parse(input_specs[gi.name]) if gi.name in input_specs \
            else ShardingSpec.replicated(len(gi.shape))
    return layout


def _add_node(sums: _Sums, node: OpNode, st: Strategy, mesh: Mesh, hardware: HardwareSpec, dtype: str,
              skip_params: frozenset[str], dtype_bytes: int) -> None:
    """One node under its strategy: its compute and collectives, then its inputs, transients and
    parameters; its output takes the strategy's layout."""
    f, b = node_compute_s(node, st, mesh, hardware, dtype)
    sums.u_f, sums.u_b = sums.u_f + f, sums.u_b + b
    # the parameter-gradient all-reduces leave the per-microbatch backward (issue 26): _add_params
    # counts them once per stored parameter, for the iteration
    sums.u_fc, sums.u_bc = sums.u_fc + st.u_fcomm, sums.u_bc + st.u_bcomm - st.grad_sync_s
    sums.o_fc, sums.o_bc = max(sums.o_fc, st.o_fcomm), max(sums.o_bc, st.o_bcomm)
    ins = list(st.input_specs)
    _add_inputs(sums, node, ins, mesh)
    _add_transients(sums, node, st, ins, mesh.shape)
    _add_params(sums, node, st, mesh, skip_params, dtype_bytes)
    sums.layout[node.name] = st.output_spec


def _add_inputs(sums: _Sums, node: OpNode, ins: list[ShardingSpec], mesh: Mesh) -> None:
    """Each input converted to the layout the strategy reads it in, and its saved part."""
    ms = mesh.shape
    for k, (src_name, shape, db) in enumerate(zip(node.inputs, node.input_shapes, node.input_dtype_bytes)):
        src = sums.layout.get(src_name, ShardingSpec.replicated(len(shape)))
        if src != ins[k] and src.ndim == ins[k].ndim:
            sums.redistribute(src, ins[k], tuple(shape), db, mesh, f"{node.name} in{k}")
        # saved parts of this input: the layer input itself (unconverted) is a^{l-1}, not ours
        part = node.fwd_in_inputs[k] if k < len(node.fwd_in_inputs) else 0
        if not (src_name == "x" and src == ins[k]):
            sums.saved += part * _share(ins[k], shape, ms)


def _add_transients(sums: _Sums, node: OpNode, st: Strategy, ins: list[ShardingSpec], ms: tuple[int, ...]) -> None:
    """The node's saved output and other tensors, and its forward and backward scratch, by share."""
    out_shape = node.output_shapes[0] if node.output_shapes else ()
    o_share = _share(st.output_spec, out_shape, ms)
    big = max(range(len(node.inputs)), key=lambda i: math.prod(node.input_shapes[i]), default=None)
    other_share = _share(ins[big], node.input_shapes[big], ms) if big is not None else o_share
    # a group of MAP §5.1 (a core op with element-wise ops and views folded in): the tensors
    # flowing inside it (the core's output that a folded GeLU saves, the gradients the folded ops
    # hand back to the core) are laid out as the group's output, not as its largest input --
    # costs.map_views.through_folded prices the same saved bytes at that share for the ILP
    core = node.ops[0] if node.ops else node
    inner_saved = max(node.fwd_in_other - max(core.fwd_in_other, 0), 0)
    sums.saved += (node.fwd_in_output * o_share + max(core.fwd_in_other, 0) * other_share
                   + inner_saved * o_share)
    # forward scratch scales with the node's work on this device: the share of its largest
    # tensor (a loss's scratch is its logits' softmax, not its scalar output's size)
    big_in = math.prod(node.input_shapes[big]) if big is not None else 0
    tmp_share = o_share if math.prod(out_shape) >= big_in else other_share
    sums.o_f = max(sums.o_f, node.fwd_tmp * tmp_share)
    inner_grads = sum(op.bwd_tmp + op.bwd_out for op in node.ops[1:])
    sums.o_b = max(sums.o_b, (core.bwd_tmp + core.bwd_out) * other_share + inner_grads * o_share)


def _add_params(sums: _Sums, node: OpNode, st: Strategy, mesh: Mesh, skip_params: frozenset[str],
                dtype_bytes: int) -> None:
    """The node's parameters: stored in the first reader's layout, redistributed for a later reader
    in another one; a skipped (tied) copy is not stored. A stored parameter's gradient all-reduce
    (costs.map_engine.param_sync_s, at the strategies' ``dtype_bytes``) is counted once, with its
    first reader's strategy."""
    ms = mesh.shape
    used = set().union(*(x.mesh_axes() for x in st.input_specs + st.param_specs + (st.output_spec,)))
    for p, spec in zip(node.params, st.param_specs):
        home = sums.stored.setdefault(p.name, spec)
        if home != spec and home.ndim == spec.ndim:
            sums.redistribute(home, spec, tuple(p.shape), p.dtype_bytes, mesh, f"{node.name} {p.name}")
        if p.name not in skip_params and p.name not in sums.params:
            sums.params[p.name] = spec.local_numel(tuple(p.shape), ms)
            sums.grad_sync += param_sync_s(spec, p.shape, used, mesh, dtype_bytes)


def _layer_of(sums: _Sums, graph: OpGraph, ms: tuple[int, ...]) -> LayerCost:
    """The finished sums as a chain stage: w_a the output's local bytes, w_abar the saved bytes
    with the output counted once."""
    nodes = {n.name: n for n in graph.nodes}
    out = nodes[graph.outputs[0]]
    out_spec = sums.layout[out.name]
    out_shape = out.output_shapes[0] if out.output_shapes else ()
    w_a = math.ceil(math.prod(out_shape) * out.output_dtype_bytes[0] * _share(out_spec, out_shape, ms)) \
        if out.output_dtype_bytes else 0
    out_saved = out.fwd_in_output * _share(out_spec, out_shape, ms)
    w_abar = max(w_a, math.ceil(sums.saved - out_saved) + w_a)
    return LayerCost(sums.u_f, sums.u_b, sums.u_fc, sums.u_bc, w_a, w_abar, math.ceil(sums.o_f), math.ceil(sums.o_b),
                     math.ceil(sums.o_fc), math.ceil(sums.o_bc), sum(sums.params.values()), str(out_spec),
                     sums.grad_sync, tuple(sums.convs))


#: one conversion slice of a pass: (offset from the pass's start ns, duration ns, trace name)
ConvSlice = tuple[int, int, str]


def conversion_slices(chain: Chain, segments: tuple[Segment, ...], costs: tuple[LayerCost, ...],
                      layer_of: tuple[int, ...]) -> tuple[tuple[ConvSlice, ...], tuple[ConvSlice, ...]]:
    """The layout conversions (:attr:`LayerCost.conversions`) of one microbatch's forward and
    backward pass through a MAP stage, as trace slices (issue 26: compare's ``conversion`` row gets
    a simulated side). Rotor's sequence of the checkpoint tree is walked as simulator.sharded's
    stage_pass walks it (the forward ends with the last layer's first forward): every forward of a
    chain stage (a recomputation in the backward too) runs its forward conversions, every B its
    gradients' (DTensor's redistribute backward), each within that op's t_fwd / t_bwd, at its start,
    one after another. ``layer_of``: the model layer of each chain stage (names: ``convert L<l>
    <what> <src>-><dst>``, ``convert grad L<l> <what> <dst>-><src>``, as
    executor.timeline.conversion_name). Slices only: the pass times are unchanged (the conversions'
    seconds are inside them). Returns (forward slices, backward slices), offsets from each pass's
    start in integer nanoseconds."""
    seq = sequence_of(segments, len(chain))
    last = len(chain) - 1
    first_b = next(i for i, (op, l) in enumerate(seq) if op != "B" and l == last) + 1
    passes: tuple[list[ConvSlice], list[ConvSlice]] = ([], [])
    now = 0.0
    for i, (op, l) in enumerate(seq):
        if i == first_b:
            now = 0.0
        out = passes[0] if i < first_b else passes[1]
        at = now
        for what, src, dst, fwd_s, bwd_s in costs[l].conversions:
            dur = bwd_s if op == "B" else fwd_s
            name = (f"convert grad L{layer_of[l]} {what} {dst}->{src}" if op == "B"
                    else f"convert L{layer_of[l]} {what} {src}->{dst}")
            out.append((int(round(at * 1e9)), int(round(dur * 1e9)), name))
            at += dur
        now += chain.t_bwd(l) if op == "B" else chain.t_fwd(l)
    return tuple(passes[0]), tuple(passes[1])
