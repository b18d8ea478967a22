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
  outside the group it is ``redistribute``d to the planned input layout (the conversions MAP
  Algorithm 1 prices; the group's k-th outside read, over all its ops, gets its k-th planned
  input layout, as merge_trivial lists them); after the group's last op DTensor's sharding
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

The stage's inputs arrive whole on every rank (all ranks of a MAP stage receive the same
microbatch, as TP ranks do) and are wrapped as Replicate DTensors; its output (the loss, or the
boundary activation) leaves Replicate as a plain tensor, so the pipeline code is unchanged.
"""
from __future__ import annotations


import torch
import torch.nn as nn
from torch.export.graph_signature import TensorArgument
from torch.utils._pytree import tree_flatten

from specs.op_graph import OpGraph, OpNode, ParamRef, merge_trivial
from specs.plan import LayerSharding


class MapPlanError(ValueError):
    """The plan's sharding does not fit the traced layer (names, inputs, shapes)."""


# ---- tracing (as executor.op_graph does for the planner) --------------------------------------------

def _export(cfg, index: int, microbatch: int, dtype: torch.dtype):
    """``torch.export`` of layer ``index`` at the microbatch's global shapes, traced as the
    planner's op graph was (executor.op_graph.export_layer), so node names match the plan's."""
    from executor.op_graph import export_layer

    return export_layer(cfg, index, microbatch, dtype)


def _groups(ep) -> tuple[OpGraph, dict[str, str]]:
    """The merged op graph of an export (node names, kinds and activation inputs as
    executor.op_graph._nodes records them; costs left at 0) and FX node -> group head."""
    from executor.op_graph import _kind, _meta_shape, _target_name

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
        if not vals or not (acts or prm):  # executor.op_graph._nodes: not a node (MAP §5.1)
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


# ---- one layer -------------------------------------------------------------------------------------

