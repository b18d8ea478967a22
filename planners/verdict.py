"""Does the plan fit? And if not, which knobs would help — computed, not guessed.

Every planner returns its closest plan when none fits (the lowest peak it found); this module
checks a plan against device memory with the analytic memory model (simulator/analytic.py, the
same closed forms the simulator's memory follows) and, when it does not fit, prices the knobs:

* recompute: a re-plan with full recompute of every transformer block (Megatron), or — for
  planners whose degrees the user fixed — the same plan with it;
* ZeRO: the same plan with optimizer state, gradients and weights sharded over each stage's
  data-parallel replicas (ZeRO stage 3, §5) — zero help where every stage has dp = 1;
* more devices: a lower bound from the model state alone (weights + gradients + optimizer bytes
  ÷ device memory, i.e. perfect sharding and no activations), and, for planners that choose their
  own degrees, re-plans on 2×, 4×, … 64× the nodes (sizes the lower bound allows, up to
  16,384 devices and 2 M device-layers in all, so that it takes seconds);
* offload: named (STRONGHOLD's CPU/NVMe window, MPress swaps), with the host memory there is.

Pure: returns data and text; the shell prints it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulator.analytic import device_memory
from planners.layout import PlanningError, recompute_actions
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import CheckpointSegment, Plan, PlanError, ScheduleSpec
from specs.training import TrainingSpec
from specs.units import size_text

GIB = float(1 << 30)


@dataclass(frozen=True)
class Verdict:
    fits: bool
    peak_bytes: int                 # the plan's highest per-device peak
    peak_device: int
    capacity_bytes: int
    oom_devices: int
    num_devices: int
    knobs: tuple[str, ...] = field(default=())  # one line per knob that was priced
    searched: bool = True           # the planner searched for the lowest peak (else the user fixed degrees)
    given: str = "this policy's degrees and depth are given, not searched"  # when not searched: what was given

    @property
    def over_bytes(self) -> int:
        return max(0, self.peak_bytes - self.capacity_bytes)

    def text(self) -> str:
        """Plain words for the user ("" when the plan fits)."""
        if self.fits:
            return ""
        what = ("NO PLAN FITS: the lowest peak found is" if self.searched else
                f"THE PLAN DOES NOT FIT ({self.given}): its peak is")
        head = (f"{what} {size_text(self.peak_bytes, 1)} (device {self.peak_device}), "
                f"{size_text(self.over_bytes, 1)} over the {size_text(self.capacity_bytes, 1)} of device memory; "
                f"{self.oom_devices} of {self.num_devices} devices run out of memory"
                + (". The plan below is the closest." if self.searched else "."))
        return "\n".join([head, "  what would help:", *(f"  - {k}" for k in self.knobs)])


def peaks(plan: Plan, model: ModelSpec, hardware: HardwareSpec | None = None) -> dict[int, int]:
    """Per-device peak bytes of ``plan`` (analytic memory model; ``hardware`` needed for MAP stages)."""
    return {d: mem.total_bytes for d, (mem, _) in device_memory(plan, model, hardware).items()}


def _checkpoint_all(plan: Plan) -> Plan:
    """``plan`` with every layer of its MAP stages a checkpoint segment of its own (the least
    activation memory rotor's sequences reach without nesting, MAP §5.2)."""
    return plan.model_copy(update={"stages": [
        s.model_copy(update={"checkpoint": [CheckpointSegment(start=l, stop=l + 1) for l in s.layers]})
        if s.sharding else s for s in plan.stages]})


def _state(peak: int, capacity: int) -> str:
    return f"fits ({size_text(peak, 1)})" if peak <= capacity else \
        f"{size_text(peak, 1)}, still {size_text(peak - capacity, 1)} over"


def given_words(policy) -> str:
    """For a planner that does not search for the lowest peak: what the user gave and what the
    planner chose by rule (even/balanced with policy.pp=null pick the depth, never by memory)."""
    if getattr(policy, "kind", None) in ("even", "balanced") and getattr(policy, "pp", 0) is None:
        return ("policy.dp and policy.tp are given; policy.pp=null takes the deepest pipeline the layers allow, "
                "not the one with the lowest peak")
    return "this policy's degrees and depth are given, not searched"


def fit_verdict(policy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec, schedule: ScheduleSpec,
                plan: Plan, replan=None, searched: bool = True) -> Verdict:
    """Check ``plan`` against device memory; price the knobs if it does not fit.

    ``replan(policy, hardware) -> Plan`` re-runs the planner (for "more devices"); None skips it.
    ``searched``: the planner looked for the lowest peak (throughput, CAPTURE), so "no plan fits"
    is its finding; else only this plan is said not to fit.
    """
    capacity = hardware.device.memory_bytes
    by_device = peaks(plan, model, hardware)
    device, peak = max(by_device.items(), key=lambda e: (e[1], -e[0]))
    oom = sum(1 for v in by_device.values() if v > capacity)
    given = given_words(policy)
    verdict = Verdict(peak <= capacity, peak, device, capacity, oom, hardware.num_devices, searched=searched,
                      given=given)
    if verdict.fits:
        return verdict
    knobs = []
    recompute = getattr(policy, "recompute", "none")
    sharded = any(s.sharding for s in plan.stages)
    if sharded:  # MAP: recomputation is rotor's checkpoint tree, not per-layer memory actions
        knobs.append("checkpointing (MAP: rotor's segments): every layer checkpointed, this plan would peak at "
                     f"{_state(max(peaks(_checkpoint_all(plan), model, hardware).values()), capacity)}")
    elif recompute == "none":
        rc = None
        if replan is not None:
            try:
                rc = replan(policy.model_copy(update={"recompute": "full"}), hardware)
                what = "re-planned with policy.recompute=full:"
            except (PlanningError, PlanError, ValueError):
                rc = None
        if rc is None:
            rc = plan.model_copy(update={"stages": [s.model_copy(update={"memory": recompute_actions(
                model, s.layer_start, s.layer_stop, "full")}) for s in plan.stages]})
            what = "recompute (policy.recompute=full): this plan would peak at"
        knobs.append(f"{what} {_state(max(peaks(rc, model, hardware).values()), capacity)}")
    if sharded:
        knobs.append("ZeRO: not for MAP-sharded stages (their strategies already split weights, gradients and "
                     "optimizer state over the mesh)")
    elif any(s.dp > 1 for s in plan.stages) and plan.zero_stage < 3:
        z3 = plan.model_copy(update={"zero_stage": 3})
        knobs.append(f"ZeRO-3 over each stage's data-parallel replicas (policy.zero_stage=3 with even/balanced/manual): "
                     f"this plan would peak at {_state(max(peaks(z3, model, hardware).values()), capacity)}")
    else:
        knobs.append("ZeRO: no help for this plan (no stage is data-parallel); with policy.dp > 1 it shards "
                     "optimizer state, gradients and weights over the replicas")
    w_b, g_b, o_b = training.bytes_per_param()
    state = model.total_params * (w_b + g_b + o_b)
    need = math.ceil(state / capacity)
    line = (f"more devices: the model state alone ({state / GIB:,.0f} GiB of weights, gradients and optimizer) "
            f"needs at least {need} devices ({math.ceil(need / hardware.devices_per_node)} nodes) before activations")
    if replan is not None:
        # skip sizes the model state alone rules out; bound the work (devices x layers) of each
        # re-plan, and of all of them, so that pricing this knob stays within seconds
        factors, work = [], 0
        for f in (2, 4, 8, 16, 32, 64):
            size = hardware.num_devices * f * model.num_layers
            if need <= hardware.num_devices * f <= 16384 and work + size <= 2_000_000:
                factors.append(f)
                work += size
        for factor in factors:
            try:  # (a one-node hardware spec without inter_node links cannot grow: ValueError)
                bigger = HardwareSpec.model_validate({**hardware.model_dump(), "nodes": hardware.nodes * factor})
                other = replan(policy, bigger)
            except (PlanningError, PlanError, ValueError):
                continue
            top = max(peaks(other, model, bigger).values())
            if top <= capacity:
                line += f"; re-planned on hardware.nodes={bigger.nodes}: {_state(top, capacity)}"
                break
        else:
            if factors:
                line += f"; re-planned on up to hardware.nodes={hardware.nodes * factors[-1]}: still does not fit"
            else:
                line += "; no re-plan on more nodes (too large to price in seconds)"
    knobs.append(line)
    host = hardware.host.memory_bytes
    knobs.append(f"offload: optimizer state and weights to host memory ({host / GIB:,.0f} GiB per node; "
                 "STRONGHOLD's layer window) or activations (MPress CPU/D2D swaps)")
    return Verdict(False, peak, device, capacity, oom, hardware.num_devices, tuple(knobs), searched, given)


__all__ = ["Verdict", "fit_verdict", "given_words", "peaks"]
