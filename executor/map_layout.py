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
