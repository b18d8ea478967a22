"""Activation bytes of a stage: what each layer saves for its backward, what its boundaries hold,
the backward's workspace and transients, and how many microbatches are in flight (1F1B keeps at most
p − i on stage i; PipeDream-2BW §3).

Per device: one tensor-parallel rank of one data-parallel replica. Shared by the analytic
estimator, the simulator and the planners, so each formula lives here once.
"""
from __future__ import annotations

import math

from costs.context_parallel import ring_workspace_bytes
from costs.params import samples_per_replica
from costs.sharded_dp import zero2_layer_grad_bytes, zero3_backward_bytes
from specs.model import LayerKind, LayerSpec, ModelSpec
from specs.plan import SPLIT_BACKWARD, LayerMemory, MemoryAction, Plan, ScheduleKind, StagePlan


SWAP_ACTIONS = frozenset({MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme})
#: actions whose layer keeps (part of) its saved tensors on the device and its boundaries as kept
KEPT_ACTIONS = frozenset({MemoryAction.keep, MemoryAction.selective, MemoryAction.op_sac})


def layer_saved_bytes(layer: LayerSpec, samples: int, tp: int, *, sp: bool = False, selective: bool = False,
                      op_sac: bool = False) -> int:
    """Activations a layer keeps for backward on one TP rank, Korthikanti et al. 2022 Table 2 for a
    GPT block: s·b·h·(10 + 24/t + 5as/(ht)) (eq. 2; generally the tp-sharded fraction divides by
    t); with sequence parallelism (``sp``) the rest splits too, sbh·(34/t + 5as/(ht)) (§4.2.2);
    with selective recompute (``selective``) the attention core's tensors are dropped
    (``selective_bytes_per_sample``, all tp-sharded): sbh·(10 + 24/t), and sbh·34/t with both (§5).
    Under torchtitan's op-level checkpointing (``op_sac``) what its policy holds:
    ``op_sac_bytes_per_sample`` at tp 1 (the checkpoint's input and the saved operators' outputs);
    at tp t, :func:`op_sac_held_per_sample`."""
    if op_sac:
        return math.ceil(samples * op_sac_held_per_sample(layer, tp, sp))
    per_sample = layer.saved_bytes_per_sample
    sharded = per_sample * (layer.tp_sharded_saved_fraction + (layer.sp_sharded_saved_fraction if sp else 0.0))
    sharded = min(sharded, per_sample)
    dropped = layer.selective_bytes_per_sample if selective else 0
    return math.ceil(samples * (max(sharded - dropped, 0.0) / tp + (per_sample - sharded)))


def op_sac_held_per_sample(layer: LayerSpec, tp: int, sp: bool) -> float:
    """What op-level checkpointing holds per sample on one rank of a tp-way block (executor.op_sac
    on the executor's DTensor Megatron TP, whose matmuls the policy sees as DTensor operators):
    the column-parallel outputs it saves, the kernel's and what else ``op_sac_tp_sharded_bytes_per_
    sample`` lists, divided by t; the checkpoint's input, the block's boundary
    (``output_bytes_per_sample``), whole or (sequence parallelism) split by t; the row-parallel
    matmul it saves (down), whose DTensor output is the unreduced partial sum, whole on every rank;
    and under sequence parallelism the reduce-scatter outputs torchtitan's list saves, one per
    ``tp_allreduces_per_pass``, s/t each. At tp 1: ``op_sac_bytes_per_sample``."""
    total, split = layer.op_sac_bytes_per_sample, layer.op_sac_tp_sharded_bytes_per_sample
    if tp <= 1:
        return total
    inp = layer.output_bytes_per_sample
    whole = total - split - inp  # the row-parallel partial sums
    boundary = (1 + layer.tp_allreduces_per_pass) * inp / tp if sp else inp
    return whole + split / tp + boundary


