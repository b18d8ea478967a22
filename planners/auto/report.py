"""policy=auto's report (auto.json) and printed table (issue 23): the winner and why it won (per
stage: layout, actions, bottleneck), each single policy's own answer beside it, the Pareto frontier
of peak memory vs iteration time over everything simulated, and what was pruned or left out.
No clock readings: the same inputs give the same file, byte for byte."""
from __future__ import annotations

from collections import Counter

from planners.auto.candidate import Candidate, LAYOUT_ONLY, knobs, knobs_text, techniques
from planners.auto.search import AutoOutcome
from specs.units import size_text  # bytes in the unit their magnitude calls for (shared by the planners)
from specs.plan import Plan



def stage_rows(plan: Plan, cand: Candidate, capacity: int) -> list[dict]:
    """Per stage: layers, devices, dp × tp, actions by kind, window, peak and what binds it."""
    peaks = {d.device: d.peak_bytes for d in cand.result.devices}
    rows = []
    for s, st in enumerate(plan.stages):
        acts = Counter(m.action.value for m in st.memory)
        peak = max(peaks.get(d, 0) for d in st.devices)
        if st.sharding:
            binds = "MAP sharding: " + ("rotor checkpointing" if st.checkpoint else "no checkpointing")
        elif st.offload.window_layers:
            binds = (f"window of {st.offload.window_layers} layers: weights stream over PCIe"
                     + (f", {st.offload.streams} streams share it (STRONGHOLD §IV-A)" if st.offload.streams > 1
                        else ""))
        elif acts or st.offload.weight_swap_layers:
            binds = "memory: per-layer actions bring it under the capacity"
        else:
            binds = "compute" if peak <= capacity else "memory: over the capacity"
        rows.append({"stage": s, "layers": [st.layer_start, st.layer_stop], "devices": list(st.devices),
                     "dp": st.dp, "tp": st.tp, "cp": st.cp, "sequence_parallel": st.sequence_parallel,
                     "actions": dict(sorted(acts.items())),
                     "window_layers": st.offload.window_layers, "streams": st.offload.streams,
                     "optimizer_swap": st.offload.optimizer_swap,
                     "weight_swap": list(st.offload.weight_swap_layers),
                     "peak_bytes": peak, "use": round(peak / capacity, 4), "binds": binds})
    return rows


def combined(plan: Plan) -> bool:
    """The plan combines techniques no single layout planner has together: a memory technique
    (recompute, a swap, a window, ZeRO, MAP's sharding) with at least one other technique
    (pipelining, dp, tp, or another memory technique)."""
    t = techniques(plan)
    memory = [x for x in t if x not in LAYOUT_ONLY]
    return bool(memory) and len(t) >= 2


def report(outcome: AutoOutcome) -> dict:
    w, cap = outcome.winner, outcome.capacity_bytes
    best = outcome.best_single
    return {
        "capacity_bytes": cap,
        "fits": outcome.fits,
        "winner": {**w.row(), "combines": combined(w.plan), "notes": w.notes, "knobs": knobs(w.plan, outcome.model),
                   "stages": stage_rows(w.plan, w, cap),
                   "speedup_over_best_single": (best.candidate.time_s / w.time_s) if best is not None else None,
                   "best_single": best.name if best is not None else None},
        "singles": [s.row() | {"planning_s": None} for s in outcome.singles],
        "frontier": [c.row() for c in outcome.frontier],
        "search": {"layouts_priced": outcome.layouts_priced, "layouts_kept": outcome.layouts_kept,
                   "layouts_realised": outcome.layouts_realised, "stop": outcome.stop,
                   "pruned": dict(sorted(outcome.pruned.items())), "left_out": outcome.left_out,
                   "simulated": [c.row() for c in outcome.candidates]},
    }


def summary_lines(outcome: AutoOutcome) -> list[str]:
    """The printed table: singles beside auto, the frontier, the winner's stages, the pruning."""
    w, cap = outcome.winner, outcome.capacity_bytes
    lines = [f"auto: capacity {size_text(cap)} per device; {len(outcome.everything)} plans simulated "
             f"({outcome.layouts_realised} of {outcome.layouts_kept} kept layouts realised, "
             f"{outcome.layouts_priced} priced); {outcome.stop}"]
    lines.append(f"  {'policy':<12} {'fits':<5} {'iteration':>11} {'samples/s':>10} {'peak':>11}  techniques")
    for s in outcome.singles:
        c = s.candidate
        if c is None:
            lines.append(f"  {s.name:<12} {'-':<5} {'-':>11} {'-':>10} {'-':>11}  {s.error}")
            continue
        lines.append(f"  {s.name:<12} {'yes' if c.fits else 'NO':<5} {c.time_s:>9.3f} s {c.result.samples_per_s:>10.3f} "
                     f"{size_text(c.peak):>11}  {', '.join(techniques(c.plan)) or '-'}")
    lines.append(f"  {'auto':<12} {'yes' if w.fits else 'NO':<5} {w.time_s:>9.3f} s {w.result.samples_per_s:>10.3f} "
                 f"{size_text(w.peak):>11}  {', '.join(techniques(w.plan)) or '-'}  <- {w.source}: {w.how}")
    lines.append(f"  knobs: {knobs_text(w.plan, outcome.model)}")
    best = outcome.best_single
    if best is not None and w.fits:
        lines.append(f"  auto vs the best single policy ({best.name}): {best.candidate.time_s / w.time_s:.3f}x")
    lines.append("  frontier (peak vs iteration time): " + "; ".join(
        f"{size_text(c.peak)} {c.time_s:.3f} s ({c.source})" for c in outcome.frontier))
    for row in stage_rows(w.plan, w, cap):
        acts = ", ".join(f"{n} {k}" for k, n in row["actions"].items()) or "no action"
        lines.append(f"  stage {row['stage']}: layers {row['layers'][0]}-{row['layers'][1]} on {len(row['devices'])} "
                     f"device(s) dp{row['dp']}" + (f" cp{row['cp']}" if row["cp"] > 1 else "")
                     + f" tp{row['tp']}" + (" sp" if row["sequence_parallel"] else "") + f", {acts}"
                     + (f", window {row['window_layers']}, streams {row['streams']}" if row["window_layers"] else "")
                     + (f", weights+grads+optimizer to host L{','.join(map(str, row['weight_swap']))}"
                        if row.get("weight_swap") else "")
                     + f"; peak {size_text(row['peak_bytes'])} ({row['use']:.0%}); {row['binds']}")
    for reason, n in sorted(outcome.pruned.items()):
        lines.append(f"  pruned {n} layout(s): {reason}")
    for why in outcome.left_out:
        lines.append(f"  left out: {why}")
    return lines
