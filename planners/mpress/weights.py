"""GPU-CPU swap of live model data (MPress §II-D: "GPU-CPU swap ... is a general solution
applicable to all model data"), the planner's last resort before a stage is declared not to fit:
``offload.weight_swap_layers`` (the contract: specs.plan_memory.OffloadPolicy; simulated by
simulator/weightswap.py).

Rule (§III-D: GPU-CPU swap goes to the longest-lived data first; footnote 2: a swap costs the part
of its transfer its live interval does not hide). Activations live from a layer's forward to its
backward, a stashed version from its update to its backward (planners/mpress/stash.py), both
chosen before. A live weight is needed by every pass and lives one pass of the stage between two
uses, a gradient from its backward to the update, the optimizer state from update to update: the
longest-lived of all, but its swap moves the weights twice per microbatch. So it comes after the
activation choices (planners/mpress/choice.py) and the stashed versions: for a stage the repaired
assignment still leaves over capacity (its closed form, simulator.analytic, plus the margin the
emulator learnt), layers are added in order of least exposed cost per byte freed until the closed
form says the stage fits, or no layer is left, or one more no longer lowers the peak.

Exposed cost of a layer per iteration (seconds), from the stage's layer times (costs.layer_time)
and the host link its switch's GPUs share (one way, costs.collectives.transfer_s):

* each of its 2m fetches (a forward and a backward per microbatch) hides in the compute of the
  pass's preceding layer (the copy is issued when it starts); the pass's first layer hides in
  nothing;
* its gradient copy hides in the backward of the layer below (the other direction of the link):
  what it exceeds that by;
* the CPU step (costs.window.cpu_step_s): under PipeDream after every backward, and the layer's
  next forward waits for it: m steps; otherwise once, after the last backward, overlapped with the
  rest of it: counted whole (an upper bound).

Freed bytes: its weights, gradient and optimizer state on the device (costs.static.weight_swap_layer_bytes;
the optimizer state not again where an optimizer swap already moved it). Only stages the field
allows (dp = 1, no ZeRO, no window or ZeRO-Offload) and layers without a tied weight (the other
side would need it on the device) are considered.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import costs.collectives
import costs.layer_time
import costs.static
from costs.window import cpu_step_s
from planners.mpress.assign import Assignment, analytic_over, size_text
from planners.mpress.emulate import Emulator, fits as _fits
from planners.mpress.facts import CPU
from planners.mpress.repair import repair
from simulator.stagecost import host_link
from specs.hardware import HardwareSpec
from specs.plan import Plan, ScheduleKind


@dataclass(frozen=True)
class WeightSwapChoice:
    stage: int
    layer: int
    freed_bytes: int      # off the device: weights + gradient + optimizer state
    exposed_s: float      # per iteration, priced as the module docstring says
    why: str


def allowed_stage(plan: Plan, s: int) -> bool:
    """Whether stage ``s`` may list weight-swapped layers (specs/plan.py validation)."""
    stage = plan.stages[s]
    return (stage.dp == 1 and not plan.zero_stage and stage.offload.window_layers is None
            and not stage.offload.optimizer_on_cpu and not stage.sharding)


def _tied(plan: Plan, layer: int, model) -> bool:
    owners = {model.tied_owner(c) for c in model.tied_layers}
    return layer in set(model.tied_layers) | owners


def exposed_s(st: Assignment, hardware: HardwareSpec, s: int, layer: int) -> float:
    """The layer's exposed cost per iteration (module docstring)."""
    plan, model = st.plan, st.model
    stage = plan.stages[s]
    m = plan.training.microbatches
    w, g, _ = costs.static.weight_swap_layer_bytes(model, plan, stage, layer)
    link = host_link(hardware)
    fetch, grad = costs.collectives.transfer_s(w, link), costs.collectives.transfer_s(g, link)
    times = {l: costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l)[:2] for l in stage.layers}
    before_f = times[layer - 1][0] if layer - 1 in times else 0.0  # forward: the layer below runs first
    before_b = times[layer + 1][1] if layer + 1 in times else 0.0  # backward: the layer above
    below_b = times[layer - 1][1] if layer - 1 in times else 0.0
    params = costs.static.layer_params_of_stage(model, plan, stage, layer)
    step = cpu_step_s(plan, hardware, stage, params)
    pipedream = plan.schedule.kind is ScheduleKind.pipedream_async
    return m * (max(fetch - before_f, 0.0) + max(fetch - before_b, 0.0) + max(grad - below_b, 0.0)) \
        + (m if pipedream else 1) * step


