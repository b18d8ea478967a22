"""MPress's inner compaction on a given layout (MPress HPCA'23 §III-C/D, without its pipeline).

:func:`compact` takes any plan (pipeline depth, split, schedule, microbatch and per-stage dp x tp
fixed by its caller, e.g. policy=auto's layout search) and gives the layers of the stages over a
memory budget MPress's per-layer actions, as planners/mpress/planner.py does for its own
one-device-per-stage pipeline: live intervals and per-technique costs off the plan's simulated
schedule (facts.py), the initial assignment cheapest per saved byte (choice.py), the emulator's
repair until it fits (repair.py) and its improve rounds until one gains less than
``min_round_gain`` (improve.py). The same steps, not a copy; what differs:

- *No device mapping.* The stages keep their devices: MPress's Fig. 6 search permutes one-device
  stages, a layout's groups are its caller's choice. The mapping is the identity over each
  stage's first device, which is the device that holds a target stage's stripes.
- *D2D swap only from stages of one device* (dp = tp = 1). The simulator and the closed form
  (simulator/analytic.py ``_d2d_held``) park one replica's share on a target, but the executor
  sends every replica's and every TP rank's stripes there: for dp x tp > 1 the two disagree
  (measured), so such a stage recomputes or swaps to the host instead. A target stage must have
  every device an NVLink/NVSwitch peer of the source's (specs/plan.py ``validate_plan`` asks its
  stripe device to be one) and spare memory; devices outside the plan's stages are not used.
- *A budget.* ``capacity_bytes`` may be below the device's memory; the emulator simulates on a
  copy of the hardware whose device holds that much, so its out-of-memory flags, the returned
  Result's per-device ``capacity_bytes`` and every spare-memory figure use the budget.
- *Given actions* (recompute, CPU swap, optimizer swap in the plan) are the starting assignment;
  the improve rounds may change them like their own.

What is exact: every accepted candidate was simulated, and ``fits`` reads the simulated peaks (and
the host memory per node). What is heuristic: which layers get which action (the §III-D greedy
fill, then one-move-at-a-time improvement: a local optimum), the cost estimates steering it
(facts.py, choice.py), and the stripe placement (mapping.py's progressive filling).

Pure: no I/O, no clocks; the same inputs give the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.mpress.base import whole_layer_demand
from planners.mpress.choice import initial_assignment
from planners.mpress.emulate import Emulator, check_size, fits as _fits, host_bytes_per_node, over_and_spare
from planners.mpress.facts import CPU, D2D, RC
from planners.mpress.improve import cap_text, improve, remap
from planners.mpress.mapping import search_mapping
from planners.mpress.outcome import final_outcome
from planners.mpress.repair import repair
from planners.mpress.weights import swap_until_fits
from planners.policy import MPressPolicy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import MemoryAction, Plan, ScheduleKind, validate_plan
from specs.result import Result

__all__ = ["Compacted", "compact", "compactable", "d2d_pairs"]

_NAMES = {"recompute": RC, "cpu_swap": CPU, "d2d_swap": D2D}
FITS_AS_IS = "fits as is"


@dataclass(frozen=True)
class Compacted:
    plan: Plan          # the given plan with per-layer actions (stage.memory), devices unchanged
    result: Result      # the simulation of ``plan`` (its devices' capacity_bytes: the budget)
    fits: bool          # no device over the budget, no node over its host memory
    stop: str           # "fits as is", "converged: ...", "no move left ...", "does not fit: ...", "safety cap ..."
    simulations: int
    log: list[str]      # the emulator's log lines (what MPress prints)


def compactable(plan: Plan) -> str | None:
    """Why :func:`compact` cannot take ``plan``, or None. Interleaved chunks share devices (an
    over-full device is several stages: which to compact is not a per-stage question), MAP stages
    price memory by rotor's checkpoint walk, not by per-layer actions, and a STRONGHOLD window
    streams the layers' state already; a given D2D swap or NVMe spill names devices the identity
    mapping's stages cannot own."""
    if plan.schedule.kind is ScheduleKind.interleaved_1f1b or plan.schedule.virtual_stages > 1:
        return "interleaved schedule (virtual stages)"
    for i, stage in enumerate(plan.stages):
        if stage.sharding:
            return f"stage {i} has MAP sharding"
        if stage.offload.window_layers is not None:
            return f"stage {i} has a STRONGHOLD window"
        if any(m.action in (MemoryAction.d2d_swap, MemoryAction.nvme) for m in stage.memory):
            return f"stage {i} already has d2d_swap or nvme actions"
    return None


def d2d_pairs(plan: Plan, hardware: HardwareSpec) -> list[list[bool]]:
    """pairs[i][j]: stage i may stripe D2D swaps onto stage j's first device. Only a one-device
    stage swaps (see the module docstring: the executor would send every replica's stripes), and
    only to a stage whose every device is a peer of its own."""
    out = []
    for i, src in enumerate(plan.stages):
        one = len(src.devices) == 1
        out.append([one and i != j and all(hardware.is_peer(src.devices[0], d) for d in tgt.devices)
                    for j, tgt in enumerate(plan.stages)])
    return out


