"""Costs of a MAP-sharded stage (MAP §5.3), shared by the MAP planner and the simulator: the
stage's layers (each priced by simulator.sharded_layer, MAP §5.1-5.2) chained on the stage's one
mesh as MAP's rotor chain (costs.rotor.Chain, Table 1-2 quantities), tied parameters read from
their owner, the last layer's output made replicated, and the fixed bytes of the stored shards.

The stage's time and activation bytes then come from walking rotor's sequence for the plan's
checkpoint tree (costs.rotor.walk), so recomputation is timed and its memory counted the
way the planner's DP counted them. Pure: no I/O, no torch.

A stage is priced on the mesh the plan carries when it carries one (:func:`plan_mesh`: the measured
cluster's per-axis prices, ``StagePlan.mesh_axes``), else on the hardware YAML's links.

The layer-level names (stage_mesh, node_compute_s, find_strategy, layer_cost, ...) stay importable
from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from costs.map_layout import convert, local_bytes
from costs.rotor import Chain, Segment, sequence_of, walk
import costs.activations
from simulator.sharded_groups import LinearChain, Parts, group_costs, group_holds, plan_parts
from simulator.sharded_layer import LayerCost, act_dtype_bytes, layer_cost, stage_mesh
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.op_graph import OpGraph
from specs.plan import CheckpointSegment, LayerSharding, Plan, StagePlan
from specs.result import MemoryBreakdown
from specs.training import TrainingSpec
from specs.sharding import Mesh, MeshAxis, ShardingSpec


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


def stage_pass(chain: Chain, segments: tuple[Segment, ...], held: tuple[tuple[int, int, int], ...] = ()) -> StagePass:
    """``held``: tied copies' gradients kept from the reader's backward to the owner's
    (:func:`tied_grad_holds`, stage indices; costs.rotor.walk)."""
    seq = sequence_of(segments, len(chain))
    steps = walk(chain, seq, held)
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


def grad_sync_exposed_s(chain: Chain, segments: tuple[Segment, ...], sync_s: tuple[float, ...]) -> float:
    """Seconds of the parameter-gradient all-reduces (``sync_s`` per layer, stage order) that
    outlast the backward of the iteration's last microbatch, run as PyTorch DDP and Colossal-AI
    run them (issue 26; MAP §6.1's extra stream, which §7 credits for δ's plan): once per iteration (the
    microbatches accumulate locally, DDP's ``no_sync``), one bucket per layer, issued when the
    layer's last backward B^l of that microbatch completes (rotor's order, recomputations
    included) and run one after another on a communication stream beside the compute. Exposed:
    what ends after the backward does. Contention of these all-reduces with the backward's own
    collectives (u_bcomm) for the links is not modelled."""
    if not any(sync_s):
        return 0.0
    seq = sequence_of(segments, len(chain))
    last = len(chain) - 1
    first_b = next(i for i, (op, l) in enumerate(seq) if op != "B" and l == last) + 1
    now = comm_end = 0.0
    for op, l in seq[first_b:]:
        now += chain.t_fwd(l) if op != "B" else chain.t_bwd(l)
        if op == "B" and sync_s[l] > 0:
            comm_end = max(comm_end, now) + sync_s[l]
    return max(comm_end - now, 0.0)


@dataclass(frozen=True)
class ShardedStage:
    """A MAP stage priced for one microbatch on one device (all devices of the mesh alike, SPMD).

    ``costs``: per layer (stage order; per node group when ``groups``, see :meth:`layer_spans`) its
    chain stage, the last one with the conversion of its output to replicated added; ``chain``:
    rotor's chain (fixed bytes = the stored parameter elements x (weights + gradients + optimizer)
    bytes each, input = the stage's input); ``run``:
    rotor's walk of the plan's checkpoint tree; ``static``: the fixed bytes by category;
    ``input_bytes``: the stage input held from forward to backward (full: it arrives replicated);
    ``output_bytes``: the replicated output the stage sends (the loss on the last stage); of it,
    ``held_output_bytes`` is kept to the backward (the pipeline's autograd root; rotor's walk has
    only its sharded a^{L-1}) and ``sent_output_bytes`` lives only until its send is done
    (training.deallocate_pipeline_outputs, costs.activations.sent_output_bytes); the last stage's loss is
    the walk's own a^{L-1}: neither;
    ``optimizer_s``: the update of the stored shards (memory-bound, costs.layer_time.optimizer_step_s);
    ``grad_sync_s``: the stored parameters' gradient all-reduces of one iteration, serially
    (issue 26: once per iteration, not per microbatch), of which ``grad_sync_exposed_s`` outlasts
    the last backward (:func:`grad_sync_exposed_s`) and delays the optimizer step."""

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
    grad_sync_s: float = 0.0
    grad_sync_exposed_s: float = 0.0
    groups: tuple[tuple[int, int, int], ...] | None = None   # chain over node groups: (layer, start, stop) each

    def layer_spans(self) -> tuple[tuple[int, int], ...]:
        """Per layer (stage order) its chain stages [a, b): (i, i + 1) on a per-layer chain; its node
        groups' on a chain over node groups (StagePlan.node_groups, MAP Algorithm 2)."""
        if self.groups is None:
            return tuple((i, i + 1) for i in range(len(self.layers)))
        at: dict[int, list[int]] = {}
        for g, (l, _, _) in enumerate(self.groups):
            at.setdefault(l, []).append(g)
        return tuple((at[l][0], at[l][-1] + 1) for l in self.layers)

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


