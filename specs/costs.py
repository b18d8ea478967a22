"""Closed-form costs of a plan, shared by the analytic estimator and the simulator.

Both must agree on static memory exactly and on activations per microbatch, so the formulas live
here once. Everything is per device (one tensor-parallel rank of one data-parallel replica).
"""
from __future__ import annotations

import math

from specs.hardware import HardwareSpec, LinkSpec
from specs.model import LayerSpec, ModelSpec
from specs.plan import MemoryAction, Plan, ScheduleKind, StagePlan
from specs.result import MemoryBreakdown

SWAP_ACTIONS = frozenset({MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme})


def samples_per_replica(plan: Plan, stage: StagePlan) -> int:
    """Samples one replica of ``stage`` processes per microbatch (microbatch split over dp)."""
    return plan.training.samples_per_microbatch // stage.dp


def layer_params_on_device(layer: LayerSpec, tp: int) -> int:
    """Parameters one TP rank holds: the sharded fraction divides by tp (Megatron §3)."""
    sharded = layer.params * layer.tp_sharded_param_fraction
    return math.ceil(sharded / tp + (layer.params - sharded))


def layer_saved_bytes(layer: LayerSpec, samples: int, tp: int) -> int:
    """Activations a layer keeps for backward on one TP rank: s·b·h·(10 + 24/t + 5as/(ht)) for a
    GPT block (Korthikanti et al. 2022, eq. 2) — generally the sharded fraction divides by t."""
    per_sample = layer.saved_bytes_per_sample
    sharded = per_sample * layer.tp_sharded_saved_fraction
    return math.ceil(samples * (sharded / tp + (per_sample - sharded)))


def layer_input_bytes(model: ModelSpec, layer: int, samples: int) -> int:
    """Bytes of a layer's input (the previous layer's output; token ids are negligible)."""
    return samples * model.layers[layer - 1].output_bytes_per_sample if layer > 0 else 0


def resident_activation_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """Bytes a layer leaves on the device between its forward and backward, given its action.

    keep: everything it saved. recompute: only its input, the checkpoint (torch.utils.checkpoint
    saves the inputs of the checkpointed region). swaps: nothing once the copy-out completes.
    """
    action = stage.action_of(layer).action
    if action is MemoryAction.keep:
        return layer_saved_bytes(model.layers[layer], samples, stage.tp)
    if action is MemoryAction.recompute:
        return layer_input_bytes(model, layer, samples)
    return 0


def stage_activation_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Resident activation bytes of one microbatch of ``stage`` after its forward."""
    b = samples_per_replica(plan, stage)
    return sum(resident_activation_bytes(model, stage, layer, b) for layer in stage.layers)


def backward_transient_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int]:
    """(recompute, swap-in) bytes re-materialised during one backward, one layer at a time:
    the largest recomputed layer's activations, the largest swapped layer's prefetched copy."""
    b = samples_per_replica(plan, stage)
    recompute = swap = 0
    for layer in stage.layers:
        action = stage.action_of(layer).action
        full = layer_saved_bytes(model.layers[layer], b, stage.tp)
        if action is MemoryAction.recompute:
            recompute = max(recompute, full)
        elif action in SWAP_ACTIONS:
            swap = max(swap, full)
    return recompute, swap


def comm_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """One receive buffer for the incoming activation and one for the incoming gradient."""
    b = samples_per_replica(plan, stage)
    grad_in = b * model.layers[stage.layer_stop - 1].output_bytes_per_sample
    if stage.layer_stop == model.num_layers:
        grad_in = 0  # the last stage starts backward from its own loss
    return layer_input_bytes(model, stage.layer_start, b) + grad_in


def stage_static(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[MemoryBreakdown, int]:
    """(device-resident weights/grads/optimizer, host-resident bytes) of one stage on one device.

    ZeRO stage k shards optimizer (k>=1), gradients (k>=2), parameters (k>=3) over dp (ZeRO §5).
    STRONGHOLD window: only the largest ``window_layers`` consecutive layers' weights and grads
    are resident; the rest and all optimizer state live on the host (STRONGHOLD §3.2).
    """
    w_b, g_b, o_b = plan.training.bytes_per_param()
    per_layer = [layer_params_on_device(model.layers[i], stage.tp) for i in stage.layers]
    params = sum(per_layer)
    z, dp = plan.zero_stage, stage.dp
    shard = lambda n, level: math.ceil(n / dp) if z >= level else n  # noqa: E731
    weights, grads, optim = shard(params * w_b, 3), shard(params * g_b, 2), shard(params * o_b, 1)
    host = 0
    window = stage.offload.window_layers
    if window is not None:
        resident = max(sum(per_layer[i:i + window]) for i in range(len(per_layer) - window + 1))
        host += weights + grads + optim
        weights, grads, optim = shard(resident * w_b, 3), shard(resident * g_b, 2), 0
        host -= weights + grads
    elif stage.offload.optimizer_on_cpu:
        host, optim = optim, 0
    return MemoryBreakdown(parameters_bytes=weights, gradients_bytes=grads, optimizer_bytes=optim), host


def stashed_versions(plan: Plan, stage_index: int) -> int:
    """Weight versions PipeDream async keeps on pipeline position i of p: p - i (PipeDream §3.3),
    i.e. p - i - 1 stashed copies besides the live weights; 0 for flushing schedules."""
    if plan.schedule.kind is not ScheduleKind.pipedream_async:
        return 0
    return plan.pipeline_depth - plan.device_group_of(stage_index) - 1


def in_flight_microbatches(plan: Plan, stage_index: int) -> int:
    """Microbatches whose activations a stage holds at its peak.

    GPipe: all m. 1F1B and PipeDream: min(p - i, m) (PipeDream-2BW §3). Interleaved 1F1B: the
    Megatron warm-up count of chunk-microbatches on the device, min((p-i-1)·2 + (v-1)·p + 1, m·v)
    (Narayanan et al. 2021 §2.2), reported per chunk as that count divided over the v chunks.
    """
    m, p = plan.training.microbatches, plan.pipeline_depth
    i = plan.device_group_of(stage_index)
    kind = plan.schedule.kind
    if kind is ScheduleKind.gpipe:
        return m
    if kind is ScheduleKind.interleaved_1f1b:
        v = plan.schedule.virtual_stages
        return math.ceil(min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) / v)
    return min(p - i, m)


# ---- time -----------------------------------------------------------------------------------

def ring_allreduce_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-reduce: 2(n-1)/n · bytes / bw + 2(n-1) · latency (Thakur et al. 2005)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.total_bw_gbps * 1e9) + 2 * (n - 1) * link.latency_s


def transfer_s(nbytes: float, link: LinkSpec) -> float:
    """Point-to-point copy over an idle link: latency + bytes / bandwidth."""
    return link.latency_s + nbytes / (link.total_bw_gbps * 1e9) if nbytes > 0 else 0.0


def group_link(hardware: HardwareSpec, devices: list[int]) -> LinkSpec:
    """The slowest link of a ring over ``devices`` in order: it bounds a ring collective."""
    if len(devices) < 2:
        return hardware.intra_node.fallback
    pairs = zip(devices, devices[1:] + devices[:1])
    return min((hardware.link(a, b) for a, b in pairs), key=lambda l: (l.total_bw_gbps, -l.latency_s))


def compute_dtype(plan: Plan) -> str:
    return plan.training.precision.value


def layer_fwd_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Forward compute time of one layer for one microbatch on one device: FLOPs / (tp · rate)."""
    flops = model.layers[layer].fwd_flops_per_sample * samples_per_replica(plan, stage) / stage.tp
    return flops / hardware.device.flops_per_s(compute_dtype(plan))


