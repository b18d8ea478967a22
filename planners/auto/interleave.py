"""Interleaved 1F1B beside policy=auto's fastest layouts (issue 23; Narayanan et al. 2021 §2.2).

The layout table (layouts.py) prices non-interleaved pipelines only, and MPress's compaction takes
no interleaved plan (planners/mpress/compact.py: an over-full device is several chunks). So
interleaving enters after the search, as Megatron-LM configures it: for the fastest fitting
layouts whose stages are uniform (p stages of the same dp × tp, 1F1B, at least p microbatches),
the same p × dp × tp with v = 2, 3, 4 model chunks per device group (and the configured v), layers
split by compute balance (policy=balanced's partition), no memory action — tried only when the
layout fits as it is: interleaving holds more microbatches on the first groups — or every layer
recomputed (Megatron's full activation checkpointing). Where p does not divide the microbatch count,
Megatron-Core's microbatch groups make the schedule possible: the smallest group size it runs
(``schedule.microbatch_group_size``, specs.plan.smallest_microbatch_group). Each is simulated.

Heuristic, not exact: which layouts (the ``top`` fastest distinct uniform ones), the chunking
(balanced, not searched) and no per-layer actions on interleaved plans.
"""
from __future__ import annotations

from planners.auto.candidate import Candidate
from planners.auto.realise import simulated_candidate
from planners.layout import PlanningError
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.plan import PlanError, ScheduleSpec, smallest_microbatch_group

#: virtual stages tried per device group (Megatron's published runs use 2-3; the bubble shrinks as 1/v)
VIRTUAL_STAGES = (2, 3, 4)


def _uniform(layout) -> tuple[int, int] | None:
    """(dp, tp) when every stage of ``layout`` has the same sub-mesh, else None."""
    degrees = {p.degrees for p in layout.stages}
    return next(iter(degrees)) if len(degrees) == 1 else None


def interleaved(cands: list[Candidate], model: ModelSpec, hardware: HardwareSpec, plan_hw: HardwareSpec,
                capacity: int, schedule: ScheduleSpec, top: int = 2) -> list[Candidate]:
    """Interleaved versions of the ``top`` fastest fitting uniform 1F1B layouts in ``cands`` (module doc)."""
    from planners.baselines.partition import plan_balanced
    from planners.policy import BalancedPolicy

    vs = sorted(set(VIRTUAL_STAGES) | ({schedule.virtual_stages} if schedule.virtual_stages > 1 else set()))
    out: list[Candidate] = []
    seen: set = set()
    for c in sorted((c for c in cands if c.fits and c.layout is not None), key=lambda c: (c.time_s, c.how)):
        lay = c.layout
        mesh = _uniform(lay)
        p, training = len(lay.stages), lay.variant.training
        if mesh is None or p < 2 or lay.variant.schedule.kind.value != "1f1b" or training.microbatches < p:
            continue
        # p | m: Narayanan et al.'s schedule; else Megatron-Core's smallest microbatch group
        group = smallest_microbatch_group(training.microbatches, p) if training.microbatches % p else None
        key = (p, mesh, training.samples_per_microbatch)
        if key in seen:
            continue
        if len(seen) == top:
            break
        seen.add(key)
        dp, tp = mesh
        actions = ("none", "full") if max(lay.peaks_none) <= capacity else ("full",)
        for v in vs:
            if p * v > model.num_layers:
                break
            for recompute in actions:
                try:
                    zero = lay.variant.zero_stage
                    knobs = BalancedPolicy(pp=p, dp=dp, tp=tp, recompute=recompute, zero_stage=zero,
                                           overlap_grad_reduce=bool(zero) and dp > 1)
                    plan = plan_balanced(knobs, model, plan_hw, training, ScheduleSpec(
                        kind="interleaved_1f1b", virtual_stages=v, microbatch_group_size=group))
                    got = simulated_candidate(f"interleaved 1F1B, v={v}" + (f", microbatch groups of {group}"
                                                                            if group else "")
                                              + (", every layer recomputed" if recompute == "full" else ""),
                                     plan.model_copy(update={"planner": "auto"}), model, hardware, capacity)
                except (PlanningError, PlanError, ValueError):
                    continue
                got.how = f"{lay.text()} -> {got.how}"
                out.append(got)
    return out
