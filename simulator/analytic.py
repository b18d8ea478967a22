"""Analytic estimate: closed-form per-device peak memory and iteration time of a plan.

Cheap enough for planners to call inside a search (no simulation); the simulator refines it with
the schedule's real timing (swap overlap, link contention, per-step memory). Both use costs.
"""
from __future__ import annotations

import math

import costs.activations
import costs.buffers
import costs.collectives
import costs.layer_time
import costs.params
import costs.static
from costs.activations import split_peak
from costs.window import group_workspace_bytes, grouped_plan, plan_streams
from simulator.pipe_walk import grouped_interleaved_pipe_s, split_pipe_s
from simulator.sharded import sharded_stage
from simulator.stagecost import host_link, split_b_workspace_bytes, split_bytes, w_rerun_s, wgrad_s
from simulator.stash_peak import PeakParts, max_stashed_versions, pipedream_peak
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import SPLIT_BACKWARD, MemoryAction, Plan, ScheduleKind, stage_for_microbatch
from specs.result import DeviceResult, MemoryBreakdown, Result


def _add(a: MemoryBreakdown, **extra: int) -> MemoryBreakdown:
    return a.model_copy(update={k: getattr(a, k) + v for k, v in extra.items()})


def _sharded(plan: Plan, model: ModelSpec, hardware: HardwareSpec | None) -> dict[int, object]:
    """The MAP stages of ``plan`` priced by simulator.sharded (rotor's walk of their checkpoint
    tree, MAP §5.2), by stage index: their closed form is that walk, not costs' per-layer
    formulas (which know nothing of intra-op strategies). Needs the hardware (the mesh's links)."""
    if not any(stage.sharding for stage in plan.stages):
        return {}
    if hardware is None:
        raise ValueError(f"plan {plan.id} has MAP-sharded stages: their memory depends on the mesh, so pass the "
                         "hardware (device_memory(plan, model, hardware))")
    return {i: sharded_stage(plan, model, hardware, stage) for i, stage in enumerate(plan.stages) if stage.sharding}


