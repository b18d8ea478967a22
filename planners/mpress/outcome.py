"""What the MPress planner hands back (MPress §III-B, the static part's output: Table IV's
per-tensor strategies): :class:`MPressOutcome` with the plan, the per-layer choices and why, the
mapping and the emulator's log; :func:`report` as mpress.json, :func:`summary_lines` for the
terminal.

Pure: no I/O, no clocks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from planners.mpress.assign import Assignment, period_text, size_text, with_actions
from planners.mpress.emulate import Emulator, fits as _fits, host_bytes_per_node
from planners.mpress.facts import CPU, D2D, KEEP
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
    microbatch_period: int = 1  # the action takes every n-th microbatch (LayerMemory.microbatch_period)
    # a swap of some saved tensors only (LayerMemory.tensors, MPress §III-D): per tensor (index,
    # name, bytes per microbatch, live interval s, whether its round trip hides); () = whole layer
    tensors: tuple = ()
    moved_bytes: int = 0        # what the action moves off the device per microbatch (0: keep, recompute)


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
    # MPress §II-D weight swap (planners/mpress/weights.py): (stage, layer, why), in the order chosen
    weight_swap: tuple[tuple[int, int, str], ...] = ()


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


def tensor_rows(st: Assignment, key: tuple[int, int]) -> tuple:
    """The tensors a per-tensor swap of ``key`` moves: (index, name, bytes per microbatch, live
    interval s, hides); () when the layer is not swapped per tensor."""
    action, sub = st.actions.get(key), st.tensors.get(key)
    if sub is None or action not in (CPU, D2D):
        return ()
    return tuple((t.index, t.name, t.nbytes, t.live_s, t.hides(action)) for t in st.facts[key].subset(sub))


def layer_choices(st: Assignment, allowed: list) -> tuple[LayerChoice, ...]:
    """Per layer that had a choice, its action, facts, every technique's estimate (whole layer)
    and why, with the tensors a per-tensor swap moves."""
    facts, mapping = st.facts, st.mapping
    out = []
    for s, l in sorted(st.why):
        action = st.actions.get((s, l), KEEP)
        out.append(LayerChoice(
            stage=s, layer=l, action=action.value, saved_bytes=facts[(s, l)].saved_bytes, live_s=facts[(s, l)].live_s,
            costs_s={a.value: facts[(s, l)].cost_s(a) for a in allowed if a is not D2D or mapping.targets[s]},
            why=st.why[(s, l)], microbatch_period=st.period.get((s, l), 1), tensors=tensor_rows(st, (s, l)),
            moved_bytes=st.moved_bytes((s, l)) if action in (CPU, D2D) else 0))
    return tuple(out)


def optimizer_why(s: int, why: str, choices: tuple[LayerChoice, ...], plan: Plan) -> str:
    """An optimizer swap's reason as of the final plan: the reason was given when it was assigned
    (choice.py: with every layer of the stage compacted); layers that went back to keep since are
    named, so the text does not claim a state the plan no longer has."""
    kept = [l for l in plan.stages[s].layers if plan.stages[s].action_of(l).action.value == "keep"]
    if not kept:
        return why
    n = len(plan.stages[s].layers)
    return (f"{why}; since then layer{'s' if len(kept) > 1 else ''} {','.join(map(str, kept))} went back to keep "
            f"({n - len(kept)} of {n} compacted now)")


def final_outcome(em: Emulator, st: Assignment, allowed: list, sim, first, fits: bool,
                  hardware: HardwareSpec, stop: str, rounds: tuple = (), weights=()) -> MPressOutcome:
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
                         tuple((s, optimizer_why(s, st.opt_why[s], choices, plan)) for s in sorted(st.opt_swap)),
                         tuple(per_node),
                         hardware.host.memory_bytes, stop, tuple(rounds), em.hits,
                         tuple((c.stage, c.layer, c.why) for c in weights
                               if c.layer in plan.stages[c.stage].offload.weight_swap_layers))


def report(outcome: MPressOutcome) -> dict:
    """The planner's decisions as plain JSON (mpress.json): per stage which layers got which
    technique and why, the device mapping, the emulator's log."""
    stages: dict[str, list] = {}
    for c in outcome.choices:
        stages.setdefault(str(c.stage), []).append({
            "layer": c.layer, "action": c.action, "microbatch_period": c.microbatch_period,
            "applies_to": period_text(c.microbatch_period) if c.action != "keep" else "",
            "saved_bytes_per_microbatch": c.saved_bytes, "live_interval_s": c.live_s,
            "moved_bytes_per_microbatch": c.moved_bytes,
            # MPress §III-D per tensor: the saved tensors a partial swap moves (null: the whole layer)
            "tensors": [{"index": i, "name": n, "bytes_per_microbatch": b, "live_interval_s": live, "hides": h}
                        for i, n, b, live, h in c.tensors] if c.tensors else None,
            "extra_s_per_microbatch": c.costs_s, "why": c.why})
    m = outcome.mapping
    return {
        "fits": outcome.fits, "iteration_time_s": outcome.iteration_s, "base_iteration_time_s": outcome.base_iteration_s,
        "simulations": outcome.simulations, "stop_reason": outcome.stop_reason,
        "rounds": [{"round": r.number, "start_s": r.start_s, "end_s": r.end_s, "gain": r.gain,
                    "candidates": r.candidates, "simulations": r.simulations} for r in outcome.rounds],
        "candidates_read_back": outcome.read_back,
        "mapping": {"device_of_stage": list(m.device_of_stage), "identity": is_identity(m),
                    "exact": m.exact, "candidates": m.candidates,
                    "targets": {str(s): [{"stage": t, "device": m.device_of_stage[t], "weight": w} for t, w in ts]
                                for s, ts in enumerate(m.targets) if ts},
                    "placed_bytes": list(m.placed_bytes), "swap_time_s": list(m.swap_time_s)},
        "stages": stages, "log": list(outcome.log),
        "optimizer_swap": {str(s): why for s, why in outcome.optimizer_swap},
        "host_bytes_per_node": list(outcome.host_bytes_per_node),
        "why_conflicts": why_conflicts(outcome),
        # PipeDream's stashed weight versions waiting in host memory (planners/mpress/stash.py)
        "stash_swap": {str(s): list(st.offload.stash_swap_layers)
                       for s, st in enumerate(outcome.plan.stages) if st.offload.stash_swap_layers},
        # live weights, gradients and optimizer state in host memory (planners/mpress/weights.py)
        "weight_swap": {str(s): [{"layer": l, "why": why} for t, l, why in outcome.weight_swap if t == s]
                        for s in sorted({t for t, _, _ in outcome.weight_swap})},
    }


