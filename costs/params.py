"""Parameters a device holds: per layer under tensor parallelism, per stage with tied embeddings,
and the per-replica sample count every per-device cost starts from.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from specs.model import LayerSpec, ModelSpec
from specs.plan import Plan, StagePlan


def samples_per_replica(plan: Plan, stage: StagePlan) -> int | float:
    """Samples one replica of ``stage`` processes per microbatch (microbatch split over dp), in
    whole-sequence units per device: context parallelism gives each of its cp ranks s/cp of every
    sequence (costs/context_parallel.py), so every sequence-proportional byte, FLOP and transfer of
    a device is that of samples/cp sequences (a float when cp does not divide them; int otherwise)."""
    b = plan.training.samples_per_microbatch // stage.dp
    return b // stage.cp if b % stage.cp == 0 else b / stage.cp


def grad_reduce_ranks(stage: StagePlan) -> int:
    """Ranks a stage's gradient is all-reduced over: parameters are replicated over dp and cp
    alike (Megatron-Core's data-parallel group with cp; costs/context_parallel.py), dp·cp."""
    return stage.dp * stage.cp


def layer_params_on_device(layer: LayerSpec, tp: int) -> int:
    """Parameters one TP rank holds: the sharded fraction divides by tp (Megatron §3)."""
    sharded = layer.params * layer.tp_sharded_param_fraction
    return math.ceil(sharded / tp + (layer.params - sharded))


def stage_holding(plan: Plan, layer: int) -> StagePlan:
    return next(st for st in plan.stages if st.layer_start <= layer < st.layer_stop)


def tied_copies(model: ModelSpec, plan: Plan, stage: StagePlan) -> list[tuple[int, int, bool]]:
    """(owner layer, copy layer, shared) for every tied weight (a GPT LM head tied to the word
    embedding) with owner or copy in ``stage``; ``shared`` when both sit on the same devices, so
    one Parameter serves both (Megatron with pp = 1). Otherwise the copy's stage holds its own
    and the two stages all-reduce the gradient (Megatron's embedding group, Narayanan et al. 2021)."""
    out = []
    for copy in model.tied_layers:
        owner = model.tied_owner(copy)
        here = stage.layer_start <= owner < stage.layer_stop or stage.layer_start <= copy < stage.layer_stop
        if here:
            shared = set(stage_holding(plan, owner).devices) == set(stage_holding(plan, copy).devices)
            out.append((owner, copy, shared))
    return out


def layer_params_of_stage(model: ModelSpec, plan: Plan, stage: StagePlan, layer: int) -> int:
    """Parameters one device of ``stage`` holds of ``layer`` (its TP shard; a tied copy whose owner
    shares the stage's devices holds no weights of its own, as in
    :func:`stage_params_on_device`)."""
    params = layer_params_on_device(model.layers[layer], stage.tp)
    for _, copy, shared in tied_copies(model, plan, stage):
        if shared and copy == layer:
            params -= math.ceil(model.layers[copy].tied_params / stage.tp)
    return max(params, 0)


def tied_pairs(model: ModelSpec) -> list[tuple[int, int, int]]:
    """(owner layer, copy layer, tied params) of every tied weight (GPT: embed, head, h·V)."""
    return [(model.tied_owner(c), c, model.layers[c].tied_params) for c in model.tied_layers]


def shared_tied_params_on_device(pairs: list[tuple[int, int, int]], start: int, stop: int, tp: int) -> int:
    """Params of tied copies (``tied_pairs``) whose owner and copy both lie in layers [start, stop):
    one stage holds one Parameter for both (as ``stage_params_on_device`` counts)."""
    return sum(math.ceil(n / tp) for o, c, n in pairs if start <= o < stop and start <= c < stop)


def stage_params_on_device(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Parameters one device of ``stage`` holds: its layers' TP shards, minus the second copy of a
    tied weight whose owner is on the same devices (counted once, at the owner)."""
    params = sum(layer_params_on_device(model.layers[i], stage.tp) for i in stage.layers)
    for _, copy, shared in tied_copies(model, plan, stage):
        if shared and stage.layer_start <= copy < stage.layer_stop:
            params -= math.ceil(model.layers[copy].tied_params / stage.tp)  # vocab-parallel: split by t
    return params


def dp_grad_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Gradient bytes one device of ``stage`` all-reduces over its dp replicas (its TP shard). A
    window's streamed layers are not among them: each is all-reduced on the host before its CPU
    step (costs.window.host_allreduce_s)."""
    _, g_b, _ = plan.training.bytes_per_param()
    return g_b * dp_synced_params(model, plan, stage)


def dp_param_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Parameter bytes ZeRO-1/2 all-gathers after the step over the same replicas as
    :func:`dp_grad_bytes`: the updated weights in the weight dtype (bf16/fp16 under mixed precision),
    not the gradients' (fp32 main grads at 18 B/param): Megatron's distributed optimizer copies its
    fp32 shard into the bf16 parameter buffer and gathers that (Megatron-LM
    docs/source/api-guide/dist_optimizer.md), as DeepSpeed's ZeRO-1/2 and FSDP gather bf16 weights."""
    w_b, _, _ = plan.training.bytes_per_param()
    return w_b * dp_synced_params(model, plan, stage)


def dp_synced_params(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Parameters of one device of ``stage`` synchronised over its dp replicas (its TP shard, less a
    window's streamed layers, which are all-reduced on the host: costs.window.host_allreduce_s)."""
    streamed = sum(layer_params_on_device(model.layers[i], stage.tp) for i in stage.streamed_layers)
    return stage_params_on_device(model, plan, stage) - streamed