def device_memory(plan: Plan, model: ModelSpec, hardware: HardwareSpec | None = None
                  ) -> dict[int, tuple[MemoryBreakdown, int]]:
    """Peak breakdown and host bytes for every device the plan uses. ``hardware`` is needed only
    for a plan with MAP-sharded stages (ValueError without it); their activations and workspace
    are rotor's walk (simulator.sharded.ShardedStage), their static bytes the stored shards.

    Peak = static + received-gradient buffers + stashed weights (PipeDream) + the larger of
    (a) the activation peak of the device's pipeline position — the microbatches held per stage at
    the moment the schedule holds the most bytes, plus that backward's workspace (scratch,
    recomputed activations; or the output of the last forward still being sent, when stage outputs
    are released once sent; costs.activations.activation_peak; with the input gradient each stage sends
    back once its first backward has ended) — and (b) the flat gradient copy of a data-parallel
    all-reduce (after the last backward, when activations are gone, the sent gradients not); plus the
    largest swap-in copy and bytes peers D2D-swapped here (held for the in-flight microbatches,
    striped by weight, MPress §IV-C). A PipeDream position whose stashed versions go to the host
    (``offload.stash_swap_layers``) or whose optimizer state is streamed through the device for
    each per-backward update walks its pass order with those moving bytes instead
    (simulator.stash_peak), its stash in (a) only. Weight-swapped layers (``offload.weight_swap_layers``,
    MPress §II-D) are not in the static bytes (costs.static.stage_static: host memory); during a
    backward up to three of their weights and one gradient are on the device, less what their
    backwards have released by then (costs.static.weight_swap_transient_bytes: their own activations,
    their weight-gradient scratch, which is the gradient), added to the backwards' moments of (a): the walk
    without the forwards' sent outputs, which the backwards then cover. Under PipeDream a stale
    version of them waits in host memory per stashed version. Stashed versions sent to peers
    (``offload.stash_targets``, MPress §III-C) are held there, each target its stripe of every
    stashed version, as bytes held for peers: the most simulator.stash holds (for a moment, as the
    newest lands and the oldest goes back), added to the target's own peak as an upper bound.
    """
    # STRONGHOLD §IV-A streams: S workers' activations (costs.window.grouped_plan) and each worker's
    # own backward transients (costs.window.group_workspace_bytes)
    group_work = ({i: group_workspace_bytes(model, plan, i) for i in range(len(plan.stages))}
                  if plan_streams(plan) > 1 else {})
    plan = grouped_plan(plan)
    out: dict[int, tuple[MemoryBreakdown, int]] = {d: (MemoryBreakdown(), 0) for d in plan.used_devices()}
    acts, work, swap_in, allreduce, sent, grads = {}, {}, {}, {}, {}, {}
    sharded = _sharded(plan, model, hardware)
    for i, stage in enumerate(plan.stages):
        grads[i] = costs.buffers.sent_grad_buffer_bytes(model, plan, stage)  # from the first backward's end on
        if i in sharded:
            sh = sharded[i]
            acts[i], work[i], sent[i], swap_in[i] = sh.act_bytes, sh.run.workspace_bytes, sh.sent_output_bytes, 0
            allreduce[i] = costs.buffers.tied_sync_buffer_bytes(model, plan, stage)
            continue
        # actions with a microbatch_period apply to some microbatches: the mean activation bytes
        # over one period (the simulator walks each microbatch's own), the worst transient
        variants = _variants(plan, stage)
        acts[i] = _mean_activation_bytes(model, plan, variants)
        sent[i] = max(costs.activations.sent_output_bytes(model, plan, v) for v in variants)
        work[i], swap_in[i] = (max(x) for x in zip(*(costs.activations.backward_transient_bytes(model, plan, v) for v in variants)))
        work[i] = group_work.get(i, work[i])
        if plan.schedule.kind in SPLIT_BACKWARD:  # a zero-bubble B frees nothing as it goes
            work[i] = split_b_workspace_bytes(model, plan, stage)
        allreduce[i] = costs.buffers.allreduce_buffer_bytes(model, plan, stage)
    # zero bubble: recomputed activations held from B to W, W's scratch (stagecost.StageCost)
    w_bytes = ({i: split_bytes(model, plan, st) for i, st in enumerate(plan.stages)}
               if plan.schedule.kind in SPLIT_BACKWARD else None)
    peaks = {pos: activation_peak(plan, pos, acts, work, sent, grads, w_bytes=w_bytes)
             for pos in range(plan.pipeline_depth)}
    # weight-swapped layers (MPress §II-D) put their fetched weights and a gradient on the device
    # during each backward (costs.static.weight_swap_transient_bytes): on top of the backwards'
    # moments only, the walk without the forwards' sent outputs (whose moments the backwards'
    # then cover: the same microbatches held, plus the workspace)
    transient = {pos: _ws_transient(model, plan, pos) for pos in range(plan.pipeline_depth)}
    unsent = {s: 0 for s in sent}
    at_backward = {pos: activation_peak(plan, pos, acts, work, unsent, grads)
                   for pos, t in transient.items() if t[0] or t[1]}
    walked: dict[int, PeakParts] = {}  # PipeDream positions whose memory moves each backward
    walked_bwd: dict[int, PeakParts] = {}  # the same without the sent outputs (weight swap)
    for i, stage in enumerate(plan.stages):
        static, host = (sharded[i].static, 0) if i in sharded else costs.static.stage_static(model, plan, stage)
        in_flight = peaks[plan.device_group_of(i)][1][i]
        versions = (max_stashed_versions(plan.pipeline_depth, plan.training.microbatches,
                                         plan.device_group_of(i))
                    if costs.activations.stashed_versions(plan, i) else 0)  # distinct, as executed
        stashed = versions * static.parameters_bytes
        if _walks_versions(plan, stage):
            swap = costs.static.stash_swap_bytes(model, plan, stage)
            opt = costs.static.OPTIMIZER_SWAP_RESIDENT_CHUNKS * max(
                costs.static.optimizer_swap_chunks(model, plan, stage), default=0)
            walked[i] = pipedream_peak(plan, i, acts[i], work[i], sent[i], grads[i],
                                       static.parameters_bytes - swap, swap, opt,
                                       allreduce[i] if costs.params.grad_reduce_ranks(stage) > 1 else 0)  # per-update all-reduce
            if any(transient[plan.device_group_of(i)][:2]):
                walked_bwd[i] = pipedream_peak(plan, i, acts[i], work[i], 0, grads[i],
                                               static.parameters_bytes - swap, swap, opt, 0)
            stashed = 0
            stripes = costs.static.stash_stripes(model, plan, stage)  # peers instead (MPress §III-C)
            if not stripes:
                host += versions * swap  # (on the host: at most one per stashed version)
            for target, part in stripes:  # held there from the copy out to the last copy back: every
                mem, h = out.setdefault(target, (MemoryBreakdown(), 0))  # stale version at once as the
                out[target] = (_add(mem, swapped_in_bytes=versions * part), h)  # newest lands (a bound)
        if versions and stage.offload.weight_swap_layers:  # a stale version of them waits on the host
            host += versions * costs.static.weight_swap_bytes(model, plan, stage)[0]
        # the sent one (grads[i]) is in the walk; ZeRO-3's unsharded layers in the backward's workspace
        buffers = costs.buffers.received_grad_buffer_bytes(model, plan, stage)
        for device in stage.devices:
            mem, h = out[device]
            mem = _add(mem, parameters_bytes=static.parameters_bytes, gradients_bytes=static.gradients_bytes,
                       optimizer_bytes=static.optimizer_bytes, buffers_bytes=buffers,
                       swapped_in_bytes=swap_in[i], stashed_weights_bytes=stashed)
            out[device] = (mem, h + host + _swapped_to_host(model, plan, stage, in_flight))
        for target, nbytes in _d2d_held(model, plan, stage, in_flight).items():
            mem, h = out.setdefault(target, (MemoryBreakdown(), 0))
            out[target] = (_add(mem, swapped_in_bytes=nbytes), h)
    for pos, (act_peak, _, grad_peak) in peaks.items():
        stages = _stages_on(plan, pos)
        flat = max(allreduce[s] for s in stages)
        sent_grads = sum(grads[s] for s in stages)  # made by the backwards, kept through the step
        for device in plan.stages[pos].devices:
            mem, h = out[device]
            # after the last backward (activations gone): the all-reduce's flat copy, or a
            # swapped-in optimizer state for the step (MPress optimizer swap)
            opt_in = max(costs.static.OPTIMIZER_SWAP_RESIDENT_CHUNKS * max(costs.static.optimizer_swap_chunks(
                model, plan, plan.stages[s]), default=0) for s in stages)
            if plan.schedule.kind is ScheduleKind.pipedream_async:
                opt_in = 0  # PipeDream updates after every backward, none after the last one's all-reduce
            tw, tg, tr = transient[pos]
            if pos in walked:  # simulator.stash_peak: the walk with the moving versions and updates
                w = walked[pos]
                extra = ({"activations_bytes": w.activations_bytes, "buffers_bytes": w.buffers_bytes,
                          "stashed_weights_bytes": w.stashed_weights_bytes, "optimizer_bytes": w.optimizer_bytes}
                         if w.total_bytes >= flat + sent_grads else {"buffers_bytes": flat + sent_grads})
                b = walked_bwd.get(pos)
                if b is not None and b.total_bytes + tw + tg - tr > sum(extra.values()):
                    extra = {"activations_bytes": b.activations_bytes - tr, "buffers_bytes": b.buffers_bytes,
                             "stashed_weights_bytes": b.stashed_weights_bytes, "optimizer_bytes": b.optimizer_bytes,
                             "parameters_bytes": tw, "gradients_bytes": tg}
            elif act_peak >= flat + opt_in + sent_grads:
                extra = {"activations_bytes": act_peak - grad_peak, "buffers_bytes": grad_peak}
            else:
                extra = {"buffers_bytes": flat + sent_grads, "optimizer_bytes": opt_in}
            if pos in at_backward and pos not in walked:
                bwd_peak, _, bwd_grads = at_backward[pos]
                if bwd_peak + tw + tg - tr > sum(extra.values()):
                    extra = {"activations_bytes": bwd_peak - bwd_grads - tr, "buffers_bytes": bwd_grads,
                             "parameters_bytes": tw, "gradients_bytes": tg}
            out[device] = (_add(mem, **extra), h)
    return out


