"""Run a MAP-sharded stage (``StagePlan.sharding``) on DTensor: MAP §6's "generator" step.

MAP (§5) plans one intra-op strategy per operator group of every layer — a layout (specs.sharding:
R / S<axes> per tensor dim) for each activation input, parameter and the output — on the stage's
devices viewed as one logical mesh. §6 turns that into a runnable program by annotating the traced
graph with those layouts and letting the SPMD machinery insert the communication. Not
``parallelize_module``: its ParallelStyles fix one input/output layout and parameter placement per
*module*, while MAP's plan is per *operator* inside modules (q, k, v, attention, the projection and
the residual add of one Attention each have their own layouts), so the executor applies what those
styles apply underneath — ``distribute_tensor`` per parameter, ``redistribute`` per input — at the
granularity the plan has. Here:

* the stage's devices become one ``DeviceMesh`` (row-major: ``devices[i]`` has coordinate
  ``unravel(i, mesh)``), built from sub-groups every rank created up front
  (topology.process_groups: ``new_group`` is collective over the world, so every rank makes every
  stage's groups in one order, also for pp > 1);
* each layer is re-traced with ``torch.export`` (non-strict, FakeTensor, microbatch shapes) exactly
  as executor.op_graph traces it for the planner, and its FX nodes are grouped with
  ``specs.op_graph.merge_trivial``: the group heads are the names the plan uses;
* each parameter is distributed ONCE with ``distribute_tensor`` to the layout of the first node
  that reads it (a tied weight, GPT's head = word embedding, keeps its owner's, the embedding's,
  layout; a reader planned otherwise gets a differentiable ``redistribute``, so its gradient flows
  back into the one parameter); the module's parameters become these DTensors, so the optimizer,
  the gradient buffers and the memory tracker see the shards;
* forward interprets the exported graph on DTensors: before a group's ops read an activation from
  outside the group it is converted to the planned input layout along the step sequence the
  planner prices (costs.map_layout.convert, MAP §4.3; executor.map_layout.planned_redistribute:
  one ``redistribute`` per step, the gradient back along the priced reverse path; the group's
  k-th outside read, over all its ops, gets its k-th planned input layout, as merge_trivial lists
  them; the executed steps in ``stats["conversions"]``); after the group's last op DTensor's sharding
  propagation is compared with the planned output layout. A pending ``Partial`` sum on an axis
  the plan replicates is the all-reduce the strategy includes (name suffix "(AR..)"): counted
  in ``reductions``. Any other difference is a disagreement between the planner's strategy
  model and DTensor: redistributed, and recorded in ``mismatches`` (tests assert on it);
* a group's core linear / embedding runs on the local shards exactly as the planned einsum
  strategy says (``ShardedLayer._linear`` / ``_embedding``), its partial sum all-reduced right
  after it, where the strategy prices it (before a folded bias, residual add or GELU). DTensor's
  own rules cannot run some planned strategies: its linear flattens (b, s) and cannot unflatten a
  sequence dim split over two mesh axes (nested ``_StridedShard``), and its vocabulary-parallel
  embedding cannot split the vocabulary over two mesh axes (both axes' ``_MaskPartial`` share
  one ``MaskBuffer``: "materialized with conflicting data");
* rotor's checkpoint segments (``StagePlan.checkpoint``) run under nested non-reentrant
  ``torch.utils.checkpoint`` calls: a checkpointed segment keeps only its input, its children say
  how its recomputation is split (MAP §5.2).

Any model (issue 26): a layer's user inputs are the leaves of ``((x, batch), {})`` as export
flattened them (a user's pieces pass tuples), its outputs the traced pytree; an operator DTensor
has no rule for, or refuses in the layouts it gets (BatchNorm, a masked attention), runs
replicated (``ShardedLayout._call``, listed in ``stats["replicated"]``); conv2d runs on local
shards (``ShardedOps._conv2d``); buffers a graph returns as mutated are written back.

The stage's inputs arrive whole on every rank (all ranks of a MAP stage receive the same
microbatch, as TP ranks do) and are wrapped as Replicate DTensors; its output (the loss, or the
boundary activation) leaves Replicate as a plain tensor, so the pipeline code is unchanged.

ShardedLayer (here) builds a layer's plan and interprets its graph; its pieces: the trace and
grouping (executor.map_trace), the layout helpers (executor.map_layout) and the core ops on local
shards (executor.map_local).
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn as nn
from torch.export.graph_signature import TensorArgument
from torch.utils._pytree import tree_flatten

from executor.map_layout import ShardedLayout, _ContiguousGrad, _RESHAPES, _replicate
from executor.map_local import ShardedOps, _LOCAL
from executor.map_trace import MapPlanError, _groups
from specs.plan import LayerSharding


#: conversion events a layer keeps until the worker drains them (executor.timeline.conversion_events)
CONV_EVENTS_KEPT = 1 << 16


# ---- one layer -------------------------------------------------------------------------------------

class ShardedLayer(ShardedLayout, ShardedOps, nn.Module):
    """``module`` run as its exported graph on DTensors with the plan's layouts (module doc).
    ``shared``: {id(plain parameter): DTensor parameter} across the stage's layers, so a tied
    weight is distributed once, by the first layer (the owner) that reads it. ``stats``: the
    stage's {"mismatches": {(layer, node): why}, "reductions": {(layer, node): axes}}."""

    def __init__(self, index: int, module: nn.Module, sharding: LayerSharding, mesh, ep, shared: dict,
                 stats: dict, price_mesh=None):
        super().__init__()
        from torch.distributed.tensor import distribute_tensor

        from executor.sharding import to_dtensor_placements

        self.index, self.inner, self.mesh, self.stats = index, module, mesh, stats
        # layout conversions run the priced step sequence (ShardedLayout._convert): on the
        # planner's alpha-beta mesh (specs.sharding.Mesh) when given, else one with alike axes
        self.price_mesh = price_mesh
        self.conv_events = deque(maxlen=CONV_EVENTS_KEPT)  # (kind, layer, label, start_ns, end_ns)
        self.gm, sig = ep.graph_module, ep.graph_signature
        other = sorted({s.kind.name for s in sig.output_specs} - {"USER_OUTPUT", "BUFFER_MUTATION"})
        if other:  # export's training IR mutates buffers in place (BatchNorm); a functional one returns them
            raise MapPlanError(f"layer {index} ({type(module).__name__}): export outputs of kind {other} "
                               "(the MAP executor writes back buffers only)")
        merged, self.group_of = _groups(ep)
        planned = {ns.node: ns for ns in sharding.nodes}
        heads = {g.name: g for g in merged.nodes}
        if set(planned) != set(heads):
            raise MapPlanError(f"layer {index} ({type(module).__name__}): the plan's nodes are not the traced op "
                               f"graph's: missing {sorted(set(heads) - set(planned))}, unknown "
                               f"{sorted(set(planned) - set(heads))} (plan again for this model and microbatch)")
        ndim = mesh.ndim
        place = lambda text: tuple(to_dtensor_placements(text, ndim))  # noqa: E731
        self.last_op, self.in_place, self.out_place, self.param_place, self.kind = {}, {}, {}, {}, {}
        for g in merged.nodes:
            ns = planned[g.name]
            if len(ns.inputs) != len(g.inputs) or set(ns.params) != {p.name for p in g.params}:
                raise MapPlanError(f"layer {index} node {g.name!r}: needs {len(g.inputs)} input layouts and params "
                                   f"{sorted(p.name for p in g.params)}, the plan gives {len(ns.inputs)} and "
                                   f"{sorted(ns.params)}")
            self.last_op[g.name] = (g.ops or (g,))[-1].name
            self.in_place[g.name] = [place(t) for t in ns.inputs]
            self.out_place[g.name] = place(ns.output)
            self.param_place[g.name] = {k: place(t) for k, t in ns.params.items()}
            self.kind[g.name] = f"{g.kind}:{ns.output}"
        # parameters: distributed once, to the layout of the first node reading them (owner)
        first_use = {}
        for g in merged.nodes:
            for name, pl in self.param_place[g.name].items():
                first_use.setdefault(name, pl)
        self.param_fqn = {s.arg.name: s.target for s in sig.input_specs if s.kind.name == "PARAMETER"}
        named = list(module.named_parameters(remove_duplicate=False))
        names_of: dict[int, list[str]] = {}   # a tied weight has several names; the plan uses export's
        for fqn, p in named:
            names_of.setdefault(id(p), []).append(fqn)
        for fqn, p in named:
            owner, leaf = module.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else module, fqn.rpartition(".")[2]
            if id(p) not in shared:
                pl = next((first_use[n] for n in names_of[id(p)] if n in first_use), (_replicate(),) * ndim)
                dt = distribute_tensor(p.detach(), mesh, list(pl), src_data_rank=None)  # same weights on all ranks
                shared[id(p)] = shared[id(dt)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            setattr(owner, leaf, shared[id(p)])
        # placeholders: (name, kind, what): a parameter / buffer FQN, a constant, or the k-th user
        # input: the k-th leaf of ((x, batch), {}) flattened as export's in_spec says (x any pytree:
        # a user model's layers pass tuples, export names them x_0, x_1, ...; batch fields batch_<key>)
        self.in_spec, self.out_spec = ep.call_spec.in_spec, ep.call_spec.out_spec
        self.out_kinds = [(s.kind.name, s.target) for s in sig.output_specs]
        self.placeholders = []
        k = 0
        for s in sig.input_specs:
            kind = s.kind.name
            if kind == "USER_INPUT":
                # a non-tensor leaf (x = None of a first layer) is a ConstantArgument: its traced value
                entry = (kind, k) if isinstance(s.arg, TensorArgument) else ("CONSTANT", s.arg.value)
                self.placeholders.append((s.arg.name, *entry))
                k += 1
            elif kind in ("PARAMETER", "BUFFER"):
                self.placeholders.append((s.arg.name, kind, s.target))
            else:
                raise MapPlanError(f"layer {index}: export input kind {kind} is not supported")
        self.user_names = {n for n, kind, _ in self.placeholders if kind == "USER_INPUT"}
        self.consumers = {}  # FX node -> last node reading it (free values once read: interpreter memory)
        for n in self.gm.graph.nodes:
            for a in n.all_input_nodes:
                self.consumers[a.name] = n.name

    def bind(self, env: dict, x=None, batch: dict | None = None) -> dict:
        """``env`` plus the exported graph's placeholders: the layer's parameters, buffers and
        constants (read afresh: a recomputation sees the same Parameters) and, given ``batch``,
        the layer's inputs (they arrive whole on every rank: Replicate)."""
        params = dict(self.inner.named_parameters(remove_duplicate=False))
        buffers = dict(self.inner.named_buffers(remove_duplicate=False))
        flat = self._flat_inputs(x, batch) if batch is not None else None
        env = dict(env)
        for name, kind, what in self.placeholders:
            if kind == "PARAMETER":
                env[name] = params[what]
            elif kind == "BUFFER":
                env[name] = self._dt(buffers[what])
            elif kind == "CONSTANT":
                env[name] = what
            elif flat is not None:
                env[name] = self._dt(flat[what])
        return env

    def forward(self, x, batch: dict):
        env = self.bind({}, x, batch)
        # per group: how many of its inputs from outside it its ops have read so far (a folded op's
        # other input, the residual of ``linear -> add``, is the group's 2nd input, not its op's 1st)
        counters: dict[str | None, list[int]] = {}
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = [env[a.name] if isinstance(a, torch.fx.Node) else a for a in tree_flatten(n.args)[0]]
                return self._outputs(outs)
            self._step(n, env, counters)
            for a in n.all_input_nodes:  # drop values whose last reader ran (as fx.Interpreter)
                if self.consumers.get(a.name) == n.name:
                    env.pop(a.name, None)
        raise AssertionError("exported graph without an output node")

    def _step(self, n: torch.fx.Node, env: dict, counters: dict) -> None:
        """One call_function node of the exported graph on DTensors: its inputs read in the planned
        layouts, run, its group's output checked; ``env[n.name]`` gets the value. Also what
        executor.map_stage replays per node group for a checkpoint that cuts inside a layer."""
        from torch.distributed.tensor import DTensor

        if isinstance(n.target, torch._ops.OpOverload) and n.target._opname.startswith("_assert"):
            return  # export's metadata asserts (a dtype check of .to()): no DTensor rule, nothing to run
        group = self.group_of.get(n.name)
        counter = counters.setdefault(group, [0])
        read = lambda a, group=group, counter=counter: self._read(a, group, env, counter)  # noqa: E731
        args = torch.fx.node.map_arg(n.args, read)
        kwargs = torch.fx.node.map_arg(n.kwargs, read)
        try:
            if n.target is torch.ops.aten.scaled_dot_product_attention.default:
                out = self._attention(args, kwargs)
            elif n.target in _LOCAL and n.name == group:  # a group's core contraction: local
                out = _LOCAL[n.target](self, group, args, kwargs)
            else:
                out = self._call(n, args, kwargs)
        except (RuntimeError, NotImplementedError) as exc:  # name the planned strategy DTensor refused
            where = f"group {group!r} ({self.kind[group]})" if group is not None else "no group"
            raise type(exc)(f"layer {self.index} node {n.name} ({n.target}) in {where}: {exc}") from exc
        if n.target in _RESHAPES and isinstance(out, DTensor) and out.requires_grad:
            out = _ContiguousGrad.apply(out)
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
            out = self._dt(out)  # a node of no group made a plain tensor (an arange): replicated
        if group is not None and self.last_op[group] == n.name:
            out = self._check(group, out)
        env[n.name] = out


__all__ = ["MapPlanError", "ShardedLayer"]