def tied_grad_holds(model: ModelSpec, layers: range, mesh: Mesh,
                    shardings: dict[int, LayerSharding]) -> tuple[tuple[int, int, int], ...]:
    """(reader, owner, bytes) per tied copy read in this stage from an owner in it (:func:`tied_skip`;
    stage indices), for costs.rotor.walk's ``held``: the copy's gradient is made in the reader's
    backward in the layout the reader's strategy reads the weight in, taken back to the owner's
    stored layout along convert(reader, owner) -- every step allocates its output (DTensor's
    Replicate -> Shard is a cloned chunk, not a view) -- and that owner-layout gradient waits in
    autograd's input buffer of the one parameter until the owner's backward adds its own (issue 26;
    executor.memtrack on hf_gpt2, 4 CPU ranks, head RR, embedding RS0: the 16 KiB shard is freed by
    layer 0's aten.add, the head's 64 KiB right after its own backward). Bytes: the owner layout's
    local bytes; the reader's where the owner's layout is unknown (another shape)."""
    out = []
    for l in layers:
        graph = _op_graph(model, l)
        skip = tied_skip(model, layers, l, graph)
        if not skip:
            continue
        owner_layouts = _tied_layouts(model, shardings, l, graph, skip)
        by_name = {n.node: n for n in shardings[l].nodes}
        params = graph.params()
        for name in sorted(skip):
            read = next((by_name[node.name].params[name] for node in graph.nodes
                         if node.name in by_name and name in by_name[node.name].params), None)
            if read is None:
                continue
            p = params[name]
            spec = ShardingSpec.parse(owner_layouts.get(name, read))
            out.append((l - layers.start, model.tied_owner(l) - layers.start,
                        local_bytes(spec, tuple(p.shape), p.dtype_bytes, mesh.shape)))
    return tuple(out)


def stage_chain(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, layers: range, mesh: Mesh,
                shardings: dict[int, LayerSharding]) -> tuple[tuple[LayerCost, ...], Chain]:
    """The stage ``layers`` (strategies ``shardings``, by layer) on ``mesh`` as rotor's chain, one
    microbatch of ``training``: layer by layer (:func:`layer_cost`, each layer reading its
    predecessor's output in the layout it was produced in; the first layer its input replicated,
    as received), tied copies read from their owner (:func:`tied_skip`), and the last layer's
    output made replicated before it is sent or the loss read (:func:`_replicate_output`). Fixed
    bytes: the stored parameter elements x (weights + gradients + optimizer) bytes; input: the
    stage's input, whole (its gradient too, except at the model's first layer, which reads token
    ids). The planner and the simulator share this."""
    w_b, g_b, o_b = training.bytes_per_param()
    bpp = float(w_b + g_b + o_b)
    dtype = training.precision.value
    costs_: list[LayerCost] = []
    prev: dict[str, str] = {}
    graph = None
    seen: dict[tuple, LayerCost] = {}    # identical layers (issue 22: 500 of them) are priced once
    for l in layers:
        graph = _op_graph(model, l)
        skip = tied_skip(model, layers, l, graph)
        ins = {"x": prev["x"]} if "x" in prev and any(gi.name == "x" for gi in graph.inputs) else {}
        tied = _tied_layouts(model, shardings, l, graph, skip)
        # layer_cost is a function of exactly these (the layer index only names an error)
        key = (model.layers[l].op_graph, _sharding_key(shardings[l]), tuple(ins.items()), skip,
               tuple(sorted(tied.items())))
        c = seen.get(key)
        if c is None:
            try:
                c = seen[key] = layer_cost(graph, shardings[l], mesh, hardware, dtype, bpp, ins, skip, tied,
                                           accumulate_bytes_per_param(training))
            except ValueError as exc:
                raise ValueError(f"layer {l} ({model.layers[l].name}): {exc}") from None
        costs_.append(c)
        prev = {"x": c.output_spec}
    _replicate_output(costs_, graph, mesh)
    fixed = sum(c.param_elems for c in costs_) * (w_b + g_b + o_b)
    input_bytes = costs.activations.layer_input_bytes(model, layers.start, training.samples_per_microbatch)
    return tuple(costs_), chain_of(costs_, fixed, input_bytes, input_bytes if layers.start > 0 else 0)


