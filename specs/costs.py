"""Closed-form costs of a plan, shared by the analytic estimator and the simulator.

Both must agree on static memory exactly and on activations per microbatch, so the formulas live
here once. Everything is per device (one tensor-parallel rank of one data-parallel replica).
"""
from __future__ import annotations

import math

from specs import gemm
from specs.hardware import HardwareSpec, LinkSpec
from specs.model import LayerKind, LayerSpec, ModelSpec
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


def _stage_holding(plan: Plan, layer: int) -> StagePlan:
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
            shared = set(_stage_holding(plan, owner).devices) == set(_stage_holding(plan, copy).devices)
            out.append((owner, copy, shared))
    return out


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


def layer_saved_bytes(layer: LayerSpec, samples: int, tp: int) -> int:
    """Activations a layer keeps for backward on one TP rank: s·b·h·(10 + 24/t + 5as/(ht)) for a
    GPT block (Korthikanti et al. 2022, eq. 2) — generally the sharded fraction divides by t."""
    per_sample = layer.saved_bytes_per_sample
    sharded = per_sample * layer.tp_sharded_saved_fraction
    return math.ceil(samples * (sharded / tp + (per_sample - sharded)))


def layer_input_bytes(model: ModelSpec, layer: int, samples: int) -> int:
    """Bytes of a layer's input: the previous layer's output, or for the first layer the batch
    tensors it keeps (``input_bytes_per_sample``: images, token ids; 0 in the closed forms, which
    count ids in the embedding's saved bytes)."""
    return samples * (model.layers[layer - 1].output_bytes_per_sample if layer > 0 else model.input_bytes_per_sample)


def holds_input(stage: StagePlan, model: ModelSpec, layer: int) -> bool:
    """Whether the layer keeps its input between forward and backward: a kept layer that saves it
    (``saves_input``), or a recomputed one (its checkpoint)."""
    action = stage.action_of(layer).action
    return action is MemoryAction.recompute or (action is MemoryAction.keep and model.layers[layer].saves_input)


def holds_output(stage: StagePlan, model: ModelSpec, layer: int) -> bool:
    return stage.action_of(layer).action is MemoryAction.keep and model.layers[layer].saves_output


def layer_own_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """What a layer keeps between forward and backward besides its input and output tensors (the
    boundaries, which :func:`stage_activation_bytes` counts once each): kept layers their saved
    bytes less those two, recomputed and swapped layers nothing."""
    if stage.action_of(layer).action is not MemoryAction.keep:
        return 0
    spec = model.layers[layer]
    own = layer_saved_bytes(spec, samples, stage.tp)
    if spec.saves_input:
        own -= layer_input_bytes(model, layer, samples)
    if spec.saves_output:
        own -= samples * spec.output_bytes_per_sample
    return max(own, 0)


def boundary_held_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """Output of ``layer`` when the next layer is in the same stage: kept (once) when either side
    saves it, freed during the forward otherwise."""
    if holds_output(stage, model, layer) or holds_input(stage, model, layer + 1):
        return samples * model.layers[layer].output_bytes_per_sample
    return 0


def releases_output(model: ModelSpec, plan: Plan, stage: StagePlan) -> bool:
    """Whether the stage's output stops counting once it is sent (``training.
    deallocate_pipeline_outputs``, Megatron's ``deallocate_output_tensor``): not on the last stage
    (its output is the loss, the backward's root), and not when the last layer saves its own output
    (a final ReLU: autograd keeps that storage, so freeing the tensor frees no memory)."""
    return (plan.training.deallocate_pipeline_outputs and stage.layer_stop < model.num_layers
            and not holds_output(stage, model, stage.layer_stop - 1))


def sent_output_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """The output a releasing stage (:func:`releases_output`) still holds while its send is in
    flight: the send reads it, and gloo (or NCCL's stream) keeps it until the transfer is done.
    The simulator frees it when the transfer ends (over gloo, once its receive is also posted);
    the closed forms count it at the end of its forward only (:func:`activation_peak`)."""
    if not releases_output(model, plan, stage):
        return 0
    return samples_per_replica(plan, stage) * model.layers[stage.layer_stop - 1].output_bytes_per_sample


