"""Zero-bubble backward: a stage's backward split into B (input gradients) and W (weight gradients).

Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", §2): the backward of a stage is two passes.
B computes the gradient of the stage's input only, so it can be sent upstream at once; W computes
the weight gradients later, in what would otherwise be a pipeline bubble. The mechanism is
torch.distributed.pipelining's (``_backward.stage_backward_input`` / ``stage_backward_weight``):

- B: ``autograd.grad`` of the stage's output (its loss on the last stage) w.r.t. the stage's
  input with ``retain_graph``. Before it runs, the graph is split at the *intermediates*: the
  autograd nodes where a path from a weight meets the input's path (``get_param_groups``). A
  pre-hook on each stores the gradient flowing into it, which is all W needs.
- W: per intermediate, its weights' gradients from the stored output gradient, summed into
  ``.grad`` (the stage's persistent gradient buffer, executor.stage); the graph goes with it. A
  linear's (``addmm``/``mm`` behind ``weight.t()``) and a norm's (``native_layer_norm``) are
  computed directly with the engine's own formulas (:func:`_direct_weight_grads`: same numbers,
  no per-group engine call, whose dependency walk over every node below the intermediate made
  W ~1.4x slower on gpt_tiny, seq 512); other groups go through ``autograd.grad`` from the
  intermediate to the weights' accumulators (torch's ``stage_backward_weight``).

Memory (what the simulator books, simulator.stagecost.split_bytes; measured): everything the
forward saved below the top intermediate stays until W (the intermediates' graph edges reach it),
with each intermediate's stored output gradient; the graph above them (a loss's logits) is dropped
at B's end (the output is detached); W frees group by group, one weight gradient at a time.

The first stage has no input to differentiate: its B differentiates its first layer's weights
(the embedding's; torch instead runs stage 0's whole backward in W, ``backward_weight_one_chunk``),
so B is the input-gradient chain there too and W the other weights' gradients.

Recomputed layers (``torch.utils.checkpoint``, non-reentrant) work: B's unpack re-runs the
layer's forward, its recomputed tensors going as B unpacks them or at B's end (its graph task);
W's unpacks re-run it once more, one layer at a time (``GraphExecGroup``). Selective layers
(executor.selective: only the attention core checkpointed) re-run the core in B only: W's weight
gradients read the projections' saved inputs, outside it. With ``overlap_grad_reduce`` each
gradient B or W sums by hand is reported to executor.zero1 (``Zero1.grad_ready``) as its
post-accumulate hook would be, so a bucket's reduction starts after its last microbatch's W
(a V's shared embedding/head, summed by two stages, at the flush). Other memory actions
and runtimes that hook the backward (swaps, windows, weight swap, PipeDream, MAP stages,
multi-stream workers, a user's pytree boundaries) are refused by name (:func:`unsupported`).

:class:`LocalLinks`: in a V placement (zbv, dualpipev) chunks p-1 and p sit on one rank, so the
activation and gradient between them are handed over in memory, not sent.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import _engine_run_backward
from torch.utils.checkpoint import GraphExecGroup
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups, stage_backward_weight,
)

from executor.megatron_tp import loss_context
from specs.plan import SPLIT_BACKWARD, V_SHAPED, MemoryAction, Plan

__all__ = ["LocalLinks", "SplitBackward", "share_tied_embedding", "unsupported"]

#: memory actions a split backward runs (keep; recompute re-runs the forward inside B; selective
#: re-runs the attention core inside B, executor.selective)
_RUNS = (MemoryAction.keep, MemoryAction.recompute, MemoryAction.selective)


def unsupported(plan: Plan, model_cfg=None) -> list[str]:
    """Why this executor cannot run ``plan``'s split backward (empty: it can, or the schedule does
    not split). Each reason names the field and what is allowed."""
    if plan.schedule.kind not in SPLIT_BACKWARD:
        return []
    out = []
    kind = plan.schedule.kind.value
    if getattr(model_cfg, "family", None) == "torch_module":
        out.append(f"model.family: torch_module with schedule {kind} (a user model's pytree boundaries are not "
                   "split into B and W; use schedule 1f1b)")
    for i, st in enumerate(plan.stages):
        bad = sorted({item.action.value for item in st.memory if item.action not in _RUNS})
        if bad:
            why = (" (op_sac: torch's selective checkpoint hands its cached outputs to one recompute only, "
                   "'Trying to backward an extra time', and W's unpacks need a second; use recompute full "
                   "or selective)") if MemoryAction.op_sac.value in bad else ""
            out.append(f"stages[{i}].memory: schedule {kind} splits the backward into B and W; the executor runs "
                       f"layers kept or recomputed there, got {bad}{why}")
        if st.streamed_layers or st.offload.weight_swap_layers or st.offload.optimizer_swap:
            out.append(f"stages[{i}].offload: schedule {kind} (split backward) runs without STRONGHOLD windows, "
                       "weight swaps or optimizer swaps in the executor")
        if st.sharding:
            out.append(f"stages[{i}].sharding: schedule {kind} (split backward) runs Megatron-style stages; "
                       "MAP stages are not split")
    family = getattr(model_cfg, "family", None)
    stored = ("gpt", "bert", "llama")  # families whose weights W computes from stored Linear inputs
    if plan.schedule.weight_store and family not in (None, "torch_module", *stored):
        out.append(f"model.family: schedule.weight_store defers only nn.Linear weight gradients "
                   f"(executor.weight_store); allowed families: {', '.join(stored)}, got {family} (moe routes "
                   "tokens to expert weights that are not Linears, wresnet's are convolutions); use weight_store false")
    return out


class SplitBackward:
    """B and W passes of one executor.stage.StageRuntime (``st``). ``w_passes`` counts the W
    passes run (the tests check every B got its W)."""

    def __init__(self, st):
        if st.bounds is not None or st.workers is not None or st.pipedream is not None:
            raise ValueError(f"schedule {st.plan.schedule.kind.value}: a split backward needs a plain tensor "
                             "boundary (not a user model's pytree), one worker and a flushed schedule")
        self.st = st
        # every weight the stage's modules use (a V's shared embedding too: the last stage's head
        # adds its gradient to the first stage's buffer, executor.split_backward.share_tied_embedding)
        self.weights = list({id(p): p for _, _, mod in st.layers for p in mod.parameters() if p.requires_grad}.values())
        first_index = st.layers[0][0] if st.first else None
        self.first_layer = [p for i, _, mod in st.layers if i == first_index for p in mod.parameters()]
        self.pending: dict[int, list] = {}  # microbatch -> W's parameter groups (intermediates, their gradients)
        self.w_passes = 0
        # overlap_grad_reduce (executor.zero1): B's first-layer sums and W's sum weight gradients by
        # hand, outside the AccumulateGrad whose post-accumulate hook counts a parameter's
        # microbatches and launches its bucket's reduction on the last; each hand sum tells the bucket
        # the same. A V's shared embedding/head (two stages sum into it, share_tied_embedding) is left
        # to the blocking launch at allreduce_grads: neither stage knows it holds the last sum
        zero1 = getattr(st, "zero1", None)
        self.ready = zero1.grad_ready if zero1 is not None and zero1.overlap_grad else None
        self.shared = set()
        if self.ready is not None and st.first and st.plan.schedule.kind in V_SHAPED and _v_tie(st):
            self.shared = {id(mod.wte.weight) for i, _, mod in st.layers if i == first_index}

    def _ready(self, params) -> None:
        """Tell executor.zero1's buckets that ``params`` got this microbatch's gradient (as the
        post-accumulate hook would); nothing without overlap_grad_reduce."""
        if self.ready is not None:
            for p in params:
                if id(p) not in self.shared:
                    self.ready(p)

    def input_pass(self, k: int, grad: torch.Tensor | None) -> None:
        """B of microbatch ``k``: the input gradient into ``st.grad_to_send``; the weight gradients
        left for :meth:`weight_pass`. ``grad``: the received output gradient (None on the last stage)."""
        st = self.st
        y = st.outputs.pop(k)
        x = st.inputs.pop(k)
        root = torch.ones_like(y) if st.last else grad  # the last stage's output is its (scaled) loss
        # what B differentiates: the stage input; on the first stage (no input) its first layer's
        # weights (the embedding: B runs the whole input-gradient chain down to them, W the other
        # weights', as on any stage; torch instead runs stage 0's whole backward in W)
        sources = [x] if x is not None else [p for p in self.first_layer if p.requires_grad]
        skip = {id(p) for p in sources}
        weights = [_get_grad_fn_or_grad_acc(p) for p in self.weights if id(p) not in skip]
        if not sources:  # a first layer without weights: nothing to split, B is the whole backward
            with loss_context(st.vocab_parallel):
                _engine_run_backward((y,), (root,), False, False, (), True, True)
            self.pending[k], st.grad_to_send = [], None
            return
        outs = [_get_grad_fn_or_grad_acc(y)]
        groups = get_param_groups([_get_grad_fn_or_grad_acc(t) for t in sources], weights,
                                  construct_reverse_graph(outs))
        handles = []
        for group in groups:
            group["intermediates"] = list(group["intermediates"])
            group["grads"] = [None] * len(group["intermediates"])
            for i, node in enumerate(group["intermediates"]):
                def keep(grad_inputs, group=group, i=i):
                    group["grads"][i] = grad_inputs
                handles.append(node.register_prehook(keep))
        try:
            with loss_context(st.vocab_parallel):
                # the engine directly: a sent output is released (executor.boundary.release), a shape
                # check on it would fail; inputs=(x,) without accumulation is autograd.grad
                got = _engine_run_backward((y,), (root,), True, False, tuple(sources), True, False)
        finally:
            for h in handles:
                h.remove()
        if y._base is None:
            y.detach_()  # the graph above the intermediates goes (torch: stage_backward_input)
        self.pending[k] = groups
        if x is not None:
            st.grad_to_send = got[0]
        else:  # the first layer's weight gradients are complete: into the stage's buffers
            for p, g in zip(sources, got):
                if g is not None:
                    p.grad.add_(g)
            self._ready(p for p, g in zip(sources, got) if g is not None)
            st.grad_to_send = None

    def weight_pass(self, k: int) -> None:
        """W of microbatch ``k``: its weight gradients summed into the stage's ``.grad`` buffers."""
        st = self.st
        groups = self.pending.pop(k)
        with loss_context(st.vocab_parallel):
            # from the output down, as the engine frees: linears' and norms' weight gradients
            # directly (as the engine would), any other group through the engine
            # (torch's stage_backward_weight) in its turn, so that a layer's graph (and a recomputed
            # layer's re-made tensors no direct group unpacks: attention's, an RMSNorm's) goes once
            # its groups are done, before the layer below is re-made. With those groups left to one
            # engine call at the end, llama_tiny's re-made blocks piled up: a 3-block stage's W
            # peaked 23 KiB above one block re-made (simulator.stagecost.w_scratch_bytes's walk).
            # One GraphExecGroup: a recomputed layer's saved tensors, unpacked here outside a graph
            # task, are re-made once for W (each unpack would otherwise re-run the layer's forward
            # under a fresh id, every copy kept until the layer's nodes go: 4.5 layers' activations
            # measured on gpt_tiny); the engine's groups share it (its id)
            once = GraphExecGroup()
            with once:
                while groups:
                    group = groups.pop()
                    with torch.no_grad():
                        direct = _direct_weight_grads(group)
                    if direct:
                        self._ready(acc.variable for acc in group["params"])
                        continue
                    # an intermediate B did not reach carries no gradient
                    group["grads"] = [g if g is not None else () for g in group["grads"]]
                    reached = [acc.variable for acc in group["params"]
                               if any(g is not None for gs in group["grads"] for g in gs)]
                    stage_backward_weight(iter(self.weights), [group])
                    self._ready(reached)
        for p in self.weights:  # accumulation may have replaced a grad tensor: keep it filed
            st.tracker.tag(p.grad, "gradients")
        self.w_passes += 1

    def check_done(self) -> None:
        """Every B met its W before the gradients are reduced."""
        if self.pending:
            raise RuntimeError(f"stage {self.st.index}: B without W for microbatches {sorted(self.pending)} "
                               "before allreduce_grads (the schedule must run every W first)")