def layer_tp_comm_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Tensor-parallel all-reduces of one layer in one pass (2 per GPT block, Megatron §3)."""
    spec = model.layers[layer]
    if stage.tp == 1 or spec.tp_allreduces_per_pass == 0:
        return 0.0
    nbytes = spec.output_bytes_per_sample * samples_per_replica(plan, stage)
    link = group_link(hardware, stage.devices[: stage.tp])
    return spec.tp_allreduces_per_pass * ring_allreduce_s(nbytes, stage.tp, link)


def stage_pass_times_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on one device of ``stage``.

    Backward is twice the forward FLOPs (dX and dW GEMMs), plus the forward again for
    recomputed layers; TP all-reduces appear in both passes.
    """
    fwd = bwd = 0.0
    for layer in stage.layers:
        f = layer_fwd_s(model, plan, hardware, stage, layer)
        c = layer_tp_comm_s(model, plan, hardware, stage, layer)
        fwd += f + c
        bwd += 2 * f + c
        if stage.action_of(layer).action is MemoryAction.recompute:
            bwd += f + c
    return fwd, bwd


def dp_allreduce_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """Gradient all-reduce of one stage over its dp replicas (one TP rank's shard each)."""
    if stage.dp == 1:
        return 0.0
    _, g_b, _ = plan.training.bytes_per_param()
    nbytes = g_b * sum(layer_params_on_device(model.layers[i], stage.tp) for i in stage.layers)
    ranks = stage.devices[:: stage.tp]
    return ring_allreduce_s(nbytes, stage.dp, group_link(hardware, ranks))


def optimizer_step_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """Optimizer update: streams weights, grads and state once through HBM (memory-bound), or
    runs at the host's CPU-Adam rate when the optimizer is on the CPU (STRONGHOLD §3.4)."""
    params = sum(layer_params_on_device(model.layers[i], stage.tp) for i in stage.layers)
    if plan.zero_stage >= 1:
        params = math.ceil(params / stage.dp)
    if stage.offload.optimizer_on_cpu or stage.offload.window_layers is not None:
        return params / hardware.host.cpu_adam_params_per_s
    w_b, g_b, o_b = plan.training.bytes_per_param()
    return params * (2 * w_b + g_b + 2 * o_b) / (hardware.device.hbm_gbps * 1e9)


def model_flops_per_iteration(model: ModelSpec, plan: Plan) -> float:
    """Model FLOPs of one iteration: 3x forward (forward + 2x backward), recompute not counted."""
    return 3 * model.fwd_flops_per_sample * plan.training.global_batch