def stage_activation_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Activation bytes one microbatch of ``stage`` holds from its forward to its backward: every
    layer's own saved bytes, the tensors between its layers that a layer saves, and the stage's
    input and output, each once. The input is kept for the backward whether or not the first layer
    saves it (the received tensor is the leaf whose gradient is sent back; Megatron keeps
    ``input_tensors`` alike). The output is kept only where it is not released once sent
    (:func:`releases_output`): otherwise the backward starts from it, and it is also the send
    buffer, so a send costs no extra copy."""
    b = samples_per_replica(plan, stage)
    layers = stage.layers
    total = sum(layer_own_bytes(model, stage, l, b) for l in layers)
    total += sum(boundary_held_bytes(model, stage, l, b) for l in layers[:-1])
    output = 0 if releases_output(model, plan, stage) else b * model.layers[stage.layer_stop - 1].output_bytes_per_sample
    return total + layer_input_bytes(model, stage.layer_start, b) + output


def backward_workspace_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Largest excess over the held microbatches during one backward of ``stage``, walking its
    layers last to first: a layer's backward scratch (``workspace_bytes_per_sample``: weight-
    gradient and intermediate gradients; for a head under tp > 1 at least its vocabulary-parallel
    loss's, :func:`vocab_parallel_loss_bytes`), the activations a recomputed layer re-materialises, and
    the gradient flowing in from the layer above (the top layer's is the receive buffer), less what
    the layers above have already freed."""
    b, tp = samples_per_replica(plan, stage), stage.tp
    best = freed = 0
    for n, l in enumerate(reversed(stage.layers)):
        spec = model.layers[l]
        # backward scratch is gradients: of the sharded weights (the fixed part) and of activations
        # inside the TP region, which splits over t like the sharded weights do (the replicated
        # layer input and output are kept, not scratch), so both follow the parameter fraction
        frac = spec.tp_sharded_param_fraction
        per_sample = spec.workspace_bytes_per_sample * frac
        fixed = spec.workspace_fixed_bytes * frac
        need = math.ceil(b * (per_sample / tp + spec.workspace_bytes_per_sample - per_sample)
                         + fixed / tp + spec.workspace_fixed_bytes - fixed)
        need = max(need, vocab_parallel_loss_bytes(spec, b, tp))
        if stage.action_of(l).action is MemoryAction.recompute:
            need += layer_saved_bytes(spec, b, tp) - (layer_input_bytes(model, l, b) if spec.saves_input else 0)
        if n:
            need += b * spec.output_bytes_per_sample
        best = max(best, need - freed)
        freed += layer_freed_bytes(model, stage, l, b)
    return best


#: logits-sized tensors torch's vocab-parallel cross-entropy (``loss_parallel``, which the executor
#: runs for an LM head under tp > 1) holds at once in its backward: it builds the fused log-softmax +
#: NLL gradient as (zeros with -1 at the targets + exp(log-probabilities)) x grad, so the zeros, the
#: exp and their sum are live together (torch.distributed.tensor.parallel.loss.
#: _nll_loss_and_log_softmax_backward). A profile traced at tp = 1 sees plain cross-entropy instead:
#: two full-vocabulary gradients (nll_loss_backward, then _log_softmax_backward_data).
VOCAB_PARALLEL_LOSS_TENSORS = 3


def vocab_parallel_loss_bytes(layer: LayerSpec, samples: int, tp: int) -> int:
    """Backward transient of a head's loss when it runs vocabulary-parallel (tp > 1): three shards
    of the fp32 logits (:data:`VOCAB_PARALLEL_LOSS_TENSORS`), the logits being the head's
    TP-sharded saved bytes (``tp_sharded_saved_fraction``: what cross-entropy keeps of them). 0 for
    other layers, at tp = 1, and for a head the executor leaves replicated (fraction 0)."""
    if layer.kind is not LayerKind.head or tp <= 1 or layer.tp_sharded_saved_fraction <= 0:
        return 0
    logits = samples * layer.saved_bytes_per_sample * layer.tp_sharded_saved_fraction
    return math.ceil(VOCAB_PARALLEL_LOSS_TENSORS * logits / tp)