def _accumulate(acc, grad: torch.Tensor) -> None:
    """AccumulateGrad ``acc``'s parameter ``.grad += grad`` (the stage keeps a gradient buffer)."""
    p = acc.variable
    if p.grad is None:
        p.grad = grad
    else:
        p.grad.add_(grad)


def _leaf(edge):
    """The AccumulateGrad node at ``edge`` (directly, or behind the TBackward0 of ``F.linear``'s
    ``weight.t()``), or None."""
    node = edge[0]
    if node is not None and type(node).__name__ == "TBackward0":
        node = node.next_functions[0][0]
    return node if node is not None and type(node).__name__ == "AccumulateGrad" else None


def _direct_weight_grads(group: dict) -> bool:
    """W of one parameter group without the autograd engine, when its one intermediate is a
    weight op whose formulas are torch's own (tools/autograd/derivatives.yaml): ``addmm``/``mm``
    of a linear (``mm_mat2_backward``'s column-major branch ``grad.t().mm(mat1).t()``, then
    TBackward0: ``dW = dY^T X``; the bias ``sum_to(dY)``) and ``native_layer_norm`` (its own
    backward, input gradient masked off). Each is what the engine would run for this group, so
    the gradients are the same numbers; what goes is the engine's per-call graph walk (its
    dependency count and exec_info over every node below the intermediate, once per group:
    Qi et al. §2 ask W to cost the weight GEMMs only). False: not such a group (left to the
    engine)."""
    nodes, grads = group["intermediates"], group["grads"]
    if len(nodes) != 1 or grads[0] is None or grads[0][0] is None:
        return False
    node, dy = nodes[0], grads[0][0]
    kind, edges = type(node).__name__, node.next_functions
    want = set(group["params"])
    if kind in ("AddmmBackward0", "MmBackward0"):
        bias = _leaf(edges[0]) if kind == "AddmmBackward0" and type(edges[0][0]).__name__ == "AccumulateGrad" else None
        weight = _leaf(edges[-1]) if type(edges[-1][0]).__name__ == "TBackward0" else None
        if weight is None or {n for n in (weight, bias) if n is not None} != want:
            return False
        sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
        scale = (node._saved_alpha, node._saved_beta) if kind == "AddmmBackward0" else (1, 1)
        if dy.dim() != 2 or not (strides[0] == 1 and strides[1] == sizes[0]) or scale != (1, 1):
            return False
        x = node._saved_mat1 if kind == "AddmmBackward0" else node._saved_self
        _accumulate(weight, dy.t().mm(x))
        if bias is not None:
            _accumulate(bias, dy.sum(0, keepdim=True).view(bias.variable.shape))
    elif kind == "NativeLayerNormBackward0":
        weight, bias = _leaf(edges[1]), _leaf(edges[2])
        if {n for n in (weight, bias) if n is not None} != want:
            return False
        _, dw, db = torch.ops.aten.native_layer_norm_backward(
            dy, node._saved_input, node._saved_normalized_shape, node._saved_result1, node._saved_result2,
            node._saved_weight, node._saved_bias, [False, weight is not None, bias is not None])
        for acc, g in ((weight, dw), (bias, db)):
            if acc is not None:
                _accumulate(acc, g)
    else:
        return False
    del group["intermediates"], group["grads"]  # the graph goes with the group (as torch's W)
    return True


