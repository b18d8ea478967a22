"""Zero-bubble backward as the paper's own implementation runs it: B stores each Linear's input and
output gradient, W computes the weight gradients from them (``plan.schedule.weight_store``).

Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", §2) split a stage's backward into B (input
gradients, sent upstream at once) and W (weight gradients, run later in what would otherwise be a
bubble). Their Megatron-LM implementation (github.com/sail-sg/zero-bubble-pipeline-parallelism,
``megatron/core/weight_grad_store.py``: ``WeightGradStore``) does not keep the autograd graph
between the two: B is the whole backward, except that each Linear's weight-gradient GEMM is
deferred, its ``(input, grad_output)`` put in a queue (``WeightGradStore.put``); W
(``WeightGradStore.pop``) runs the queued GEMMs ``dW = dY^T X`` and accumulates them into the
weights' gradient buffers. This module is that mechanism on the executor's stages:

- :class:`_StoredLinear`, an autograd Function installed as every stage ``nn.Linear``'s forward:
  ``F.linear(x, w, b)``; its backward returns ``dY W`` for x and ``sum(dY)`` for the bias, no
  gradient for the weight (the weight enters detached: no edge to its AccumulateGrad, so no
  post-accumulate hook fires for it in B), and appends ``(module, X, dY)`` to the store's list
  of the microbatch B is running.
- B (:meth:`WeightStore.input_pass`): the stage's ordinary backward (executor.stage_passes
  ``StagePasses.backward``, as 1F1B runs it: no ``retain_graph``), so the graph and everything
  the forward saved go at B's end; only the stored X and dY outlive it. Norms', embeddings' and
  biases' gradients are summed in B by autograd, as in the paper (only Linear weights wait).
- W (:meth:`WeightStore.weight_pass`): per stored entry, top layer first (the order B stored
  them, the paper's queue order), ``dY_flat^T X_flat`` (all leading dims flattened: the
  engine's own ``mm`` of a linear's weight gradient) summed into ``weight.grad``, one weight
  gradient at a time, each entry dropped as it is done.

Why a custom Function: torch.distributed.pipelining has only the retained-graph split
(``_backward.stage_backward_input`` / ``stage_backward_weight``, executor.split_backward), whose
B keeps every activation below the weight-gradient intermediates alive until W. Here W needs no
graph: what the stage holds from B's end to W's end is each Linear's X and dY (an X read by
several Linears, q, k and v of one attention, is one tensor, held once; an X the forward saved
for its own backward anyway is that same tensor). Recomputed layers (``torch.utils.checkpoint``,
non-reentrant) re-run the Function in B's unpack; the X stored is then the recomputed one, and
only it outlives the layer's recompute. executor.selective's attention core is checkpointed
inside the layer; the Linears around it are plain Function calls.

Tensor parallelism (executor.megatron_tp, DTensor Linears): the Function runs on the DTensors the
TP styles hand it; dX and the bias gradient are DTensor ops (a column-parallel dX Partial, reduced
by its input style's backward, as in DTensor's own linear), and each rank stores its local X and dY:
column-parallel, the whole X (all-gathered under sequence parallelism) and its dY shard;
row-parallel, its X shard and the whole dY. W's ``dY^T X`` is then local, no communication, and has
the weight's placements (Shard(0) / Shard(1)); simulator.stagecost.stored_bytes counts the same.

With ``overlap_grad_reduce`` (executor.zero1) each weight gradient W sums is reported
(``Zero1.grad_ready``) as its post-accumulate hook would be; what B sums goes through autograd's
AccumulateGrad and its hook. A V placement's embedding/head shared by the first and last stage
(executor.split_backward.share_tied_embedding) is left out of that counting, so its bucket is
reduced at the flush, after both stages' sums, as with executor.split_backward. The schedule's
boundaries and V hand-overs (executor.split_backward.LocalLinks) are unchanged. A backward run
outside B (a benchmark alternating with a 1F1B iteration, executor.worker) sums each weight
gradient at once, as autograd would.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from executor.split_backward import _v_tie
from specs.plan import V_SHAPED

__all__ = ["WeightStore"]


class _StoredLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward defers the weight gradient to ``store``
    (Qi et al. 2024's ``WeightGradStore.put``). ``weight`` comes detached (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, store):
        ctx.save_for_backward(x, weight)  # x: what autograd's linear saves too (for dW); weight: for dX
        ctx.module, ctx.store, ctx.has_bias = module, store, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy_flat = dy.reshape(-1, dy.shape[-1])
        # the engine's own formulas for addmm/mm (mm_mat1_backward: grad.mm(mat2.t()), mat2 = w.t();
        # the bias: sum_to of the expanded bias, a sum over the flattened rows). Under tensor
        # parallelism (DTensors) these are DTensor's ops, so the placements are its own: a
        # column-parallel dX is Partial (its input style reduces it), a row-parallel one Shard(-1)
        dx = dy_flat.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        db = dy_flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        # detached: a stored X with its grad_fn would keep the graph's nodes, and through their edges
        # the stage's input leaf (a received boundary buffer), alive until W
        ctx.store.put(ctx.module, x.detach(), dy.detach())
        return dx, None, db, None, None


class WeightStore:
    """B and W passes of one executor.stage.StageRuntime (``st``) with the weight store;
    executor.split_backward.SplitBackward's interface. ``w_passes`` counts the W passes run,
    ``pending`` maps a microbatch to its stored ``(Linear, X, dY)`` list."""

    def __init__(self, st):
        if st.bounds is not None or st.workers is not None or st.pipedream is not None:
            raise ValueError(f"schedule {st.plan.schedule.kind.value}: a split backward needs a plain tensor "
                             "boundary (not a user model's pytree), one worker and a flushed schedule")
        self.st = st
        self.pending: dict[int, list] = {}  # microbatch -> [(Linear, X, dY)] in B's order (top layer first)
        self.w_passes = 0
        self.current: list | None = None  # B's list while input_pass runs
        for lin in {id(m): m for _, _, mod in st.layers for m in mod.modules() if isinstance(m, nn.Linear)}.values():
            _install(lin, self)
        zero1 = getattr(st, "zero1", None)
        self.ready = zero1.grad_ready if zero1 is not None and zero1.overlap_grad else None
        if self.ready is not None and st.first and st.plan.schedule.kind in V_SHAPED and _v_tie(st):
            # the V's shared embedding/head: B's AccumulateGrad of the embedding would fire its hook
            # m times and launch its bucket while the last stage's W may still add the head's dW to
            # it. Out of the hook's bucket map, the bucket is launched at the flush (Zero1.reduce), as
            # executor.split_backward leaves it (its B sums the embedding by hand, untold)
            first_index = st.layers[0][0]
            for i, _, mod in st.layers:
                if i == first_index:
                    zero1._bucket_of.pop(id(mod.wte.weight), None)

    def put(self, module, x: torch.Tensor, dy: torch.Tensor) -> None:
        """A Linear's backward in B: keep (X, dY) for W; outside B, its weight gradient at once."""
        if self.current is not None:
            self.current.append((module, x, dy))
        else:
            with torch.no_grad():
                self._add(module.weight, _weight_grad(x, dy, module.weight))

    def _add(self, p, grad: torch.Tensor) -> None:
        """``p.grad += grad`` in place (the stage's gradient buffer, a bucket's view with
        executor.zero1), told to zero1's buckets as the post-accumulate hook would be."""
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)
        if self.ready is not None:
            self.ready(p)

    def input_pass(self, k: int, grad: torch.Tensor | None) -> None:
        """B of microbatch ``k``: the stage's whole backward (graph freed) but the Linears' weight
        gradients, whose (X, dY) pairs wait in ``pending[k]``; the input gradient into
        ``st.grad_to_send`` (None on the first stage). ``grad``: the received output gradient."""
        self.current = []
        try:
            self.st.backward(k, grad)
        finally:
            self.pending[k], self.current = self.current, None

    def weight_pass(self, k: int) -> None:
        """W of microbatch ``k``: ``dW = dY^T X`` per stored Linear (Qi et al.'s ``WeightGradStore.pop``),
        top layer first, summed into ``.grad`` one at a time, each (X, dY) dropped when done."""
        st = self.st
        stored = self.pending.pop(k)
        stored.reverse()  # pop() from the end walks B's order
        touched = {}
        with torch.no_grad():
            while stored:
                mod, x, dy = stored.pop()
                dw = _weight_grad(x, dy, mod.weight)
                del x, dy
                self._add(mod.weight, dw)
                del dw
                touched[id(mod.weight)] = mod.weight
        for p in touched.values():  # accumulation may have replaced a grad tensor: keep it filed
            st.tracker.tag(p.grad, "gradients")
        self.w_passes += 1

    def check_done(self) -> None:
        """Every B met its W before the gradients are reduced (executor.split_backward's check)."""
        from executor.split_backward import SplitBackward

        SplitBackward.check_done(self)


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``dY_flat^T X_flat``: the engine's weight gradient of a linear (mm_mat2_backward's
    column-major branch ``grad.t().mm(mat1)`` after TBackward0), leading dims flattened. Tensor
    parallel (DTensor X, dY): local GEMMs with no communication, column-parallel dY Shard(-1)
    times the replicated X gives Shard(0), replicated dY times the row-parallel X's Shard(-1)
    gives Shard(1): the weight's own placements, as autograd's would be (checked against
    ``weight``'s, so a layout this does not know fails rather than redistributes)."""
    dw = dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
    if weight is not None and getattr(weight, "placements", None) != getattr(dw, "placements", None):
        raise RuntimeError(f"weight_store: a stored Linear's dW has placements {getattr(dw, 'placements', None)}, "
                           f"its weight {getattr(weight, 'placements', None)}")
    return dw


def _install(lin: nn.Linear, store: WeightStore) -> None:
    """``lin.forward`` (an instance attribute) through :class:`_StoredLinear` when autograd records
    the call and there is an input gradient to carry it (an input without one: plain ``F.linear``,
    its weight gradient summed by autograd in B, as no W could get a dY from it otherwise)."""
    def forward(x, lin=lin, store=store):
        w, b = lin.weight, lin.bias
        if torch.is_grad_enabled() and w.requires_grad and x.requires_grad:
            return _StoredLinear.apply(x, w.detach(), b, lin, store)
        return F.linear(x, w, b)

    lin.forward = forward