def layer_freed_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """What a layer's backward releases for good: its own saved bytes and its input when nothing
    below needs that tensor again (the layer below does not save its own output). Not used for a
    stage's first layer (its input is the stage's, kept until the backward ends)."""
    freed = layer_own_bytes(model, stage, layer, samples)
    if layer > 0 and holds_input(stage, model, layer) and not holds_output(stage, model, layer - 1):
        freed += layer_input_bytes(model, layer, samples)
    return freed


def backward_transient_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int]:
    """(workspace, swap-in) bytes during one backward: :func:`backward_workspace_bytes` (scratch and
    recomputed activations) and the prefetched copies of swapped layers (two at a time)."""
    b = samples_per_replica(plan, stage)
    # double buffering (simulator/engine.py _layered_backward; executor/swap.py): the layer being
    # run and the next one coming in, so the two largest swapped layers bound the copies
    sizes = sorted((layer_saved_bytes(model.layers[l], b, stage.tp) for l in stage.layers
                    if stage.action_of(l).action in SWAP_ACTIONS), reverse=True)
    return backward_workspace_bytes(model, plan, stage), sum(sizes[:2])


def comm_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Gradient buffers of the pipeline boundaries: the received output gradient
    (:func:`received_grad_buffer_bytes`) and the input gradient sent back
    (:func:`sent_grad_buffer_bytes`). Received activations are the stage's held input
    (:func:`stage_activation_bytes`)."""
    return received_grad_buffer_bytes(model, plan, stage) + sent_grad_buffer_bytes(model, plan, stage)


def received_grad_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """The gradient of the stage's output received from downstream (0 on the last stage: it starts
    backward from its own loss), counted for the whole iteration."""
    if stage.layer_stop == model.num_layers:
        return 0
    return samples_per_replica(plan, stage) * model.layers[stage.layer_stop - 1].output_bytes_per_sample


def sent_grad_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """The input gradient a stage sends back (0 on the first stage): made by its first backward
    (the received input's ``.grad``), then kept until the next backward replaces it. It does not
    exist before the stage's first backward ends, so a peak inside that backward (GPipe's, with all
    m microbatches held) is without it."""
    b = samples_per_replica(plan, stage)
    return layer_input_bytes(model, stage.layer_start, b) if stage.layer_start > 0 else 0


def allreduce_buffer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """A flat copy of the stage's gradients while they are all-reduced over dp (the executor sends
    one bucket per stage, ``torch.cat`` of the gradients, as DDP's default buckets are copies);
    0 without data parallelism. Allocated after the last backward, when activations are gone.
    The tied-weight gradient copy (:func:`tied_sync_buffer_bytes`) comes after it is freed: the
    larger of the two."""
    flat = dp_grad_bytes(model, plan, stage) if stage.dp > 1 else 0
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


def stage_static(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[MemoryBreakdown, int]:
    """(device-resident weights/grads/optimizer, host-resident bytes) of one stage on one device.

    ZeRO stage k shards optimizer (k>=1), gradients (k>=2), parameters (k>=3) over dp (ZeRO §5).
    STRONGHOLD window: the resident layers and ``window_layers`` slots on the device, the streamed
    layers' state on the host (specs.window.window_static; its NVMe part is not host RAM).
    """
    w_b, g_b, o_b = plan.training.bytes_per_param()
    params = stage_params_on_device(model, plan, stage)  # a tied embedding once where shared
    z, dp = plan.zero_stage, stage.dp
    shard = lambda n, level: math.ceil(n / dp) if z >= level else n  # noqa: E731
    weights, grads, optim = shard(params * w_b, 3), shard(params * g_b, 2), shard(params * o_b, 1)
    host = 0
    if stage.offload.window_layers is not None:  # specs.window: resident layers + w slots
        from specs.window import window_static

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


def stashed_versions(plan: Plan, stage_index: int) -> int:
    """Weight versions PipeDream async keeps on pipeline position i of p: p - i (PipeDream §3.3),
    i.e. p - i - 1 stashed copies besides the live weights; 0 for flushing schedules."""
    if plan.schedule.kind is not ScheduleKind.pipedream_async:
        return 0
    return plan.pipeline_depth - plan.device_group_of(stage_index) - 1


def activation_peak(plan: Plan, position: int, act_bytes: dict[int, int] | None = None,
                    transient_bytes: dict[int, int] | None = None,
                    sent_bytes: dict[int, int] | None = None,
                    grad_bytes: dict[int, int] | None = None) -> tuple[int, dict[int, int], int]:
    """(bytes, held microbatches per stage, of the bytes the sent-gradient buffers) at the peak of
    pipeline ``position``, found by walking its pass order (specs.schedule.compute_order, the order
    the simulator and the executor walk): a forward adds ``act_bytes[stage]``; a backward peaks at
    everything held plus ``transient_bytes[stage]`` and then frees its microbatch; a forward's end
    also peaks at what is held plus ``sent_bytes[stage]``, a released output still being sent
    (:func:`sent_output_bytes`; assumed sent before the next pass ends, as the simulator finds it
    unless links are slower than a pass); ``grad_bytes[stage]`` (:func:`sent_grad_buffer_bytes`)
    counts from the end of the stage's first backward on (so not in GPipe's peak, inside the first
    backward). Unit bytes by default, so the counts are those of the most microbatches held (first
    such moment).

    GPipe holds all m; 1F1B and PipeDream min(p - i, m) (PipeDream-2BW §3); interleaved 1F1B the
    Megatron warm-up count min((p-i-1)·2 + (v-1)·p + 1, m·v) of chunk-microbatches, unevenly over
    the chunks (Narayanan et al. 2021 §2.2: p=8, v=3, i=0 holds 31 = 15 + 8 + 8)."""
    from specs.schedule import compute_order  # specs.schedule imports specs.plan only

    p, m, v = plan.pipeline_depth, plan.training.microbatches, plan.schedule.virtual_stages
    held: dict[int, int] = {s: 0 for s in range(position, len(plan.stages), p)}
    now = best = grads = best_grads = 0
    best_held = dict(held)
    graded: set[int] = set()
    for pass_, s, _ in compute_order(plan.schedule.kind, p, m, v, position):
        a = act_bytes[s] if act_bytes is not None else 1
        if pass_ == "F":
            held[s] += 1
            now += a
            if sent_bytes is not None and now + grads + sent_bytes[s] > best:
                best, best_held, best_grads = now + grads + sent_bytes[s], dict(held), grads
            continue
        peak = now + grads + (transient_bytes[s] if transient_bytes is not None else 0)
        if peak > best:
            best, best_held, best_grads = peak, dict(held), grads
        held[s] -= 1
        now -= a
        if grad_bytes is not None and s not in graded:
            graded.add(s)
            grads += grad_bytes[s]
    return best, best_held, best_grads


def in_flight_microbatches(plan: Plan, stage_index: int) -> int:
    """Microbatches of ``stage_index`` held at its position's peak (see :func:`activation_peak`):
    GPipe m, 1F1B min(p - i, m), interleaved exact per chunk (15, 8, 8 for p=8, v=3, i=0)."""
    return activation_peak(plan, plan.device_group_of(stage_index))[1][stage_index]


# ---- time -----------------------------------------------------------------------------------

def ring_allreduce_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-reduce: 2(n-1)/n · bytes / bw + 2(n-1) · latency (Thakur et al. 2005); the
    latency per step is the link's ``collective_latency_s`` where given (gloo on local_cpu pays far
    more per collective step than per p2p message, issue #11), else its ``latency_s``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    lat = link.collective_latency_s if link.collective_latency_s is not None else link.latency_s
    return 2 * (n - 1) / n * nbytes / (link.total_bw_gbps * 1e9) + 2 * (n - 1) * lat


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
    each GEMM at its own shape's efficiency (specs/gemm.py), the memory-bound ops at HBM bandwidth,
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


def collective_link(link: LinkSpec) -> LinkSpec:
    """``link`` at the bus bandwidth a collective achieves on it (``collective_efficiency``)."""
    if link.collective_efficiency == 1.0:
        return link
    return link.model_copy(update={"bw_gbps": link.bw_gbps * link.collective_efficiency})


def allreduce_link(hardware: HardwareSpec, devices: list[int]) -> LinkSpec:
    """The effective link of a ring all-reduce over ``devices``. Inside one node: the slowest
    pair link (``group_link``). Across nodes NCCL runs one ring per NIC rail in parallel, so with r
    group members on every node the inter-node hops carry r x the fabric bandwidth (one HCA per GPU
    on DGX A100 / Selene, Narayanan et al. §5); the intra-node hops still bound it."""
    nodes: dict[int, list[int]] = {}
    for d in devices:
        nodes.setdefault(hardware.node_of(d), []).append(d)
    if len(nodes) == 1 or hardware.inter_node is None:
        return collective_link(group_link(hardware, devices))
    per_node = min(len(v) for v in nodes.values())
    inter = hardware.inter_node
    rails = inter.model_copy(update={"count": inter.count * per_node})  # one rail per GPU
    intra = [group_link(hardware, v) for v in nodes.values() if len(v) > 1]
    return min((collective_link(l) for l in (rails, *intra)), key=lambda l: (l.total_bw_gbps, -l.latency_s))


def dp_grad_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Gradient bytes one device of ``stage`` all-reduces over its dp replicas (its TP shard)."""
    _, g_b, _ = plan.training.bytes_per_param()
    return g_b * stage_params_on_device(model, plan, stage)


