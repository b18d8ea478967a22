"""MPress's base pipeline: the layout and schedule before any memory action, one stage per device
(PipeDream/DAPPLE's partition, MPress §IV-A), and its first stage->device mapping (§III-C, Fig. 6)
for what the base overflows.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from planners.baselines.partition import plan_balanced, plan_even
from planners.layout import PlanningError
from planners.mpress.assign import size_text
from planners.mpress.facts import D2D
from planners.mpress.mapping import Mapping, search_mapping
from planners.policy import BalancedPolicy, EvenPolicy, MPressPolicy
import costs.activations
import costs.params
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec
from specs.training import TrainingSpec


def capture_partition(model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, schedule: ScheduleSpec,
                      profile) -> Plan:
    """CAPTURE's memory-centric partition, pipeline only (degree 1 per stage, CAPTURE Fig. 6g-l),
    as MPress's starting point (``policy.partition=capture``)."""
    from planners.capture.planner import plan_capture

    if profile is None or profile.capture is None:
        raise PlanningError("policy.partition=capture needs a CAPTURE profile: python -m run profiles first "
                            "(mode=simulate does), or pass one to make_plan(..., profile=...)")
    return plan_capture(capture_policy(), model, hardware, training, schedule, profile)


def capture_policy():
    """The CAPTURE policy whose profile and plan ``partition=capture`` uses: pipeline only."""
    from planners.policy import CapturePolicy

    return CapturePolicy(pipeline_only=True, compare_throughput=False)


def base_plan(policy: MPressPolicy, model, hardware, training, schedule, profile=None) -> Plan:
    """The pipeline MPress compacts: one stage per device, partitioned by ``policy.partition``."""
    if schedule.virtual_stages > 1:  # interleaved 1F1B, a V (zbv, dualpipev): several chunks per device
        raise PlanningError(f"policy=mpress plans one stage per device (MPress §IV evaluates PipeDream async and "
                            f"DAPPLE's 1F1B); schedule {schedule.kind.value} places {schedule.virtual_stages} "
                            "chunks on each: use schedule=1f1b, pipedream_async, gpipe or zb_h1")
    if policy.partition == "capture":
        plan = capture_partition(model, hardware, training, schedule, profile)
        if any(st.dp != 1 or st.tp != 1 for st in plan.stages) or len({st.devices[0] for st in plan.stages}) != len(plan.stages):
            raise PlanningError("policy.partition=capture: CAPTURE's plan is not one stage per device")
        return plan.model_copy(update={"planner": "mpress"})
    pp = policy.pp or min(hardware.num_devices, model.num_layers)
    if pp != hardware.num_devices:
        why = (f"got {pp}" if policy.pp else
               f"but model {model.name!r} has only {model.num_layers} layers (a stage needs one); use a smaller hardware")
        raise PlanningError(f"policy.pp: MPress runs one pipeline stage per device (no data or tensor parallelism, "
                            f"§IV-A), so pp must be null or {hardware.num_devices} (the devices of hardware "
                            f"{hardware.name!r}), {why}")
    base = (BalancedPolicy if policy.partition == "balanced" else EvenPolicy)(pp=pp, dp=1, tp=1)
    planner = plan_balanced if policy.partition == "balanced" else plan_even
    plan = planner(base, model, hardware, training, schedule)
    return plan.model_copy(update={"planner": "mpress"})


def boundary_bytes(base: Plan, model: ModelSpec) -> list:
    """Per microbatch, what stage i sends stage i + 1 (the mapping's tie-break on pipeline sends)."""
    return [costs.params.samples_per_replica(base, st) * model.layers[st.layer_stop - 1].output_bytes_per_sample
            for st in base.stages[:-1]]


def whole_layer_demand(base: Plan, model: ModelSpec, demand: list) -> list:
    """A plan swaps whole layers (all their in-flight microbatches): ask the mapping for room in
    whole layers, the overflow rounded up to the stage's largest layer x its in-flight count."""
    want = []
    for s, stage in enumerate(base.stages):
        unit = costs.activations.in_flight_microbatches(base, s) * max(
            costs.activations.layer_saved_bytes(model.layers[l], costs.params.samples_per_replica(base, stage), 1) for l in stage.layers)
        want.append(-(-demand[s] // unit) * unit if demand[s] and unit else demand[s])
    return want


def map_base(policy: MPressPolicy, hardware: HardwareSpec, model: ModelSpec, base: Plan, devices: list,
             demand: list, spare: list, boundary: list, allowed: list) -> Mapping:
    """The stage->device mapping for the base's overflow (the identity without D2D swap)."""
    use_d2d = D2D in allowed
    want = whole_layer_demand(base, model, demand)
    return search_mapping(hardware, devices, want if use_d2d else [0] * len(devices), spare, boundary,
                          striping=policy.striping, mode=policy.mapping if use_d2d else "identity")


def mapping_text(mapping: Mapping) -> str:
    """How a mapping was found and what it maps, for the log."""
    perm = list(mapping.device_of_stage)
    what = ("identity (stage i on device i)" if perm == list(range(len(perm)))
            else " ".join(f"s{s}->d{d}" for s, d in enumerate(perm)))
    n = mapping.candidates
    if n == 1 and not mapping.exact:  # mapping=identity (or nothing to search): no search ran
        return f"(not searched): {what}"
    return f"({'exact' if mapping.exact else 'local search'}, {n} candidate{'' if n == 1 else 's'}): {what}"


def base_lines(iteration_s: float, demand: list, mapping: Mapping, allowed: list) -> list[str]:
    """The log's first lines: the base's iteration, what overflows, the mapping chosen for it."""
    p = len(demand)
    lines = [f"base: {p} stages, iteration {iteration_s:.3f} s; over capacity: "
             + (", ".join(f"stage {s} +{size_text(demand[s])}" for s in range(p) if demand[s]) or "none")]
    if D2D in allowed:
        lines.append("device mapping " + mapping_text(mapping))
    return lines
