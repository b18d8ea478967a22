"""Public entry points: ``run_plan`` (raw per-rank reports) and ``execute`` (a measured Result)."""
from __future__ import annotations

import statistics

import torch

from executor import timeline
from executor.launch import RunOutput, launch
from executor.memtrack import CATEGORY_FIELDS
from costs.layer_time import model_flops_per_iteration
from costs.families import build_model, parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import MemoryAction, Plan
from specs.result import DeviceResult, MemoryBreakdown, Result


class UnsupportedPlan(ValueError):
    """The plan asks for something the executor cannot run yet; the message names the field."""


def unsupported(plan: Plan, model_cfg=None) -> list[str]:
    """Plan features the executor would silently drop, as 'field: why' (empty: runnable).
    Swaps run (executor.swap: cpu_swap, nvme as cpu_swap, d2d_swap striped to peer ranks by
    executor.d2d), but a d2d target must be a device that runs a stage: the executor starts one
    rank per stage device, and a device holding only stripes would need a rank of its own.
    STRONGHOLD windows run (executor.window), dp replicas and tp shards included (issue 25);
    ``model_cfg`` (optional) also checks that a tied embedding/head is resident."""
    out = []
    used = set(plan.used_devices())
    for i, st in enumerate(plan.stages):
        for j, item in enumerate(st.memory):
            for t, target in enumerate(item.targets):
                if target.device not in used:
                    out.append(f"stages[{i}].memory[{j}].targets[{t}].device: device {target.device} runs no stage "
                               f"(d2d targets must be among the plan's stage devices {sorted(used)})")
    from executor.context_parallel import unsupported as cp_unsupported  # cp > 1: ring attention

    out += cp_unsupported(plan, _config(model_cfg) if model_cfg is not None else None)
    from executor.fsdp import unsupported as zero3_unsupported  # ZeRO-3: FSDP2
    from executor.zero1 import unsupported as zero1_unsupported  # ZeRO-1 and the overlapped dp sync
    from executor.zero2 import unsupported as zero2_unsupported

    zcfg = _config(model_cfg) if model_cfg is not None else None
    out += zero1_unsupported(plan, zcfg) + zero2_unsupported(plan, zcfg) + zero3_unsupported(plan, zcfg)
    from executor.megatron_tp import unsupported as sp_unsupported  # sequence parallelism
    from executor.selective import unsupported as selective_unsupported

    out += sp_unsupported(plan, _config(model_cfg) if model_cfg is not None else None) + selective_unsupported(plan)
    cfg = _config(model_cfg) if model_cfg is not None else None
    if plan.p2p_scatter_gather and getattr(cfg, "family", None) == "torch_module":
        out.append("p2p_scatter_gather: a user model's boundaries are pytrees, sent one leaf at a time and whole; "
                   "scattering them over the tp ranks (Narayanan et al. §4.1) is not implemented: set it false")
    if plan.schedule.kind.value == "pipedream_async":
        out += _pipedream_unsupported(plan, model_cfg)
    from executor.split_backward import unsupported as split_unsupported  # zero-bubble B/W passes

    out += split_unsupported(plan, _config(model_cfg) if model_cfg is not None else None)
    for i, st in enumerate(plan.stages):
        out += _offload_unsupported(plan, i, model_cfg)
        out += _weight_swap_unsupported(plan, i, model_cfg)
        if st.sharding:
            out += _map_unsupported(plan, i, model_cfg)
    return out


def _map_unsupported(plan: Plan, i: int, model_cfg) -> list[str]:
    """What executor.map_exec cannot run of a MAP stage: memory actions (swaps: it recomputes by
    checkpoint segments only), offload, and layers of several mesh shapes (one DeviceMesh per stage).
    Any model family runs (issue 26): an operator DTensor cannot run as planned runs replicated
    (executor.map_exec), and BatchNorm's running statistics are written back."""
    st, out = plan.stages[i], []
    where = f"stages[{i}]"
    if st.memory:
        out.append(f"{where}.memory: {sorted({m.action.value for m in st.memory})} on a MAP-sharded stage (the MAP "
                   "executor recomputes by checkpoint segments only; swaps are not implemented)")
    if st.offload.window_layers is not None or st.offload.optimizer_on_cpu or st.offload.optimizer_swap:
        out.append(f"{where}.offload: offloading a MAP-sharded stage is not implemented")
    shapes = sorted({tuple(s.mesh) for s in st.sharding})
    if len(shapes) > 1:
        out.append(f"{where}.sharding: layers use meshes {shapes}; the MAP executor runs one mesh per stage")
    cfg = _config(model_cfg) if model_cfg is not None else None
    if cfg is not None and cfg.family == "torch_module":  # a tie over stages sums DTensor grads over meshes
        from executor import user_model

        for group in user_model.tied_groups(cfg, meta=True):
            inside = {j for j, _ in group if j in st.layers}
            if inside and len(inside) < len(group):
                out.append(f"{where}.sharding: layers {sorted(j for j, _ in group)} share a tied weight across MAP "
                           "stages (not implemented: one MAP stage must hold all of them; use policy.pp=1)")
    return out