def _stages_on(plan: Plan, position: int) -> list[int]:
    """The stages on pipeline ``position``: j mod p, or a V's s and 2p-1-s (Plan.device_group_of)."""
    return [s for s in range(len(plan.stages)) if plan.device_group_of(s) == position]


def _ws_transient(model: ModelSpec, plan: Plan, position: int) -> tuple[int, int, int]:
    """(weights, gradient, relief) of weight-swapped layers on position ``position``'s device at
    their worst moment of one backward of one of its stages (costs.static.
    weight_swap_transient_bytes: relief is the activations and workspace their backwards have
    released by then)."""
    best = (0, 0, 0)
    for s in _stages_on(plan, position):
        w, g, r = costs.static.weight_swap_transient_bytes(model, plan, plan.stages[s])
        if (w or g) and (best == (0, 0, 0) or w + g - r > best[0] + best[1] - best[2]):
            best = (w, g, r)
    return best


def _walks_versions(plan: Plan, stage) -> bool:
    """A PipeDream stage: its stashed versions come and go with the updates (their most need
    not meet its most activations when microbatches are few, simulator.stash_peak), and with
    stashed versions swapped to the host or optimizer state streamed in and out for each of its
    per-backward steps its device memory changes with every update."""
    return plan.schedule.kind is ScheduleKind.pipedream_async and not stage.sharding