def group_chain(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, layers: range, mesh: Mesh,
                shardings: dict[int, LayerSharding], parts_of: Callable[[int, OpGraph], Parts],
                refine: Callable | None = None) -> LinearChain:
    """:func:`stage_chain` with node groups as chain stages (MAP §5.2.2-§5.2.4, Algorithm 2;
    simulator.sharded_groups): layer ``l``'s node ranges ``parts_of(l, graph)``, each priced by
    sharded_groups.group_costs; ``refine(parts, costs, the layer's input bytes, price)`` -> (parts,
    costs) lets the planner (planners.map.linearise) drop cuts after pricing them. One range per
    layer gives stage_chain's chain exactly. The planner's chain and the simulator's come from here."""
    w_b, g_b, o_b = training.bytes_per_param()
    bpp = float(w_b + g_b + o_b)
    acc = accumulate_bytes_per_param(training)
    costs_: list[LayerCost] = []
    groups: list[tuple[int, int, int]] = []
    prev: dict[str, str] = {}
    graph = None
    seen: dict[tuple, tuple] = {}
    into = costs.activations.layer_input_bytes(model, layers.start, training.samples_per_microbatch)
    for l in layers:
        graph = _op_graph(model, l)
        skip = tied_skip(model, layers, l, graph)
        ins = {"x": prev["x"]} if "x" in prev and any(gi.name == "x" for gi in graph.inputs) else {}
        tied = _tied_layouts(model, shardings, l, graph, skip)
        parts = tuple(parts_of(l, graph))
        key = (model.layers[l].op_graph, _sharding_key(shardings[l]), tuple(ins.items()), skip,
               tuple(sorted(tied.items())), parts, into)
        hit = seen.get(key)
        if hit is None:
            def price(p, graph=graph, l=l, ins=ins, skip=skip, tied=tied) -> list[LayerCost]:
                try:
                    return group_costs(graph, p, shardings[l], mesh, hardware, training.precision.value, bpp, ins,
                                       skip, tied, acc)
                except ValueError as exc:
                    raise ValueError(f"layer {l} ({model.layers[l].name}): {exc}") from None
            cs = price(parts)
            hit = seen[key] = (parts, cs) if refine is None else refine(parts, cs, into, price)
        parts, cs = hit
        into = cs[-1].w_a
        costs_.extend(cs)
        groups.extend((l, a, b) for a, b in parts)
        prev = {"x": cs[-1].output_spec}
    _replicate_output(costs_, graph, mesh)
    fixed = sum(c.param_elems for c in costs_) * (w_b + g_b + o_b)
    input_bytes = costs.activations.layer_input_bytes(model, layers.start, training.samples_per_microbatch)
    chain = chain_of(costs_, fixed, input_bytes, input_bytes if layers.start > 0 else 0)
    return LinearChain(chain, tuple(groups), tuple(costs_))


def accumulate_bytes_per_param(training: TrainingSpec) -> int:
    """HBM bytes per parameter element that adding one microbatch's gradient into the accumulated
    one moves: costs.layer_time.accumulate_bytes_per_param's rule (which reads a plan's training
    alone): 0 for the fused fp32 main-grad mode (18 B/param, not fp32), else read both and write
    one gradient."""
    if training.precision.value != "fp32" and training.mixed_bytes_per_param == 18:
        return 0
    return 3 * training.bytes_per_param()[1]


def _sharding_key(sh: LayerSharding) -> tuple:
    """Everything of a layer's sharding that layer_cost reads (all of it but the layer index)."""
    return tuple(sh.mesh), tuple((n.node, tuple(n.inputs), tuple(sorted(n.params.items())), n.output) for n in sh.nodes)


def _op_graph(model: ModelSpec, l: int) -> OpGraph:
    """Layer ``l``'s op graph (ValueError when the model has none for it)."""
    key = model.layers[l].op_graph
    if key is None or key not in model.op_graphs:
        raise ValueError(f"layer {l} ({model.layers[l].name}) has no op graph (ModelSpec.op_graphs); a MAP "
                         "plan needs the model's op graphs (executor.op_graph.model_op_graphs)")
    return model.op_graphs[key]


