"""policy=mpress: MPress's memory-compaction planner (Zhou et al., HPCA'23, §III-C/D).

Start from a compute-balanced pipeline, one stage per device (PipeDream/DAPPLE's partition,
§IV-A), simulate it, and give the layers of every stage that overflows its device a memory action:

1. *Live intervals* (§III-D, footnote 1): for every layer and microbatch, the time from the end of
   the layer's forward to the start of its backward, read off the simulated schedule; a layer's
   interval is its shortest over the microbatches (the one a transfer must hide in).
2. *Cost per technique* (Table III, footnote 2): recompute costs one more forward of the layer;
   a swap costs what its out-and-back transfer does not hide in the interval, CPU swap over the
   PCIe uplink shared by the GPUs behind one switch, D2D swap striped over the NVLinks to the
   peers with spare memory (planners/mpress/mapping.py, §III-C), plus the stall of the forwards
   when a stage's swap-outs take longer than its passes (a forward waits for the previous
   microbatch's swap-outs, in the simulator and the executor alike).
3. *Device mapping* (Fig. 6): the stage->GPU permutation that puts light stages next to heavy ones
   on fast links (exhaustive for 8 GPUs, local search beyond; mpress_mapping).
4. *Initial assignment* (§III-D): per overflowing stage, the cheapest of recompute / CPU swap per
   saved byte first (free swaps of long-lived tensors before anything that costs), until the
   closed-form peak (simulator/analytic.py) fits; a stage still over with every layer compacted
   streams its optimizer state through host memory (§II-D: GPU-CPU swap of model data). Spare
   peer memory smaller than a layer's in-flight bytes takes every n-th microbatch of it
   (``LayerMemory.microbatch_period``: MPress picks tensors, a layer's microbatches are ours).
5. *Emulator loop* (§III-B step 5, §III-D): simulate the candidate (simulator/, the same engine
   the user sees); a stage still over capacity gets more layers, a D2D target over capacity *at
   some moment of its timeline* (its own memory plus what peers hold there) loses its largest
   stripes; once it fits (and, if no layer is D2D-swapped then, after mapping again for the room
   compaction made), optimizer swaps are dropped where they are not needed, the costliest
   compacted layers are tried with the other techniques and as keep (a change is kept only if the
   simulated iteration is faster, or for less data moved no slower, and still fits), and hidden
   CPU swaps move to spare peer memory when that is no slower. One pass over all these moves is a
   *round* (planners/mpress/improve.py); rounds repeat until one makes the iteration less than
   ``policy.min_round_gain`` (0.5 %) faster (§III-D: "terminates if the subsequent assignment
   brings nonvisible performance gains"), or has no move to try. ``policy.max_simulations`` is
   only a safety cap; the outcome says why the search stopped (``stop_reason``), after how many
   rounds and simulations. A candidate emulated before is read back, not simulated again.

Pure: no I/O, no clocks; the same inputs give the same plan. Returns :class:`MPressOutcome`
(plan, per-layer choices with their reason, fit, the log of the emulator loop). This module is the
loop; its steps live beside it: base.py (the base pipeline and its mapping), facts.py (live
intervals, costs per technique), mapping.py (stage->GPU mapping), assign.py (the assignment being
built), choice.py (cost model, initial assignment), emulate.py (one simulation and what it reads),
repair.py (until it fits), improve.py (once it fits), outcome.py (the result and its reports),
weights.py (step 6).

6. *Live model data* (§II-D: GPU-CPU swap applies to all model data): with cpu_swap allowed, a
   stage the repaired assignment leaves over capacity gets weight-swapped layers
   (``offload.weight_swap_layers``: weights, gradient and optimizer state in host memory, fetched
   for every pass, stepped by the CPU), least exposed cost per freed byte first, until its closed
   form fits; the repair runs again on that plan (planners/mpress/weights.py).
"""
from __future__ import annotations