def activation_peak(plan: Plan, position: int, act_bytes: dict[int, int] | None = None,
                    transient_bytes: dict[int, int] | None = None, sent_bytes: dict[int, int] | None = None,
                    grad_bytes: dict[int, int] | None = None, w_bytes: dict[int, tuple[int, int]] | None = None
                    ) -> tuple[int, dict[int, int], int]:
    """costs.activations.activation_peak, in time independent of the microbatch count m: the same
    integers, found by walking a shorter but equivalent pass order once m > 4p.

    * 1F1B and PipeDream: after the warm-up every (forward, backward) pair of the steady state
      starts from the same state (same microbatches held, the same sent gradients) from the second
      pair on, so it offers the same candidate peaks as the second pair, and the walk keeps the first
      strictly larger one; the cool-down starts from that state too. m' = 4p microbatches
      (>= warm-up + 2 pairs on every position) walk the same candidates minus repeats.
    * Interleaved 1F1B with microbatch groups of n (p unless ``schedule.microbatch_group_size``,
      Megatron-Core's; the last group of tail = 1..n): over the full groups the steady state is
      periodic over n·v pairs (each chunk runs n forwards and n backwards per period, and every chunk
      has had its first backward by the end of the first period, n >= p), so from the second period
      on every period repeats the second; m' = tail + 3n keeps m - m' a multiple of n (the same last
      group and cool-down) and at least two full periods (n = p, m % p == 0: m' = 4p).
    * GPipe holds all m: :func:`_gpipe_peak`, the walk's closed form.
    Exact either way: integers, the same comparisons in the same order; up to 4p microbatches the
    walk itself runs. tests/unit/simulator/test_scale.py checks both against the full walk."""
    p, m, kind = plan.pipeline_depth, plan.training.microbatches, plan.schedule.kind
    if kind in SPLIT_BACKWARD:
        return split_peak(plan, position, act_bytes, transient_bytes, sent_bytes, grad_bytes, w_bytes)
    short = 4 * p
    if kind is ScheduleKind.interleaved_1f1b:  # microbatch groups of n (p unless set), the last of tail
        n = plan.schedule.microbatch_group_size or p
        short = m - ((m - 1) // n) * n + 3 * n
    if m > short:
        if kind is ScheduleKind.gpipe:
            return _gpipe_peak(plan, position, act_bytes, transient_bytes, sent_bytes, grad_bytes)
        training = plan.training.model_copy(update={"num_microbatches": short, "microbatch_size": None})
        plan = plan.model_copy(update={"training": training})  # only its pass order is walked
    return costs.activations.activation_peak(plan, position, act_bytes, transient_bytes, sent_bytes, grad_bytes)



def _gpipe_peak(plan: Plan, position: int, act_bytes, transient_bytes, sent_bytes, grad_bytes
                ) -> tuple[int, dict[int, int], int]:
    """costs.activations.activation_peak's walk of GPipe's order (m forwards, then m backwards of
    stage ``position``) in closed form. Its candidates: forward k ends at (k+1)·a + sent; backward 0
    peaks at m·a + workspace; backward j >= 1 at (m-j)·a + the sent gradient + workspace. Each run is
    arithmetic in k (or j), so its first largest candidate is at one end of it; the walk's answer is
    the first strictly largest of those three, as its running maximum finds it."""
    p, m, s = plan.pipeline_depth, plan.training.microbatches, position
    held = {i: 0 for i in range(position, len(plan.stages), p)}
    a = act_bytes[s] if act_bytes is not None else 1
    t = transient_bytes[s] if transient_bytes is not None else 0
    g = grad_bytes[s] if grad_bytes is not None else 0
    candidates = []  # (bytes, microbatches held, sent-gradient bytes), in walk order
    if sent_bytes is not None:
        k = m - 1 if a > 0 else 0
        candidates.append(((k + 1) * a + sent_bytes[s], k + 1, 0))
    candidates.append((m * a + t, m, 0))
    if m > 1:
        j = 1 if a >= 0 else m - 1
        candidates.append(((m - j) * a + g + t, m - j, g))
    best, best_held, best_grads = 0, dict(held), 0
    for value, n, grads in candidates:
        if value > best:
            best, best_held, best_grads = value, {**held, s: n}, grads
    return best, best_held, best_grads


def _variants(plan: Plan, stage) -> list:
    """The stage as each microbatch of one period of its actions sees it (one when all apply)."""
    periods = [item.microbatch_period for item in stage.memory]
    span = min(math.lcm(*periods), plan.training.microbatches) if periods else 1
    return [stage_for_microbatch(stage, k) for k in range(span)]


def _swapping(in_flight: int, item) -> int:
    """Of ``in_flight`` consecutive microbatches, the most that ``item`` swaps."""
    return -(-in_flight // item.microbatch_period)


def _swapped_to_host(model: ModelSpec, plan: Plan, stage, in_flight: int) -> int:
    b = costs.params.samples_per_replica(plan, stage)
    return sum(_swapping(in_flight, item) * costs.activations.swapped_bytes(model, stage, item.layer, b)
               for item in stage.memory if item.action in (MemoryAction.cpu_swap, MemoryAction.nvme))


def d2d_held_by_device(plan: Plan, model: ModelSpec) -> dict[int, int]:
    """Bytes every D2D target holds for its peers at their peaks (each source stage's in-flight
    microbatches it swaps, striped by weight): the part of a target's closed-form peak that its
    own stage's actions cannot change (planners/mpress/assign.py)."""
    held: dict[int, int] = {}
    for s, stage in enumerate(plan.stages):
        in_flight = activation_peak(plan, plan.device_group_of(s))[1][s]  # costs.activations.in_flight_microbatches
        for device, nbytes in _d2d_held(model, plan, stage, in_flight).items():
            held[device] = held.get(device, 0) + nbytes
    return held


def _d2d_held(model: ModelSpec, plan: Plan, stage, in_flight: int) -> dict[int, int]:
    """Bytes each D2D target holds for one replica of ``stage`` (every replica swaps alike, so a
    target shared by k replicas of the stage would hold k shares; planners give each its own)."""
    held: dict[int, int] = {}
    b = costs.params.samples_per_replica(plan, stage)
    for item in stage.memory:
        if item.action is not MemoryAction.d2d_swap:
            continue
        nbytes = _swapping(in_flight, item) * costs.activations.swapped_bytes(model, stage, item.layer, b)
        total = sum(t.weight for t in item.targets)
        for t in item.targets:
            held[t.device] = held.get(t.device, 0) + round(nbytes * t.weight / total)
    return held


def iteration_time_s(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> float:
    """Pipeline time + gradient all-reduce + optimizer step.

    GPipe / 1F1B (flush): Σ_i (F_i + B_i + p2p) + (m − 1) · max_i (F_i + B_i) — the first microbatch
    crosses every stage, the rest queue behind the slowest; uniform stages give the bubble
    (p − 1)/(m + p − 1) (GPipe §2.2). With ``plan.p2p_blocking`` each stage's own sends are in its
    passes (costs.layer_time.blocking_send_s) and a transfer arrives as its pass ends; GPipe's two
    phases then queue behind their own slowest pass, (m − 1) · (max_i F_i + max_i B_i), which the
    simulator walks and this form (the planners' stage tables' too) approximates by max_i (F_i + B_i).
    Interleaved: (m + (p − 1)/v) · max_i work (Megatron §2.2).
    PipeDream async has no flush: m · max_i (work + update) per iteration in steady state, the
    update after every backward (PipeDream §3.3; with an optimizer swap at least the state's copy
    one way, :func:`_update_s`); its iteration ends with the all-reduce only.
    Stage times come from costs (shape-aware GEMMs, memory-bound ops, synchronous TP
    all-reduces), exactly what the simulator walks. The gradient all-reduce follows the flush,
    blocking, on an idle fabric (Megatron-LM as run for Narayanan et al. SC'21, and memwall's
    executor); the simulator additionally books it on the links, where it can contend with sends.
    """
    plan = grouped_plan(plan)  # STRONGHOLD §IV-A streams: m / S group passes of S·b samples
    p, m, v = plan.pipeline_depth, plan.training.microbatches, plan.schedule.virtual_stages
    work = [0.0] * p
    kind_split = plan.schedule.kind in SPLIT_BACKWARD
    passes: dict[int, tuple[float, float, float]] = {}  # zero bubble: (F, B, W) seconds per stage
    hops: dict[int, float] = {}  # one boundary transfer from stage s to s + 1
    p2p = [0.0] * p
    sharded = _sharded(plan, model, hardware)
    for i, stage in enumerate(plan.stages):
        fwd, bwd = _stage_pass_s(model, plan, hardware, stage, sharded.get(i))
        work[plan.device_group_of(i)] += fwd + bwd
        if kind_split:
            passes[i] = _split_pass_s(model, plan, hardware, stage, fwd, bwd)
            work[plan.device_group_of(i)] += w_rerun_s(model, plan, hardware, stage)  # W re-runs recomputed layers
        else:
            passes[i] = (fwd, bwd, 0.0)  # walked by grouped_interleaved_pipe_s
        if i + 1 < len(plan.stages):
            hops[i] = _hop_s(model, plan, hardware, i)
            p2p[plan.device_group_of(i)] += 2 * hops[i]
    kind = plan.schedule.kind
    stepped = kind is ScheduleKind.pipedream_async
    if stepped:  # an update after every backward (a STRONGHOLD window steps once, at the end)
        for i, stage in enumerate(plan.stages):
            if i not in sharded and stage.offload.window_layers is None:
                # a replicated stage all-reduces each microbatch's gradient first (walk.py _update)
                ar_s = costs.collectives.dp_allreduce_s(model, plan, hardware, stage)
                if ar_s:
                    ar_s += costs.collectives.embedding_group_allreduce_s(model, plan, hardware, stage)
                work[plan.device_group_of(i)] += ar_s + _update_s(model, plan, hardware, stage)
    slowest = max(work)
    if kind is ScheduleKind.pipedream_async:
        pipe = m * slowest
    elif kind is ScheduleKind.interleaved_1f1b and plan.schedule.microbatch_group_size not in (None, p):
        pipe = grouped_interleaved_pipe_s(plan, passes, hops, (m + (p - 1) / v) * slowest + sum(p2p))
    elif kind is ScheduleKind.interleaved_1f1b:
        pipe = (m + (p - 1) / v) * slowest + sum(p2p)
    elif kind_split:  # no closed form for unequal F, B, W: walk the orders (split_pipe_s)
        pipe = split_pipe_s(plan, passes, hops)
    else:
        pipe = sum(work) + sum(p2p) + (m - 1) * slowest
    per_device_sync: dict[int, float] = {}
    for i, stage in enumerate(plan.stages):
        # a MAP stage has no dp all-reduce of its own: its batch split's parameter-gradient
        # all-reduces run once per iteration, overlapped with the last backward (issue 26), and only
        # what outlasts it delays the step; it steps only the shards it stores
        sync = ((sharded[i].grad_sync_exposed_s, sharded[i].optimizer_s) if i in sharded else
                (_dp_sync_exposed_s(model, plan, hardware, stage), costs.layer_time.optimizer_step_s(model, plan, hardware, stage)))
        tied_s = costs.collectives.embedding_group_allreduce_s(model, plan, hardware, stage)
        if stepped and i not in sharded and stage.offload.window_layers is None:
            sync, tied_s = (), 0.0  # all-reduced and stepped in the pipeline, after each backward
        t = sum(sync) + tied_s
        for d in stage.devices:
            per_device_sync[d] = per_device_sync.get(d, 0.0) + t
    return pipe + max(per_device_sync.values())


def _stage_pass_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage, sharded=None) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on ``stage``, with what its passes wait for:
    the p2p all-gather (Narayanan §4.1), ZeRO-2/3 / FSDP collectives, blocking sends. A MAP stage
    (``sharded``, simulator.sharded): rotor's walk, its backward with the recomputed forwards."""
    fwd, bwd = ((sharded.run.fwd_s, sharded.run.bwd_s) if sharded is not None
                else costs.layer_time.stage_pass_times_s(model, plan, hardware, stage))
    gather_f, gather_b = costs.layer_time.p2p_gather_s(model, plan, hardware, stage)  # Narayanan §4.1
    z3_f, z3_b = costs.layer_time.sharded_dp_comm_s(model, plan, hardware, stage)  # ZeRO-2/3, FSDP
    send_f, send_b = costs.layer_time.blocking_send_s(model, plan, hardware, stage)  # plan.p2p_blocking
    return fwd + gather_f + z3_f + send_f, bwd + gather_b + z3_b + send_b


def _split_pass_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage, fwd: float, bwd: float
                  ) -> tuple[float, float, float]:
    """(F, B, W) seconds of a split backward (Qi et al. 2024 §2): W the weight gradients plus the
    re-run of recomputed layers (stagecost.w_rerun_s), B the rest of the backward."""
    w_s, rerun = wgrad_s(model, plan, hardware, stage), w_rerun_s(model, plan, hardware, stage)
    return fwd, max(bwd - w_s, 0.0), w_s + rerun


def _hop_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, i: int) -> float:
    """One boundary transfer from stage ``i`` to ``i + 1`` (s/t per rank under SP); 0 with
    ``plan.p2p_blocking``, whose transfer is in the sender's passes (blocking_send_s) and arrives as
    they end, and between chunks on one device."""
    stage, nxt = plan.stages[i], plan.stages[i + 1]
    nbytes = costs.buffers.boundary_send_bytes(model, plan, stage)[0]
    src, dst = stage.devices[0], nxt.devices[0]
    return (costs.collectives.transfer_s(nbytes, hardware.link(src, dst))
            if src != dst and not plan.p2p_blocking else 0.0)


