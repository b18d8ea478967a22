"""ZeRO-2 over one stage's dp group (Rajbhandari et al. 2020 §5.2, P_os+g): the weights whole on
every replica, the gradients and the optimizer state 1/d, as the simulator holds them
(costs.static: grads and optimizer sharded at ``zero_stage`` >= 2; costs.activations: one layer's
whole gradient inside its backward) and times them (costs.layer_time.sharded_dp_comm_s: each
layer's reduce-scatter after its backward in every microbatch).

It is executor.zero1's layout with the persistent whole gradient buffer taken away:

* buckets: one per layer (Zero1's overlapped layout), its parameters views into one flat buffer,
  rank r owning elements [r·S, (r+1)·S); the rank's gradient is ``acc``, the S elements of its shard
  summed over the iteration's microbatches (filed ``gradients``: 1/d of them, as ZeRO-2 holds);
* every microbatch: a layer's first post-accumulate hook allocates the layer's whole gradient as one
  flat buffer, makes every parameter's ``.grad`` a view of it (the hooked one's fresh gradient
  copied in; the others' AccumulateGrad then add into their views in place), and once each of
  the layer's parameters accumulated, ``reduce_scatter_single`` (SUM) of the flat buffer into a 1/d
  shard that is added to ``acc``; the flat buffer is freed there and then. DeepSpeed's stage 2
  reduces every micro-step alike (``reduce_ipg_grads`` into its partitioned gradients). Blocking,
  where DeepSpeed overlaps on a side stream: on CPU gloo the transfer does not overlap anyway, and
  a blocking call frees the buffer at a fixed point of the backward, so the measured peak is the
  same in every run;
* step: Zero1's — the optimizer steps the rank's shards (the parameter buffer's own elements in
  fp32, an fp32 master of 16-bit ones) with ``acc`` as their gradient, then each bucket's parameters
  are all-gathered (asynchronously with ``overlap_param_gather``, waited by the layer's forward
  pre-hook).

A weight tied over pipeline stages (GPT's embedding and LM head) has a bucket of its own, laid out
alike on both stages (Zero1's), so Megatron's embedding group sums the two stages' reduced shards
(executor.stage_grads ``allreduce_embedding_grads``: each replica's shard in its place in a whole
zero tensor, one all-reduce over the group, as under ZeRO-1).

Not run here (:func:`unsupported`): tensor / context parallelism, a user model's weights tied over
stages (executor.user_model sums whole gradients), offload and swaps, schedules other than
GPipe / 1F1B, MAP stages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from executor.zero1 import Zero1
from specs.plan_memory import ON_DEVICE_ACTIONS, ON_DEVICE_TEXT


class Zero2(Zero1):
    """ZeRO-2 of one stage (executor.stage.StageRuntime builds it for ``zero_stage`` 2 and a stage
    with replicas). Zero1's interface: ``zero_grad``, ``reduce``, ``step``, ``finish``, ``masters``."""

    def __init__(self, rt, overlap_gather: bool):
        # per-layer buckets and post-accumulate hooks (overlap_grad=True: Zero1's layout for them)
        super().__init__(rt, shard=True, overlap_grad=True, overlap_gather=overlap_gather)
        for b in self.buckets:
            b.grad_buf = None  # no whole gradient at rest: only the rank's shard, ``acc``
            for p in b.params:
                p.grad = None
            b.acc = torch.zeros(b.shard_numel, dtype=b.param_buf.dtype, device=b.param_buf.device)
            b.flat = None  # the layer's whole gradient of the microbatch in its backward
            b.seen = set()

    def _reduced(self, b) -> torch.Tensor:
        return b.acc  # what Zero1.step hands the optimizer

    def tag(self, tracker) -> None:
        """File the gradient shards (executor.memtrack.tag_static: the parameters' ``.grad`` are None)."""
        for b in self.buckets:
            tracker.tag(b.acc, "gradients")

    # ---- gradients ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for b in self.buckets:
            if hasattr(b, "acc"):  # (Zero1.__init__ calls this before the shards exist)
                b.acc.zero_()
            b.seen = set()

    def _accumulated(self, p) -> None:
        """post-accumulate hook, once per parameter and microbatch (autograd sums a leaf's uses
        before its one AccumulateGrad): gather the layer's gradient into its flat buffer; reduce
        it once every parameter of the layer has accumulated."""
        b = self._bucket_of.get(id(p))
        if b is None:
            return
        tracker = self.rt.tracker
        if b.flat is None:
            with tracker.phase("buffers"):
                b.flat = torch.zeros(b.shard_numel * self.d, dtype=b.param_buf.dtype, device=b.param_buf.device)
            offset = 0
            for q in b.params:
                k = q.numel()
                view = b.flat[offset:offset + k].view_as(q)
                if q.grad is not None:  # accumulated before the buffer existed (the hooked one)
                    view.copy_(q.grad)
                q.grad = view
                offset += k
        b.seen.add(id(p))
        if len(b.seen) == len(b.params):
            self._reduce_bucket(b)

    def _reduce_bucket(self, b) -> None:
        tracker = self.rt.tracker
        with tracker.phase("buffers"):
            part = torch.empty(b.shard_numel, dtype=b.flat.dtype, device=b.flat.device)
        dist.reduce_scatter_single(part, b.flat, op=dist.ReduceOp.SUM, group=self.group)
        b.acc.add_(part)
        for q in b.params:
            q.grad = None
        tracker.release(b.flat)  # gloo's worker thread may still hold both (executor.memtrack.release)
        tracker.release(part)
        b.flat, b.seen = None, set()

    def grad_ready(self, p) -> None:
        raise AssertionError("zero_stage 2 does not run split backwards (executor.zero2.unsupported)")

    def reduce(self) -> None:
        """The allreduce_grads entry: a layer some parameter of which got no gradient in the last
        microbatch is reduced now (same stage order on every replica)."""
        for b in self.buckets:
            if b.flat is not None:
                self._reduce_bucket(b)

    def tied_acc(self, param) -> torch.Tensor:
        """The gradient shard of a weight tied over stages (alone in its bucket, as Zero1 lays it
        out, so its elements [lo, hi) of :meth:`tied_shard` are the shard's first hi - lo)."""
        b = self._bucket_of[id(param)]
        lo, hi = self.tied_shard(param)
        return b.acc[:hi - lo]


