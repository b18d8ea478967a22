"""Costs of a MAP-sharded layer and stage (MAP §5.1-5.3), shared by the MAP planner and the simulator.

A layer's plan (specs.plan.LayerSharding) names one strategy per operator group of its op graph
(specs.op_graph). Here each named strategy is found among ``costs.map_strategies``' generated
ones (so the planner's ILP and the simulator price the same object), and the layer becomes one
stage of MAP's rotor chain (costs.rotor.Chain, Table 1-2 quantities):

* u_f / u_b: per-node compute on the device's share (GEMM kinds at the device's GEMM efficiency
  for the kernel size, the rest memory-bound), plus per-operator framework overhead;
* u_fcomm / u_bcomm: the strategies' collectives (partial sums, eq. 1's c_v) plus the layout
  conversions on the edges (Algorithm 1, costs.map_layout.convert; eq. 1's R_uv): forward
  src -> dst, and in backward the gradient back dst -> src (DTensor's redistribute backward);
* w_a / w_delta: the layer output's local bytes; w_abar: what the backward needs (MAP §4.1's
  fwd_in per node, scaled by the local share of the tensor each part belongs to), the output
  included, the layer input excluded (that is a^{l-1}, the previous stage's);
* o_f / o_b: the largest transient (fwd_tmp, bwd_tmp + bwd_out) of one node, by share;
  o_fcomm / o_bcomm: the largest collective / conversion buffer.

The stage's time and activation bytes then come from walking rotor's sequence for the plan's
checkpoint tree (costs.rotor.walk), so recomputation is timed and its memory counted the
way the planner's DP counted them. Pure: no I/O, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from costs.map_layout import convert
from costs.rotor import Chain, Segment, sequence_of, walk
from costs.map_strategies import Strategy, strategies
import costs.activations
import costs.collectives
import costs.layer_time
import costs.params
from costs import gemm
from costs.collectives import allreduce_link
from costs.layer_time import BWD_MEM_FACTOR
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.op_graph import OpGraph, OpNode
from specs.plan import CheckpointSegment, LayerSharding, NodeSharding, Plan, StagePlan
from specs.result import MemoryBreakdown
from specs.training import TrainingSpec
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
    if node.kind in GEMM_KINDS and node.fwd_flops > 0:
        rate = dev.peak_tflops[dtype] * 1e12
        # the generator's flops_per_device is forward + backward over the devices sharing the work
        share = strategy.flops_per_device / (node.fwd_flops + node.bwd_flops)
        f, b = node.fwd_flops * share, node.bwd_flops * share
        fwd = f / (rate * gemm.efficiency(dev, dtype, f)) if f > 0 else 0.0
        # backward: two GEMMs (data and weight gradient) of about the forward's size each
        bwd = b / (rate * gemm.efficiency(dev, dtype, b / 2)) if b > 0 else 0.0
        return fwd + overhead, bwd + overhead
    # memory-bound: read the inputs and write the output, each at its local share; the backward
    # moves about 1.5x that (costs.layer_time.BWD_MEM_FACTOR's reasoning: grad in, saved, grad out)
    ms = mesh.shape
    moved = sum(math.prod(s) * db * _share(sp, s, ms)
                for s, db, sp in zip(node.input_shapes, node.input_dtype_bytes, strategy.input_specs))
    if node.output_shapes:
        moved += math.prod(node.output_shapes[0]) * node.output_dtype_bytes[0] * _share(
            strategy.output_spec, node.output_shapes[0], ms)
    t = moved / dev.hbm_bytes_per_s
    return t + overhead, BWD_MEM_FACTOR * t + overhead


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


def layer_cost(graph: OpGraph, sharding: LayerSharding, mesh: Mesh, hardware: HardwareSpec, dtype: str,
               bytes_per_param: float, input_specs: dict[str, str], skip_params: frozenset[str] = frozenset(),
               param_layouts: dict[str, str] | None = None) -> LayerCost:
    """``input_specs``: layout of each graph input as it arrives (the previous layer's output
    layout for ``x``; batch fields arrive replicated when absent). ``skip_params``: parameters
    this layer reads but does not store (a tied copy: its owner stores it); ``param_layouts``:
    the layout such a parameter is stored in (its owner's), when known.

    A parameter is stored once, in the layout of the first node that reads it (executor.map_exec
    distributes it so); a node reading it in another layout gets a differentiable redistribute
    (its gradient converts back), priced like an activation conversion (Algorithm 1)."""
    ms = mesh.shape
    by_name = {n.node: n for n in sharding.nodes}
    nodes = {n.name: n for n in graph.nodes}
    missing = [n.name for n in graph.nodes if n.name not in by_name]
    if missing:
        raise ValueError(f"layer {sharding.layer}: no strategy for op graph nodes {missing}")
    act_bytes = act_dtype_bytes(graph)
    layout: dict[str, ShardingSpec] = {}
    for gi in graph.inputs:
        layout[gi.name] = ShardingSpec.parse(input_specs[gi.name]) if gi.name in input_specs \
            else ShardingSpec.replicated(len(gi.shape))
    u_f = u_b = u_fc = u_bc = 0.0
    saved = 0.0
    o_f = o_b = o_fc = o_bc = 0.0
    params: dict[str, int] = {}
    stored: dict[str, ShardingSpec] = {k: ShardingSpec.parse(v) for k, v in (param_layouts or {}).items()}
    for node in graph.nodes:
        ns = by_name[node.name]
        st = find_strategy(node, ns, mesh, act_bytes, bytes_per_param)
        f, b = node_compute_s(node, st, mesh, hardware, dtype)
        u_f, u_b = u_f + f, u_b + b
        u_fc, u_bc = u_fc + st.u_fcomm, u_bc + st.u_bcomm
        o_fc, o_bc = max(o_fc, st.o_fcomm), max(o_bc, st.o_bcomm)
        ins = list(st.input_specs)
        for k, (src_name, shape, db) in enumerate(zip(node.inputs, node.input_shapes, node.input_dtype_bytes)):
            src = layout.get(src_name, ShardingSpec.replicated(len(shape)))
            if src != ins[k] and src.ndim == ins[k].ndim:
                fwd = convert(src, ins[k], tuple(shape), db, mesh)
                back = convert(ins[k], src, tuple(shape), db, mesh)
                u_fc, u_bc = u_fc + fwd.cost_s, u_bc + back.cost_s
                o_fc, o_bc = max(o_fc, fwd.peak_bytes), max(o_bc, back.peak_bytes)
            # saved parts of this input: the layer input itself (unconverted) is a^{l-1}, not ours
            part = node.fwd_in_inputs[k] if k < len(node.fwd_in_inputs) else 0
            if not (src_name == "x" and src == ins[k]):
                saved += part * _share(ins[k], shape, ms)
        out_shape = node.output_shapes[0] if node.output_shapes else ()
        o_share = _share(st.output_spec, out_shape, ms)
        big = max(range(len(node.inputs)), key=lambda i: math.prod(node.input_shapes[i]), default=None)
        other_share = _share(ins[big], node.input_shapes[big], ms) if big is not None else o_share
        saved += node.fwd_in_output * o_share + max(node.fwd_in_other, 0) * other_share
        # forward scratch scales with the node's work on this device: the share of its largest
        # tensor (a loss's scratch is its logits' softmax, not its scalar output's size)
        big_in = math.prod(node.input_shapes[big]) if big is not None else 0
        tmp_share = o_share if math.prod(out_shape) >= big_in else other_share
        o_f = max(o_f, node.fwd_tmp * tmp_share)
        o_b = max(o_b, (node.bwd_tmp + node.bwd_out) * other_share)
        for p, spec in zip(node.params, st.param_specs):
            home = stored.setdefault(p.name, spec)
            if home != spec and home.ndim == spec.ndim:
                fwd = convert(home, spec, tuple(p.shape), p.dtype_bytes, mesh)
                back = convert(spec, home, tuple(p.shape), p.dtype_bytes, mesh)
                u_fc, u_bc = u_fc + fwd.cost_s, u_bc + back.cost_s
                o_fc, o_bc = max(o_fc, fwd.peak_bytes), max(o_bc, back.peak_bytes)
            if p.name not in skip_params:
                params.setdefault(p.name, spec.local_numel(tuple(p.shape), ms))
        layout[node.name] = st.output_spec
    out = nodes[graph.outputs[0]]
    out_spec = layout[out.name]
    out_shape = out.output_shapes[0] if out.output_shapes else ()
    w_a = math.ceil(math.prod(out_shape) * out.output_dtype_bytes[0] * _share(out_spec, out_shape, ms)) \
        if out.output_dtype_bytes else 0
    out_saved = out.fwd_in_output * _share(out_spec, out_shape, ms)
    w_abar = max(w_a, math.ceil(saved - out_saved) + w_a)
    return LayerCost(u_f, u_b, u_fc, u_bc, w_a, w_abar, math.ceil(o_f), math.ceil(o_b), math.ceil(o_fc),
                     math.ceil(o_bc), sum(params.values()), str(out_spec))


def chain_of(costs: list[LayerCost], fixed_bytes: int = 0, input_bytes: int = 0,
             delta_input_bytes: int | None = None) -> Chain:
    """The stage's layers as rotor's chain; delta^l is the size of a^l (same layout).
    ``delta_input_bytes``: the gradient of the chain's input (default ``input_bytes``; 0 where the
    input needs none, the model's first layer reading token ids)."""
    return Chain(
        u_f=tuple(c.u_f for c in costs), u_b=tuple(c.u_b for c in costs),
        u_fcomm=tuple(c.u_fcomm for c in costs), u_bcomm=tuple(c.u_bcomm for c in costs),
        w_a=tuple(c.w_a for c in costs), w_abar=tuple(c.w_abar for c in costs),
        w_delta=tuple(c.w_a for c in costs), o_f=tuple(c.o_f for c in costs), o_b=tuple(c.o_b for c in costs),
        o_fcomm=tuple(c.o_fcomm for c in costs), o_bcomm=tuple(c.o_bcomm for c in costs),
        w_input=input_bytes, w_delta_input=input_bytes if delta_input_bytes is None else delta_input_bytes,
        fixed_bytes=fixed_bytes)


def to_segments(plan_segments: list[CheckpointSegment], start: int) -> tuple[Segment, ...]:
    """The plan's checkpoint tree (layer indices) as rotor segments (stage indices from ``start``)."""
    return tuple(Segment(g.start - start, g.stop - start, g.checkpointed, to_segments(g.children, start))
                 for g in plan_segments)


@dataclass(frozen=True)
class StagePass:
    """One microbatch through a sharded stage: forward and backward seconds (the backward with its
    recomputation), activation bytes live when the forward ends, and the backward's peak above
    them (all per device, fixed bytes excluded)."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    act_bytes: int
    workspace_bytes: int
    peak_bytes: int


def stage_pass(chain: Chain, segments: tuple[Segment, ...]) -> StagePass:
    seq = sequence_of(segments, len(chain))
    steps = walk(chain, seq)
    # the forward pass ends with the first forward of the last layer: when that layer is itself
    # checkpointed, its recomputation (F_all^{L-1} right before B^{L-1}) already belongs to the
    # backward (torch.utils.checkpoint re-runs it there), so "up to the first B" would count it
    # in the forward and its a-bar among the held activations
    last = len(chain) - 1
    first_b = next(i for i, (op, l) in enumerate(seq) if op != "B" and l == last) + 1
    t = [chain.t_fwd(l) if op != "B" else chain.t_bwd(l) for op, l in seq]
    base = chain.fixed_bytes + chain.w_input
    act = steps[first_b - 1][0] - base
    peak = max(p for _, p in steps) - base
    fwd_s, bwd_s = sum(t[:first_b]), sum(t[first_b:])
    once = sum(chain.t_fwd(l) + chain.t_bwd(l) for l in range(len(chain)))
    return StagePass(fwd_s, bwd_s, fwd_s + bwd_s - once, act, max(peak - act, 0), peak)


@dataclass(frozen=True)
class ShardedStage:
    """A MAP stage priced for one microbatch on one device (all devices of the mesh alike, SPMD).

    ``costs``: per layer (stage order) its chain stage, the last one with the conversion of its
    output to replicated added; ``chain``: rotor's chain (fixed bytes = the stored parameter
    elements x (weights + gradients + optimizer) bytes each, input = the stage's input); ``run``:
    rotor's walk of the plan's checkpoint tree; ``static``: the fixed bytes by category;
    ``input_bytes``: the stage input held from forward to backward (full: it arrives replicated);
    ``output_bytes``: the replicated output the stage sends (the loss on the last stage); of it,
    ``held_output_bytes`` is kept to the backward (the pipeline's autograd root; rotor's walk has
    only its sharded a^{L-1}) and ``sent_output_bytes`` lives only until its send is done
    (training.deallocate_pipeline_outputs, costs.activations.sent_output_bytes); the last stage's loss is
    the walk's own a^{L-1}: neither;
    ``optimizer_s``: the update of the stored shards (memory-bound, costs.layer_time.optimizer_step_s)."""

    layers: tuple[int, ...]
    mesh: Mesh
    costs: tuple[LayerCost, ...]
    chain: Chain
    segments: tuple[Segment, ...]
    run: StagePass
    param_elems: int
    static: MemoryBreakdown
    input_bytes: int
    output_bytes: int
    held_output_bytes: int
    sent_output_bytes: int
    optimizer_s: float

    @property
    def act_bytes(self) -> int:
        """Bytes one microbatch holds from the end of its forward to the end of its backward: what
        rotor's walk has live after the last forward, plus the stage input (the walk counts it as
        the caller's; the executor keeps it for the backward, as costs does) and the held
        replicated output."""
        return self.run.act_bytes + self.input_bytes + self.held_output_bytes

    @property
    def peak_bytes(self) -> int:
        """One microbatch alone on the device: fixed bytes + the walk's peak (its input included)
        + the held replicated output (an upper bound where the walk peaks in the forward)."""
        return self.static.total_bytes + self.input_bytes + self.run.peak_bytes + self.held_output_bytes


def stage_layout(stage: StagePlan) -> tuple[int, ...]:
    """The mesh shape every layer of a MAP stage shares (ValueError naming the layers otherwise):
    the executor builds one DeviceMesh per stage (MAP §5: a stage's devices are one logical mesh)."""
    if not stage.sharding:
        raise ValueError(f"stage [{stage.layer_start}, {stage.layer_stop}) has no sharding (not a MAP stage)")
    shapes: dict[tuple[int, ...], list[int]] = {}
    for s in sorted(stage.sharding, key=lambda s: s.layer):
        shapes.setdefault(tuple(s.mesh), []).append(s.layer)
    if len(shapes) > 1:
        raise ValueError("a MAP stage's layers share one mesh; this stage mixes "
                         + ", ".join(f"{list(m)} (layers {ls})" for m, ls in shapes.items()))
    return next(iter(shapes))


def _first_layout(graph: OpGraph, sharding: LayerSharding, numel: int) -> tuple[str, tuple[int, ...], str] | None:
    """(name, shape, layout) of the first parameter of ``numel`` elements the graph reads, in the
    layout its first reader stores it (executor.map_exec), or None."""
    by_name = {n.node: n for n in sharding.nodes}
    for node in graph.nodes:
        for p in node.params:
            if p.numel == numel and node.name in by_name and p.name in by_name[node.name].params:
                return p.name, tuple(p.shape), by_name[node.name].params[p.name]
    return None


def tied_skip(model: ModelSpec, layers: range, layer: int, graph: OpGraph) -> frozenset[str]:
    """Parameters ``layer`` reads but does not store: a tied copy (an LM head tied to the word
    embedding) whose owner is in the same stage reads the owner's parameter (one Parameter on the
    same devices, as costs.params.stage_params_on_device counts it once). The op graph names the
    copy by the copy's module path, so it is found by size: the first parameter (graph order) with
    ``tied_params`` elements. None of that size: nothing skipped (counted twice: an over-count).
    An owner in another stage: the copy is stored here and its gradient all-reduced with the owner's
    (costs.collectives.embedding_group_allreduce_s)."""
    spec = model.layers[layer]
    owner = model.tied_owner(layer)
    if not spec.tied_params or owner is None or owner not in layers:
        return frozenset()
    for p in graph.params().values():
        if p.numel == spec.tied_params:
            return frozenset({p.name})
    return frozenset()


def _tied_layouts(model: ModelSpec, shardings: dict[int, LayerSharding], layer: int, graph: OpGraph,
                  skip: frozenset[str]) -> dict[str, str]:
    """The owner's stored layout of each skipped (tied) parameter of ``layer``, when the two have
    one shape (GPT: the word embedding and the head's weight are both vocab x hidden): the copy's
    reader then redistributes from it (executor.map_exec keeps the owner's layout)."""
    if not skip:
        return {}
    owner = model.tied_owner(layer)
    okey = model.layers[owner].op_graph
    osh = shardings.get(owner)
    if okey is None or okey not in model.op_graphs or osh is None:
        return {}
    home = _first_layout(model.op_graphs[okey], osh, model.layers[layer].tied_params)
    mine = graph.params()
    return {name: home[2] for name in skip if home is not None and tuple(mine[name].shape) == home[1]}


def stage_chain(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, layers: range, mesh: Mesh,
                shardings: dict[int, LayerSharding]) -> tuple[tuple[LayerCost, ...], Chain]:
    """The stage ``layers`` (strategies ``shardings``, by layer) on ``mesh`` as rotor's chain, one
    microbatch of ``training``: layer by layer (:func:`layer_cost`, each layer reading its
    predecessor's output in the layout it was produced in; the first layer its input replicated,
    as received), tied copies read from their owner (:func:`tied_skip`), and the last layer's
    output made replicated before it is sent or the loss read (executor.map_exec): that conversion
    (Algorithm 1) priced on the last layer's forward communication, its reverse (the gradient
    coming back) on its backward. Fixed bytes: the stored parameter elements x (weights +
    gradients + optimizer) bytes; input: the stage's input, whole (its gradient too, except at the
    model's first layer, which reads token ids). The planner and the simulator share this."""
    w_b, g_b, o_b = training.bytes_per_param()
    bpp = float(w_b + g_b + o_b)
    dtype = training.precision.value
    costs_: list[LayerCost] = []
    prev: dict[str, str] = {}
    graph = None
    for l in layers:
        key = model.layers[l].op_graph
        if key is None or key not in model.op_graphs:
            raise ValueError(f"layer {l} ({model.layers[l].name}) has no op graph (ModelSpec.op_graphs); a MAP "
                             "plan needs the model's op graphs (executor.op_graph.model_op_graphs)")
        graph = model.op_graphs[key]
        skip = tied_skip(model, layers, l, graph)
        try:
            c = layer_cost(graph, shardings[l], mesh, hardware, dtype, bpp,
                           {"x": prev["x"]} if "x" in prev and any(gi.name == "x" for gi in graph.inputs) else {},
                           skip, _tied_layouts(model, shardings, l, graph, skip))
        except ValueError as exc:
            raise ValueError(f"layer {l} ({model.layers[l].name}): {exc}") from None
        costs_.append(c)
        prev = {"x": c.output_spec}
    # the last layer's output to replicated (the send buffer / the loss), and its gradient back
    out = graph.node(graph.outputs[0])
    out_shape = tuple(out.output_shapes[0]) if out.output_shapes else ()
    out_db = out.output_dtype_bytes[0] if out.output_dtype_bytes else act_dtype_bytes(graph)
    last = costs_[-1]
    src, rep = ShardingSpec.parse(last.output_spec), ShardingSpec.replicated(len(out_shape))
    if src != rep:
        fwd, back = convert(src, rep, out_shape, out_db, mesh), convert(rep, src, out_shape, out_db, mesh)
        costs_[-1] = replace(last, u_fcomm=last.u_fcomm + fwd.cost_s, u_bcomm=last.u_bcomm + back.cost_s,
                             o_fcomm=max(last.o_fcomm, fwd.peak_bytes), o_bcomm=max(last.o_bcomm, back.peak_bytes),
                             output_spec=str(rep))
    fixed = sum(c.param_elems for c in costs_) * (w_b + g_b + o_b)
    input_bytes = costs.activations.layer_input_bytes(model, layers.start, training.samples_per_microbatch)
    return tuple(costs_), chain_of(costs_, fixed, input_bytes, input_bytes if layers.start > 0 else 0)


def sharded_stage(plan: Plan, model: ModelSpec, hardware: HardwareSpec, stage: StagePlan) -> ShardedStage:
    """Price ``stage`` (a MAP stage of ``plan``, validated by specs.plan.validate_plan):
    :func:`stage_chain` on the stage's mesh, then rotor's walk of its checkpoint tree
    (:func:`stage_pass`)."""
    if model.op_graph_microbatch is not None and model.op_graph_microbatch != plan.training.samples_per_microbatch:
        raise ValueError(f"the op graphs were traced at microbatch {model.op_graph_microbatch}, the plan runs "
                         f"{plan.training.samples_per_microbatch}: trace them again for this batch")
    mesh = stage_mesh(hardware, tuple(stage.devices), stage_layout(stage))
    w_b, g_b, o_b = plan.training.bytes_per_param()
    costs_, chain = stage_chain(model, hardware, plan.training, range(stage.layer_start, stage.layer_stop), mesh,
                                {s.layer: s for s in stage.sharding})
    b = plan.training.samples_per_microbatch
    elems = sum(c.param_elems for c in costs_)
    static = MemoryBreakdown(parameters_bytes=elems * w_b, gradients_bytes=elems * g_b, optimizer_bytes=elems * o_b)
    segments = to_segments(stage.checkpoint, stage.layer_start)
    out_bytes = b * model.layers[stage.layer_stop - 1].output_bytes_per_sample
    sent = costs.activations.sent_output_bytes(model, plan, stage)
    held = out_bytes if stage.layer_stop < model.num_layers and not sent else 0
    return ShardedStage(
        layers=tuple(stage.layers), mesh=mesh, costs=costs_, chain=chain, segments=segments,
        run=stage_pass(chain, segments), param_elems=elems, static=static, input_bytes=chain.w_input,
        output_bytes=out_bytes, held_output_bytes=held, sent_output_bytes=sent,
        optimizer_s=elems * (2 * w_b + g_b + 2 * o_b) / hardware.device.hbm_bytes_per_s)


__all__ = ["GEMM_KINDS", "LayerCost", "ShardedStage", "StagePass", "act_dtype_bytes", "chain_of", "find_strategy",
           "layer_cost", "node_compute_s", "sharded_stage", "stage_chain", "stage_layout", "stage_mesh", "stage_pass",
           "tied_skip", "to_segments"]