def split_pass_costs(plan: Plan, model: ModelSpec, hardware: HardwareSpec
                     ) -> tuple[dict[int, tuple[float, float, float]], dict[int, float]]:
    """A split-backward plan's (F, B, W) seconds per stage and one boundary hop per stage, as
    :func:`iteration_time_s` walks them (:func:`split_pipe_s`): what the zero-bubble schedule search
    (planners.zero_bubble, Qi et al. 2024 §3.1: T_F, T_B, T_W, T_comm) is given. Needs no pass order."""
    sharded = _sharded(plan, model, hardware)
    passes = {i: _split_pass_s(model, plan, hardware, st, *_stage_pass_s(model, plan, hardware, st, sharded.get(i)))
              for i, st in enumerate(plan.stages)}
    return passes, {i: _hop_s(model, plan, hardware, i) for i in range(len(plan.stages) - 1)}


def split_pass_bytes(plan: Plan, model: ModelSpec) -> dict[int, tuple[int, int]]:
    """Per stage (a microbatch's activations held from its F, what its B's end adds until its W's
    end): the memory deltas of F, B and W (W frees both) that the zero-bubble search's memory limit
    counts (Qi et al. 2024 §3: M_B, M_W), as :func:`device_memory`'s walk (costs.activations.split_peak)
    books them."""
    return {i: (_mean_activation_bytes(model, plan, _variants(plan, stage)), split_bytes(model, plan, stage)[0])
            for i, stage in enumerate(plan.stages)}