def _pipedream_unsupported(plan: Plan, model_cfg) -> list[str]:
    """What executor.pipedream (PipeDream's per-microbatch updates with weight stashing) does not
    run: a tied embedding/head over a first and last stage of different replica counts or tp
    degrees (replica r, tp rank t of one pairs with replica r, tp rank t of the other), host-side weights
    (windows, ZeRO-Offload), MAP stages, a user's own model (its ties are summed once per step),
    stashed versions of a tp stage on peers (stash_targets). Replicated stages run (PipeDream §3.1: a per-microbatch all-reduce before each update), and
    tensor-parallel ones (each tp rank updates its shard; executor.pipedream)."""
    out = []
    for i, st in enumerate(plan.stages):
        where = f"stages[{i}]"
        if st.offload.window_layers is not None or st.offload.optimizer_on_cpu:
            out.append(f"{where}.offload: a window or optimizer_on_cpu with schedule pipedream_async (weights "
                       "homed on the host are not stashed; use keep/recompute/swap, optimizer_swap or "
                       "stash_swap_layers)")
        if st.sharding:
            out.append(f"{where}.sharding: a MAP stage with schedule pipedream_async (not implemented)")
        if st.offload.stash_targets and st.tp > 1:  # as specs/plan.py refuses dp > 1: one version code per stage
            out.append(f"{where}.offload.stash_targets: with tp {st.tp} every tp rank would send its shards of a "
                       "stashed version to the same peers under one version code (not implemented; use tp 1 or "
                       "host memory: drop stash_targets)")
    cfg = _config(model_cfg) if model_cfg is not None else None
    first, last = plan.stages[0], plan.stages[-1]
    if (len(plan.stages) > 1 and first.dp != last.dp and getattr(cfg, "tie_embeddings", False)):
        out.append(f"stages[{len(plan.stages) - 1}].dp: {last.dp} with schedule pipedream_async and a tied "
                   f"embedding/head (stages[0].dp: {first.dp}; each replica of the first stage sums the tied "
                   "gradient with its own replica of the last stage: use equal dp, or model.tie_embeddings=false)")
    if (len(plan.stages) > 1 and first.tp != last.tp and getattr(cfg, "tie_embeddings", False)):
        out.append(f"stages[{len(plan.stages) - 1}].tp: {last.tp} with schedule pipedream_async and a tied "
                   f"embedding/head (stages[0].tp: {first.tp}; tp rank t of the first stage sums its vocabulary "
                   "shard of the tied gradient with tp rank t of the last stage: use equal tp, or "
                   "model.tie_embeddings=false)")
    if cfg is not None and cfg.family == "torch_module":
        out.append("model.family: torch_module with schedule pipedream_async (a user model's tied weights are "
                   "synced once per step; use schedule 1f1b)")
    return out


def _offload_unsupported(plan: Plan, i: int, model_cfg) -> list[str]:
    st, out = plan.stages[i], []
    off = st.offload
    if off.window_layers is None:
        if off.optimizer_on_cpu and st.tp > 1:  # executor.zero_offload runs ZeRO-Offload on plain tensors
            out.append(f"stages[{i}].tp: {st.tp} with offload.optimizer_on_cpu (a host master of tensor-parallel "
                       "DTensor shards is not implemented; use 1)")
        return out
    streamed = set(st.streamed_layers)
    for j, item in enumerate(st.memory):
        if item.layer in streamed and item.action not in (MemoryAction.keep, MemoryAction.recompute):
            out.append(f"stages[{i}].memory[{j}].action: {item.action.value} of streamed layer {item.layer} "
                       "(swapping the saved tensors of a window's layer is not implemented; keep or recompute "
                       "it, or list it in offload.resident_layers)")
    cfg = _config(model_cfg) if model_cfg is not None else None
    if cfg is not None and getattr(cfg, "tie_embeddings", False):
        last = len(build_model(cfg, plan.training.act_dtype_bytes).layers) - 1
        for layer in sorted(streamed & {0, last}):
            out.append(f"stages[{i}].offload.resident_layers: layer {layer} (the tied embedding/head) is "
                       "streamed; a window streams a parameter of one layer only, so it must be resident")
    return out


