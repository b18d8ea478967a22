"""Layouts of a MAP-sharded layer's values on DTensor (MAP §6; for executor.map_exec.ShardedLayer):
a plain tensor wrapped as Replicate, a value ``redistribute``d to the layout the planned group
reading it expects, a group's output checked against its planned layout (a pending ``Partial`` the
plan replicates is the strategy's all-reduce, anything else a recorded mismatch), and the
identity that makes a reshape's gradient locally contiguous.

Executed = priced (issue 26 item 4): a layout conversion runs as the step sequence
costs.map_layout.convert prices (MAP §4.3: all-gather / shard / all-to-all, one mesh axis each),
each step one ``redistribute`` between adjacent placements (one collective, a shard none:
tests/integration/map/test_map_layout_dtensor.py), never DTensor's own multi-axis plan; its
gradient runs back along ``convert(dst, src)``'s steps, as simulator/sharded_layer.py prices the
backward (:func:`planned_redistribute`). Each conversion's executed steps are kept in
``stats["conversions"]`` and its interval in ``conv_events`` (executor.timeline.CONVERSION_KINDS).

ShardedLayout is a mixin of ShardedLayer: it reads the layer's mesh, planned layouts, groups and
stats set up there."""
from __future__ import annotations

import time

import torch

from costs.map_layout import Conversion, check_spec, convert
from executor.map_trace import MapPlanError
from specs.sharding import Mesh, MeshAxis, ShardingSpec


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
            return value if want is None or tuple(value.placements) == want else \
                self._convert(value, want, f"{group} {self.param_fqn[a.name]}")
        is_act = a.op == "call_function" or a.name in self.user_names  # as executor.op_graph_nodes._nodes
        if not is_act or self.group_of.get(a.name) == group or not hasattr(value, "placements"):
            return value
        k = counter[0]
        counter[0] += 1
        if k >= len(self.in_place[group]):
            raise MapPlanError(f"layer {self.index} group {group!r} reads more inputs than its "
                               f"{len(self.in_place[group])} planned layouts (executor and op graph disagree)")
        want = self.in_place[group][k]
        return value if tuple(value.placements) == want else self._convert(value, want, f"{group} in{k}")

    def _convert(self, value, want: tuple, what: str):
        """``value`` to placements ``want`` along the priced path (:func:`planned_redistribute`),
        on the stage's pricing mesh (``price_mesh``: the planner's alpha-beta axes; without one,
        :func:`uniform_price_mesh`). The executed steps go to ``stats["conversions"]``, keyed
        (layer, "<group> in<k>" / "<group> <param>"), the interval to ``conv_events``."""
        price = getattr(self, "price_mesh", None) or uniform_price_mesh(tuple(self.mesh.shape))
        return planned_redistribute(value, want, self.mesh, price, self.stats.setdefault("conversions", {}),
                                    (self.index, what), self.conv_events)

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


# ---- conversions along the priced path (MAP §4.3; issue 26 item 4) --------------------------------

#: a pricing mesh without the planner's: every axis alike (alpha 10 us, 10 GB/s), so only the axis
#: sizes and the tensor choose the path. The planner's own mesh (simulator.sharded_layer.stage_mesh,
#: or the measured cluster's) picks the same path unless its axes are priced differently
UNIFORM_ALPHA_S, UNIFORM_BW_BYTES_PER_S = 1e-5, 1e10


def uniform_price_mesh(shape: tuple[int, ...]) -> Mesh:
    return Mesh(tuple(MeshAxis(int(n), UNIFORM_ALPHA_S, UNIFORM_BW_BYTES_PER_S) for n in shape))


def spec_of(placements, ndim: int) -> ShardingSpec | None:
    """The ShardingSpec of DTensor ``placements`` (Shard / Replicate only; None for a Partial or
    a strided shard: no spec, no priced path)."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in placements:
        if type(p) is Shard:
            out.append(("shard", p.dim if p.dim >= 0 else p.dim + ndim))
        elif type(p) is Replicate:
            out.append(("replicate", None))
        else:
            return None
    return ShardingSpec.from_placements(out, ndim)


def plan_conversion(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], dtype_bytes: int,
                    price: Mesh) -> Conversion | None:
    """costs.map_layout.convert's path, or None where the specs are not valid for ``shape`` (an
    uneven split: DTensor's own redistribute runs it, recorded as unplanned)."""
    try:
        check_spec(src, shape, price.shape)
        check_spec(dst, shape, price.shape)
    except ValueError:
        return None
    return convert(src, dst, shape, dtype_bytes, price)


def run_steps(value, conv: Conversion, mesh):
    """``value`` (in ``conv.path[0]``) moved along ``conv``: one ``redistribute`` per step, to the
    next spec's placements (one mesh axis changes: one collective, a shard step a local slice)."""
    from executor.sharding import to_dtensor_placements

    for spec in conv.path[1:]:
        value = value.redistribute(mesh, to_dtensor_placements(spec, mesh.ndim))
    return value


