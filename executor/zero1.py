"""Megatron's distributed optimizer (ZeRO-1 over data parallelism) and bucketed, overlapped
gradient reduction / parameter all-gather for one stage's dp group (issue 27).

Layout (Megatron-Core ``ParamAndGradBuffer``): the stage's parameters are split into buckets (one
for the whole stage, or one per layer when anything overlaps); each bucket's parameters and
gradients are views into one flat buffer each, padded to a multiple of the dp degree d, and rank
r owns elements [r·S, (r+1)·S) of every bucket (S = padded size / d). Per iteration:

* reduce: ``reduce_scatter_single`` (torch 2.13's name of reduce_scatter_tensor) of each bucket's gradient buffer (SUM) into a 1/d shard
  (ZeRO-1), or an in-place ``all_reduce`` of it (ZeRO-0 with overlap_grad_reduce). torch 2.13's
  gloo implements it (checked on this machine, 2 ranks), so no ring of
  send/recv is needed. With ``overlap_grad_reduce`` a bucket's collective is launched
  asynchronously from ``register_post_accumulate_grad_hook`` once every parameter of it has
  accumulated its last microbatch's gradient (autograd sums a leaf's uses before its one
  AccumulateGrad, so each hook fires once per backward; a split backward's W, which sums by hand,
  calls :meth:`Zero1.grad_ready` per sum instead); whatever was not launched then (a parameter
  without gradient) is launched, blocking, at the allreduce_grads entry, where everything is waited for;
* step: the optimizer owns one tensor per bucket, the rank's shard: for fp32/fp64 weights a view
  of the parameter buffer itself (Megatron's "fp32 param, fp32 grads": 8 + 8/d B/param), for
  16-bit weights an fp32 master copy (2 + 4 + 12/d with fp32 grads);
* gather: ``all_gather_single`` of each bucket's parameter buffer from the updated shards;
  with ``overlap_param_gather`` asynchronously, each bucket waited by a forward pre-hook of its
  layer before the layer's first forward of the next iteration (the executor runs several
  iterations; :meth:`Zero1.finish` waits for the last one's at the run's end).

Tensor parallelism (executor.megatron_tp): a tp rank's parameters are DTensors; its buckets
hold their local shards (``_local_tensor``) and its dp group is the replicas of its tp rank
(topology's ("dp", stage, tp_rank) group), so each reduce-scatters, steps and all-gathers its
own shards, as Megatron-Core's distributed optimizer over the DP group of each TP rank. The
gradient views are DTensors of the parameters' placements over the flat buffer, so autograd
accumulates into it as in the plain dp path; a parameter replicated over tp (a norm's weight:
a plain tensor without sequence parallelism, a Replicate DTensor whose partial gradient the
accumulation all-reduces over tp with it) has the same gradient, position and shard on every
tp rank and so the same update.

Memory per rank: parameters and gradients whole (plus < d elements of padding per bucket), the
optimizer state (Adam m, v; 16-bit weights' master) 1/d; while reducing, the 1/d gradient shard.
No flat copy: the collectives run on the buffers in place, as Megatron's do.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


class _Bucket:
    """One bucket: its parameters (local tensors), flat parameter and gradient buffers, the
    rank's shard of both, and its launched collective."""

    def __init__(self, params: list, d: int, rank: int, dtype_master: torch.dtype | None):
        self.params = params
        local = [getattr(p, "_local_tensor", p) for p in params]
        n = sum(t.numel() for t in local)
        self.shard_numel = math.ceil(n / d) if n else 0
        padded = self.shard_numel * d
        ref = local[0]
        self.param_buf = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        self.grad_buf = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        offset = 0
        for p, t in zip(params, local):
            k = t.numel()
            self.param_buf[offset:offset + k].copy_(t.detach().reshape(-1))
            t.data = self.param_buf[offset:offset + k].view_as(t)
            p.grad = _grad_like(p, self.grad_buf[offset:offset + k].view_as(t))
            offset += k
        lo = rank * self.shard_numel
        self.param_shard = self.param_buf[lo:lo + self.shard_numel]
        # the optimizer's tensor: the shard itself, or an fp32 master copy of 16-bit weights
        self.master = torch.nn.Parameter(self.param_shard if dtype_master is None
                                         else self.param_shard.detach().to(dtype_master))
        self.grad_shard: torch.Tensor | None = None
        self.work = None     # the launched reduction
        self.gather = None   # the launched parameter all-gather
        self.pending: set[int] = set()
        self._lo = lo

    def grad_shard_view(self) -> torch.Tensor:
        """This rank's shard of the gradient buffer (after :meth:`Zero1.reduce`: the dp sum)."""
        return self.grad_buf[self._lo:self._lo + self.shard_numel]