def _weight_swap_unsupported(plan: Plan, i: int, model_cfg) -> list[str]:
    """What executor.weight_swap (MPress §II-D: a layer's live weights, gradient and optimizer
    state homed in host memory) does not run: DTensor parameters (tp > 1, MAP stages), a tied
    embedding/head (one parameter, two homes), a user's own model."""
    st = plan.stages[i]
    listed = st.offload.weight_swap_layers
    if not listed:
        return []
    where, out = f"stages[{i}].offload.weight_swap_layers", []
    if st.tp > 1 or st.sharding:
        out.append(f"{where}: {listed} on a {'MAP-sharded' if st.sharding else f'tp {st.tp}'} stage (DTensor "
                   "parameters are not swapped; use tp 1)")
    cfg = _config(model_cfg) if model_cfg is not None else None
    if cfg is not None and cfg.family == "torch_module":
        out.append(f"{where}: a user's own model (family torch_module) is not supported")
    if cfg is not None and getattr(cfg, "tie_embeddings", False):
        last = len(build_model(cfg, plan.training.act_dtype_bytes).layers) - 1
        for layer in sorted(set(listed) & {0, last}):
            out.append(f"{where}: layer {layer} is the tied embedding/head (one parameter with two homes); "
                       "keep it on the device or set model.tie_embeddings=false")
    return out


def _config(model_cfg):
    return parse_model_config(model_cfg) if isinstance(model_cfg, dict) else model_cfg


def _device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run_plan(plan: Plan, model_cfg, *, iterations: int, timeout_s: float = 120.0, collect: bool = False,
             memory_iteration: int | None = None, fault: dict | None = None, seed: int = 0,
             device: str = "cpu", threads: int = 1, capacity_bytes: int | None = None) -> RunOutput:
    """Train ``iterations`` steps of ``plan`` on one local process per plan device.

    ``collect``: reports carry replica 0's full parameters after the last step and that step's
    gradients (numpy, by ``layer.param``). ``memory_iteration``: the iteration whose peak live
    bytes are tracked. ``fault`` (debug): ``{"rank": r, "kind": "raise"|"kill"|"hang"|"stop", "iteration": i}``
    makes rank r raise (SIGKILL itself, sleep forever, SIGSTOP itself) at its first backward of
    iteration i. A timeout names the rank that stopped making progress (executor.liveness).
    ``capacity_bytes`` (CPU): the tracked iteration fails on a rank whose live bytes exceed it."""
    problems = unsupported(plan, model_cfg)
    if problems:
        raise UnsupportedPlan("the executor cannot run this plan:\n  " + "\n  ".join(problems))
    opts = {"iterations": iterations, "collect": collect, "memory_iteration": memory_iteration,
            "track_memory": memory_iteration is not None, "fault": fault, "seed": seed,
            "device": _device(device), "threads": threads, "capacity_bytes": capacity_bytes}
    return launch(plan, _config(model_cfg), opts, timeout_s)


def execute(plan: Plan, model_cfg, hardware: HardwareSpec, iterations: int = 5, warmup: int = 1,
            timeout_s: float = 300.0, fault: dict | None = None, device: str = "auto",
            model_spec=None) -> Result:
    """Run ``plan`` and measure it: a Result with ``source="measured"``.

    Runs ``warmup`` iterations, then one iteration under the memory tracker (peak live-tensor
    bytes per rank by category on CPU; ``torch.cuda.max_memory_allocated`` on CUDA), then
    ``iterations`` timed iterations. ``iteration_time_s`` is the median of the timed iterations
    (each the slowest rank's time); samples/s = global batch / that; TFLOP/s per device = model
    FLOPs (3x forward, no recompute) / time / devices. The model runs in fp32 whatever
    ``plan.training.precision`` says (CPU), so compare against a simulation built for 4-byte
    activations. On failure (exception, killed rank, timeout after ``timeout_s``) the Result has
    ``failure`` naming the rank and the error, zero times and zero peaks (on CPU, going over
    ``hardware.device.memory_bytes`` in the tracked iteration is such a failure: the OOM); a plan with features the
    executor does not implement (:func:`unsupported`) fails the same way without starting ranks.
    Launch errors (bad ``model_cfg``) raise."""
    return execute_run(plan, model_cfg, hardware, iterations, warmup, timeout_s, fault, device, model_spec)[0]