def _steps_text(conv: Conversion | None, src, dst) -> str:
    if conv is None:
        return f"{src}->{dst}: unplanned (DTensor's redistribute)"
    return f"{conv.path[0]}->{conv.path[-1]}: " + (", ".join(map(str, conv.steps)) or "none")


class _PlannedRedistribute(torch.autograd.Function):
    """Forward: ``fwd``'s steps. Backward: the gradient along ``back``'s steps (convert(dst,
    src), as the simulator prices it); a gradient arriving with pending partial sums (the reader's
    input-gradient reduction) or whole where the target is sharded is first brought into the
    target layout (logged ``reduce_partial(axis a)``, ``slice(axis a, dim d)``); any other
    arriving layout runs DTensor's redistribute, logged as unplanned."""

    @staticmethod
    def forward(ctx, x, fwd, back, mesh, src_place, log, key, events):
        ctx.fwd, ctx.back, ctx.mesh, ctx.src_place = fwd, back, mesh, src_place
        ctx.log, ctx.key, ctx.events = log, key, events
        t0 = time.perf_counter_ns()
        out = run_steps(x.detach(), fwd, mesh)
        events.append(("convert", key[0], f"{key[1]} {fwd.path[0]}->{fwd.path[-1]}", t0, time.perf_counter_ns()))
        return out

    @staticmethod
    def backward(ctx, g):
        from executor.sharding import to_dtensor_placements

        t0 = time.perf_counter_ns()
        dst_place = tuple(to_dtensor_placements(ctx.fwd.path[-1], ctx.mesh.ndim))
        key = (ctx.key[0], ctx.key[1] + " grad")
        got = tuple(g.placements)
        pre = []  # the reader's backward left its gradient in another layout than fwd's target:
        for a, (p, d) in enumerate(zip(got, dst_place)):
            if p.is_partial() and not d.is_partial():
                pre.append(f"reduce_partial(axis {a})")  # its input-gradient sum (the reading strategy's)
            elif p.is_replicate() and d.is_shard():
                pre.append(f"slice(axis {a}, dim {d.dim})")  # a whole gradient: a local slice
            elif p != d:
                pre = None
                break
        if pre:  # into the target layout first (all-reduce / reduce-scatter per axis, slices), then the priced path
            g, got = g.redistribute(ctx.mesh, dst_place), dst_place
        if got == dst_place:
            reduce = "".join(f"{x}, " for x in pre or ())
            out = run_steps(g, ctx.back, ctx.mesh)
            text = _steps_text(ctx.back, None, None)
            head, _, steps = text.partition(": ")
            ctx.log[key] = f"{head}: {reduce}{steps}" if reduce else text
        else:
            out = g.redistribute(ctx.mesh, ctx.src_place)
            ctx.log[key] = _steps_text(None, list(g.placements), list(ctx.src_place))
        ctx.events.append(("convert_grad", key[0], f"{ctx.key[1]} {ctx.back.path[0]}->{ctx.back.path[-1]}",
                           t0, time.perf_counter_ns()))
        return out, None, None, None, None, None, None, None


def planned_redistribute(value, want: tuple, mesh, price: Mesh, log: dict, key: tuple, events: list):
    """DTensor ``value`` to placements ``want`` along the step sequence costs.map_layout.convert
    prices on ``price`` (MAP §4.3), its gradient back along convert(dst, src)'s. ``log[key]``: the
    executed steps as text (``key + " grad"``'s for the backward); ``events``: (kind, layer,
    label, start_ns, end_ns) per conversion run (executor.timeline.conversion_events). A layout
    without a spec (Partial) or with uneven splits runs DTensor's redistribute, logged
    "unplanned"."""
    ndim = value.ndim
    src, dst = spec_of(value.placements, ndim), spec_of(want, ndim)
    conv = back = None
    if src is not None and dst is not None:
        shape, nbytes = tuple(value.shape), value.element_size()
        conv = plan_conversion(src, dst, shape, nbytes, price)
        back = plan_conversion(dst, src, shape, nbytes, price) if conv is not None else None
    log[key] = _steps_text(conv, list(value.placements), list(want))
    if conv is None:
        return value.redistribute(mesh, want)
    if not value.requires_grad or not torch.is_grad_enabled():
        t0 = time.perf_counter_ns()
        out = run_steps(value, conv, mesh)
        events.append(("convert", key[0], f"{key[1]} {conv.path[0]}->{conv.path[-1]}", t0, time.perf_counter_ns()))
        return out
    return _PlannedRedistribute.apply(value, conv, back, mesh, tuple(value.placements), log, key, events)


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