def budget_hardware(hardware: HardwareSpec, capacity_bytes: int) -> HardwareSpec:
    """``hardware`` whose devices hold ``capacity_bytes`` (the simulator flags what is over it)."""
    if not 0 < capacity_bytes <= hardware.device.memory_bytes:
        raise ValueError(f"capacity_bytes: between 1 and the device's {hardware.device.memory_bytes} bytes; "
                         f"got {capacity_bytes}")
    if capacity_bytes == hardware.device.memory_bytes:
        return hardware
    device = hardware.device.model_copy(update={"memory_bytes": capacity_bytes})
    return hardware.model_copy(update={"device": device})


def compact(plan: Plan, model: ModelSpec, hardware: HardwareSpec, capacity_bytes: int,
            techniques=("recompute", "cpu_swap", "d2d_swap"), striping: str = "weighted",
            min_round_gain: float = 0.005, max_simulations: int = 200, progress=None,
            improve_rounds: bool = True) -> Compacted | None:
    """MPress's per-layer compaction of ``plan`` (validated against ``model`` and ``hardware``;
    its devices stay) under ``capacity_bytes`` per device (at most the device's memory). Returns
    None for a plan it does not take (:func:`compactable`); raises specs.plan.PlanError for an
    invalid plan, planners.layout.PlanningError for one too large to simulate, ValueError for a
    bad argument. ``techniques``, ``striping``, ``min_round_gain``, ``max_simulations``: as in
    MPressPolicy; ``progress(simulations, None)`` after each simulation. ``improve_rounds=False``
    stops once the repair fits (§III-D's initial assignment, repaired; no remap, no improve rounds):
    policy=auto screens layouts so and improves only the most promising ones."""
    validate_plan(plan, model, hardware)
    if compactable(plan) is not None:
        return None
    check_size(plan)
    policy = MPressPolicy(techniques=list(techniques), mapping="identity", striping=striping,
                          max_simulations=max_simulations, min_round_gain=min_round_gain)
    hw = budget_hardware(hardware, capacity_bytes)
    em = Emulator(model, hw, policy.max_simulations, progress)
    first = em.run(plan, trace=True)  # facts (the layers' timing) come from its trace
    devices = [stage.devices[0] for stage in plan.stages]
    demand, spare = over_and_spare(first, devices, capacity_bytes)
    em.log.append(f"given plan: {len(plan.stages)} stages, iteration {first.result.iteration_time_s:.3f} s, "
                  f"peak {max(d.peak_bytes for d in first.result.devices) / 2**30:.2f} GiB of a "
                  f"{capacity_bytes / 2**30:.2f} GiB budget")
    if _fits(first):
        host = host_bytes_per_node(first, hw)
        ok = all(n <= hw.host.memory_bytes for n in host)
        stop = FITS_AS_IS if ok else "does not fit: host memory over with no device over its budget"
        em.log.append(f"result: {stop}")
        return Compacted(plan, first.result, ok, stop, em.sims, list(em.log))

    allowed = [_NAMES[t] for t in policy.techniques]
    pairs = d2d_pairs(plan, hw)
    want = whole_layer_demand(plan, model, demand) if D2D in allowed else [0] * len(devices)
    mapping = search_mapping(hw, devices, want, spare, (), striping=striping, mode="identity", pairs=pairs)
    if D2D in allowed:
        em.log.append("d2d targets (stages keep their devices): " + (", ".join(
            f"s{s}->{'+'.join(f's{t}' for t, _ in ts)}" for s, ts in enumerate(mapping.targets) if ts) or "none"))
    st = initial_assignment(plan, model, hw, first.trace, mapping, allowed, capacity_bytes, spare, adopt=True)
    sim = repair(em, st, allowed)
    sim, weights = swap_until_fits(em, st, hw, allowed, sim)  # live model data to the host (weights.py)
    if not _fits(sim):
        stop = cap_text(em) if em.capped else "does not fit: nothing left to compact"
        out = final_outcome(em, st, allowed, sim, first, False, hw, stop, weights=weights)
        return Compacted(out.plan, sim.result, False, stop, em.sims, list(out.log))
    if not improve_rounds:
        stop = "fits (repaired; improve rounds not run)"
        out = final_outcome(em, st, allowed, sim, first, True, hw, stop, weights=weights)
        return Compacted(out.plan, sim.result, out.fits, stop, em.sims, list(out.log))
    if D2D in allowed and not any(a is D2D for a in st.actions.values()) and em.left:
        sim = remap(em, st, policy, hw, devices, [], first.trace, capacity_bytes, sim, pairs=pairs)
    sim, rounds, stop = improve(em, st, allowed, sim, policy.min_round_gain)
    out = final_outcome(em, st, allowed, sim, first, True, hw, stop, rounds, weights=weights)
    return Compacted(out.plan, sim.result, out.fits, stop, em.sims, list(out.log))