def op_sac_remade_bytes(layer: LayerSpec, samples: int, tp: int, sp: bool) -> int:
    """What an ``op_sac`` layer's backward holds beyond what the policy held: the kept layer's saved
    set, re-made, less what the policy saved of it. The policy's saved set is not a subset of
    autograd's: what the re-run never reaches stays in SAC's cache through the backward
    (``op_sac_extra_bytes_per_sample``: a LLaMA block's MLP output, which the residual add does not
    save; at tp > 1 the row-parallel partial sum, whole; under sequence parallelism also that
    matmul's reduce-scatter output, s/t; executor.op_sac.Mirror.extra_bytes), so kept minus saved
    under-counts by it. Measured on a llama_tiny block (h 128, s 256, fp32, tp 1): keep holds
    3,528,704 B at the start of its backward, op_sac 3,659,776 = keep + its MLP output (131,072 B)."""
    extra = layer.op_sac_extra_bytes_per_sample
    if tp > 1 and sp:  # the last row-parallel output's reduce-scatter, after the re-run's stop
        extra += layer.output_bytes_per_sample / tp
    kept = layer_saved_bytes(layer, samples, tp, sp=sp)
    return max(kept - layer_saved_bytes(layer, samples, tp, sp=sp, op_sac=True) + math.ceil(samples * extra), 0)


def seq_split(stage: StagePlan) -> int:
    """How many ways a sequence-sharded boundary is split on one rank: t under sequence
    parallelism (Korthikanti §4.2.2: each block's input and output are s/t of the sequence), else 1."""
    return stage.tp if stage.sequence_parallel else 1


def layer_output_bytes(model: ModelSpec, layer: int, samples: int, split: int = 1) -> int:
    """Bytes of ``layer``'s output on one rank: its ``output_bytes_per_sample`` x samples, divided
    by ``split`` (:func:`seq_split`) where sequence parallelism splits it (``sp_shards_output``)."""
    spec = model.layers[layer]
    nbytes = math.ceil(samples * spec.output_bytes_per_sample)  # cp: samples may be a fraction (costs.params)
    return math.ceil(nbytes / split) if split > 1 and spec.sp_shards_output else nbytes


def layer_input_bytes(model: ModelSpec, layer: int, samples: int, split: int = 1) -> int:
    """Bytes of a layer's input: the previous layer's output (split over the sequence under
    sequence parallelism: ``split``, :func:`seq_split`), or for the first layer the batch tensors
    it keeps (``input_bytes_per_sample``: images, token ids; 0 in the closed forms, which count
    ids in the embedding's saved bytes)."""
    if layer > 0:
        return layer_output_bytes(model, layer - 1, samples, split)
    return math.ceil(samples * model.input_bytes_per_sample)


def stage_saved_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """:func:`layer_saved_bytes` of ``layer`` as ``stage`` runs it: its tensor- and (with
    ``sequence_parallel``) sequence-parallel split, less the attention core where its action is
    ``selective`` (Korthikanti §5), or what op-level checkpointing holds where it is ``op_sac``."""
    action = stage.action_of(layer).action
    return layer_saved_bytes(model.layers[layer], samples, stage.tp, sp=stage.sequence_parallel,
                             selective=action is MemoryAction.selective, op_sac=action is MemoryAction.op_sac)


