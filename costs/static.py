"""Static memory of a stage: weights, gradients and optimizer state per device (a STRONGHOLD
window's through costs.window), and the optimizer-swap chunks.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs.params import layer_params_on_device, stage_params_on_device
from costs.window import window_static
from specs.model import ModelSpec
from specs.plan import Plan, StagePlan
from specs.result import MemoryBreakdown


def stage_static(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[MemoryBreakdown, int]:
    """(device-resident weights/grads/optimizer, host-resident bytes) of one stage on one device.

    ZeRO stage k shards optimizer (k>=1), gradients (k>=2), parameters (k>=3) over dp (ZeRO §5).
    STRONGHOLD window: the resident layers and ``window_layers`` slots on the device, the streamed
    layers' state on the host (costs.window.window_static; its NVMe part is not host RAM).
    """
    w_b, g_b, o_b = plan.training.bytes_per_param()
    params = stage_params_on_device(model, plan, stage)  # a tied embedding once where shared
    z, dp = plan.zero_stage, stage.dp
    shard = lambda n, level: math.ceil(n / dp) if z >= level else n  # noqa: E731
    weights, grads, optim = shard(params * w_b, 3), shard(params * g_b, 2), shard(params * o_b, 1)
    host = 0
    if stage.offload.window_layers is not None:  # costs.window: resident layers + w slots
        weights, grads, optim, host, _ = window_static(model, plan, stage)
    elif stage.offload.optimizer_on_cpu or stage.offload.optimizer_swap:
        host, optim = optim, 0  # swapped: streamed through the device by its step (optimizer_swap_chunks)
    return MemoryBreakdown(parameters_bytes=weights, gradients_bytes=grads, optimizer_bytes=optim), host


def optimizer_swap_chunks(model: ModelSpec, plan: Plan, stage: StagePlan) -> list[int]:
    """Optimizer-state bytes per layer of a stage with ``offload.optimizer_swap`` (empty without):
    the state lives on the host between steps and the update streams it layer by layer, in over
    the host link, stepped, out again (MPress §II-D swap of model data; ZeRO-Infinity streams its
    optimizer alike), so the device holds a few layers' state at a time, never all of it."""
    if not stage.offload.optimizer_swap:
        return []
    plain = stage.model_copy(update={"offload": stage.offload.model_copy(update={"optimizer_swap": False})})
    total = stage_static(model, plan, plain)[0].optimizer_bytes
    per_layer = [layer_params_on_device(model.layers[i], stage.tp) for i in stage.layers]
    params = sum(per_layer) or 1
    chunks = [total * n // params for n in per_layer]
    chunks[-1] += total - sum(chunks)  # the tied-copy and rounding remainder rides with the last
    return [c for c in chunks if c > 0]


#: chunks of a streamed optimizer step on the device at once: the one being stepped, the next
#: coming in, the previous going out (the in and out copies run on opposite directions)
OPTIMIZER_SWAP_RESIDENT_CHUNKS = 3


def stash_layer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan, layer: int) -> int:
    """Bytes of one PipeDream stashed weight version of ``layer`` on one device of ``stage`` (its
    TP shard at the weights' precision; a tied copy whose owner shares the stage's devices holds
    no weights of its own, as in :func:`costs.params.stage_params_on_device`)."""
    from costs.params import tied_copies

    w_b = plan.training.bytes_per_param()[0]
    params = layer_params_on_device(model.layers[layer], stage.tp)
    for _, copy, shared in tied_copies(model, plan, stage):
        if shared and copy == layer:
            params -= math.ceil(model.layers[copy].tied_params / stage.tp)
    return max(params, 0) * w_b


def stash_swap_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Bytes of one stashed weight version that ``offload.stash_swap_layers`` keep in host memory
    (MPress §II-D: GPU-CPU swap of model data, here PipeDream's stashed versions, PipeDream §3.3),
    at most the stage's parameter bytes; 0 without the field."""
    layers = stage.offload.stash_swap_layers
    if not layers:
        return 0
    total = sum(stash_layer_bytes(model, plan, stage, l) for l in sorted(set(layers)))
    if plan.zero_stage >= 3:  # ZeRO-3 shards the weights over dp (stage_static)
        total = math.ceil(total / stage.dp)
    return min(total, stage_static(model, plan, stage)[0].parameters_bytes)