def freed_bytes(st: Assignment, s: int, layer: int) -> int:
    stage = st.plan.stages[s]
    w, g, o = costs.static.weight_swap_layer_bytes(st.model, st.plan, stage, layer)
    return w + g + (0 if stage.offload.optimizer_swap or s in st.opt_swap else o)


def with_weight_swap(plan: Plan, s: int, layers: list[int]) -> Plan:
    """``plan`` with ``layers`` added to stage ``s``'s weight swap (and out of its stashed-version
    swap: a weight-swapped layer's versions are on the host already)."""
    stage = plan.stages[s]
    ws = sorted(set(stage.offload.weight_swap_layers) | set(layers))
    offload = stage.offload.model_copy(update={
        "weight_swap_layers": ws, "stash_swap_layers": [l for l in stage.offload.stash_swap_layers if l not in ws]})
    stages = list(plan.stages)
    stages[s] = stage.model_copy(update={"offload": offload})
    return plan.model_copy(update={"stages": stages})


def add_weight_swap(st: Assignment, hardware: HardwareSpec) -> list[WeightSwapChoice]:
    """Give every stage the closed form still finds over capacity weight-swapped layers, least
    exposed cost per freed byte first, until it fits; ``st.plan`` (the base the assignment's plan
    is made from) carries them. Returns the choices, in the order made."""
    chosen: list[WeightSwapChoice] = []
    over = analytic_over(st.plan_now(), st.model, st.capacity, st.margin)
    for s in sorted(s for s, o in over.items() if o > 0):
        if not allowed_stage(st.plan, s):
            continue
        stage = st.plan.stages[s]
        taken = set(stage.offload.weight_swap_layers)
        ranked = sorted((exposed_s(st, hardware, s, l) / max(freed_bytes(st, s, l), 1), l)
                        for l in stage.layers if l not in taken and not _tied(st.plan, l, st.model)
                        and freed_bytes(st, s, l) > 0)
        left = over[s]
        for _, l in ranked:
            if left <= 0:
                break
            trial = with_weight_swap(st.plan, s, [l])
            previous, st.plan = st.plan, trial
            now = analytic_over(st.plan_now(), st.model, st.capacity, st.margin)[s]
            if now >= left:  # the fetched weights cost more than it frees (a layer too small)
                st.plan = previous
                break
            freed, cost = freed_bytes(st, s, l), exposed_s(st, hardware, s, l)
            why = (f"weight swap: stage {s} still over by {size_text(left)} with its activations compacted; "
                   f"weights, gradient and optimizer state of layer {l} ({size_text(freed)}) to host memory, "
                   f"fetched for every pass (MPress §II-D), {cost * 1e3:.2f} ms exposed per iteration, the "
                   f"least per byte of the stage's layers left")
            chosen.append(WeightSwapChoice(s, l, freed, cost, why))
            left = now
    return chosen


def swap_until_fits(em: Emulator, st: Assignment, hardware: HardwareSpec, allowed: list, sim):
    """The planner's last step (policy=mpress's step 6, policy=auto's compaction): while the
    repaired assignment ``sim`` does not fit, cpu_swap is allowed and simulations are left, add
    weight swaps (:func:`add_weight_swap`) and repair again. Returns (the last simulation, the
    choices made, in order)."""
    weights: list[WeightSwapChoice] = []
    while not _fits(sim) and CPU in allowed and em.left:
        more = add_weight_swap(st, hardware)
        if not more:
            break
        weights += more
        em.log.append(weight_swap_line(em.sims, more))
        sim = repair(em, st, allowed)
    return sim, weights


def weight_swap_line(em_sims: int, chosen: list[WeightSwapChoice]) -> str:
    """The emulator log's line for the weight swaps added (the CLI's log style)."""
    per: dict[int, list[int]] = {}
    for c in chosen:
        per.setdefault(c.stage, []).append(c.layer)
    parts = [f"stage {s} L{','.join(map(str, ls))} "
             f"({size_text(sum(c.freed_bytes for c in chosen if c.stage == s))} off the device, "
             f"{sum(c.exposed_s for c in chosen if c.stage == s) * 1e3:.1f} ms exposed)"
             for s, ls in sorted(per.items())]
    return (f"emulator {em_sims}: still over with activations compacted: live weights, gradients and optimizer "
            f"state to host memory (MPress §II-D weight swap): " + "; ".join(parts))


__all__ = ["WeightSwapChoice", "add_weight_swap", "allowed_stage", "exposed_s", "weight_swap_line", "with_weight_swap"]
