"""A STRONGHOLD window priced (§III-D): stage ``s``'s passes walked back to back with its window by
the simulator's own mechanism (simulator/window.py) driven by plain arithmetic, not simpy, and its
device peak (the analytic memory model, the simulator's). The window choice
(planners/stronghold/planner.py) and the streams choice (planners/stronghold/streams.py, §IV-A)
both price candidates here; with ``offload.streams`` S > 1 the walk is of the stage's m / S group
passes (costs.window.grouped_plan). Pure."""
from __future__ import annotations

from dataclasses import dataclass

from costs import window as win
from planners.verdict import peaks
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import Plan
from specs.schedule import plan_order

#: a window within this fraction of the best fitting window's time is on the plateau (Fig. 9):
#: STRONGHOLD §V-D measures run-to-run variance "less than 3%", so a smaller gain is not measurable
PLATEAU = 0.03

@dataclass(frozen=True)
class WindowPrice:
    """One candidate window of one stage, as the window walk times it."""

    window: int
    peak_bytes: int           # the stage device's peak (analytic memory model = the simulator's)
    fits: bool
    stall_s: float            # compute waiting for the host link, after the cold start (steady state)
    cold_stall_s: float       # what a slot per streamed layer still waits for the link (steady state)
    cpu_wait_s: float         # compute waiting for fetches held by the previous iteration's CPU steps (eq. 3)
    time_s: float             # the stage's passes back to back, plus its step (steady state)
    first_cold_s: float = 0.0  # the first iteration's cold start: its first forward's wait, nothing carried in



def _passes(plan: Plan, s: int) -> list[tuple[str, int]]:
    """Stage ``s``'s forwards and backwards in its device's schedule order."""
    # the compute order alone (what build_schedule's forwards and backwards follow), without
    # building every position's Action objects: 175B on Selene spent 60 s there
    return [(kind, k) for kind, st, k in plan_order(plan, plan.device_group_of(s)) if st == s]


def price(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int, base=None,
          peak: int | None = None, capacity_bytes: int | None = None, cold_ns: int | None = None) -> WindowPrice:
    """Walk stage ``s``'s passes back to back with its window (simulator/window.py) and its memory.
    ``base``: (stage costs, passes, host ring) of this stage with any window, from :func:`price_base`: only
    the slot count differs between windows, so pricing many reuses them; ``peak``: its device
    peak if known (:func:`_peak_of`); ``capacity_bytes``: what ``fits`` compares the peak with
    (default: the device's memory); ``cold_ns``: the stage's cold start (:func:`cold_start_ns`),
    computed when not given. With ``streams`` S > 1 (§IV-A) the walk is of the stage's m / S group
    passes (costs.window.grouped_plan)."""
    if peak is None:  # of the plan as given: S workers' own transients (costs.window.group_workspace_bytes)
        peak = max(peaks(plan, model, hardware)[d] for d in plan.stages[s].devices)
    plan = win.grouped_plan(plan)
    stage = plan.stages[s]
    sc, passes, ring = base if base is not None else price_base(plan, model, hardware, s)
    stall, cpu_wait, t = _walk(sc, passes, hardware, plan.training.microbatches, stage.offload.window_layers,
                               ring=ring)
    if cold_ns is None:
        cold_ns = cold_start_ns(plan, hardware, sc, passes, ring)
    capacity = hardware.device.memory_bytes if capacity_bytes is None else capacity_bytes
    link = stall - cpu_wait
    cold = min(cold_ns, link)
    first = _walk(sc, passes[:1], hardware, plan.training.microbatches, stage.offload.window_layers, steady=False,
                  ring=ring)[0]
    return WindowPrice(window=stage.offload.window_layers, peak_bytes=peak,
                       fits=peak <= capacity, stall_s=(link - cold) / 1e9,
                       cold_stall_s=cold / 1e9, cpu_wait_s=cpu_wait / 1e9, time_s=t / 1e9, first_cold_s=first / 1e9)


def _walk(sc, passes, hardware: HardwareSpec, microbatches: int, w: int, steady: bool = True,
          ring=None) -> tuple[int, int, int]:
    """(compute stall, the part of it held by CPU steps (eq. 3), the passes and the step) in ns,
    the stage's passes walked back to back with ``w`` slots (simulator/window.py, plain
    arithmetic): the steady-state iteration, or with ``steady=False`` the first one. ``ring``:
    the stage's host gradient all-reduce with dp > 1 (simulator.window.host_ring)."""
    from dataclasses import replace

    from simulator.links import Links  # the planner borrows the simulator's mechanism (lazy: STYLE)
    from simulator.window import Clock, WindowWalk, drive, resources, walk_passes

    sc = replace(sc, window=w)
    clock = Clock()
    walk = WindowWalk(sc, Links(hardware), *resources(hardware, sc), microbatches, clock, steady=steady, ring=ring)
    walk_passes(walk, passes, clock)  # exact; the periodic middle is not re-walked
    drive(walk.step(), clock)
    return walk.stall_ns, walk.cpu_hold_ns, clock.t


def cold_start_ns(plan: Plan, hardware: HardwareSpec, sc, passes, ring=None) -> int:
    """The cold start of a stage (ns): what its compute waits for the host link (not for CPU
    steps) in the steady-state iteration when every streamed layer has a slot, i.e. every fetch is
    issued as the iteration starts (the step left every slot stale), back to back on the host
    link, and none is ever repeated. No window can wait less (a smaller one issues each fetch no
    earlier, in the same order), so the rest of a window's link stall is what a larger window
    would hide (P1 (1b), P2 (2b)) and is what the choice counts. With the resident first window
    (§III-E1) the first fetches land behind the resident layers' forwards: usually 0."""
    plan = win.grouped_plan(plan)
    streamed = sum(1 for lc in sc.layers if lc.streamed)
    stall, held, _ = _walk(sc, passes, hardware, plan.training.microbatches, max(streamed, 1), ring=ring)
    return stall - held


def price_base(plan: Plan, model: ModelSpec, hardware: HardwareSpec, s: int) -> tuple:
    """What every window of stage ``s`` shares: its per-layer costs, its pass sequence and its host
    gradient all-reduce with dp > 1 (simulator.window.host_ring; None with one replica); with
    ``streams`` S > 1 a group's costs (S·b samples) and the m / S group passes (§IV-A)."""
    from simulator.links import Links
    from simulator.stagecost import stage_cost
    from simulator.window import host_ring

    plan = win.grouped_plan(plan)
    sc = stage_cost(plan, model, hardware, s, plan.stages[s])
    return sc, _passes(plan, s), host_ring(plan, model, hardware, sc, Links(hardware))