def tensor_bytes(spec: LayerSpec, index: int, samples: int, tp: int) -> int:
    """Bytes of saved tensor ``index`` of ``spec`` (``LayerSpec.saved_tensors``) for ``samples``
    samples on one TP rank: its per-sample bytes times the samples, divided by t (rounded up) when
    tensor parallelism shards it (MPress §III-D decides per tensor, Table III's t1-t4)."""
    t = spec.saved_tensors[index]
    nbytes = t.bytes_per_sample * samples
    return -(-nbytes // tp) if t.tp_sharded else nbytes


def _kept_own_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """A kept (or selective) layer's saved bytes less its boundaries (its input when it saves it,
    its output when it saves it): its interior, what :func:`layer_own_bytes` counts for it."""
    spec, split = model.layers[layer], seq_split(stage)
    own = stage_saved_bytes(model, stage, layer, samples)
    if spec.saves_input:
        own -= layer_input_bytes(model, layer, samples, split)
    if spec.saves_output:
        own -= layer_output_bytes(model, layer, samples, split)
    return max(own, 0)


def moved_bytes(spec: LayerSpec, item: LayerMemory, samples: int, tp: int) -> int:
    """Bytes a per-tensor swap (``item.tensors``, MPress §III-D) moves, one microbatch of
    ``samples`` on one TP rank: the listed saved tensors' :func:`tensor_bytes`. The caller caps it
    at the layer's interior (:func:`swapped_bytes`), so what moves and what stays sum to a kept
    layer's bytes however the per-tensor sizes round."""
    return sum(tensor_bytes(spec, i, samples, tp) for i in item.tensors or ())


def is_partial(item: LayerMemory) -> bool:
    """Whether ``item`` swaps some saved tensors of its layer only (``LayerMemory.tensors``): the
    layer otherwise behaves as kept (its boundaries and unlisted tensors stay on the device)."""
    return item.tensors is not None and item.action in SWAP_ACTIONS


def _kept(item: LayerMemory) -> bool:
    """Whether the layer holds its boundaries as a kept layer does: kept, selective (it keeps all
    but its attention core, Korthikanti §5), op-level checkpointed (its checkpoint keeps the input,
    counted in ``op_sac_bytes_per_sample`` as a kept layer's saved bytes count it), or partially
    swapped."""
    return item.action in KEPT_ACTIONS or is_partial(item)


def swapped_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """Bytes a swap of ``layer`` (cpu_swap, nvme, d2d_swap) moves off the device at its forward and
    brings back for its backward, one microbatch on one TP rank: its saved bytes, less its input
    when that is the stage's received input. executor.swap keeps the received input in place
    (``Swapper.begin_forward``: the stage holds it for its backward anyway, the leaf whose gradient
    it sends back, so a copy would free nothing), and :func:`stage_activation_bytes` counts it once,
    as held. A first stage receives nothing: the batch tensors its first layer saves
    (``input_bytes_per_sample``) move with that layer (:func:`keeps_input`). A per-tensor swap
    (``tensors``, MPress §III-D) moves the listed tensors only (:func:`moved_bytes`), at most the
    layer's interior: its boundaries stay as a kept layer's."""
    spec = model.layers[layer]
    item = stage.action_of(layer)
    if is_partial(item):
        return min(moved_bytes(spec, item, samples, stage.tp), _kept_own_bytes(model, stage, layer, samples))
    nbytes = stage_saved_bytes(model, stage, layer, samples)
    if layer == stage.layer_start and layer > 0 and spec.saves_input:
        nbytes -= layer_input_bytes(model, layer, samples, seq_split(stage))
    return max(nbytes, 0)


def keeps_input(model: ModelSpec, stage: StagePlan) -> bool:
    """Whether the stage holds its input from its forward to its backward: a received input always
    (:func:`swapped_bytes`); a first stage's batch tensors unless its first layer, which saves them,
    is swapped whole (they then leave with it; a per-tensor swap leaves them in place)."""
    item = stage.action_of(0) if stage.layer_start == 0 else None
    return not (item is not None and model.layers[0].saves_input and item.action in SWAP_ACTIONS
                and not is_partial(item))


def holds_input(stage: StagePlan, model: ModelSpec, layer: int) -> bool:
    """Whether the layer keeps its input between forward and backward: a kept (or per-tensor
    swapped) layer that saves it (``saves_input``), or a recomputed one (its checkpoint)."""
    item = stage.action_of(layer)
    return item.action is MemoryAction.recompute or (_kept(item) and model.layers[layer].saves_input)


def holds_output(stage: StagePlan, model: ModelSpec, layer: int) -> bool:
    """Whether a kept (or per-tensor swapped) layer keeps its own output (``saves_output``)."""
    return _kept(stage.action_of(layer)) and model.layers[layer].saves_output


def layer_own_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """What a layer keeps between forward and backward besides its input and output tensors (the
    boundaries, which :func:`stage_activation_bytes` counts once each): kept layers their saved
    bytes less those two, per-tensor swapped layers that less what their swap moves
    (:func:`swapped_bytes`), recomputed and wholly swapped layers nothing."""
    item = stage.action_of(layer)
    if not _kept(item):
        return 0
    own = _kept_own_bytes(model, stage, layer, samples)
    if item.action not in KEPT_ACTIONS:
        own -= swapped_bytes(model, stage, layer, samples)
    return own


def boundary_held_bytes(model: ModelSpec, stage: StagePlan, layer: int, samples: int) -> int:
    """Output of ``layer`` when the next layer is in the same stage: kept (once) when either side
    saves it, freed during the forward otherwise."""
    if holds_output(stage, model, layer) or holds_input(stage, model, layer + 1):
        return layer_output_bytes(model, layer, samples, seq_split(stage))
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
    return layer_output_bytes(model, stage.layer_stop - 1, samples_per_replica(plan, stage), seq_split(stage))


def stage_activation_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> int:
    """Activation bytes one microbatch of ``stage`` holds from its forward to its backward: every
    layer's own saved bytes, the tensors between its layers that a layer saves, and the stage's
    input and output, each once. The input is kept for the backward whether or not the first layer
    saves it (the received tensor is the leaf whose gradient is sent back; Megatron keeps
    ``input_tensors`` alike; a first stage's batch tensors leave with a swapped first layer:
    :func:`keeps_input`). The output is kept only where it is not released once sent
    (:func:`releases_output`): otherwise the backward starts from it, and it is also the send
    buffer, so a send costs no extra copy."""
    b = samples_per_replica(plan, stage)
    layers = stage.layers
    total = sum(layer_own_bytes(model, stage, l, b) for l in layers)
    total += sum(boundary_held_bytes(model, stage, l, b) for l in layers[:-1])
    split = seq_split(stage)
    output = 0 if releases_output(model, plan, stage) else layer_output_bytes(model, stage.layer_stop - 1, b, split)
    held_input = layer_input_bytes(model, stage.layer_start, b, split) if keeps_input(model, stage) else 0
    return total + held_input + output


def backward_workspace_bytes(model: ModelSpec, plan: Plan, stage: StagePlan,
                             retained: dict[int, int] | None = None,
                             kept: dict[int, int] | None = None) -> int:
    """Largest excess over the held microbatches during one backward of ``stage``, walking its
    layers last to first: a layer's backward scratch (``workspace_bytes_per_sample``: weight-
    gradient and intermediate gradients; for a head under tp > 1 at least its vocabulary-parallel
    loss's, :func:`vocab_parallel_loss_bytes`), the activations a recomputed layer re-materialises, and
    the gradient flowing in from the layer above (the top layer's is the receive buffer), less what
    the layers above have already freed. A ``selective`` layer re-makes its attention core's
    tensors (Korthikanti §5) for its backward; with sequence parallelism the recomputed and the
    flowing tensors are split as the stage holds them.

    ``retained`` (layer -> bytes): a zero-bubble B (simulator.stagecost.split_b_workspace_bytes),
    which frees nothing as it goes (its graph is retained for W) and keeps each layer's weight ops'
    output gradients: those of the layers above and of the layer itself are added instead of the
    freed activations being subtracted. ``kept`` (layer -> bytes): a weight-store B
    (``schedule.weight_store``, simulator.stagecost.stored_bytes), which frees each layer as this
    walk does but keeps its Linears' inputs and output gradients for W: the layers' above, less
    what they freed (measured on gpt/bert/llama tiny stages: within one output gradient of SwiGLU's
    low on LLaMA, where the up projection's dY is stored while gate's backward still runs)."""
    b, tp, split = samples_per_replica(plan, stage), stage.tp, seq_split(stage)
    best = freed = 0
    zero3 = zero3_backward_bytes(model, plan, stage)  # ZeRO-3's unsharded weights and buffers, per layer
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
        scratch = need
        action = stage.action_of(l).action
        if action is MemoryAction.recompute:
            need += (layer_saved_bytes(spec, b, tp, sp=stage.sequence_parallel)
                     - (layer_input_bytes(model, l, b, split) if spec.saves_input else 0))
        elif action is MemoryAction.selective:
            need += math.ceil(b * spec.selective_bytes_per_sample / tp)
        elif action is MemoryAction.op_sac:  # the re-run forward re-makes what the policy did not save
            need += op_sac_remade_bytes(spec, b, tp, stage.sequence_parallel)
        if n:
            need += layer_output_bytes(model, l, b, split)
        # cp > 1: the ring's K/V send-receive buffers live while the attention core runs, not beside
        # the layer's largest scratch (its weight gradients, the MLP's first in the backward): the
        # larger of the two (measured on local_cpu, recomputed gpt blocks at cp 2: the scratch's peak,
        # ring buffers freed; costs.context_parallel.ring_workspace_bytes)
        need += max(0, ring_workspace_bytes(spec, b, tp, stage.cp) - scratch)
        need += zero2_layer_grad_bytes(model, plan, stage, l) + zero3.get(l, 0)  # costs.sharded_dp
        # B: the layer's own gradients stored by its scratch's peak, except a recomputed layer's,
        # which peaks as its backward starts, on its re-made activations (measured: executor
        # SplitBackward, tests/unit/simulator/test_zero_bubble.py)
        stored = retained.get(l, 0) if retained is not None else 0
        own = 0 if action is MemoryAction.recompute else stored
        # a weight store: the layer's dY are its backward's own gradients, already in its scratch;
        # they and its X stay after it (measured: tests/unit/simulator/test_zero_bubble.py)
        if kept is not None:
            stored, own = kept.get(l, 0), 0
        best = max(best, need - freed + own)
        freed += layer_freed_bytes(model, stage, l, b) - stored if retained is None else -stored
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
        freed += layer_input_bytes(model, layer, samples, seq_split(stage))
    return freed


def backward_transient_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> tuple[int, int]:
    """(workspace, swap-in) bytes during one backward: :func:`backward_workspace_bytes` (scratch and
    recomputed activations) and the prefetched copies of swapped layers (two at a time,
    :func:`swapped_bytes` each)."""
    b = samples_per_replica(plan, stage)
    # double buffering (simulator/walk.py _layered_backward; executor/swap.py): the layer being
    # run and the next one coming in, so the two largest swapped layers bound the copies
    sizes = sorted((swapped_bytes(model, stage, l, b) for l in stage.layers
                    if stage.action_of(l).action in SWAP_ACTIONS), reverse=True)
    return backward_workspace_bytes(model, plan, stage), sum(sizes[:2])


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
    from specs.schedule import interleaved_runs, iter_compute_order  # specs.schedule imports specs.plan only

    if plan.schedule.kind in SPLIT_BACKWARD:  # zero-bubble: held until W (Qi et al. 2024)
        return split_peak(plan, position, act_bytes, transient_bytes, sent_bytes, grad_bytes)
    p, m, v = plan.pipeline_depth, plan.training.microbatches, plan.schedule.virtual_stages
    sch = plan.schedule
    if sch.kind is ScheduleKind.interleaved_1f1b:  # runs of the same chunks: O(v·m/N) however large N
        runs = interleaved_runs(p, m, v, position, sch.microbatch_group_size)
    else:
        runs = ((((kind, s),), 1) for kind, s, _ in iter_compute_order(sch.kind, p, m, v, position, sch.order))
    held: dict[int, int] = {s: 0 for s in range(position, len(plan.stages), p)}
    return _walk_runs(runs, held, act_bytes, transient_bytes, sent_bytes, grad_bytes)


def _walk_runs(runs, held: dict[int, int], act_bytes, transient_bytes, sent_bytes, grad_bytes
               ) -> tuple[int, dict[int, int], int]:
    """:func:`activation_peak`'s walk over ``runs`` = [(steps, count)]: ``steps`` (("F"|"B", stage),
    ...) repeated ``count`` times. A run of more than three repetitions walks its first two and its
    last and adds the middle ones' net effect (each repetition moves the held bytes by the same d,
    and its candidate peaks with them): past the first repetition (which may add a stage's
    sent-gradient buffer) every candidate is its predecessor's plus d, so if d <= 0 none in the
    middle exceeds its counterpart in the second repetition, which came first, and if d > 0 each is
    below its counterpart in the last; either way the first occurrence of the largest value, where
    the walk records the peak and its held counts, is in a repetition walked. The same integers as
    walking every pass (tests/unit/simulator/test_microbatch_group.py)."""
    state = {"now": 0, "best": 0, "grads": 0, "best_grads": 0, "best_held": dict(held)}
    graded: set[int] = set()

    def step(kind: str, s: int) -> None:
        a = act_bytes[s] if act_bytes is not None else 1
        if kind == "F":
            held[s] += 1
            state["now"] += a
            if sent_bytes is not None and state["now"] + state["grads"] + sent_bytes[s] > state["best"]:
                state.update(best=state["now"] + state["grads"] + sent_bytes[s], best_held=dict(held),
                             best_grads=state["grads"])
            return
        peak = state["now"] + state["grads"] + (transient_bytes[s] if transient_bytes is not None else 0)
        if peak > state["best"]:
            state.update(best=peak, best_held=dict(held), best_grads=state["grads"])
        held[s] -= 1
        state["now"] -= a
        if grad_bytes is not None and s not in graded:
            graded.add(s)
            state["grads"] += grad_bytes[s]

    for steps, count in runs:
        for _ in range(count if count <= 3 else 2):
            for kind, s in steps:
                step(kind, s)
        if count <= 3:
            continue
        skip = count - 3
        for kind, s in steps:  # the middle repetitions' net effect: no candidate there is the first maximum
            sign = 1 if kind == "F" else -1
            held[s] += sign * skip
            state["now"] += sign * skip * (act_bytes[s] if act_bytes is not None else 1)
        for kind, s in steps:
            step(kind, s)
    return state["best"], state["best_held"], state["best_grads"]


def in_flight_microbatches(plan: Plan, stage_index: int) -> int:
    """Microbatches of ``stage_index`` held at its position's peak (see :func:`activation_peak`):
    GPipe m, 1F1B min(p - i, m), interleaved exact per chunk (15, 8, 8 for p=8, v=3, i=0)."""
    return activation_peak(plan, plan.device_group_of(stage_index))[1][stage_index]


def split_peak(plan: Plan, position: int, act_bytes: dict[int, int] | None = None,
               transient_bytes: dict[int, int] | None = None, sent_bytes: dict[int, int] | None = None,
               grad_bytes: dict[int, int] | None = None, w_bytes: dict[int, tuple[int, int]] | None = None
               ) -> tuple[int, dict[int, int], int]:
    """costs.activations.activation_peak's walk for a zero-bubble order (B and W passes, Qi et al.
    2024 §2): a microbatch's activations are held from its forward's end to its W's end (B's
    retained graph keeps them for W's groups; simulator.stagecost.split_bytes), B peaks with the backward's
    transient on top, the stage's sent-gradient buffer counts from its first B's end on. The
    stages of a V (zbv, dualpipev) are those on ``position`` (Plan.device_group_of). ``w_bytes[s]``
    = (held, scratch): what B's end adds until W's end (the weight ops' stored output gradients,
    less a head's logits B frees), and W's own scratch (one weight's gradient, a recomputed layer
    re-made) (simulator.stagecost.split_bytes, measured on the executor), as the simulator books them."""
    from specs.schedule import plan_order

    held = {s: 0 for s in range(len(plan.stages)) if plan.device_group_of(s) == position}
    now = best = grads = best_grads = 0
    best_held = dict(held)
    graded: set[int] = set()
    for pass_, s, _ in plan_order(plan, position):
        a = act_bytes[s] if act_bytes is not None else 1
        if pass_ == "F":
            held[s] += 1
            now += a
            if sent_bytes is not None and now + grads + sent_bytes[s] > best:
                best, best_held, best_grads = now + grads + sent_bytes[s], dict(held), grads
            elif sent_bytes is None and now + grads > best:
                best, best_held, best_grads = now + grads, dict(held), grads
        elif pass_ == "B":
            peak = now + grads + (transient_bytes[s] if transient_bytes is not None else 0)
            if peak > best:
                best, best_held, best_grads = peak, dict(held), grads
            if grad_bytes is not None and s not in graded:
                graded.add(s)
                grads += grad_bytes[s]
            now += w_bytes[s][0] if w_bytes is not None else 0
        else:
            if w_bytes is not None and now + grads + w_bytes[s][1] > best:
                best, best_held, best_grads = now + grads + w_bytes[s][1], dict(held), grads
            held[s] -= 1
            now -= a + (w_bytes[s][0] if w_bytes is not None else 0)
    return best, best_held, best_grads