def _replicate_output(costs_: list[LayerCost], graph: OpGraph, mesh: Mesh) -> None:
    """The last layer's output to replicated (the send buffer / the loss; executor.map_exec): that
    conversion (Algorithm 1) priced on the last layer's forward communication, its reverse (the
    gradient coming back) on its backward. ``graph``: the last layer's op graph."""
    out = graph.node(graph.outputs[0])
    out_shape = tuple(out.output_shapes[0]) if out.output_shapes else ()
    out_db = out.output_dtype_bytes[0] if out.output_dtype_bytes else act_dtype_bytes(graph)
    last = costs_[-1]
    src, rep = ShardingSpec.parse(last.output_spec), ShardingSpec.replicated(len(out_shape))
    if src != rep:
        fwd, back = convert(src, rep, out_shape, out_db, mesh), convert(rep, src, out_shape, out_db, mesh)
        costs_[-1] = replace(last, u_fcomm=last.u_fcomm + fwd.cost_s, u_bcomm=last.u_bcomm + back.cost_s,
                             o_fcomm=max(last.o_fcomm, fwd.peak_bytes, fwd.work_bytes),
                             o_bcomm=max(last.o_bcomm, back.peak_bytes, back.work_bytes),
                             output_spec=str(rep))


def plan_mesh(hardware: HardwareSpec, stage: StagePlan) -> Mesh:
    """The mesh a MAP stage is priced on: the per-axis alpha-beta the plan carries
    (``StagePlan.mesh_axes``: the measured cluster the planner used, policy.cluster, MAP §4.2), else
    the hardware YAML's links (:func:`stage_mesh`), so a plan is simulated on the prices it was
    planned on."""
    shape = stage_layout(stage)
    if stage.mesh_axes is None:
        return stage_mesh(hardware, tuple(stage.devices), shape)
    return Mesh(tuple(MeshAxis(a.size, a.alpha_s, math.inf if a.beta_bytes_per_s is None else a.beta_bytes_per_s)
                      for a in stage.mesh_axes))


def sharded_stage(plan: Plan, model: ModelSpec, hardware: HardwareSpec, stage: StagePlan) -> ShardedStage:
    """Price ``stage`` (a MAP stage of ``plan``, validated by specs.plan.validate_plan):
    :func:`stage_chain` on the stage's mesh, then rotor's walk of its checkpoint tree
    (:func:`stage_pass`)."""
    if model.op_graph_microbatch is not None and model.op_graph_microbatch != plan.training.samples_per_microbatch:
        raise ValueError(f"the op graphs were traced at microbatch {model.op_graph_microbatch}, the plan runs "
                         f"{plan.training.samples_per_microbatch}: trace them again for this batch")
    mesh = plan_mesh(hardware, stage)
    w_b, g_b, o_b = plan.training.bytes_per_param()
    layers = range(stage.layer_start, stage.layer_stop)
    if stage.node_groups is None:
        costs_, chain = stage_chain(model, hardware, plan.training, layers, mesh, {s.layer: s for s in stage.sharding})
    else:   # the checkpoint tree over node groups (MAP Algorithm 2): the chain the planner's rotor solved
        parts = plan_parts(model, stage.node_groups, layers)
        lin = group_chain(model, hardware, plan.training, layers, mesh, {s.layer: s for s in stage.sharding},
                          lambda l, _: parts[l])
        costs_, chain = lin.costs, lin.chain
    b = plan.training.samples_per_microbatch
    elems = sum(c.param_elems for c in costs_)
    static = MemoryBreakdown(parameters_bytes=elems * w_b, gradients_bytes=elems * g_b, optimizer_bytes=elems * o_b)
    segments = to_segments(stage.checkpoint, stage.layer_start if stage.node_groups is None else 0)
    holds = tied_grad_holds(model, layers, mesh, {s.layer: s for s in stage.sharding})
    if stage.node_groups is not None:
        holds = group_holds(model, layers, lin, holds, {l: tied_skip(model, layers, l, _op_graph(model, l))
                                                        for l in layers})
    out_bytes = b * model.layers[stage.layer_stop - 1].output_bytes_per_sample
    sent = costs.activations.sent_output_bytes(model, plan, stage)
    held = out_bytes if stage.layer_stop < model.num_layers and not sent else 0
    sync = tuple(c.grad_sync_s for c in costs_)
    return ShardedStage(
        layers=tuple(stage.layers), mesh=mesh, costs=costs_, chain=chain, segments=segments,
        run=stage_pass(chain, segments, holds), param_elems=elems, static=static, input_bytes=chain.w_input,
        output_bytes=out_bytes, held_output_bytes=held, sent_output_bytes=sent,
        optimizer_s=elems * (2 * w_b + g_b + 2 * o_b) / hardware.device.hbm_bytes_per_s,
        grad_sync_s=sum(sync), grad_sync_exposed_s=grad_sync_exposed_s(chain, segments, sync),
        groups=None if stage.node_groups is None else lin.groups)
