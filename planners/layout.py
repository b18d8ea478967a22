"""Shared plan-building steps: device groups, layer splits, memory actions."""
from __future__ import annotations

from specs.hardware import HardwareSpec
from specs.model import LayerKind, ModelSpec
from specs.plan import LayerMemory, MemoryAction, Plan, ScheduleSpec, StagePlan, position_of_stage
from specs.training import TrainingSpec

#: layers that full recompute checkpoints (Megatron recomputes whole transformer layers)
RECOMPUTED_KINDS = frozenset({LayerKind.transformer_block, LayerKind.moe_block, LayerKind.residual_block,
                              LayerKind.generic})
#: layers with an attention core that selective recompute (Korthikanti §5) re-runs
SELECTIVE_KINDS = frozenset({LayerKind.transformer_block, LayerKind.moe_block})


class PlanningError(ValueError):
    """The planner cannot make a valid plan for these inputs; the message says which knob to turn."""


def device_groups(hardware: HardwareSpec, pp: int, dp: int, tp: int, cp: int = 1) -> list[list[int]]:
    """Consecutive blocks of dp·cp·tp devices, tensor-parallel ranks adjacent (then context-parallel)
    so TP groups stay on one node's fast links when tp divides the node (Megatron's rank ordering
    tp < cp < dp < pp)."""
    per_stage = dp * cp * tp
    if pp * per_stage != hardware.num_devices:
        cps = f" x policy.cp ({cp})" if cp > 1 else ""
        raise PlanningError(
            f"policy.pp ({pp}) x policy.dp ({dp}){cps} x policy.tp ({tp}) = {pp * per_stage} must equal "
            f"the {hardware.num_devices} devices of hardware {hardware.name!r}"
        )
    return [list(range(s * per_stage, (s + 1) * per_stage)) for s in range(pp)]


