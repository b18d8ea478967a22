"""Time of a layer's forward and backward passes on one device (GEMM curve, memory-bound rest,
per-operator overhead, tensor-parallel all-reduces), the optimizer step and the model's FLOPs.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs import gemm, window
from costs.buffers import boundary_send_bytes, neighbour_stage, p2p_gathered_bytes
from costs.collectives import (allreduce_link, collective_link, contention_s, group_link, ring_allreduce_s,
                               transfer_s)
from costs.context_parallel import layer_cp_comm_s
from costs.params import grad_reduce_ranks, layer_params_on_device, samples_per_replica, stage_params_on_device
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import LayerKind, LayerSpec, ModelSpec
from specs.plan import MemoryAction, Plan, StagePlan


def compute_dtype(plan: Plan) -> str:
    return plan.training.precision.value


#: memory traffic of a backward relative to its forward for the elementwise ops: each op's backward
#: reads the output gradient and one saved tensor and writes the input gradient (3 tensors where
#: the forward moved 2: layernorm, GeLU, softmax, dropout alike)
BWD_MEM_FACTOR = 1.5


def _mem_s(layer: LayerSpec, samples: int, tp: int, hardware: HardwareSpec, sp: bool = False,
           backward: bool = False) -> float:
    """Forward (``backward``: backward) seconds of a layer's memory-bound (non-GEMM) ops at HBM
    bandwidth. Their traffic splits over TP like the activations they act on
    (``tp_sharded_saved_fraction``); with sequence parallelism (``sp``) the layernorm, dropout and
    bias-add regions split too (``sp_sharded_saved_fraction``, Korthikanti §4.2.2). The backward's
    is the measured ``bwd_mem_bytes_per_sample`` where a profile gives it, else
    :data:`BWD_MEM_FACTOR` x the forward's."""
    per_sample = layer.fwd_mem_bytes_per_sample
    if backward:
        per_sample = layer.bwd_mem_bytes_per_sample or BWD_MEM_FACTOR * per_sample
    frac = layer.tp_sharded_saved_fraction + (layer.sp_sharded_saved_fraction if sp else 0.0)
    sharded = per_sample * min(frac, 1.0)
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
    return (gemm.gemms_fwd_s(dev, dtype, spec.gemms, b, tp) + _mem_s(spec, b, tp, hardware, stage.sequence_parallel)
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
    backward (measured, or ``BWD_MEM_FACTOR`` x the forward traffic: :func:`_mem_s`), the gradient
    accumulation, twice the unlisted FLOPs, ``bwd_ops`` x the per-operator overhead, and under TP
    the DTensor operators' extra dispatch cost (:func:`tp_dtensor_ops`)."""
    spec, dtype, dev = model.layers[layer], compute_dtype(plan), hardware.device
    b, tp = samples_per_replica(plan, stage), stage.tp
    dgrad, wgrad = gemm.gemms_bwd_s(dev, dtype, spec.gemms, b, tp)
    accumulate = accumulate_bytes_per_param(plan) * layer_params_on_device(spec, tp) / dev.hbm_bytes_per_s
    return (dgrad + wgrad + _mem_s(spec, b, tp, hardware, stage.sequence_parallel, backward=True) + accumulate
            + 2 * _rest_flops_s(spec, b, tp, hardware, dtype) + spec.bwd_ops * dev.op_overhead_s
            + tp_dtensor_ops(spec, tp)[1] * dev.dtensor_op_overhead_s)


def _tp_collective(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan,
                   layer: int) -> tuple[float, LinkSpec]:
    """(bytes, link) of one tensor-parallel collective of a layer: its boundary tensor for the
    stage's microbatch (``output_bytes_per_sample``), over the link joining the stage's tp group."""
    nbytes = model.layers[layer].output_bytes_per_sample * samples_per_replica(plan, stage)
    return nbytes, collective_link(group_link(hardware, stage.devices[: stage.tp]))


def layer_tp_comm_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Tensor-parallel all-reduces of one layer in one pass (2 per GPT block, Megatron §3).

    Not overlapped with compute, in either pass: Megatron-LM as run for Narayanan et al. SC'21
    all-reduces synchronously in forward (g after the row-parallel GEMMs) and backward (f before
    the column-parallel ones); overlapping the backward all-reduce with the wgrad GEMM
    (``--async-tensor-model-parallel-allreduce``) came later, and memwall's executor (DTensor) does
    not do it either, so the plan and the runs agree."""
    spec = model.layers[layer]
    if stage.sequence_parallel:
        return layer_sp_comm_s(model, plan, hardware, stage, layer)
    if stage.tp == 1 or spec.tp_allreduces_per_pass == 0:
        return 0.0
    nbytes, link = _tp_collective(model, plan, hardware, stage, layer)
    return spec.tp_allreduces_per_pass * ring_allreduce_s(nbytes, stage.tp, link)


def ring_half_s(nbytes: float, n: int, link) -> float:
    """Ring all-gather or reduce-scatter of a tensor of ``nbytes`` (whole, before the split) over
    ``n`` ranks: (n-1)/n · bytes / bw + (n-1) · latency, half a ring all-reduce (an all-reduce is
    one of each: Korthikanti §4.2.2, "same bandwidth as an all-reduce")."""
    return ring_allreduce_s(nbytes, n, link) / 2


def layer_sp_comm_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Sequence-parallel communication of one layer in one pass (Korthikanti §4.2.2, Fig. 5): each
    of ``tp_allreduces_per_pass`` all-reduces becomes a reduce-scatter (g) and each column-parallel
    region is entered by an all-gather (``sp_allgathers_per_pass``, ḡ); the backward runs the
    conjugates (all-gather for g, reduce-scatter for ḡ), the same bytes. A GPT block: 2 + 2
    halves, the all-reduce volume of tensor parallelism alone; the embedding only its
    reduce-scatter. The backward's extra re-gathers are :func:`sp_regather_s`."""
    spec = model.layers[layer]
    halves = spec.tp_allreduces_per_pass + spec.sp_allgathers_per_pass
    if stage.tp == 1 or halves == 0:
        return 0.0
    nbytes, link = _tp_collective(model, plan, hardware, stage, layer)
    return halves * ring_half_s(nbytes, stage.tp, link)


def sp_regather_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """The backward's re-gather under sequence parallelism (Korthikanti §4.2.2): each
    column-parallel GEMM saved its sequence-split input (s/t, what makes the 34/t of Table 2), so
    its weight gradient first all-gathers it again: ``sp_allgathers_per_pass`` all-gathers per
    backward. None for a fully recomputed or op-level checkpointed layer: its re-run forward
    gathered the inputs already (priced in its recompute). Exposed, as every tensor-parallel
    collective of this model is (``layer_tp_comm_s``); Megatron-LM issues it asynchronously behind
    the input-gradient GEMM (``LinearWithGradAccumulationAndAsyncCommunication``), as it issues the
    backward's all-reduce / reduce-scatter behind the weight-gradient GEMM, and memwall models
    neither overlap."""
    spec = model.layers[layer]
    if not stage.sequence_parallel or stage.tp == 1 or spec.sp_allgathers_per_pass == 0 \
            or stage.action_of(layer).action in (MemoryAction.recompute, MemoryAction.op_sac):
        return 0.0
    nbytes, link = _tp_collective(model, plan, hardware, stage, layer)
    return spec.sp_allgathers_per_pass * ring_half_s(nbytes, stage.tp, link)


def selective_recompute_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Seconds of re-running one layer's attention core before its backward under selective
    recompute (Korthikanti §5; Table 4: 2.7 % overhead on 22B against 36 % for full recompute):
    its ``selective_gemms`` (QKᵀ, attention·V, heads split over t) at their shapes' efficiency,
    its element-wise traffic (softmax, dropout; split over t with the heads) at HBM bandwidth and
    its operators' overhead; 0 unless the layer's action is ``selective``."""
    if stage.action_of(layer).action is not MemoryAction.selective:
        return 0.0
    spec, dtype, dev = model.layers[layer], compute_dtype(plan), hardware.device
    b, tp = samples_per_replica(plan, stage), stage.tp
    return (gemm.gemms_fwd_s(dev, dtype, spec.selective_gemms, b, tp)
            + b * spec.selective_mem_bytes_per_sample / tp / dev.hbm_bytes_per_s
            + spec.selective_ops * dev.op_overhead_s)


def op_sac_recompute_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan, layer: int) -> float:
    """Seconds of the forward re-run before one layer's backward under torchtitan's op-level
    checkpointing (executor.op_sac): the matmuls whose outputs its policy did not save
    (``op_sac_gemms``) at their shapes' efficiency (a profiled layer, which has no GEMM shapes: its
    re-run FLOPs, ``op_sac_rerun_flops_per_sample``, at the rate its forward's run), every
    element-wise op (the layer's whole forward traffic) at HBM bandwidth, and the whole forward's
    operators' overhead (the saved ones are dispatched again and answered from the cache); 0 unless
    the layer's action is ``op_sac``."""
    if stage.action_of(layer).action is not MemoryAction.op_sac:
        return 0.0
    spec, dtype, dev = model.layers[layer], compute_dtype(plan), hardware.device
    b, tp = samples_per_replica(plan, stage), stage.tp
    rerun = spec.op_sac_rerun_flops_per_sample * b / tp / dev.flops_per_s(dtype)  # a profiled layer's, as _rest_flops_s
    return (gemm.gemms_fwd_s(dev, dtype, spec.op_sac_gemms, b, tp) + rerun
            + _mem_s(spec, b, tp, hardware, stage.sequence_parallel) + spec.fwd_ops * dev.op_overhead_s
            + tp_dtensor_ops(spec, tp)[0] * dev.dtensor_op_overhead_s
            + op_sac_recompute_comm_s(model, plan, hardware, stage, layer))


def op_sac_recompute_comm_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan,
                            layer: int) -> float:
    """The tensor-parallel collectives the op-level recompute re-runs (tp > 1), which stops at the
    forward's last saved-tensor pack, before the last row-parallel output's reduction: without
    sequence parallelism every all-reduce but that one (a LLaMA block: proj's); with it every
    all-gather (``sp_allgathers_per_pass``: the inputs of the recomputed k and up), the
    reduce-scatters' outputs being saved (torchtitan's list, executor.op_sac)."""
    spec = model.layers[layer]
    if stage.tp == 1:
        return 0.0
    nbytes, link = _tp_collective(model, plan, hardware, stage, layer)
    if stage.sequence_parallel:
        return spec.sp_allgathers_per_pass * ring_half_s(nbytes, stage.tp, link)
    return max(spec.tp_allreduces_per_pass - 1, 0) * ring_allreduce_s(nbytes, stage.tp, link)


def layer_pass_times_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan,
                       layer: int) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one layer for one microbatch, communication
    included; recompute is 0 unless the layer's action is recompute (then one more forward runs
    just before its backward). The simulator and the analytic estimate both sum these."""
    f = layer_fwd_s(model, plan, hardware, stage, layer)
    c = layer_tp_comm_s(model, plan, hardware, stage, layer)
    # selective recompute re-runs the attention core inside the layer's backward (Megatron's
    # checkpointed core attention), so it is part of the backward, not a whole-layer re-run (rc)
    b = (layer_bwd_s(model, plan, hardware, stage, layer) + selective_recompute_s(model, plan, hardware, stage, layer)
         + op_sac_recompute_s(model, plan, hardware, stage, layer) + sp_regather_s(model, plan, hardware, stage, layer))
    cp_f, cp_b = layer_cp_comm_s(model, plan, hardware, stage, layer)  # ring attention's exposed transfers
    rc = f + c + cp_f if stage.action_of(layer).action is MemoryAction.recompute else 0.0
    if stage.action_of(layer).action is MemoryAction.selective:
        cp_b += cp_f  # the re-run core runs its forward ring again
    return f + c + cp_f, b + c + cp_b, rc


def p2p_gather_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> tuple[float, float]:
    """(forward, backward) seconds of the tp all-gathers that rebuild a scattered boundary tensor
    on ``stage`` (Narayanan et al. SC'21 §4.1: the received input before the forward, the received
    output gradient before the backward; costs.buffers.p2p_gathered_bytes), synchronous like every
    tensor-parallel collective of this model (:func:`layer_tp_comm_s`)."""
    act, grad = p2p_gathered_bytes(model, plan, stage)
    if not act and not grad:
        return 0.0, 0.0
    link = collective_link(group_link(hardware, stage.devices[: stage.tp]))
    return ring_half_s(act, stage.tp, link), ring_half_s(grad, stage.tp, link)


def blocking_send_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch that ``stage``'s own pipeline sends hold one of
    its devices with ``plan.p2p_blocking``: its output to the next stage after the forward, its
    input gradient to the previous one after the backward, each one transfer over the link between
    the stages' first devices (as the simulator books it, simulator.transfers._send), the next
    pass waiting for it. Megatron-LM's p2p is a ``batch_isend_irecv`` waited (and, until
    Megatron-Core's ``batch_p2p_sync``, followed by ``cuda.synchronize``) before the next pass —
    Megatron-Core overlaps it only with ``overlap_p2p_comm`` (interleaved schedule, default off);
    DeepSpeed's pipeline engine sends synchronously. Neighbours on the same device (a V's bottom)
    hand over in memory: nothing. 0 without the flag (sends overlap the next pass)."""
    if not plan.p2p_blocking:
        return 0.0, 0.0
    out_bytes, grad_bytes = boundary_send_bytes(model, plan, stage)
    src = stage.devices[0]
    nxt, prev = neighbour_stage(plan, stage, +1), neighbour_stage(plan, stage, -1)
    fwd = (transfer_s(out_bytes, hardware.link(src, nxt.devices[0]))
           if nxt is not None and nxt.devices[0] != src and out_bytes else 0.0)
    bwd = (transfer_s(grad_bytes, hardware.link(src, prev.devices[0]))
           if prev is not None and prev.devices[0] != src and grad_bytes else 0.0)
    return fwd, bwd