class LocalLinks:
    """Boundary hand-over between two stages on this rank (V placement: chunks p-1 and p share
    position p-1; specs.schedule lists no send/recv there, as torch's stage-to-rank map has none).
    After stage s's forward its output goes to stage s + 1 as a detached view (the consumer's input
    leaf; the producer's output released as after a real send); after stage s's backward (B) its
    input gradient goes to stage s - 1 as is. Explicit local send/recv actions are no-ops."""

    def __init__(self, stages: dict):
        self.stages = stages
        self.box: dict[tuple[str, int, int], torch.Tensor] = {}

    def local(self, a) -> bool:
        """Is ``a`` (a send/recv Action) between two stages both on this rank?"""
        return a.peer_stage is not None and a.peer_stage in self.stages and a.stage in self.stages

    def after_forward(self, st, k: int) -> None:
        if st.index + 1 in self.stages:
            y = st.outputs[k]
            self.box[("act", st.index + 1, k)] = y.detach()
            st.release_output("act", k, y)

    def after_backward(self, st, k: int) -> None:
        if st.index - 1 in self.stages:
            self.box[("grad", st.index - 1, k)] = st.grad_to_send

    def take(self, kind: str, stage: int, k: int, received: dict):
        """The value a pass of ``stage`` on microbatch ``k`` consumes: received, or handed over here."""
        found = received.pop((stage, k), None)
        return found if found is not None else self.box.pop((kind, stage, k), None)



