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


def boundary_send_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int]:
    """(activation, gradient) bytes one rank of ``stage`` sends per microbatch across its
    pipeline boundaries: its output forward, its input's gradient backward (on the first stage
    its batch input's size, as simulator.stagecost counts it: nothing is sent); under sequence
    parallelism each tp rank sends its s/t share (Megatron's p2p of the sequence-parallel hidden
    states, Korthikanti §4.2.2)."""
    b, split = samples_per_replica(plan, stage), seq_split(stage)
    out = layer_output_bytes(model, stage.layer_stop - 1, b, split)
    return out, layer_input_bytes(model, stage.layer_start, b, split)


def allreduce_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """A flat copy of the stage's gradients while they are all-reduced over dp (the executor sends
    one bucket per stage, ``torch.cat`` of the gradients, as DDP's default buckets are copies);
    0 without data parallelism. Allocated after the last backward, when activations are gone.
    The tied-weight gradient copy (:func:`tied_sync_buffer_bytes`) comes after it is freed: the
    larger of the two."""
    flat = dp_grad_bytes(model, plan, stage) if grad_reduce_ranks(stage) > 1 else 0  # dp x cp replicas
    if plan.zero_stage == 1 and flat:  # ZeRO-1 reduce-scatters in place (executor.zero1, Megatron): its 1/d shard
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