def _grad_like(p, local: torch.Tensor):
    """``p``'s gradient with ``local`` as its storage: a DTensor of ``p``'s mesh and placements
    for a tensor-parallel parameter (executor.megatron_tp), so autograd accumulates each tp
    rank's local shard into its dp group's flat buffer; ``local`` itself for a plain one."""
    if not hasattr(p, "_local_tensor"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


class Zero1:
    """The dp sync and step of one stage (executor.stage.StageRuntime builds it when the plan has
    ``zero_stage`` 1 or ``overlap_grad_reduce`` and the stage has replicas). ``shard``: ZeRO-1
    (reduce-scatter, 1/d step, all-gather); False: bucketed in-place all-reduce (ZeRO-0)."""

    def __init__(self, rt, shard: bool, overlap_grad: bool, overlap_gather: bool):
        self.rt, self.group, self.shard = rt, rt.dp_group, shard
        self.d, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.overlap_grad, self.overlap_gather = overlap_grad, overlap_gather and shard
        master = None
        if shard and rt.params and rt.params[0].dtype in (torch.float16, torch.bfloat16):
            master = torch.float32
        seen: set[int] = set()
        groups: list[tuple[object, list]] = []  # (layer module, its parameters not seen before)
        for _, _, mod in rt.layers:
            ps = [p for p in mod.parameters() if id(p) not in seen and any(p is q for q in rt.params)]
            seen.update(id(p) for p in ps)
            if ps:
                groups.append((mod, ps))
        # A tied embedding split over stages gets a bucket of its own, laid out alike on both stages, so
        # each replica's shard of it is the same elements there (Megatron-Core's _ParamAndGradBuffer
        # splits the shared embedding into its own bucket for this reason): the embedding group then
        # sums reduced shards (stage_grads.allreduce_embedding_grads)
        tied = rt.tied[0] if rt.tied is not None else None
        if tied is not None:
            groups = [(mod, [p for p in ps if p is not tied]) for mod, ps in groups]
            groups = [g for g in groups if g[1]]
        if not (overlap_grad or self.overlap_gather):  # one bucket: one collective per stage, as simulated
            groups = [(groups[0][0], [p for _, ps in groups for p in ps])] if groups else []
        if tied is not None:
            home = next(mod for _, _, mod in rt.layers if any(p is tied for p in mod.parameters()))
            groups = ([(home, [tied])] + groups) if rt.first else (groups + [(home, [tied])])
        self.buckets = [_Bucket(ps, self.d, self.rank, master) for _, ps in groups]
        self.masters = [b.master for b in self.buckets]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._count: dict[int, int] = {}
        if overlap_grad:
            for p in rt.params:
                p.register_post_accumulate_grad_hook(self._accumulated)
        if self.overlap_gather:
            for (mod, _), b in zip(groups, self.buckets):
                mod.register_forward_pre_hook(lambda _m, _a, b=b: self._wait_gather(b))
        self.zero_grad()

    # ---- gradients ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """A new iteration: every bucket's parameters still to accumulate their last gradient."""
        self._count.clear()
        for b in self.buckets:
            b.pending = {id(p) for p in b.params}

    def _accumulated(self, p) -> None:
        """post-accumulate hook: on the last microbatch's accumulation of every parameter of a
        bucket, launch its reduction (asynchronously: the rest of the backward runs beside it)."""
        n = self._count[id(p)] = self._count.get(id(p), 0) + 1
        b = self._bucket_of.get(id(p))
        if b is None or n < self.rt.m:
            return
        b.pending.discard(id(p))
        if not b.pending and b.work is None:
            self._launch(b, async_op=True)

    def grad_ready(self, p) -> None:
        """``p``'s gradient of one microbatch was summed into ``.grad`` by hand (executor.split_backward's
        B and W): counted as the post-accumulate hook counts it."""
        self._accumulated(p)

    def _launch(self, b: _Bucket, async_op: bool) -> None:
        with self.rt.tracker.phase("buffers"):
            if self.shard:
                b.grad_shard = torch.empty(b.shard_numel, dtype=b.grad_buf.dtype, device=b.grad_buf.device)
                b.work = dist.reduce_scatter_single(b.grad_shard, b.grad_buf, op=dist.ReduceOp.SUM, group=self.group,
                                                    async_op=async_op)
            else:
                b.work = dist.all_reduce(b.grad_buf, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        if not async_op:
            b.work = True

    def reduce(self) -> None:
        """The allreduce_grads entry: launch what the hooks did not (stage order is the same on
        every replica), then wait for every bucket."""
        for b in self.buckets:
            if b.work is None:
                self._launch(b, async_op=False)
        for b in self.buckets:
            if b.work is not True:
                b.work.wait()
            b.work = None
            if self.shard:  # the reduced shard into its place in the gradient buffer (Megatron's in-place RS)
                b.grad_shard_view().copy_(b.grad_shard)
                b.grad_shard = None

    def tied_shard(self, param) -> tuple[int, int]:
        """[lo, hi) of ``param``'s flat local elements (a tp rank's shard of a DTensor) whose reduced
        gradient this rank holds (ZeRO-1: its own bucket, so its shard, clipped to the parameter)."""
        b = self._bucket_of[id(param)]
        lo, n = self.rank * b.shard_numel, getattr(param, "_local_tensor", param).numel()  # a TP rank's rows
        return min(lo, n), min(lo + b.shard_numel, n)

    # ---- the step and the parameter all-gather ----------------------------------------------
    def step(self, optimizer, tracker) -> None:
        """Step the rank's shards (their reduced gradients), then all-gather every bucket's
        parameters (asynchronously with ``overlap_param_gather``)."""
        for b in self.buckets:
            g = self._reduced(b)
            b.master.grad = g if g.dtype == b.master.dtype else g.to(b.master.dtype)
        with tracker.phase("optimizer"):
            optimizer.step()
        for b in self.buckets:
            b.master.grad = None
            if b.master.data_ptr() != b.param_shard.data_ptr():  # a 16-bit weight's fp32 master
                b.param_shard.copy_(b.master.detach())
                tracker.tag(b.master, "optimizer")
        with tracker.phase("buffers"):
            for b in self.buckets:
                mine = b.param_shard.clone()  # gloo's input must not alias the output it fills
                b.gather = (dist.all_gather_single(b.param_buf, mine, group=self.group,
                                                        async_op=self.overlap_gather), mine)
                if not self.overlap_gather:
                    b.gather = None

    def _reduced(self, b: _Bucket) -> torch.Tensor:
        """This rank's reduced gradient shard of bucket ``b``, what the step hands the optimizer
        (ZeRO-2, executor.zero2, keeps it apart from any whole buffer)."""
        return b.grad_shard_view()

    def _wait_gather(self, b: _Bucket) -> None:
        if b.gather is not None:
            b.gather[0].wait()
            b.gather = None

    def finish(self) -> None:
        """Wait for every launched all-gather (the run's end: the weights are read then)."""
        for b in self.buckets:
            self._wait_gather(b)


def unsupported(plan, cfg=None) -> list[str]:
    """What of ``zero_stage`` / ``overlap_grad_reduce`` / ``overlap_param_gather`` this module does
    not run, as 'field: why' (executor.measure.unsupported lists them); ZeRO-2/3: executor.zero2's, executor.fsdp's."""
    if plan.zero_stage > 1:  # ZeRO-2: executor.zero2's; ZeRO-3: executor.fsdp's (measure.unsupported asks both)
        return []
    out = []
    if not (plan.zero_stage == 1 or plan.overlap_grad_reduce):
        return out
    what = "zero_stage 1" if plan.zero_stage == 1 else "overlap_grad_reduce"
    if plan.schedule.kind.value == "pipedream_async":
        out.append(f"schedule.kind: pipedream_async with {what} (PipeDream updates after every backward; "
                   "executor.zero1 reduces once per iteration); allowed: a flushing schedule")
    for i, st in enumerate(plan.stages):
        off = st.offload
        if st.dp > 1 and (off.window_layers is not None or off.optimizer_on_cpu or off.optimizer_swap
                          or off.weight_swap_layers):
            out.append(f"stages[{i}].offload: with {what} (executor.zero1's flat buffers hold resident "
                       "parameters and a device optimizer only)")
        if st.dp > 1 and st.sharding:
            out.append(f"stages[{i}].sharding: a MAP stage with {what} (not implemented)")
    return out
