"""policy=stronghold's layout (issue 25 item 2): how many pipeline stages, and how many dp replicas
and tp shards per stage, each streaming its own window (STRONGHOLD §III-E2, §III-F).

STRONGHOLD's premise (§I, §VI-D2) is that a window keeps a model on fewer GPUs than model
parallelism needs; §III-F then runs data parallelism on the GPUs it frees ("each computing node
holds the entire model parameters"), and a tp rank can stream its shard. :func:`search_layouts`
plans the fewest-stage layout and every layout over all the devices, and keeps the one the
simulator times fastest (a per-stage price leaves out the pipeline's sends and bubbles and what
the windows of one node share: its CPU, host link and host all-reduce).
"""
from __future__ import annotations

import math
from typing import Callable

from planners.layout import PlanningError
from planners.policy import StrongholdPolicy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec
from specs.training import TrainingSpec
from specs.units import time_text


def search_layouts(policy: StrongholdPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                   schedule: ScheduleSpec, search: Callable):
    """The layout, then a window per stage (``search``: planner._search, policy -> StrongholdOutcome,
    its pp, dp and tp given).

    ``policy.pp`` null: the fewest stages that fit, from 1 up (STRONGHOLD's premise, §I, §VI-D2: a
    window keeps a model on fewer GPUs than model parallelism needs). ``policy.dp`` / ``policy.tp``
    null: the planner chooses (§III-F: the devices a window frees from model parallelism run data
    parallelism instead, "each computing node holds the entire model"): the fewest-stage layout
    with dp = tp = 1, and every layout that uses all the devices (pp x dp x tp = the device count,
    the given degrees kept, dp splitting the microbatch, tp within every layer's cap) are planned;
    of those that fit, the one with the shortest simulated iteration (:func:`simulated_iteration_s`)
    wins, fewer devices on a tie. A note lists each layout's time."""
    if policy.dp is not None and policy.tp is not None:
        return _fewest_stages(policy, model, hardware, training, schedule, search)
    fixed = {"dp": policy.dp or 1, "tp": policy.tp or 1}
    tried: list[tuple[tuple[int, int, int], object | None, str]] = []  # (layout, its outcome or None, why)
    try:
        outcome = _fewest_stages(policy.model_copy(update=fixed), model, hardware, training, schedule, search)
        tried.append((_degrees(outcome.plan), outcome, ""))
    except PlanningError as exc:
        tried.append(((policy.pp or 0, fixed["dp"], fixed["tp"]), None, str(exc).splitlines()[0]))
    for pp, dp, tp in _layouts(policy, model, hardware, training):
        if any(t[0] == (pp, dp, tp) for t in tried):
            continue
        try:
            one = search(policy.model_copy(update={"pp": pp, "dp": dp, "tp": tp}), model, hardware, training,
                         schedule)
            tried.append(((pp, dp, tp), one, ""))
        except PlanningError as exc:
            tried.append(((pp, dp, tp), None, str(exc).splitlines()[0]))
    fitting = [i for i, (_, o, _) in enumerate(tried) if o is not None and o.fits]
    if len(fitting) == 1 and len(tried) == 1:  # one layout (a single device, or pp x 1 x 1 given): nothing to compare
        return tried[0][1]
    times = {i: simulated_iteration_s(tried[i][1], model, hardware) for i in fitting}
    if not times:
        best = next((o for _, o, _ in tried if o is not None), None)
        if best is None:
            raise PlanningError(tried[0][2])
        return best
    i = min(times, key=lambda j: (times[j], math.prod(tried[j][0]), j))
    outcome = tried[i][1]
    outcome.notes.append("layouts (pp x dp x tp: simulated iteration): " + "; ".join(
        f"{pp}x{dp}x{tp}: " + (time_text(times[j]) if j in times else "does not fit" if o is not None
                               else f"refused ({why})")
        for j, ((pp, dp, tp), o, why) in enumerate(tried)) + f"; chosen {'x'.join(map(str, tried[i][0]))}")
    used = len(outcome.plan.used_devices())
    if used < hardware.num_devices:
        outcome.notes.append(f"uses {used} of {hardware.num_devices} devices: no layout over all of them fits "
                             "or is faster (policy.pp / policy.dp / policy.tp force one)")
    return outcome


def _degrees(plan: Plan) -> tuple[int, int, int]:
    st = plan.stages[0]
    return len(plan.stages), st.dp, st.tp


def _layouts(policy: StrongholdPolicy, model: ModelSpec, hardware: HardwareSpec,
             training: TrainingSpec) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) over every device of ``hardware``, the policy's given degrees kept: dp divides
    the microbatch, tp is within every layer's ``max_tp`` and, on nodes of several devices, divides
    the node (a tp group on one node's links; one device per node, as the A10 cluster: any tp), pp
    within the layers; dp-major order."""
    n = hardware.num_devices
    caps = [layer.max_tp for layer in model.layers if layer.max_tp is not None]
    out = []
    for dp in range(n, 0, -1):
        for tp in range(1, n + 1):
            if n % (dp * tp):
                continue
            pp = n // (dp * tp)
            if any(g is not None and g != v for g, v in ((policy.pp, pp), (policy.dp, dp), (policy.tp, tp))):
                continue
            if training.samples_per_microbatch % dp or (caps and tp > min(caps)) or pp > model.num_layers:
                continue
            if hardware.devices_per_node > 1 and hardware.devices_per_node % tp:
                continue  # Megatron's rule: a tp group within one node's fast links
            out.append((pp, dp, tp))
    return out


def simulated_iteration_s(outcome, model: ModelSpec, hardware: HardwareSpec) -> float:
    """The outcome's plan's iteration as the simulator times it (seconds): the layouts differ in
    what a per-stage price leaves out, the pipeline's sends and bubbles and the node's CPU, host
    link and host all-reduce shared by every window on it (simulator/window.py)."""
    from simulator import simulate  # the planner borrows the simulator (lazy: STYLE)

    return simulate(outcome.plan, model, hardware, trace=False).result.iteration_time_s


def _fewest_stages(policy: StrongholdPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                   schedule: ScheduleSpec, search: Callable):
    """``policy.pp`` null: the fewest stages (of ``policy.dp`` x ``policy.tp`` devices) that fit, from 1 up."""
    if policy.pp is not None:
        return search(policy, model, hardware, training, schedule)
    top = min(hardware.num_devices // ((policy.dp or 1) * (policy.tp or 1)), model.num_layers)
    outcome = None
    for pp in range(1, top + 1):
        try:
            outcome = search(policy.model_copy(update={"pp": pp}), model, hardware, training, schedule)
        except PlanningError:
            if pp == top and outcome is None:
                raise
            continue
        if outcome.fits:
            break
    if outcome is None:
        raise PlanningError(f"policy.dp x policy.tp: {policy.dp} x {policy.tp} leaves no pipeline on hardware "
                            f"{hardware.name!r}'s {hardware.num_devices} devices")
    return outcome