def execute_run(plan: Plan, model_cfg, hardware: HardwareSpec, iterations: int = 5, warmup: int = 1,
                timeout_s: float = 300.0, fault: dict | None = None, device: str = "auto",
                model_spec=None) -> tuple[Result, RunOutput]:
    """:func:`execute`, also returning the raw per-rank reports (their ``timelines``: see
    :func:`measured_timeline`)."""
    cfg = _config(model_cfg)
    problems = unsupported(plan, cfg)
    if problems:
        out = RunOutput(failure="the executor cannot run this plan: " + "; ".join(problems))
        return result_from_run(plan, cfg, hardware, out, warmup, model_spec), out
    out = run_plan(plan, cfg, iterations=warmup + 1 + iterations, timeout_s=timeout_s,
                   memory_iteration=warmup, fault=fault, device=device,
                   capacity_bytes=hardware.device.memory_bytes)
    return result_from_run(plan, cfg, hardware, out, warmup, model_spec), out


def measured_timeline(plan: Plan, out: RunOutput, warmup: int) -> tuple[dict[int, str], dict[int, list], list]:
    """The executor's action timeline in the simulator's trace terms (executor.timeline).

    Out: ``(names, representative, all_timed)``: ``names`` pid (= device) -> process name;
    ``representative`` pid -> slices ``(stream, name, start_ns, dur_ns, category)`` of the timed
    iteration whose time is the median (the one to draw); ``all_timed`` every slice of every
    timed iteration of every rank (for per-action means). Besides passes, transfers and steps, a
    STRONGHOLD window's and a weight swap's fetches (``h2d``), gradient copies (``d2h``) and CPU
    steps (``cpu``), named as the simulator names them (executor.timeline.HOST_KINDS; a CPU step
    still running when the next iteration starts stays with the iteration that submitted it).
    Empty when the run failed."""
    if out.failure or not out.reports:
        return {}, {}, []
    times = out.iteration_times_s()
    timed = [i for i in range(warmup + 1, len(times))]
    if not timed:
        return {}, {}, []
    rep_it = timeline.representative_iteration(times, timed)
    ranks = sorted(out.reports.items())
    names, rep, every = {}, {}, []
    for rank, r in ranks:
        names[r["device"]] = f"rank {rank} (device {r['device']}, stages {r['stages']}), measured iteration {rep_it}"
    for i in timed:
        have = [(r["device"], r["timelines"][i]) for _, r in ranks
                if i < len(r.get("timelines") or []) and r["timelines"][i] is not None]
        if not have:
            continue
        for (d, _), events in zip(have, timeline.aligned([line for _, line in have])):
            rows = timeline.slices(events)
            every += rows
            if i == rep_it:
                rep[d] = rows
    return names, rep, every


def result_from_run(plan: Plan, cfg, hardware: HardwareSpec, out: RunOutput, warmup: int, spec=None) -> Result:
    """Per-rank reports of a run (warm-up iterations, one tracked, then timed ones) -> Result.
    ``spec``: the ModelSpec for the FLOP count (default: the family's closed forms)."""
    spec = spec if spec is not None else build_model(cfg, plan.training.act_dtype_bytes)
    cap = hardware.device.memory_bytes
    devices = []
    for d in plan.used_devices():
        stages = plan.stages_on(d)
        rep = next((r for r in out.reports.values() if r["device"] == d), None)
        peak = rep["peak_bytes"] if rep and not out.failure else 0
        breakdown = MemoryBreakdown(**{CATEGORY_FIELDS[c]: max(0, v) for c, v in rep["breakdown"].items()}) \
            if rep and not out.failure else MemoryBreakdown()
        devices.append(DeviceResult(
            device=d, rank=plan.used_devices().index(d), stages=stages,
            layers=[(plan.stages[s].layer_start, plan.stages[s].layer_stop) for s in stages],
            capacity_bytes=cap, peak_bytes=peak, breakdown=breakdown,
            host_bytes=rep.get("host_peak_bytes", 0) if rep and not out.failure else 0,
            nvme_bytes=rep.get("nvme_peak_bytes", 0) if rep and not out.failure else 0,
            oom=peak > cap, oom_over_bytes=max(0, peak - cap)))
    if out.failure:
        t = 0.0
    else:
        t = statistics.median(out.iteration_times_s()[warmup + 1:])
    flops = model_flops_per_iteration(spec, plan)
    return Result(
        source="measured", plan_id=plan.id, model=plan.model, hardware=plan.hardware, devices=devices,
        iteration_time_s=t,
        samples_per_s=plan.training.global_batch / t if t else 0.0,
        tflops_per_device=flops / t / len(devices) / 1e12 if t else 0.0,
        failure=out.failure,
    )