def _mean_activation_bytes(model: ModelSpec, plan: Plan, variants: list) -> int:
    """A stage's activation bytes per microbatch, the mean (rounded up) over one period of its
    actions (:func:`_variants`: actions with a microbatch_period apply to some microbatches)."""
    return -(-sum(costs.activations.stage_activation_bytes(model, plan, v) for v in variants) // len(variants))


def _dp_sync_exposed_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage) -> float:
    """Seconds of a flushing schedule's dp sync not hidden by compute, as the simulator walks it
    (simulator/optimizer.py): the gradient reduction (overlap_grad_reduce: what outlasts the last
    backward, costs.collectives.grad_reduce_exposed_s) plus ZeRO-1's parameter all-gather
    (overlap_param_gather: what the next first forward does not hide, param_gather_exposed_s)."""
    red, gat = costs.collectives.dp_reduce_gather_s(model, plan, hardware, stage)
    times = ([costs.layer_time.layer_pass_times_s(model, plan, hardware, stage, l) for l in stage.layers]
             if plan.overlap_grad_reduce or plan.overlap_param_gather else [])
    slow = hardware.device.overlap_compute_slowdown
    if red and plan.overlap_grad_reduce:
        red = costs.collectives.grad_reduce_exposed_s(
            costs.collectives.dp_allreduce_buckets_s(model, plan, hardware, stage), [b + rc for _, b, rc in times], slow)
    if gat and plan.overlap_param_gather:
        gat = costs.collectives.param_gather_exposed_s(
            costs.collectives.dp_param_gather_buckets_s(model, plan, hardware, stage), [f for f, _, _ in times], slow)
    return red + gat