class ShardedLayer(nn.Module):
    """``module`` run as its exported graph on DTensors with the plan's layouts (module doc).
    ``shared``: {id(plain parameter): DTensor parameter} across the stage's layers, so a tied
    weight is distributed once, by the first layer (the owner) that reads it. ``stats``: the
    stage's {"mismatches": {(layer, node): why}, "reductions": {(layer, node): axes}}."""

    def __init__(self, index: int, module: nn.Module, sharding: LayerSharding, mesh, ep, shared: dict,
                 stats: dict):
        super().__init__()
        from torch.distributed.tensor import distribute_tensor

        from executor.sharding import to_dtensor_placements

        self.index, self.inner, self.mesh, self.stats = index, module, mesh, stats
        self.gm, sig = ep.graph_module, ep.graph_signature
        if any(s.kind.name != "USER_OUTPUT" for s in sig.output_specs):
            raise MapPlanError(f"layer {index} ({type(module).__name__}) mutates buffers (BatchNorm statistics); "
                               "the MAP executor runs stateless layers only")
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
        for fqn, p in list(module.named_parameters(remove_duplicate=False)):
            owner, leaf = module.get_submodule(fqn.rpartition(".")[0]) if "." in fqn else module, fqn.rpartition(".")[2]
            if id(p) not in shared:
                pl = first_use.get(fqn, (_replicate(),) * ndim)
                dt = distribute_tensor(p.detach(), mesh, list(pl), src_data_rank=None)  # same weights on all ranks
                shared[id(p)] = shared[id(dt)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            setattr(owner, leaf, shared[id(p)])
        # placeholders: (name, kind, what): a parameter / buffer FQN, a constant, or the user input
        # by name (export names them after the arguments: ``x``, ``batch_ids`` = batch["ids"])
        self.placeholders = []
        for s in sig.input_specs:
            kind = s.kind.name
            if kind == "USER_INPUT" and not isinstance(s.arg, TensorArgument):
                self.placeholders.append((s.arg.name, "CONSTANT", s.arg.value))
            elif kind == "USER_INPUT":
                name = s.arg.name
                if name != "x" and not name.startswith("batch_"):
                    raise MapPlanError(f"layer {index}: user input {name!r} is neither x nor a batch field")
                self.placeholders.append((name, kind, None if name == "x" else name[len("batch_"):]))
            elif kind in ("PARAMETER", "BUFFER"):
                self.placeholders.append((s.arg.name, kind, s.target))
            else:
                raise MapPlanError(f"layer {index}: export input kind {kind} is not supported")
        self.user_names = {n for n, kind, _ in self.placeholders if kind == "USER_INPUT"}
        self.consumers = {}  # FX node -> last node reading it (free values once read: interpreter memory)
        for n in self.gm.graph.nodes:
            for a in n.all_input_nodes:
                self.consumers[a.name] = n.name

    def forward(self, x, batch: dict):
        from torch.distributed.tensor import DTensor

        params = dict(self.inner.named_parameters(remove_duplicate=False))
        buffers = dict(self.inner.named_buffers())
        env: dict[str, object] = {}
        # per group: how many of its inputs from outside it its ops have read so far (a folded op's
        # other input, the residual of ``linear -> add``, is the group's 2nd input, not its op's 1st)
        counters: dict[str | None, list[int]] = {}
        for name, kind, what in self.placeholders:
            if kind == "PARAMETER":
                env[name] = params[what]
            elif kind == "BUFFER":
                env[name] = self._dt(buffers[what])
            elif kind == "CONSTANT":
                env[name] = what
            else:  # the stage's inputs arrive whole on every rank: Replicate
                env[name] = self._dt(x if what is None else batch.get(what))
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = [env[a.name] if isinstance(a, torch.fx.Node) else a for a in tree_flatten(n.args)[0]]
                return outs[0] if len(outs) == 1 else tuple(outs)
            if isinstance(n.target, torch._ops.OpOverload) and n.target._opname.startswith("_assert"):
                continue  # export's metadata asserts (a dtype check of .to()): no DTensor rule, nothing to run
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
                    out = n.target(*args, **kwargs)
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
            for a in n.all_input_nodes:  # drop values whose last reader ran (as fx.Interpreter)
                if self.consumers.get(a.name) == n.name:
                    env.pop(a.name, None)
        raise AssertionError("exported graph without an output node")

    def _attention(self, args, kwargs):
        """Attention on each rank's shard (a local map). The planner splits attention over batch
        and heads only (map_strategies._sdpa: Megatron's split), where it is exact per shard; on
        CPU DTensor has no rule for the flash kernel (``_scaled_dot_product_flash_attention_for_cpu``)
        and the math fallback builds its causal mask as a plain tensor, so the op runs on the local
        tensors and its output carries q's placements. q, k, v in other layouts (not from a
        planner strategy) are replicated first; the output check then records the difference."""
        from torch.distributed.tensor import DTensor

        q, k, v = args[:3]
        pl = tuple(q.placements)
        if any(p.is_partial() or (p.is_shard() and p.dim % q.ndim >= q.ndim - 2) for p in pl) or \
                tuple(k.placements) != pl or tuple(v.placements) != pl:
            pl = (_replicate(),) * self.mesh.ndim
        q, k, v = (t.redistribute(self.mesh, pl).to_local() for t in (q, k, v))
        out = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, *args[3:], **kwargs)
        return DTensor.from_local(out, self.mesh, pl, run_check=False)

    def _settle(self, group: str, y_local, placements: list, shape, stride):
        """The core op's local result as a DTensor with ``placements``; a ``Partial`` (a split
        contraction dim) is all-reduced right away: the strategy's "(AR..)" is priced on the core
        op's output, before any folded bias / residual add / activation (MAP §5.1), and DTensor,
        left alone, would settle it later at the folded op in its own way (a reduce-scatter at an
        add, then a gather to the planned layout)."""
        from torch.distributed.tensor import DTensor

        y = DTensor.from_local(y_local, self.mesh, placements, run_check=False, shape=shape, stride=stride)
        partial = tuple(a for a, p in enumerate(placements) if p.is_partial())
        if partial:
            self.stats["reductions"][(self.index, group)] = partial
            y = y.redistribute(self.mesh, [_replicate() if p.is_partial() else p for p in placements])
        return y

    def _linear(self, group: str, args, kwargs):
        """``aten.linear`` of a group's core op on the local shards, as MAP's einsum strategy
        (``...k,nk->...n``) says: per mesh axis a batch dim of x, the out dim n (w's dim 0, the
        bias) or the contraction k (x's last dim and w's dim 1: a partial sum) is split, or none.
        DTensor would decompose the op into flatten -> addmm -> unflatten, and cannot unflatten a
        sequence dim split over two mesh axes (nested ``_StridedShard``s); here no view happens.
        The gradients get the placements of the strategy's backward: dx partial over the axes
        that split n, dw / db partial over those that split a batch dim (the all-reduces the
        strategy prices; DTensor runs them where the gradients meet their planned layouts).
        Inputs in any other layout (not from a planner strategy) go to DTensor's own rule."""
        import torch.nn.functional as F
        from torch.distributed.tensor import Partial, Replicate, Shard

        x, w, b = (list(args) + [None])[:3]
        tensors = (x, w) if b is None else (x, w, b)
        if kwargs or not all(hasattr(t, "placements") for t in tensors) or w.ndim != 2:
            return torch.ops.aten.linear.default(*args, **kwargs)
        nd = x.ndim
        out_pl, gx, gw, gb = [], [], [], []
        for a, (px, pw) in enumerate(zip(x.placements, w.placements)):
            pb = b.placements[a] if b is not None else Replicate()
            if type(px) is Shard and px.dim % nd < nd - 1 and pw.is_replicate() and pb.is_replicate():  # batch
                out_pl.append(Shard(px.dim % nd)), gx.append(px), gw.append(Partial()), gb.append(Partial())
            elif type(px) is Shard and px.dim % nd == nd - 1 and type(pw) is Shard and pw.dim % 2 == 1 \
                    and pb.is_replicate():  # k: partial sum
                out_pl.append(Partial()), gx.append(px), gw.append(pw), gb.append(Replicate())
            elif px.is_replicate() and type(pw) is Shard and pw.dim % 2 == 0 and (b is None or type(pb) is Shard):  # n
                out_pl.append(Shard(nd - 1)), gx.append(Partial()), gw.append(pw), gb.append(pb)
            elif px.is_replicate() and pw.is_replicate() and pb.is_replicate():
                out_pl.append(Replicate()), gx.append(px), gw.append(pw), gb.append(pb)
            else:
                return torch.ops.aten.linear.default(*args, **kwargs)
        xl, wl = x.to_local(grad_placements=gx), w.to_local(grad_placements=gw)
        partial = any(p.is_partial() for p in out_pl)
        bl = b.to_local(grad_placements=gb) if b is not None and not partial else None
        shape = tuple(x.shape[:-1]) + (w.shape[0],)
        y = self._settle(group, F.linear(xl, wl, bl), out_pl, torch.Size(shape), _contiguous_stride(shape))
        return y + b if b is not None and partial else y  # the bias once, after the sum

    def _embedding(self, group: str, args, kwargs):
        """``aten.embedding`` of a group's core op on the local shards (MAP's ``ab,vh->abh``): per
        mesh axis a dim of the ids, the vocabulary (w's dim 0: each rank looks up the ids in its
        rows, zeros elsewhere, a partial sum) or the hidden dim is split, or none. DTensor's own
        vocabulary-parallel rule keeps the mask in its ``_MaskPartial`` placement, one
        ``MaskBuffer`` shared by the placements of all mesh axes: with the vocabulary split over
        two axes (S01) the second axis' mask differs from the first's and the lookup fails
        ("MaskBuffer has been materialized with conflicting data"); here the mask is local."""
        import torch.nn.functional as F
        from torch.distributed.tensor import Partial, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        w, ids = args[:2]
        rest = list(args[2:]) + [kwargs.get(k) for k in ("padding_idx", "scale_grad_by_freq", "sparse") if k in kwargs]
        if any(r not in (None, -1, False) for r in rest) or not all(hasattr(t, "placements") for t in (w, ids)) \
                or w.ndim != 2:
            return torch.ops.aten.embedding.default(*args, **kwargs)
        nd = ids.ndim
        out_pl, gw = [], []
        for pw, pi in zip(w.placements, ids.placements):
            if type(pi) is Shard and pw.is_replicate():
                out_pl.append(Shard(pi.dim % nd)), gw.append(Partial())
            elif pi.is_replicate() and type(pw) is Shard and pw.dim % 2 == 0:
                out_pl.append(Partial()), gw.append(pw)
            elif pi.is_replicate() and type(pw) is Shard and pw.dim % 2 == 1:
                out_pl.append(Shard(nd)), gw.append(pw)
            elif pi.is_replicate() and pw.is_replicate():
                out_pl.append(Replicate()), gw.append(pw)
            else:
                return torch.ops.aten.embedding.default(*args, **kwargs)
        wl, il = w.to_local(grad_placements=gw), ids.to_local()
        if any(p.is_partial() for p in out_pl):
            (rows, _), (start, _) = compute_local_shape_and_global_offset(w.shape, self.mesh, w.placements)
            mask = (il >= start) & (il < start + rows)
            yl = F.embedding(torch.where(mask, il - start, 0), wl) * mask.unsqueeze(-1).to(wl.dtype)
        else:
            yl = F.embedding(il, wl)
        shape = tuple(ids.shape) + (w.shape[1],)
        return self._settle(group, yl, out_pl, torch.Size(shape), _contiguous_stride(shape))

    def _dt(self, t):
        from torch.distributed.tensor import DTensor

        if t is None or isinstance(t, DTensor):
            return t
        return DTensor.from_local(t, self.mesh, [_replicate()] * self.mesh.ndim, run_check=False)

    def _read(self, a: torch.fx.Node, group: str | None, env: dict, counter: list):
        """Node ``a``'s value as the op of ``group`` reading it must see it: a parameter in the
        group's planned layout, an activation from outside the group in its planned input layout
        (the ``counter``-th of the group's inputs: merge_trivial lists them in the ops' order)."""
        value = env[a.name]
        if group is None:
            return value
        if a.name in self.param_fqn:
            want = self.param_place[group].get(self.param_fqn[a.name])
            return value if want is None or tuple(value.placements) == want else value.redistribute(self.mesh, want)
        is_act = a.op == "call_function" or a.name in self.user_names  # as executor.op_graph._nodes
        if not is_act or self.group_of.get(a.name) == group or not hasattr(value, "placements"):
            return value
        k = counter[0]
        counter[0] += 1
        if k >= len(self.in_place[group]):
            raise MapPlanError(f"layer {self.index} group {group!r} reads more inputs than its "
                               f"{len(self.in_place[group])} planned layouts (executor and op graph disagree)")
        want = self.in_place[group][k]
        return value if tuple(value.placements) == want else value.redistribute(self.mesh, want)

    def _check(self, group: str, out):
        """The group's output in its planned layout; a differing propagation is recorded."""
        if not hasattr(out, "placements"):
            return out
        want, got = self.out_place[group], tuple(out.placements)
        if got == want:
            return out
        key = (self.index, group)
        partial = [a for a, p in enumerate(got) if p.is_partial()]
        if all(g == w or (g.is_partial() and w.is_replicate()) for g, w in zip(got, want)):
            self.stats["reductions"][key] = tuple(partial)  # the strategy's all-reduce (AR suffix)
        else:
            self.stats["mismatches"][key] = f"{self.kind[group]}: DTensor gave {list(got)}, the plan {list(want)}"
        return out.redistribute(self.mesh, want)


_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
             torch.ops.aten.flatten.using_ints, torch.ops.aten.unflatten.int}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a locally contiguous gradient. A reshape's backward
    reshapes its incoming gradient back; after a transpose (attention's heads) that gradient is a
    non-contiguous shard, and DTensor decides view-vs-copy from the *global* strides, so the
    local ``view`` can fail ("view size is not compatible with input tensor's size and stride").
    Placed after every reshape of the exported graph, it makes that gradient contiguous first."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        local = getattr(g, "_local_tensor", g)
        return g if local.is_contiguous() else g.clone(memory_format=torch.contiguous_format)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


#: core ops run on the local shards (ShardedLayer._linear / _embedding)
_LOCAL = {torch.ops.aten.linear.default: ShardedLayer._linear,
          torch.ops.aten.embedding.default: ShardedLayer._embedding}


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


__all__ = ["MapPlanError", "ShardedLayer"]