def unsupported(plan, cfg=None) -> list[str]:
    """What of ``zero_stage`` 2 this module does not run, as 'field: why' (executor.measure's
    ``unsupported`` adds them; ``cfg``: the model config, when known)."""
    if plan.zero_stage != 2:
        return []
    z, out = "zero_stage 2 (executor.zero2)", []
    if len(plan.stages) > 1 and cfg is not None and cfg.family == "torch_module":
        out.append(f"model.family: a user model over {len(plan.stages)} pipeline stages with {z} (weights it ties "
                   "over stages are summed as whole gradients by executor.user_model, which ZeRO-2 does not keep; "
                   "not known before its layers are built); allowed: one stage (pp = 1)")
    if plan.schedule.kind.value not in ("gpipe", "1f1b"):
        out.append(f"schedule.kind: {plan.schedule.kind.value} with {z}; allowed: gpipe, 1f1b")
    for i, st in enumerate(plan.stages):
        if st.tp > 1 or st.cp > 1:
            out.append(f"stages[{i}].tp/cp: tp {st.tp} x cp {st.cp} with {z}; allowed: tp = cp = 1")
        if st.sharding:
            out.append(f"stages[{i}].sharding: a MAP stage with {z} (not implemented)")
        off = st.offload
        if (off.window_layers is not None or off.optimizer_on_cpu or off.optimizer_swap or off.weight_swap_layers
                or off.stash_swap_layers):
            out.append(f"stages[{i}].offload: with {z} (its buckets hold resident parameters and a device "
                       "optimizer only)")
        actions = sorted({m.action.value for m in st.memory if m.action not in ON_DEVICE_ACTIONS})
        if actions:
            out.append(f"stages[{i}].memory: {actions} with {z}; allowed: {ON_DEVICE_TEXT}")
    return out