def is_identity(mapping: Mapping) -> bool:
    """Stage i on device i: the mapping a run without D2D (or with mapping=identity) keeps."""
    return list(mapping.device_of_stage) == list(range(len(mapping.device_of_stage)))


def mapping_summary(mapping: Mapping) -> str:
    """'identity (stage i on device i)' or the permutation, for the terminal."""
    if is_identity(mapping):
        return "identity (stage i on device i)"
    return " ".join(f"s{s}->d{d}" for s, d in enumerate(mapping.device_of_stage))


_TRIP = re.compile(r"round trip 2 x ([0-9.]+) ms over (PCIe|NVLink stripes) (hides in|does not hide in) its live "
                   r"([0-9.]+) ms")
_EVERY = re.compile(r"every (\d+)(?:st|nd|rd|th) microbatch")
_LINK = {"PCIe": "cpu_swap", "NVLink stripes": "d2d_swap"}
#: choice.reason's per-tensor clause: 'NAME SIZE UNIT: 2 x ONE ms in its live LIVE ms, hides'
_TENSOR = re.compile(r"(?:\(|; )([^;()]+?) [0-9.]+ (?:GiB|MiB|KiB|B): 2 x ([0-9.]+) ms in its live ([0-9.]+) ms, "
                     r"(hides|does not hide)")
_OF = re.compile(r"^\w+: (\d+) of \d+ saved tensors")


def tensor_conflicts(c: LayerChoice, item) -> list[str]:
    """Where a per-tensor reason disagrees with the plan's item (LayerMemory): tensors named
    that the plan does not list (or the reverse), or a 'hides' that its own numbers contradict."""
    where = f"stage {c.stage} layer {c.layer} ({c.action})"
    of = _OF.search(c.why)
    listed = list(item.tensors) if item is not None and item.tensors is not None else None
    if of is None:
        return [f"{where}: the plan swaps tensors {listed}, the reason names none"] if listed is not None else []
    said = [m[1] for m in _TENSOR.finditer(c.why)]
    out = []
    if listed is None:
        return [f"{where}: the reason names tensors {said}, the plan swaps the whole layer"]
    if said != [n for _, n, _, _, _ in c.tensors] or [i for i, *_ in c.tensors] != listed or int(of[1]) != len(listed):
        out.append(f"{where}: the reason names tensors {said}, the plan swaps {listed}")
    for m in _TENSOR.finditer(c.why):
        one_ms, live_ms, hides = float(m[2]), float(m[3]), m[4] == "hides"
        slack = 2 * 0.005 + 0.05
        if (hides and 2 * one_ms > live_ms + slack) or (not hides and 2 * one_ms < live_ms - slack):
            out.append(f"{where}: says {m[1]} {m[4]} in {live_ms} ms with a round trip of {2 * one_ms:.2f} ms")
    return out


