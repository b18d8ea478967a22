"""Layouts of a MAP-sharded layer's values on DTensor (MAP §6; for executor.map_exec.ShardedLayer):
a plain tensor wrapped as Replicate, a value ``redistribute``d to the layout the planned group
reading it expects, a group's output checked against its planned layout (a pending ``Partial`` the
plan replicates is the strategy's all-reduce, anything else a recorded mismatch), and the
identity that makes a reshape's gradient locally contiguous.

ShardedLayout is a mixin of ShardedLayer: it reads the layer's mesh, planned layouts, groups and
stats set up there."""
from __future__ import annotations

import torch

from executor.map_trace import MapPlanError


class ShardedLayout:
    """Layout helpers of executor.map_exec.ShardedLayer (a mixin: the plan is the layer's)."""

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
        is_act = a.op == "call_function" or a.name in self.user_names  # as executor.op_graph_nodes._nodes
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


    def _flat_inputs(self, x, batch: dict) -> list:
        """The layer's user inputs as export flattened them: the leaves of ``((x, batch), {})``
        (x any pytree, None for a first layer; the batch fields export saw, in its order)."""
        from torch.utils._pytree import tree_flatten

        keys = self.in_spec.child(0).child(1).context  # the batch dict's keys
        # a field this stage is not given (the targets, on a first pipeline stage) is one the
        # layer does not read: None (a node reading it would fail by name)
        flat, spec = tree_flatten(((x, {k: batch.get(k) for k in keys}), {}))
        if spec.num_leaves != self.in_spec.num_leaves:
            raise MapPlanError(f"layer {self.index}: input {spec} is not the traced {self.in_spec}")
        return flat

    def _outputs(self, outs: list):
        """The user outputs in the traced pytree (a user layer passes tuples on); a buffer the
        graph returns as mutated (BUFFER_MUTATION) gets its new value written back."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_unflatten

        user = []
        for value, (kind, target) in zip(outs, self.out_kinds):
            if kind == "USER_OUTPUT":
                user.append(value)
            else:  # BUFFER_MUTATION (checked at build): the buffer holds the whole value on every rank
                with torch.no_grad():
                    buf = self.inner.get_buffer(target)
                    buf.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
        return tree_unflatten(user, self.out_spec)

    def _call(self, n: torch.fx.Node, args, kwargs):
        """Node ``n`` on DTensor; an operator DTensor cannot run in the layouts it gets (no
        sharding rule: BatchNorm, a user's custom op; or a propagation it refuses) runs
        replicated instead (issue 26: never a refusal after planning): its DTensor arguments
        gathered to Replicate, the op on the whole tensors (every rank the same), its tensor
        outputs Replicate DTensors. Recorded in ``stats["replicated"]``; the group's output check
        then moves the value to the planned layout. In-place ops (BatchNorm's running
        statistics, ``num_batches_tracked += 1``) update the local tensor of a Replicate buffer,
        which is the buffer itself."""
        try:
            return n.target(*args, **kwargs)
        except (NotImplementedError, RuntimeError, AssertionError, ValueError, TypeError) as exc:
            first = exc
        try:
            out = self._replicated(n.target, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - replicated fails too: the op's own error, not a layout's
            raise type(first)(f"{first} (and run replicated: {type(exc).__name__}: {exc})") from exc
        why = " ".join(str(first).split())[:160]
        self.stats.setdefault("replicated", {})[(self.index, n.name)] = f"{n.target}: {why}"
        return out

    def _replicated(self, target, args, kwargs):
        """``target`` on whole tensors: DTensor arguments gathered to Replicate (differentiable:
        each rank's gradient is the whole one), tensor outputs Replicate DTensors."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_map

        rep = [_replicate()] * self.mesh.ndim
        whole = lambda t: t.redistribute(self.mesh, rep).to_local() if isinstance(t, DTensor) else t  # noqa: E731
        out = target(*tree_map(whole, args), **tree_map(whole, kwargs))
        wrap = lambda t: DTensor.from_local(t, self.mesh, rep, run_check=False) \
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t  # noqa: E731
        return tree_map(wrap, out)


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


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()
