"""ZeRO-2/3's transient bytes in a stage's backward, layer by layer (issue 27). They are added to
that layer's backward excess (costs.activations.backward_workspace_bytes), so they count on top
of the held activations where the backward runs, and not at a forward's end.

* ZeRO-2 (Rajbhandari et al. 2020 §5.2; executor.zero2): the layer's whole gradient, gathered until
  its reduce-scatter into the 1/d shard that is kept.
* ZeRO-3 / FSDP2 (§5.3; executor.fsdp, torch's ``fully_shard`` per layer): in the backward of unit
  u, (a) u's weights unsharded, (b) the next unit's all-gather output, prefetched (FSDP2's
  backward prefetch of one unit), (c) the flat reduce-scatter input of the unit before, which
  FSDP2 keeps until the next reduce-scatter is issued (``reduce_scatter_state``), and (d) the
  whole gradients a unit still open has accumulated from layers already run (a tied embedding
  and LM head on one stage are one unit: open from the head's backward to the embedding's, the
  head's gradient of the tied weight held by autograd until the embedding's adds to it).
  Traced on llama_tiny dp 4 (MEMWALL_MEMLOG): the peak, in the last block's backward, held block
  4's weights, block 3's prefetched gather and the head's reduce-scatter input, 435,456 B, as
  (a)+(b)+(c) give.
  With tp > 1 (torchtitan's 2-D [dp, tp] layout, executor.fsdp.stage_mesh) FSDP2 gathers over dp
  only, so every term is of the rank's TP shard of the unit (costs.params.layer_params_of_stage,
  1/t of the sharded part): gpt_tiny and llama_tiny dp 2 x tp 2 measured within 1.4 % of it.
"""
from __future__ import annotations

from costs.params import grad_reduce_ranks, layer_params_of_stage, layer_params_on_device, tied_copies
from specs.model import ModelSpec
from specs.plan import Plan, StagePlan


def zero2_layer_grad_bytes(model: ModelSpec, plan: Plan, stage: StagePlan, layer: int) -> int:
    """ZeRO-2's transient in ``layer``'s backward (0 otherwise, or with one dp x cp replica): the
    layer's whole gradient until its reduce-scatter. The 1/d piece the collective returns comes
    after the layer's scratch is freed, so it is not added to it."""
    if plan.zero_stage != 2 or grad_reduce_ranks(stage) == 1:
        return 0
    return layer_params_of_stage(model, plan, stage, layer) * plan.training.bytes_per_param()[1]


def fsdp_units(model: ModelSpec, plan: Plan, stage: StagePlan) -> list[tuple[int, ...]]:
    """The stage's FSDP units in backward order (executor.fsdp ``_units``: one per layer, a tied
    pair both of whose layers this stage holds merged into one), each as its layers."""
    merged = {copy: owner for owner, copy, shared in tied_copies(model, plan, stage)
              if shared and owner in stage.layers and copy in stage.layers}
    units: dict[int, list[int]] = {}
    for l in reversed(stage.layers):
        units.setdefault(merged.get(l, l), []).append(l)
    return [tuple(ls) for ls in units.values()]


def zero3_backward_bytes(model: ModelSpec, plan: Plan, stage: StagePlan) -> dict[int, int]:
    """Layer -> ZeRO-3's transient bytes in its backward (module docstring: (a)-(d)); empty without
    ZeRO-3 or with one dp x cp replica."""
    if plan.zero_stage < 3 or grad_reduce_ranks(stage) == 1:
        return {}
    w_b, g_b, _ = plan.training.bytes_per_param()
    params = {l: layer_params_of_stage(model, plan, stage, l) for l in stage.layers}
    units = fsdp_units(model, plan, stage)  # numbered in the order the backward opens them
    unit_of = {l: i for i, ls in enumerate(units) for l in ls}
    weights = [sum(params[l] for l in ls) * w_b for ls in units]
    out: dict[int, int] = {}
    grads = [0] * len(units)  # (d) whole gradients a unit's layers already run hold
    opened, closed, last_closed = -1, set(), None
    for l in reversed(stage.layers):
        u = unit_of[l]
        opened = max(opened, u)
        open_units = [v for v in range(opened + 1) if v not in closed]
        held = sum(weights[v] + grads[v] for v in open_units)  # (a), (d)
        prefetch = weights[opened + 1] if opened + 1 < len(units) else 0  # (b)
        retained = sum(params[x] for x in units[last_closed]) * g_b if last_closed is not None else 0  # (c)
        out[l] = held + prefetch + retained
        # (d): in the weights' dtype; a tied copy's whole gradient included (autograd holds it for the
        # owner's AccumulateGrad, at the owner's backward)
        grads[u] += layer_params_on_device(model.layers[l], stage.tp) * w_b
        if l == units[u][-1]:  # the unit's last layer: its reduce-scatter is issued
            closed.add(u)
            last_closed = u
    return out