def why_conflicts(outcome: MPressOutcome) -> list[str]:
    """Where a reason text says something the plan does not do: a reason naming another technique
    than the layer's action, a swap whose 'hides in' disagrees with its own round trip and live
    interval (at the printed precision), a microbatch period other than the layer's, an
    optimizer swap claiming every layer compacted while some keep. Empty when all agree."""
    out = []
    for c in outcome.choices:
        where = f"stage {c.stage} layer {c.layer} ({c.action})"
        if not c.why.startswith(f"{c.action}:"):
            out.append(f"{where}: reason names another technique: {c.why!r}")
        trip = _TRIP.search(c.why)
        if trip is not None:
            one_ms, link, hides, live_ms = float(trip[1]), trip[2], trip[3] == "hides in", float(trip[4])
            if _LINK[link] != c.action:
                out.append(f"{where}: reason prices a swap over {link}: {c.why!r}")
            slack = 2 * 0.005 + 0.05  # the printed precision: 0.01 ms one way, 0.1 ms live
            if (hides and 2 * one_ms > live_ms + slack) or (not hides and 2 * one_ms < live_ms - slack):
                out.append(f"{where}: says it {trip[3]} {live_ms} ms with a round trip of {2 * one_ms:.2f} ms")
        every = _EVERY.search(c.why)
        said = int(every[1]) if every else 1
        if c.action != "keep" and said != c.microbatch_period:
            out.append(f"{where}: reason says every {said}, the plan every {c.microbatch_period} microbatch")
        stage = outcome.plan.stages[c.stage]
        item = next((m for m in stage.memory if m.layer == c.layer), None)
        out += tensor_conflicts(c, item)
    for s, why in outcome.optimizer_swap:
        stage = outcome.plan.stages[s]
        kept = [l for l in stage.layers if stage.action_of(l).action.value == "keep"]
        if "every layer compacted" in why and kept and "went back to keep" not in why:
            out.append(f"stage {s} optimizer swap: says every layer compacted, layers {kept} keep")
    return out


def summary_lines(outcome: MPressOutcome) -> list[str]:
    """A few lines for the terminal: the result, the device mapping ('identity' when stage i is on
    device i), host memory, per stage its techniques' layers (a layer taking every n-th microbatch
    says so), and any reason text that disagrees with the plan (:func:`why_conflicts`)."""
    per: dict[int, dict[str, list[str]]] = {}
    for c in outcome.choices:
        if c.action != "keep":
            tag = f"{c.layer} ({period_text(c.microbatch_period)})" if c.microbatch_period > 1 else str(c.layer)
            if c.tensors:
                tag += f" (tensors {names_text([n for _, n, *_ in c.tensors])}, {size_text(c.moved_bytes)})"
            per.setdefault(c.stage, {}).setdefault(c.action, []).append(tag)
    lines = [f"mpress: {outcome.log[-1]}", f"  device mapping: {mapping_summary(outcome.mapping)}"]
    for n, nbytes in enumerate(outcome.host_bytes_per_node):
        if nbytes:
            over = " -- OVER host memory" if nbytes > outcome.host_capacity_bytes else ""
            lines.append(f"  host memory of node {n} (swap space, offloaded model state): {size_text(nbytes)} of "
                         f"{size_text(outcome.host_capacity_bytes)}{over}")
    for s, _ in outcome.optimizer_swap:
        per.setdefault(s, {})["optimizer state to host"] = []
    for s, stage in enumerate(outcome.plan.stages):  # PipeDream's stashed weight versions (MPress §II-D)
        stashed = list(stage.offload.stash_swap_layers)
        if stashed:
            per.setdefault(s, {})["stashed weights to host"] = [str(l) for l in stashed]
        live = list(stage.offload.weight_swap_layers)  # live weights, gradients, optimizer state
        if live:
            per.setdefault(s, {})["weights+grads+optimizer to host"] = [str(l) for l in live]
    for s in sorted(per):
        parts = [f"{a} L{','.join(map(str, ls))}" if ls else a for a, ls in sorted(per[s].items())]
        lines.append(f"  stage {s} (device {outcome.mapping.device_of_stage[s]}): " + "; ".join(parts))
    lines += [f"  reason disagrees with the plan: {x}" for x in why_conflicts(outcome)]
    return lines


def names_text(names: list[str]) -> str:
    """Tensor names joined by '+', a name repeated in a row once with its count (LayerNorm saves its
    output, mean and rstd, all made by one operator: 'ln1:aten.native_layer_norm x3')."""
    out: list[tuple[str, int]] = []
    for n in names:
        if out and out[-1][0] == n:
            out[-1] = (n, out[-1][1] + 1)
        else:
            out.append((n, 1))
    return "+".join(n if c == 1 else f"{n} x{c}" for n, c in out)

