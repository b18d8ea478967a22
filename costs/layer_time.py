"""Time of a layer's forward and backward passes on one device (GEMM curve, memory-bound rest,
per-operator overhead, tensor-parallel all-reduces), the optimizer step and the model's FLOPs.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs import gemm, window
from costs.collectives import collective_link, group_link, ring_allreduce_s
from costs.params import layer_params_on_device, samples_per_replica, stage_params_on_device
from specs.hardware import HardwareSpec
from specs.model import LayerKind, LayerSpec, ModelSpec
from specs.plan import MemoryAction, Plan, StagePlan


def compute_dtype(plan: Plan) -> str:
    return plan.training.precision.value


#: memory traffic of a backward relative to its forward for the elementwise ops: each op's backward
#: reads the output gradient and one saved tensor and writes the input gradient (3 tensors where
#: the forward moved 2: layernorm, GeLU, softmax, dropout alike)
BWD_MEM_FACTOR = 1.5


def _mem_s(layer: LayerSpec, samples: int, tp: int, hardware: HardwareSpec) -> float:
    """Forward seconds of a layer's memory-bound (non-GEMM) ops at HBM bandwidth. Their traffic
    splits over TP like the activations they act on (``tp_sharded_saved_fraction``)."""
    per_sample = layer.fwd_mem_bytes_per_sample
    sharded = per_sample * layer.tp_sharded_saved_fraction
    return samples * (sharded / tp + per_sample - sharded) / hardware.device.hbm_bytes_per_s


def _rest_flops_s(layer: LayerSpec, samples: int, tp: int, hardware: HardwareSpec, dtype: str) -> float:
    """Forward FLOPs the layer's ``gemms`` do not list (all of them for a layer without gemms), at
    the dtype's best (largest-GEMM) rate."""
    rest = layer.fwd_flops_per_sample * samples / tp - gemm.gemm_flops(layer.gemms, samples, tp)
    return max(rest, 0.0) / hardware.device.flops_per_s(dtype)


#: (forward, backward) aten operators one pass of a layer dispatches on DTensors under Megatron
#: TP (executor.stage.tensor_parallel, tp > 1), counted on gpt/bert/moe_tiny with a
#: TorchDispatchMode over 2 gloo ranks (2026-11-24; views and detaches included: DTensor
#: propagates and wraps those too). Only what parallelize_module makes DTensor runs there:
#: a column/row-parallel Linear is 4 forward (view, t, addmm, view) and 12 backward (t x4, mm x2,
#: sum, add_ x2 into .grad, views x3); a transformer block has 6 (q, k, v, proj, fc1, fc2), an
#: MoE block its attention's 4 (the experts stay replicated: plain); the vocabulary-parallel
#: embedding its lookup (1; backward: embedding_dense_backward, add_); the LM head its decoder
#: plus the loss_parallel cross-entropy (8; 16 backward with a decoder bias, GPT's bias-free 13).
#: Everything else in those layers (layernorms, attention, GeLU, residual adds) runs on the
#: local outputs, plain. Wide-ResNet and user layers stay replicated: none.
TP_DTENSOR_OPS = {LayerKind.transformer_block: (24, 72), LayerKind.moe_block: (16, 48),
                  LayerKind.embedding: (1, 2), LayerKind.head: (8, 16)}


def tp_dtensor_ops(layer: LayerSpec, tp: int) -> tuple[int, int]:
    """(forward, backward) operators of ``layer`` dispatched on DTensors at tensor-parallel
    degree ``tp`` (:data:`TP_DTENSOR_OPS`; (0, 0) at tp 1, where nothing is a DTensor)."""
    if tp <= 1:
        return 0, 0
    return TP_DTENSOR_OPS.get(layer.kind, (0, 0))


