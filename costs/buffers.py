"""Communication buffers a stage holds: received and sent boundary tensors, the data-parallel
all-reduce bucket and the tied-embedding sync buffer.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs.activations import layer_input_bytes, layer_output_bytes, seq_split
from costs.params import dp_grad_bytes, grad_reduce_ranks, samples_per_replica, tied_copies
from specs.model import ModelSpec
from specs.plan import Plan, StagePlan


def comm_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Gradient buffers of the pipeline boundaries: the received output gradient
    (:func:`received_grad_buffer_bytes`) and the input gradient sent back
    (:func:`sent_grad_buffer_bytes`). Received activations are the stage's held input
    (:func:`stage_activation_bytes`)."""
    return received_grad_buffer_bytes(model, plan, stage) + sent_grad_buffer_bytes(model, plan, stage)


def received_grad_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """The gradient of the stage's output received from downstream (0 on the last stage: it starts
    backward from its own loss), counted for the whole iteration; sequence-sharded under sequence
    parallelism (Megatron sends s·b·h/t per rank: Korthikanti §4.2.2)."""
    if stage.layer_stop == model.num_layers:
        return 0
    return layer_output_bytes(model, stage.layer_stop - 1, samples_per_replica(plan, stage), seq_split(stage))


def sent_grad_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """The input gradient a stage sends back (0 on the first stage): made by its first backward
    (the received input's ``.grad``), then kept until the next backward replaces it. It does not
    exist before the stage's first backward ends, so a peak inside that backward (GPipe's, with all
    m microbatches held) is without it."""
    b = samples_per_replica(plan, stage)
    return layer_input_bytes(model, stage.layer_start, b, seq_split(stage)) if stage.layer_start > 0 else 0


def neighbour_stage(plan: Plan, stage: StagePlan, step: int) -> StagePlan | None:
    """The stage holding the layers right after (``step`` +1) or right before (-1) ``stage``'s,
    None at the ends (an interleaved plan's chunks are consecutive layer ranges too)."""
    for other in plan.stages:
        if (other.layer_start == stage.layer_stop) if step > 0 else (other.layer_stop == stage.layer_start):
            return other
    return None


def scatterable(src: StagePlan | None, dst: StagePlan | None) -> bool:
    """Whether a boundary from ``src`` to ``dst`` can be scattered over the tp ranks (Narayanan et
    al. SC'21 §4.1, Fig. 9: each rank sends 1/t over the inter-node link, the receiving ranks
    all-gather the whole over their tp group; Megatron-LM's ``scatter_gather_tensors_in_pipeline``):
    both stages have the same tp > 1, dp and cp, neither is sequence-parallel (its boundary is
    already s/t per rank) and neither is a MAP stage."""
    return not (src is None or dst is None or src.tp <= 1 or src.tp != dst.tp or src.dp != dst.dp
                or src.cp != dst.cp or src.sequence_parallel or dst.sequence_parallel or src.sharding
                or dst.sharding)


def p2p_split(plan: Plan, src: StagePlan | None, dst: StagePlan | None) -> int:
    """How many pieces a boundary tensor from ``src`` to ``dst`` is sent in, one per tp rank:
    tp with ``plan.p2p_scatter_gather`` where :func:`scatterable`, else 1 (whole tensors). The
    executor's sends use the same rule."""
    return src.tp if plan.p2p_scatter_gather and scatterable(src, dst) else 1


def boundary_send_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int]:
    """(activation, gradient) bytes one rank of ``stage`` sends per microbatch across its
    pipeline boundaries: its output forward, its input's gradient backward (on the first stage
    its batch input's size, as simulator.stagecost counts it: nothing is sent); under sequence
    parallelism each tp rank sends its s/t share (Megatron's p2p of the sequence-parallel hidden
    states, Korthikanti §4.2.2), with the scatter/gather optimisation 1/t of the whole
    (:func:`p2p_split`)."""
    b, split = samples_per_replica(plan, stage), seq_split(stage)
    out = layer_output_bytes(model, stage.layer_stop - 1, b, split)
    grad = layer_input_bytes(model, stage.layer_start, b, split)
    if not plan.p2p_scatter_gather:  # no neighbour lookups on the common path
        return out, grad
    out_k = p2p_split(plan, stage, neighbour_stage(plan, stage, +1))
    grad_k = p2p_split(plan, neighbour_stage(plan, stage, -1), stage)
    return math.ceil(out / out_k), math.ceil(grad / grad_k)


def p2p_gathered_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int]:
    """(activation, gradient) bytes ``stage``'s tp group all-gathers per microbatch after a
    scattered receive (:func:`p2p_split`): the whole received input forward, the whole received
    output gradient backward; 0 where the boundary is not scattered."""
    if not plan.p2p_scatter_gather:
        return 0, 0
    b = samples_per_replica(plan, stage)
    prev, nxt = neighbour_stage(plan, stage, -1), neighbour_stage(plan, stage, +1)
    act = layer_input_bytes(model, stage.layer_start, b) if p2p_split(plan, prev, stage) > 1 else 0
    grad = layer_output_bytes(model, stage.layer_stop - 1, b) if p2p_split(plan, stage, nxt) > 1 else 0
    return act, grad


def allreduce_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """A flat copy of the stage's gradients while they are all-reduced over dp (the executor sends
    one bucket per stage, ``torch.cat`` of the gradients, as DDP's default buckets are copies);
    0 without data parallelism. Allocated after the last backward, when activations are gone.
    The tied-weight gradient copy (:func:`tied_sync_buffer_bytes`) comes after it is freed: the
    larger of the two."""
    flat = dp_grad_bytes(model, plan, stage) if grad_reduce_ranks(stage) > 1 else 0  # dp x cp replicas
    # ZeRO-1 reduce-scatters in place (executor.zero1, Megatron); ZeRO-2/3 reduce-scatter bucket by
    # bucket (Rajbhandari et al. 2020 §5.2, FSDP per unit) and keep only their 1/d shard: no whole copy
    if plan.zero_stage >= 1 and flat:
        flat = math.ceil(flat / grad_reduce_ranks(stage))
    return max(flat, tied_sync_buffer_bytes(model, plan, stage))


def tied_sync_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """The gradient copy a stage holding one side of a tied weight (the other side on other
    devices) all-reduces with the other side after the data-parallel sync: Megatron's embedding
    group (executor.stage ``allreduce_embedding_grads``: ``full_tensor()``, the whole gradient even
    under TP) or a user model's running sum (executor.user_model.TiedGrads). Tied groups sync one
    after another, so the largest one."""
    _, g_b, _ = plan.training.bytes_per_param()
    return max((g_b * model.layers[copy].tied_params
                for _, copy, shared in tied_copies(model, plan, stage) if not shared), default=0)