def share_tied_embedding(st, groups: dict) -> set[int] | None:
    """A V placement (zbv, dualpipev) puts the first and last chunk on one rank: their tied
    embedding and output head become one Parameter (DeepSeek-V3 §3.2.1: DualPipe keeps the
    embedding and the output head on one rank, which "enables physical sharing of parameters and
    gradients"), one copy of weight, gradient and optimizer state. The first stage owns it (its
    gradient buffer, data-parallel all-reduce and step); the last stage's head uses it, and both
    stages' backward passes accumulate into its ``.grad``. ``groups`` (the rank's dict) carries it
    from the first stage's runtime to the last's (built in stage order). Returns None when this
    stage's tie (if any) is not split over two stages of this rank, else the ids of the parameters
    the stage uses but does not own."""
    if not _v_tie(st):
        return None
    plan = st.plan
    last = len(plan.stages) - 1
    mods = {i: mod for i, _, mod in st.layers}
    if st.first:
        groups["v_tied_embedding"] = mods[0].wte.weight
        return set()
    shared = groups["v_tied_embedding"]
    # as the in-stage tie after TP (executor.stage_grads.tied_embedding_weight): same vocabulary rows per rank
    mods[plan.stages[last].layer_stop - 1].decoder.weight = shared
    return {id(shared)}


def _v_tie(st) -> bool:
    """Does ``st`` (a first or last stage) hold a tied embedding/head whose other end is a stage of
    this same rank (a V placement)?"""
    plan = st.plan
    last = len(plan.stages) - 1
    if not getattr(st.cfg, "tie_embeddings", False) or not (st.first or st.last) or last == 0:
        return False
    return st.device in plan.stages[0].devices and st.device in plan.stages[last].devices