def layer_fwd_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Forward compute seconds of one layer for one microbatch on one device (no communication):
    each GEMM at its own shape's efficiency (costs/gemm.py), the memory-bound ops at HBM bandwidth,
    any FLOPs outside the listed GEMMs at the best GEMM rate, ``fwd_ops`` x the device's
    per-operator overhead, and under TP the DTensor operators' extra dispatch cost
    (:func:`tp_dtensor_ops` x ``dtensor_op_overhead_s``)."""
    spec, dtype, dev = model.layers[layer], compute_dtype(plan), hardware.device
    b, tp = samples_per_replica(plan, stage), stage.tp
    return (gemm.gemms_fwd_s(dev, dtype, spec.gemms, b, tp) + _mem_s(spec, b, tp, hardware)
            + _rest_flops_s(spec, b, tp, hardware, dtype) + spec.fwd_ops * dev.op_overhead_s
            + tp_dtensor_ops(spec, tp)[0] * dev.dtensor_op_overhead_s)


def accumulate_bytes_per_param(plan: Plan) -> int:
    """HBM bytes per parameter that adding one microbatch's weight gradients into the accumulated
    ones moves outside the GEMMs. Megatron's fp32 main-grad mode (18 B/param) fuses it into the
    wgrad GEMM, which accumulates in place (``--gradient-accumulation-fusion``, default since
    Megatron-LM 2022): 0. fp16/bf16 gradients (16 B/param; Megatron 2021's main_grad hook) and
    plain fp32 training accumulate through autograd's AccumulateGrad: read both, write one."""
    t = plan.training
    if t.precision.value != "fp32" and t.mixed_bytes_per_param == 18:
        return 0
    return 3 * t.bytes_per_param()[1]


def layer_bwd_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Backward compute seconds of one layer (no recompute, no communication): the dgrad and wgrad
    GEMM of every forward GEMM at their own shapes (``gemm.backward_shapes``), the elementwise
    backward at ``BWD_MEM_FACTOR`` x the forward traffic, the gradient accumulation, twice the
    unlisted FLOPs, ``bwd_ops`` x the per-operator overhead, and under TP the DTensor operators'
    extra dispatch cost (:func:`tp_dtensor_ops`)."""
    spec, dtype, dev = model.layers[layer], compute_dtype(plan), hardware.device
    b, tp = samples_per_replica(plan, stage), stage.tp
    dgrad, wgrad = gemm.gemms_bwd_s(dev, dtype, spec.gemms, b, tp)
    accumulate = accumulate_bytes_per_param(plan) * layer_params_on_device(spec, tp) / dev.hbm_bytes_per_s
    return (dgrad + wgrad + BWD_MEM_FACTOR * _mem_s(spec, b, tp, hardware) + accumulate
            + 2 * _rest_flops_s(spec, b, tp, hardware, dtype) + spec.bwd_ops * dev.op_overhead_s
            + tp_dtensor_ops(spec, tp)[1] * dev.dtensor_op_overhead_s)


def layer_tp_comm_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Tensor-parallel all-reduces of one layer in one pass (2 per GPT block, Megatron §3).

    Not overlapped with compute, in either pass: Megatron-LM as run for Narayanan et al. SC'21
    all-reduces synchronously in forward (g after the row-parallel GEMMs) and backward (f before
    the column-parallel ones); overlapping the backward all-reduce with the wgrad GEMM
    (``--async-tensor-model-parallel-allreduce``) came later, and memwall's executor (DTensor) does
    not do it either, so the plan and the runs agree."""
    spec = model.layers[layer]
    if stage.tp == 1 or spec.tp_allreduces_per_pass == 0:
        return 0.0
    nbytes = spec.output_bytes_per_sample * samples_per_replica(plan, stage)
    link = collective_link(group_link(hardware, stage.devices[: stage.tp]))
    return spec.tp_allreduces_per_pass * ring_allreduce_s(nbytes, stage.tp, link)


def layer_pass_times_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan,
                       layer: int) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one layer for one microbatch, communication
    included; recompute is 0 unless the layer's action is recompute (then one more forward runs
    just before its backward). The simulator and the analytic estimate both sum these."""
    f = layer_fwd_s(model, plan, hardware, stage, layer)
    c = layer_tp_comm_s(model, plan, hardware, stage, layer)
    b = layer_bwd_s(model, plan, hardware, stage, layer)
    rc = f + c if stage.action_of(layer).action is MemoryAction.recompute else 0.0
    return f + c, b + c, rc


def stage_pass_times_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on one device of ``stage``; the backward
    includes the recomputed forwards."""
    fwd = bwd = 0.0
    for layer in stage.layers:
        f, b, rc = layer_pass_times_s(model, plan, hardware, stage, layer)
        fwd += f
        bwd += b + rc
    return fwd, bwd


def optimizer_step_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """Optimizer update: streams weights, grads and state once through HBM (memory-bound: Adam
    reads w, g, m, v and writes w, m, v), or runs at the host's CPU-Adam rate when the optimizer
    is on the CPU (STRONGHOLD §3.4)."""
    params = stage_params_on_device(model, plan, stage)
    if plan.zero_stage >= 1:
        params = math.ceil(params / stage.dp)
    if stage.offload.window_layers is not None:
        # the device steps the resident layers; the CPU steps each streamed layer as its last
        # gradient lands, overlapped with the backward (simulator/window.py times that overlap;
        # this closed form charges it serially, an upper bound)
        return window.resident_step_s(model, plan, hardware, stage) + sum(
            window.cpu_step_s(plan, hardware, stage, n) for n in window.streamed_params(model, stage).values())
    if stage.offload.optimizer_on_cpu:  # ZeRO-Offload: grads out, CPU Adam, weights back
        w_b, g_b, _ = plan.training.bytes_per_param()
        link = hardware.host.pcie_gbps * 1e9
        return params / hardware.host.cpu_adam_params_per_s + params * (w_b + g_b) / link
    w_b, g_b, o_b = plan.training.bytes_per_param()
    return params * (2 * w_b + g_b + 2 * o_b) / hardware.device.hbm_bytes_per_s


def model_flops_per_iteration(model: ModelSpec, plan: Plan) -> float:
    """Model FLOPs of one iteration: 3x forward (forward + 2x backward), recompute not counted."""
    return 3 * model.fwd_flops_per_sample * plan.training.global_batch