def sharded_dp_comm_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch that ZeRO-2/3's data-parallel communication adds
    to the passes of one device of ``stage``, all on one communication stream (the dp x cp group's
    link), overlapped with compute where it can be:

    * ZeRO-3 (Rajbhandari et al. 2020 §5.3; FSDP2 with reshard_after_forward, torchtitan's
      default): each layer's weights all-gathered (half a ring all-reduce of its bytes) before its
      forward and again before its backward, prefetched one layer ahead: the first gather of a
      pass is exposed, layer j's only where the stream is still busy when the pass reaches it.
    * ZeRO-2 and ZeRO-3 reduce-scatter each layer's gradient in every microbatch's backward, as soon
      as the layer's backward is done (§5.2: the gradients are partitioned, so no rank keeps a
      whole gradient across microbatches; FSDP2 reduce-scatters in each unit's post-backward and
      waits for the last in its final callback; DeepSpeed ZeRO-2 reduces every micro-step): queued
      behind the prefetched gathers, hidden by the next layers' backwards, the last one exposed.
      (:func:`costs.collectives.dp_reduce_gather_s` then has no reduction left for the flush.)
    0 below ZeRO-2 or without replicas."""
    ranks = grad_reduce_ranks(stage)
    if plan.zero_stage < 2 or ranks == 1:
        return 0.0, 0.0
    w_b, g_b, _ = plan.training.bytes_per_param()
    link = allreduce_link(hardware, stage.devices[:: stage.tp])
    params = [layer_params_on_device(model.layers[l], stage.tp) for l in stage.layers]
    gathers = [ring_allreduce_s(n * w_b, ranks, link) / 2 if plan.zero_stage >= 3 else 0.0 for n in params]
    reduces = [ring_allreduce_s(n * g_b, ranks, link) / 2 for n in params]
    passes = [layer_pass_times_s(model, plan, hardware, stage, l) for l in stage.layers]
    idx = list(range(len(params)))
    slow = hardware.device.overlap_compute_slowdown
    fwd = _stream_exposed_s(idx, gathers, [0.0] * len(idx), [f for f, _, _ in passes], slow)
    bwd = _stream_exposed_s(idx[::-1], gathers, reduces, [b + rc for _, b, rc in passes], slow)
    return fwd, bwd


def _stream_exposed_s(order: list[int], gathers: list[float], reduces: list[float], busy: list[float],
                      slowdown: float = 0.0) -> float:
    """Seconds a pass over the layers in ``order`` (compute ``busy`` each) is longer for one FIFO
    communication stream: layer j's gather must be done before its compute starts, the next layer's
    gather is issued when j's compute starts (prefetch one ahead), j's reduce-scatter when j's
    compute ends; the pass is over when its compute and the stream are both done. Compute that
    runs beside the stream is slower by ``slowdown`` of the time they overlap
    (``DeviceSpec.overlap_compute_slowdown``; the stream's own times are left as they are)."""
    stream = gathers[order[0]]  # the first gather: nothing to hide it
    ready, clock = stream, 0.0
    for i, j in enumerate(order):
        start = max(clock, ready)
        if i + 1 < len(order):
            stream = max(stream, start) + gathers[order[i + 1]]
            ready = stream
        # the stream is busy from ``start`` (or earlier) until ``stream``: nothing new is issued
        # while j computes, so the overlap is one interval
        clock = start + busy[j] + contention_s([(start, stream)], start, start + busy[j], slowdown)
        stream = max(stream, clock) + reduces[j]
    return max(clock, stream) - sum(busy[j] for j in order)


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
        params = math.ceil(params / grad_reduce_ranks(stage))  # the dp x cp shard
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
