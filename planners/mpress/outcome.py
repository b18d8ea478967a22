"""What the MPress planner hands back (MPress §III-B, the static part's output: Table IV's
per-tensor strategies): :class:`MPressOutcome` with the plan, the per-layer choices and why, the
mapping and the emulator's log; :func:`report` as mpress.json, :func:`summary_lines` for the
terminal.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.mpress.assign import Assignment, size_text, with_actions
from planners.mpress.emulate import Emulator, fits as _fits, host_bytes_per_node
from planners.mpress.facts import D2D, KEEP
from planners.mpress.mapping import Mapping
from specs.hardware import HardwareSpec
from specs.plan import Plan


@dataclass(frozen=True)
class LayerChoice:
    stage: int
    layer: int
    action: str
    saved_bytes: int
    live_s: float
    costs_s: dict           # technique -> its estimated extra seconds per microbatch
    why: str


@dataclass(frozen=True)
class MPressOutcome:
    plan: Plan
    fits: bool
    choices: tuple[LayerChoice, ...]
    mapping: Mapping
    simulations: int
    iteration_s: float
    base_iteration_s: float
    log: tuple[str, ...]
    optimizer_swap: tuple[tuple[int, str], ...] = ()  # (stage, why) for stages swapping optimizer state
    host_bytes_per_node: tuple[int, ...] = ()  # simulated host memory (swap space, offloaded state), per node
    host_capacity_bytes: int = 0
    stop_reason: str = ""           # why the search stopped: converged, no move left, safety cap, does not fit
    rounds: tuple = ()              # planners/mpress/improve.Round, one per round of improvement
    read_back: int = 0              # candidates emulated before, whose simulation was reused


def fits_as_is(em: Emulator, base: Plan, first, mapping: Mapping) -> MPressOutcome:
    """Every stage of the base (simulated: ``first``) fits: no memory action, only the mapping."""
    plan = with_actions(base, {}, mapping)
    sim = em.run(plan) if plan != base else first
    em.log.append("every stage fits: no memory action needed (MPress §IV-B, small models)")
    stop = "no move left: every stage fits without a memory action"
    em.log.append(result_line(_fits(sim), sim.result.iteration_time_s, em, stop, 0))
    return MPressOutcome(plan, _fits(sim), (), mapping, em.sims,
                         sim.result.iteration_time_s, first.result.iteration_time_s, tuple(em.log),
                         stop_reason=stop, read_back=em.hits)


def result_line(fits: bool, iteration_s: float, em: Emulator, stop: str, rounds: int) -> str:
    """The log's (and the terminal's) last line: the result, the search's cost, why it stopped."""
    return (f"result: {'fits' if fits else 'does NOT fit'}, iteration {iteration_s:.3f} s after {em.sims} "
            f"simulation{'' if em.sims == 1 else 's'}, {rounds} round{'' if rounds == 1 else 's'}; stopped: {stop}")


def layer_choices(st: Assignment, allowed: list) -> tuple[LayerChoice, ...]:
    """Per layer that had a choice, its action, facts, every technique's estimate and why."""
    facts, mapping = st.facts, st.mapping
    return tuple(
        LayerChoice(stage=s, layer=l, action=st.actions.get((s, l), KEEP).value, saved_bytes=facts[(s, l)].saved_bytes,
                    live_s=facts[(s, l)].live_s,
                    costs_s={a.value: facts[(s, l)].cost_s(a) for a in allowed
                             if a is not D2D or mapping.targets[s]},
                    why=st.why[(s, l)])
        for s, l in sorted(st.why))


def final_outcome(em: Emulator, st: Assignment, allowed: list, sim, first, fits: bool,
                  hardware: HardwareSpec, stop: str, rounds: tuple = ()) -> MPressOutcome:
    """The assignment's plan and choices, with ``sim`` its best simulation, ``stop`` why the
    search stopped after ``rounds``; a node whose host memory the CPU swaps overfill does not fit
    either."""
    plan = st.plan_now()
    choices = layer_choices(st, allowed)
    per_node = host_bytes_per_node(sim, hardware)
    if any(n > hardware.host.memory_bytes for n in per_node):
        fits = False
        em.log.append(f"host memory: {size_text(max(per_node))} on one node is over its "
                      f"{size_text(hardware.host.memory_bytes)}")
    em.log.append(result_line(fits, sim.result.iteration_time_s, em, stop, len(rounds)))
    return MPressOutcome(plan, fits, choices, st.mapping, em.sims, sim.result.iteration_time_s,
                         first.result.iteration_time_s, tuple(em.log),
                         tuple((s, st.opt_why[s]) for s in sorted(st.opt_swap)), tuple(per_node),
                         hardware.host.memory_bytes, stop, tuple(rounds), em.hits)


def report(outcome: MPressOutcome) -> dict:
    """The planner's decisions as plain JSON (mpress.json): per stage which layers got which
    technique and why, the device mapping, the emulator's log."""
    stages: dict[str, list] = {}
    for c in outcome.choices:
        stages.setdefault(str(c.stage), []).append({
            "layer": c.layer, "action": c.action, "saved_bytes_per_microbatch": c.saved_bytes,
            "live_interval_s": c.live_s, "extra_s_per_microbatch": c.costs_s, "why": c.why})
    m = outcome.mapping
    return {
        "fits": outcome.fits, "iteration_time_s": outcome.iteration_s, "base_iteration_time_s": outcome.base_iteration_s,
        "simulations": outcome.simulations, "stop_reason": outcome.stop_reason,
        "rounds": [{"round": r.number, "start_s": r.start_s, "end_s": r.end_s, "gain": r.gain,
                    "candidates": r.candidates, "simulations": r.simulations} for r in outcome.rounds],
        "candidates_read_back": outcome.read_back,
        "mapping": {"device_of_stage": list(m.device_of_stage), "exact": m.exact, "candidates": m.candidates,
                    "targets": {str(s): [{"stage": t, "device": m.device_of_stage[t], "weight": w} for t, w in ts]
                                for s, ts in enumerate(m.targets) if ts},
                    "placed_bytes": list(m.placed_bytes), "swap_time_s": list(m.swap_time_s)},
        "stages": stages, "log": list(outcome.log),
        "optimizer_swap": {str(s): why for s, why in outcome.optimizer_swap},
        "host_bytes_per_node": list(outcome.host_bytes_per_node),
    }


def summary_lines(outcome: MPressOutcome) -> list[str]:
    """A few lines for the terminal: per stage the techniques' layer counts and bytes."""
    per: dict[int, dict[str, list[int]]] = {}
    for c in outcome.choices:
        if c.action != "keep":
            per.setdefault(c.stage, {}).setdefault(c.action, []).append(c.layer)
    lines = [f"mpress: {outcome.log[-1]}"]
    for n, nbytes in enumerate(outcome.host_bytes_per_node):
        if nbytes:
            over = " -- OVER host memory" if nbytes > outcome.host_capacity_bytes else ""
            lines.append(f"  host memory of node {n} (CPU swaps, offloaded optimizer state): {size_text(nbytes)} of "
                         f"{size_text(outcome.host_capacity_bytes)}{over}")
    for s, _ in outcome.optimizer_swap:
        per.setdefault(s, {})["optimizer state to host"] = []
    for s in sorted(per):
        parts = [f"{a} L{','.join(map(str, ls))}" if ls else a for a, ls in sorted(per[s].items())]
        lines.append(f"  stage {s} (device {outcome.mapping.device_of_stage[s]}): " + "; ".join(parts))
    return lines