def resolve_degrees(pp: int | None, dp: int, tp: int, hardware: HardwareSpec, model: ModelSpec,
                    training: TrainingSpec, virtual: int = 1) -> tuple[int, int]:
    """(pp, dp): pp as given, or — when null — the deepest pipeline the layers allow on all devices,
    with the devices left over going to data parallelism (so a 6-layer model on 8 GPUs gets
    pp 4 x dp 2 rather than an error). The added dp must still split the microbatch."""
    if pp is not None:
        return pp, dp
    if hardware.num_devices % (dp * tp):
        raise PlanningError(
            f"policy.dp ({dp}) x policy.tp ({tp}) must divide the {hardware.num_devices} devices of "
            f"hardware {hardware.name!r}"
        )
    groups = hardware.num_devices // (dp * tp)
    per_mb = training.samples_per_microbatch
    for depth in range(min(groups, model.num_layers // virtual), 0, -1):
        if groups % depth == 0 and per_mb % (dp * groups // depth) == 0:
            return depth, dp * (groups // depth)
    raise PlanningError(
        f"hardware {hardware.name!r} has {hardware.num_devices} devices, but model {model.name!r} has "
        f"{model.num_layers} layers and a microbatch of {per_mb} samples: no pipeline depth fills every "
        "device with data parallelism that splits the microbatch; raise training.microbatch_size or "
        "set policy.pp / policy.dp / policy.tp"
    )


def even_split(num_layers: int, parts: int) -> list[int]:
    """Layer counts as equal as possible; the extra layers go to the middle stages, which under
    1F1B hold fewer in-flight microbatches than the first ones."""
    base, extra = divmod(num_layers, parts)
    counts = [base] * parts
    start = (parts - extra) // 2
    for i in range(start, start + extra):
        counts[i] += 1
    return counts


#: the repeated body of a model, spread evenly over pipeline chunks by :func:`megatron_split`
BODY_KINDS = RECOMPUTED_KINDS


def megatron_split(model: ModelSpec, parts: int) -> list[int]:
    """Layer counts per pipeline chunk in Megatron-LM's layout: the body layers (transformer,
    MoE, residual blocks, a user's generic layers) evenly over the ``parts`` chunks, the leading
    non-body layers (the embedding) added to the first chunk and the trailing ones (the head) to
    the last. Megatron requires the blocks to divide by pp (by v·p when interleaved: chunk j of v·p
    holds L/(v·p) blocks, the embedding in chunk 0, the head in the last; Narayanan et al. 2021
    §2.2), so a 128-block model on pp=64 gets 2 blocks on every stage, the embedding beside the
    first two.

    Where the blocks do not divide evenly we still plan (Megatron would refuse): the extra blocks
    go to the middle chunks (:func:`even_split`), which under 1F1B hold fewer in-flight
    microbatches than the first ones and, unlike the last, carry no head. A model with fewer body
    layers than chunks falls back to :func:`even_split` over all layers (every chunk non-empty)."""
    kinds = [layer.kind in BODY_KINDS for layer in model.layers]
    if True not in kinds:
        return even_split(model.num_layers, parts)
    lead = kinds.index(True)
    trail = kinds[::-1].index(True)
    body = model.num_layers - lead - trail  # non-body layers between blocks count as body
    if body < parts:
        return even_split(model.num_layers, parts)
    counts = even_split(body, parts)
    counts[0] += lead
    counts[-1] += trail
    return counts


def check_chunks(model: ModelSpec, chunks: int, what: str) -> None:
    if chunks > model.num_layers:
        raise PlanningError(
            f"{what} = {chunks} pipeline chunks but model {model.name!r} has only {model.num_layers} "
            "layers; lower policy.pp (or schedule.virtual_stages), or raise policy.dp / policy.tp"
        )


def recompute_actions(model: ModelSpec, start: int, stop: int, recompute: str,
                      num_layers: int | None = None, every: int | None = None) -> list[LayerMemory]:
    """none: []; full: every block recomputed, or with ``num_layers`` only the stage's first that
    many (Megatron's --recompute-method block: the first N layers of each model chunk), or with
    ``every`` = k only the model's k-th, 2k-th, ... block (torchtitan's layer-level selective AC,
    ``selective_ac_option = k``: its wrapper counts the transformer blocks from 1 and checkpoints
    those whose count k divides); selective: every block with an attention core recomputes that
    core only (Korthikanti §5); op_sac: every layer with op-level checkpointing costs
    (``LayerSpec.has_op_sac``) runs under torchtitan's policy."""
    if recompute == "none":
        return []
    if recompute == "selective":
        return [LayerMemory(layer=i, action=MemoryAction.selective)
                for i in range(start, stop) if model.layers[i].kind in SELECTIVE_KINDS]
    if recompute == "op_sac":  # torchtitan's op-level selective AC, on the layers that price it
        return [LayerMemory(layer=i, action=MemoryAction.op_sac) for i in range(start, stop)
                if model.layers[i].has_op_sac]
    if every is not None:
        blocks = [i for i in range(model.num_layers) if model.layers[i].kind in RECOMPUTED_KINDS]
        return [LayerMemory(layer=i, action=MemoryAction.recompute)
                for n, i in enumerate(blocks, start=1) if n % every == 0 and start <= i < stop]
    blocks = [i for i in range(start, stop) if model.layers[i].kind in RECOMPUTED_KINDS]
    return [LayerMemory(layer=i, action=MemoryAction.recompute) for i in blocks[:num_layers]]


def assemble(
    planner: str,
    model: ModelSpec,
    hardware: HardwareSpec,
    training: TrainingSpec,
    schedule: ScheduleSpec,
    counts: list[int],
    groups: list[list[int]],
    dp: int,
    tp: int,
    recompute: str,
    zero_stage: int,
    *,
    cp: int = 1,
    sequence_parallel: bool = False,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    p2p_scatter_gather: bool = False,
    p2p_blocking: bool = False,
    recompute_num_layers: int | None = None,
    recompute_every: int | None = None,
) -> Plan:
    """Stages from per-chunk layer counts; chunk j goes to device group j mod p (interleaving), or
    the V of zbv / dualpipev (specs.plan.position_of_stage)."""
    if sum(counts) != model.num_layers or min(counts) < 1:
        raise PlanningError(
            f"layers per stage {counts} must be positive and sum to the model's {model.num_layers} layers"
        )
    per_mb = training.samples_per_microbatch
    if per_mb % dp:
        raise PlanningError(
            f"training: the microbatch of {per_mb} samples cannot be split over policy.dp={dp} replicas; "
            "choose training.microbatch_size divisible by dp (it is the pipeline microbatch over all dp "
            f"replicas: Megatron's --micro-batch-size {max(per_mb // dp, 1)} at dp {dp} is "
            f"training.microbatch_size={max(per_mb // dp, 1) * dp})"
        )
    stages, start = [], 0
    for j, count in enumerate(counts):
        stop = start + count
        stages.append(StagePlan(
            layer_start=start, layer_stop=stop, devices=groups[position_of_stage(schedule.kind, len(groups), j)],
            dp=dp, tp=tp, cp=cp, sequence_parallel=sequence_parallel and tp > 1,
            memory=recompute_actions(model, start, stop, recompute, recompute_num_layers, recompute_every),
        ))
        start = stop
    return Plan(
        planner=planner, model=model.name, hardware=hardware.name, num_devices=hardware.num_devices,
        training=training, schedule=schedule, zero_stage=zero_stage, stages=stages,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        p2p_scatter_gather=p2p_scatter_gather, p2p_blocking=p2p_blocking,
    )