def dp_allreduce_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """Gradient all-reduce of one stage over its dp replicas on an idle fabric (one TP rank's
    shard each; ring over ``allreduce_link``). ZeRO stage >= 2 reduce-scatters instead: half the
    traffic of an all-reduce (ZeRO §5)."""
    if stage.dp == 1:
        return 0.0
    ranks = stage.devices[:: stage.tp]
    t = ring_allreduce_s(dp_grad_bytes(model, plan, stage), stage.dp, allreduce_link(hardware, ranks))
    return t / 2 if plan.zero_stage >= 2 else t


def embedding_group_allreduce_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> float:
    """Seconds of Megatron's embedding-group all-reduce on ``stage`` (0 unless it holds one side
    of a tied weight whose other side is on other devices): after the data-parallel sync the
    first stage's word-embedding gradient and the last stage's head copy are summed over a group
    of 2, one per (dp, tp) coordinate, all pairs at once (Narayanan et al. 2021;
    ``_allreduce_word_embedding_grads``), in the gradient dtype (fp32 main grads at 18 B/param)."""
    _, g_b, _ = plan.training.bytes_per_param()
    t = 0.0
    for owner, copy, shared in tied_copies(model, plan, stage):
        if shared:
            continue
        a, b = _stage_holding(plan, owner), _stage_holding(plan, copy)
        nbytes = g_b * math.ceil(model.layers[copy].tied_params / stage.tp)
        t += ring_allreduce_s(nbytes, 2, hardware.link(a.devices[0], b.devices[0]))
    return t


def dp_allreduce_buckets_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage: StagePlan) -> list[float]:
    """``dp_allreduce_s`` split into one bucket per layer of the stage (stage order): what a
    bucketed all-reduce issues as each layer's gradients become final (PyTorch DDP, Li et al.
    VLDB'20 §3.2.3; one bucket per layer keeps the model simple), each paying its own latency."""
    if stage.dp == 1:
        return [0.0] * len(stage.layers)
    _, g_b, _ = plan.training.bytes_per_param()
    link = allreduce_link(hardware, stage.devices[:: stage.tp])
    half = 2 if plan.zero_stage >= 2 else 1
    return [ring_allreduce_s(g_b * layer_params_on_device(model.layers[i], stage.tp), stage.dp, link) / half
            for i in stage.layers]


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
        from specs import window

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
