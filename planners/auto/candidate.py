"""A plan policy=auto considered, with its simulated result and what it combines (issue 23)."""
from __future__ import annotations

from dataclasses import dataclass, field

from costs.buffers import p2p_split
from specs.plan import MemoryAction, Plan
from specs.result import Result


def over_capacity(result: Result, capacity: int) -> bool:
    """Some device's simulated peak above ``capacity`` (device memory or the user's budget), or a
    node short of host RAM / NVMe."""
    return any(d.peak_bytes > capacity or d.host_oom for d in result.devices)


def peak_bytes(result: Result) -> int:
    return max(d.peak_bytes for d in result.devices)


def techniques(plan: Plan) -> list[str]:
    """What the plan combines, in a fixed order: pipeline, dp, tp, ZeRO, each per-layer action, the
    STRONGHOLD window (with CPU optimizer / NVMe), MPress's optimizer swap, MAP's sharding."""
    found = set()
    if plan.pipeline_depth > 1:
        found.add("pipeline")
    if plan.zero_stage:
        found.add(f"zero{plan.zero_stage}")
    for stage in plan.stages:
        if stage.sharding:
            found.add("map_sharding")
            if stage.checkpoint:
                found.add("rotor_checkpointing")
            continue
        if stage.dp > 1:
            found.add("dp")
        if stage.tp > 1:
            found.add("tp")
        if stage.sequence_parallel:
            found.add("sequence_parallel")
        if stage.cp > 1:
            found.add("cp")
        for item in stage.memory:
            if item.action is not MemoryAction.keep:
                found.add(item.action.value)
        if stage.offload.window_layers:
            found.add("window")
        if stage.offload.nvme:
            found.add("nvme")
        if stage.offload.optimizer_swap:
            found.add("optimizer_swap")
        if stage.offload.stash_swap_layers:  # PipeDream's stashed versions in host (or peer) memory, MPress §II-D
            found.add("stash_swap")
        if stage.offload.weight_swap_layers:  # live weights, gradients, optimizer state in host memory, §II-D
            found.add("weight_swap")
        if stage.offload.optimizer_on_cpu and not stage.offload.window_layers:  # ZeRO-Offload
            found.add("optimizer_on_cpu")
    if plan.overlap_grad_reduce:
        found.add("overlap_grad_reduce")
    if plan.overlap_param_gather:
        found.add("overlap_param_gather")
    if plan.p2p_scatter_gather and any(p2p_split(plan, a, b) > 1 for a, b in zip(plan.stages, plan.stages[1:])):
        found.add("p2p_scatter_gather")
    if plan.schedule.kind.value in ("zb_h1", "zbv", "dualpipev", "zb_auto") and plan.pipeline_depth > 1:
        found.add(plan.schedule.kind.value)
        if plan.schedule.weight_store:
            found.add("weight_store")
    order = ["pipeline", "zb_h1", "zbv", "dualpipev", "zb_auto", "weight_store", "dp", "cp", "tp", "sequence_parallel", "zero1", "zero2",
             "zero3", "overlap_grad_reduce", "overlap_param_gather", "p2p_scatter_gather", "recompute", "selective", "cpu_swap", "d2d_swap",
             "nvme",
             "window", "optimizer_swap", "optimizer_on_cpu", "stash_swap", "weight_swap", "map_sharding",
             "rotor_checkpointing"]
    return [t for t in order if t in found]


#: techniques that are not memory actions: a plan "combines" when it has ≥ 2 of the others or mixes
LAYOUT_ONLY = {"pipeline", "dp", "tp", "cp", "zb_h1", "zbv", "dualpipev", "zb_auto", "weight_store", "overlap_grad_reduce",
               "overlap_param_gather",
               "p2p_scatter_gather"}


def knobs(plan: Plan, model=None) -> dict:
    """The Megatron-Core / torchtitan knobs of ``plan`` (issue 27), as a run sets them: schedule,
    sequence parallelism, recompute (none; full or selective when every block takes it, given
    ``model``; else per-layer), ZeRO stage and the overlaps, context parallelism."""
    from planners.layout import RECOMPUTED_KINDS, SELECTIVE_KINDS

    by = {a: {m.layer for st in plan.stages for m in st.memory if m.action is a}
          for a in (MemoryAction.recompute, MemoryAction.selective, MemoryAction.op_sac)}
    rec, sel, op = by[MemoryAction.recompute], by[MemoryAction.selective], by[MemoryAction.op_sac]
    if not rec and not sel and not op:
        recompute = "none"
    elif model is not None and not rec and not sel and op >= {i for i, x in enumerate(model.layers) if x.has_op_sac}:
        recompute = "op_sac"
    elif model is not None and not sel and not op and rec >= {i for i, x in enumerate(model.layers)
                                                         if x.kind in RECOMPUTED_KINDS}:
        recompute = "full"
    elif model is not None and not rec and not op and sel >= {i for i, x in enumerate(model.layers)
                                                         if x.kind in SELECTIVE_KINDS}:
        recompute = "selective"
    else:
        recompute = f"per-layer ({len(rec)} full, {len(sel)} selective" + (f", {len(op)} op_sac)" if op else ")")
    return {"schedule": plan.schedule.kind.value, "virtual_stages": plan.schedule.virtual_stages,
            "sequence_parallel": any(st.sequence_parallel for st in plan.stages), "recompute": recompute,
            "zero_stage": plan.zero_stage, "overlap_grad_reduce": plan.overlap_grad_reduce,
            "overlap_param_gather": plan.overlap_param_gather, "cp": max(st.cp for st in plan.stages)}


def knobs_text(plan: Plan, model=None) -> str:
    k = knobs(plan, model)
    return (f"schedule {k['schedule']}" + (f" v={k['virtual_stages']}" if k["virtual_stages"] > 1 else "")
            + (f" (ZB-{plan.schedule.zb_memory_limit:g}p)" if plan.schedule.zb_memory_limit else "")
            + (" with weight_store" if plan.schedule.weight_store else "")
            + f", sequence_parallel {'on' if k['sequence_parallel'] else 'off'}, recompute {k['recompute']}"
            + f", zero_stage {k['zero_stage']}, overlap_grad_reduce {'on' if k['overlap_grad_reduce'] else 'off'}"
            + (", overlap_param_gather on" if k["overlap_param_gather"] else "") + f", cp {k['cp']}"
            + (", p2p_scatter_gather on" if plan.p2p_scatter_gather else ""))


@dataclass
class Candidate:
    """One simulated plan: where it came from (a single policy's name, or "auto" with how it was
    built), whether it fits the capacity, its time and peak."""

    source: str
    how: str
    plan: Plan
    result: Result
    fits: bool
    notes: list[str] = field(default_factory=list)
    layout: object = field(default=None, repr=False, compare=False)  # the auto layout it realises, if any

    @property
    def time_s(self) -> float:
        return self.result.iteration_time_s

    @property
    def peak(self) -> int:
        return peak_bytes(self.result)

    def row(self) -> dict:
        return {"source": self.source, "how": self.how, "fits": self.fits,
                "iteration_time_s": self.time_s, "samples_per_s": self.result.samples_per_s,
                "peak_bytes": self.peak, "techniques": techniques(self.plan), "plan_id": self.plan.id}


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """The frontier of (peak bytes, iteration time) over ``cands``: no other is lower in both
    (ties broken by source, so the same inputs give the same frontier), fastest last."""
    ordered = sorted(cands, key=lambda c: (c.peak, c.time_s, c.source, c.how))
    out: list[Candidate] = []
    for c in ordered:
        if not out or c.time_s < out[-1].time_s:
            out.append(c)
    return out