from planners.mpress.base import base_lines, base_plan, boundary_bytes, map_base
from planners.mpress.choice import initial_assignment
from planners.mpress.emulate import Emulator, check_size, fits as _fits, over_and_spare
from planners.mpress.facts import CPU as _CPU, D2D as _D2D, RC as _RC
from planners.mpress.improve import cap_text, improve, remap
from planners.mpress.outcome import MPressOutcome, final_outcome, fits_as_is
from planners.mpress.repair import repair
from planners.mpress.stash import choose_stash_swap, choose_stash_targets, stash_line, with_stash_swap
from planners.mpress.weights import swap_until_fits
from planners.policy import MPressPolicy
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan, ScheduleSpec
from specs.training import TrainingSpec

__all__ = ["mpress_search", "plan_mpress"]


def stash_base(em: Emulator, base: Plan, first, demand: list, spare: list, policy: MPressPolicy, model: ModelSpec,
               hardware: HardwareSpec, devices: list, capacity: int):
    """Step 0 under PipeDream: the stashed weight versions of the over-full stages go to host
    memory first (planners/mpress/stash.py, MPress §II-D and §III-D), and that plan, simulated,
    is the base the activations' assignment starts from. Returns (base, its simulation, demand,
    spare), the given ones when nothing is swapped."""
    chosen, windows = choose_stash_swap(base, model, hardware, first.trace, demand, "cpu_swap" in policy.techniques)
    if not chosen:
        return base, first, demand, spare
    targets = (choose_stash_targets(base, model, hardware, chosen, windows, dict(zip(devices, spare)))
               if "d2d_swap" in policy.techniques else {})  # peers' spare memory instead (MPress §III-C)
    plan = with_stash_swap(base, chosen, targets)
    sim = em.run(plan, trace=True)
    em.log.append(stash_line(plan, model, hardware, chosen, windows, sim.trace, demand))
    return (plan, sim, *over_and_spare(sim, devices, capacity))

_NAMES = {"recompute": _RC, "cpu_swap": _CPU, "d2d_swap": _D2D}


def plan_mpress(policy: MPressPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                schedule: ScheduleSpec, progress=None, profile=None) -> Plan:
    """``profile``: a CAPTURE profile (specs.profile.Profile), for ``policy.partition=capture``."""
    return mpress_search(policy, model, hardware, training, schedule, progress, profile).plan


def mpress_search(policy: MPressPolicy, model: ModelSpec, hardware: HardwareSpec, training: TrainingSpec,
                  schedule: ScheduleSpec, progress=None, profile=None) -> MPressOutcome:
    """The MPress static planner (§III-B steps 3-5); see the module docstring. ``profile``: the
    CAPTURE profile ``policy.partition=capture`` starts from."""
    em = Emulator(model, hardware, policy.max_simulations, progress)
    base = base_plan(policy, model, hardware, training, schedule, profile)
    check_size(base)  # the emulator simulates (§III-B step 5)
    capacity = hardware.device.memory_bytes
    first = em.run(base, trace=True)  # facts (the layers' timing) come from its trace
    devices = [stage.devices[0] for stage in base.stages]
    demand, spare = over_and_spare(first, devices, capacity)
    base, first, demand, spare = stash_base(em, base, first, demand, spare, policy, model, hardware, devices, capacity)
    boundary = boundary_bytes(base, model)  # per microbatch, stage i -> i + 1
    allowed = [_NAMES[t] for t in policy.techniques]
    mapping = map_base(policy, hardware, model, base, devices, demand, spare, boundary, allowed)
    em.log.extend(base_lines(first.result.iteration_time_s, demand, mapping, allowed))
    if not any(demand):
        return fits_as_is(em, base, first, mapping)

    st = initial_assignment(base, model, hardware, first.trace, mapping, allowed, capacity, spare)
    sim = repair(em, st, allowed)
    sim, weights = swap_until_fits(em, st, hardware, allowed, sim)  # 6. live model data to the host (weights.py)
    fits = _fits(sim)
    if not fits:
        stop = cap_text(em) if em.capped else "does not fit: nothing left to compact"
        return final_outcome(em, st, allowed, sim, first, fits, hardware, stop, weights=weights)
    if _D2D in allowed and not any(a is _D2D for a in st.actions.values()) and em.left:
        sim = remap(em, st, policy, hardware, devices, boundary, first.trace, capacity, sim)
    sim, rounds, stop = improve(em, st, allowed, sim, policy.min_round_gain)
    return final_outcome(em, st, allowed, sim, first, fits, hardware, stop, rounds, weights=weights)
