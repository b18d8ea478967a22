"""Static memory of a stage: weights, gradients and optimizer state per device (a STRONGHOLD
window's through costs.window), and the optimizer-swap chunks.

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs.params import grad_reduce_ranks, layer_params_of_stage, layer_params_on_device, stage_params_on_device
from costs.window import window_static
from specs.model import ModelSpec
from specs.plan import Plan, StagePlan
from specs.result import MemoryBreakdown


def stage_static(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[MemoryBreakdown, int]:
    """(device-resident weights/grads/optimizer, host-resident bytes) of one stage on one device.

    ZeRO stage k shards optimizer (k>=1), gradients (k>=2), parameters (k>=3) over dp (ZeRO §5).
    Stage 1 is Megatron's distributed optimizer: weights and (main) gradients whole, the fp32
    master copy and Adam's m, v 1/d, i.e. 6 + 12/d B/param with fp32 grads, 8 + 8/d in fp32
    (Megatron-LM docs/source/api-guide/dist_optimizer.md; theoretical_memory_usage.py's
    ``6 + 12 / data_parallel_size``). It needs no buffer of its own: the reduce-scatter and the
    all-gather run in place on the contiguous gradient / parameter buffers ("no dynamic buffers
    are allocated", same page); the executor's 1/d shard transients are costs.buffers' part.
    STRONGHOLD window: the resident layers and ``window_layers`` slots on the device, the streamed
    layers' state on the host (costs.window.window_static; its NVMe part is not host RAM).
    """
    w_b, g_b, o_b = plan.training.bytes_per_param()
    params = stage_params_on_device(model, plan, stage)  # a tied embedding once where shared
    z, dp = plan.zero_stage, grad_reduce_ranks(stage)  # ZeRO shards over dp x cp (Megatron-Core's DP-CP group)
    shard = lambda n, level: math.ceil(n / dp) if z >= level else n  # noqa: E731
    weights, grads, optim = shard(params * w_b, 3), shard(params * g_b, 2), shard(params * o_b, 1)
    host = 0
    if stage.offload.window_layers is not None:  # costs.window: resident layers + w slots
        weights, grads, optim, host, _ = window_static(model, plan, stage)
    elif stage.offload.optimizer_on_cpu or stage.offload.optimizer_swap:
        host, optim = optim, 0  # swapped: streamed through the device by its step (optimizer_swap_chunks)
    if stage.offload.weight_swap_layers:  # MPress §II-D: their home is host memory (plans refuse dp > 1, ZeRO)
        w_ws, g_ws, o_ws = weight_swap_bytes(model, plan, stage)
        on_device_o = 0 if stage.offload.optimizer_swap else o_ws  # an optimizer swap already put it there
        weights, grads, optim = weights - w_ws, grads - g_ws, optim - on_device_o
        host += w_ws + g_ws + on_device_o
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
    swapped = set(stage.offload.weight_swap_layers)  # their state is stepped on the CPU (weight_swap_bytes)
    per_layer = [layer_params_on_device(model.layers[i], stage.tp) for i in stage.layers if i not in swapped]
    if not per_layer:  # every layer weight-swapped: what is left (a tied copy's) is one chunk
        return [total] if total > 0 else []
    params = sum(per_layer) or 1
    chunks = [total * n // params for n in per_layer]
    chunks[-1] += total - sum(chunks)  # the tied-copy and rounding remainder rides with the last
    return [c for c in chunks if c > 0]


#: chunks of a streamed optimizer step on the device at once: the one being stepped, the next
#: coming in, the previous going out (the in and out copies run on opposite directions)
OPTIMIZER_SWAP_RESIDENT_CHUNKS = 3


def stash_layer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan, layer: int) -> int:
    """Bytes of one PipeDream stashed weight version of ``layer`` on one device of ``stage`` (its
    TP shard at the weights' precision: :func:`layer_params_of_stage`)."""
    return layer_params_of_stage(model, plan, stage, layer) * plan.training.bytes_per_param()[0]


def stash_stripes(model: ModelSpec, plan: Plan, stage: StagePlan) -> list[tuple[int, int]]:
    """(target device, bytes) of one stashed version striped over ``offload.stash_targets`` by weight
    (MPress §III-C; rounding as simulator.transfers._stripes: round(n·w/Σw), the last target takes
    the remainder); [] when the versions go to host memory."""
    targets = stage.offload.stash_targets
    if not targets:
        return []
    nbytes = stash_swap_bytes(model, plan, stage)
    total = sum(t.weight for t in targets)
    out, left = [], nbytes
    for j, t in enumerate(targets):
        part = left if j == len(targets) - 1 else round(nbytes * t.weight / total)
        out.append((t.device, part))
        left -= part
    return out


def weight_swap_layer_bytes(model: ModelSpec, plan: Plan, stage: StagePlan, layer: int) -> tuple[int, int, int]:
    """(weights, gradient, optimizer state) bytes of ``layer`` on one device of ``stage``: what a
    weight swap (``offload.weight_swap_layers``, MPress §II-D GPU-CPU swap of live model data)
    keeps in host memory instead. Plans refuse it with dp > 1 or ZeRO, so nothing is sharded over
    replicas; the TP shard and a shared tied copy as :func:`layer_params_of_stage`."""
    params = layer_params_of_stage(model, plan, stage, layer)
    w_b, g_b, o_b = plan.training.bytes_per_param()
    return params * w_b, params * g_b, params * o_b


def weight_swap_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int, int]:
    """:func:`weight_swap_layer_bytes` summed over the stage's ``offload.weight_swap_layers``."""
    parts = [weight_swap_layer_bytes(model, plan, stage, l) for l in sorted(set(stage.offload.weight_swap_layers))]
    return tuple(sum(p[i] for p in parts) for i in range(3)) if parts else (0, 0, 0)


def weight_swap_backward_relief(model: ModelSpec, plan: Plan, stage: StagePlan, layer: int) -> tuple[int, int]:
    """(freed, scratch) bytes of weight-swapped ``layer``'s backward, at the moment its gradient is
    complete (its parameters' post-accumulate hooks fire, executor.weight_swap):

    * ``freed``: the activations autograd has released by then: the layer's own saved bytes and
      its input when nothing below needs it again (costs.activations.layer_freed_bytes; a stage's
      first layer its own only: the stage's input is kept until the backward ends). A wholly
      swapped layer's copy (its swapped-in storages, held until its last saved tensor goes) and
      a recomputed layer's re-made activations (the workspace) are not in it;
    * ``scratch``: what of the backward workspace the layer's own backward held and no longer
      does, at most the stage's workspace: its weight-gradient part (the layer's
      ``workspace_fixed_bytes``, its TP share as costs.activations.backward_workspace_bytes
      takes it) — with weight swap the parameters have no gradient when the backward starts, so
      autograd keeps each computed weight gradient as the gradient itself instead of adding it
      to a resident one and dropping it: those bytes are the gradient (counted in full from then
      on), not scratch beside it — and a recomputed layer's re-made activations (the workspace
      counts them), released as its backward consumed them.

    The simulator (simulator/weightswap.py) books both at the layer's backward end: ``freed`` for
    the rest of the pass, ``scratch`` until the next layer of the pass starts computing."""
    from costs.activations import (backward_transient_bytes, layer_freed_bytes, layer_input_bytes,
                                   layer_own_bytes, layer_saved_bytes)
    from costs.params import samples_per_replica
    from specs.plan import MemoryAction

    b = samples_per_replica(plan, stage)
    freed = (layer_own_bytes(model, stage, layer, b) if layer == stage.layer_start
             else layer_freed_bytes(model, stage, layer, b))
    spec = model.layers[layer]
    fixed = spec.workspace_fixed_bytes * spec.tp_sharded_param_fraction
    scratch = math.ceil(fixed / stage.tp + spec.workspace_fixed_bytes - fixed)
    if stage.action_of(layer).action is MemoryAction.recompute:  # as backward_workspace_bytes adds them
        scratch += layer_saved_bytes(spec, b, stage.tp) - (layer_input_bytes(model, layer, b) if spec.saves_input else 0)
    return freed, min(scratch, backward_transient_bytes(model, plan, stage)[0])


def weight_swap_transient_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int, int]:
    """(weights, gradient, relief) bytes of weight-swapped layers on the device during one
    backward at its worst moment, relief being the activations and workspace the swapped layers'
    backwards have released by then (:func:`weight_swap_backward_relief`), to take off the
    backward's activation moment. The moments, in pass order (descending), with the prefetch rule
    (specs.plan_memory.OffloadPolicy: a layer's copy is issued when the pass's preceding layer
    starts): layer j starts computing — j's weights and j - 1's (its fetch issued now), and, when
    j + 1 is swapped, j + 1's weights and gradient (its device->host copy runs beside j's
    compute); a swapped layer L's backward has ended — L's weights and gradient, L - 1's weights
    (fetched), its workspace scratch gone. Each where the layer is swapped; relief counts the
    ``freed`` of the swapped layers whose backwards have ended. At most three layers' weights
    and one gradient. Assumes a gradient copy ends before the next layer's backward does (it
    runs on the other direction of the host link beside that layer's compute); a slower link
    piles copies up and the simulator's peak is higher. A CPU rank's copies are memcpys on the
    compute thread (the simulator releases a layer before the next one starts): there this is an
    upper bound."""
    swapped = set(stage.offload.weight_swap_layers)
    if not swapped:
        return 0, 0, 0
    sizes = {l: weight_swap_layer_bytes(model, plan, stage, l) for l in swapped}
    relief = {l: weight_swap_backward_relief(model, plan, stage, l) for l in swapped}
    w = lambda l: sizes[l][0] if l in swapped else 0  # noqa: E731
    best, freed = None, 0
    for j in reversed(stage.layers):
        above = j + 1 if j + 1 in swapped and j + 1 < stage.layer_stop else None
        starts = (w(j) + w(j - 1) + (w(above) if above is not None else 0),
                  sizes[above][1] if above is not None else 0, freed)
        moments = [starts]
        if j in swapped:
            freed += relief[j][0]
            moments.append((w(j) + w(j - 1), sizes[j][1], freed + relief[j][1]))
        for m in moments:
            if best is None or m[0] + m[1] - m[2] > best[0] + best[1] - best[2]:
                best = m
    return best


def stash_swap_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Bytes of one stashed weight version that ``offload.stash_swap_layers`` keep in host memory
    (MPress §II-D: GPU-CPU swap of model data, here PipeDream's stashed versions, PipeDream §3.3),
    at most the stage's parameter bytes; 0 without the field."""
    layers = stage.offload.stash_swap_layers
    if not layers:
        return 0
    total = sum(stash_layer_bytes(model, plan, stage, l) for l in sorted(set(layers)))
    if plan.zero_stage >= 3:  # ZeRO-3 shards the weights over dp (stage_static)
        total = math.ceil(total / grad_reduce_ranks(stage))
    return min(total, stage_static(model, plan, stage)[0].parameters_bytes)