def _update_s(model: ModelSpec, plan: Plan, hardware: HardwareSpec, stage) -> float:
    """One optimizer update of ``stage``; with MPress's optimizer swap the state streams in while
    it steps and out behind it (simulator/optimizer.py), so at least its copy one way plus the last
    chunk's way back."""
    step_s = costs.layer_time.optimizer_step_s(model, plan, hardware, stage)
    chunks = costs.static.optimizer_swap_chunks(model, plan, stage)
    if not chunks:
        return step_s
    link = host_link(hardware)
    return max(step_s, sum(costs.collectives.transfer_s(c, link) for c in chunks)) + costs.collectives.transfer_s(chunks[-1], link)


def estimate(plan: Plan, model: ModelSpec, hardware: HardwareSpec) -> Result:
    """The plan's closed-form Result (source ``predicted-by-analytic``)."""
    capacity = hardware.device.memory_bytes
    devices = []
    for device, (mem, host) in sorted(device_memory(plan, model, hardware).items()):
        stages = plan.stages_on(device)
        peak = mem.total_bytes
        devices.append(DeviceResult(
            device=device, stages=stages,
            layers=[(plan.stages[s].layer_start, plan.stages[s].layer_stop) for s in stages],
            capacity_bytes=capacity, peak_bytes=peak, breakdown=mem, host_bytes=host,
            oom=peak > capacity, oom_over_bytes=max(0, peak - capacity),
        ))
    # a node's devices share its DRAM: flag every device of a node whose host bytes, summed, exceed
    # it (as simulator.report's _host_over does for the simulator; NVMe is not priced here)
    ram: dict[int, int] = {}
    for d in devices:
        ram[hardware.node_of(d.device)] = ram.get(hardware.node_of(d.device), 0) + d.host_bytes
    over = {n for n, b in ram.items() if b > hardware.host.memory_bytes}
    if over:
        devices = [d.model_copy(update={"host_oom": True}) if hardware.node_of(d.device) in over else d
                   for d in devices]
    t = iteration_time_s(plan, model, hardware)
    if not (math.isfinite(t) and t > 0):
        # bounded specs (finite rates >= 1e-6, counts <= 2**40) keep t finite and positive; a
        # model with no FLOPs and nothing to move would give 0 -- say so rather than divide by it
        raise ValueError(f"analytic estimate: iteration time {t!r} s for plan {plan.id} of {model.name} on "
                         f"{hardware.name} is not a positive finite number (a model without FLOPs?)")
    flops = costs.layer_time.model_flops_per_iteration(model, plan)
    return Result(
        source="predicted-by-analytic", plan_id=plan.id, model=plan.model, hardware=plan.hardware,
        devices=devices, iteration_time_s=t, samples_per_s=plan.training.global_batch / t,
        tflops_per_device=flops / t / len(plan.used_devices()) / 1e12,
    )
