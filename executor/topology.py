"""Pure bookkeeping of a plan at run time: ranks, per-stage coordinates and boundary routes.

Rank r runs plan device ``plan.used_devices()[r]``. A stage's devices are ordered tensor-parallel
fastest (``devices[replica * tp + tp_rank]``); replica ``r`` of a stage with data-parallel degree
``d`` takes rows ``[r·b/d, (r+1)·b/d)`` of each pipeline microbatch of ``b`` samples.

Why not ``torch.distributed.pipelining``: its ``PipelineStage`` assumes one rank per stage in a
pipeline group and the same data-parallel/tensor-parallel layout on every stage (the DP and TP
meshes are the same shape for all stages). CAPTURE/Alpa plans give each stage its own (dp, tp), so
a boundary tensor must be re-split along the batch dim between two differently shaped meshes; the
routes below do that, and the executor walks ``specs.schedule`` lists (the simulator's) instead of
torch's schedule IR so that both sides run the same action order.
"""
from __future__ import annotations

from typing import NamedTuple

from specs.plan import Plan, StagePlan
from specs.sharding import mesh_lines


class Route(NamedTuple):
    """One point-to-point piece of a boundary tensor: rows [start, stop) of the microbatch."""

    src_device: int
    dst_device: int
    start: int
    stop: int


def rank_of_device(plan: Plan) -> dict[int, int]:
    return {d: r for r, d in enumerate(plan.used_devices())}


def coords(stage: StagePlan, device: int) -> tuple[int, int]:
    """(replica, tp_rank) of ``device`` within ``stage``."""
    i = stage.devices.index(device)
    return divmod(i, stage.tp)


def mesh_coords(stage: StagePlan, device: int) -> tuple[int, int, int]:
    """(replica, cp_rank, tp_rank) of ``device`` within ``stage``: devices are ordered tp fastest,
    then cp, then dp (``devices[(replica*cp + cp_rank)*tp + tp_rank]``, specs/plan_stage.py). At
    cp 1 the first and last are :func:`coords`."""
    rc, t = divmod(stage.devices.index(device), stage.tp)
    r, c = divmod(rc, stage.cp)
    return r, c, t


def cp_group_devices(stage: StagePlan) -> list[list[int]]:
    """The devices of every context-parallel ring of ``stage``, one per (replica, tp_rank), in
    cp-rank order: ``[devices[(r*cp + c)*tp + t] for c < cp]``; empty at cp 1. (The gradient
    all-reduce spans dp x cp ranks of one tp_rank: ``devices[t::tp]``.)"""
    if stage.cp == 1:
        return []
    cp, tp = stage.cp, stage.tp
    return [[stage.devices[(r * cp + c) * tp + t] for c in range(cp)] for r in range(stage.dp) for t in range(tp)]


def replica_rows(plan: Plan, stage: StagePlan, replica: int) -> tuple[int, int]:
    """Rows of the pipeline microbatch that ``replica`` of ``stage`` processes."""
    per = plan.training.samples_per_microbatch // stage.dp
    return replica * per, (replica + 1) * per


def routes(plan: Plan, src: int, dst: int) -> list[Route]:
    """Pieces that carry a boundary tensor from stage ``src`` to stage ``dst`` (activations go
    s -> s+1, gradients s+1 -> s). Every device of ``dst`` needs its replica's rows (all TP ranks
    of a replica hold the whole, replicated, boundary tensor); it gets them from each ``src``
    replica whose rows overlap, from that replica's TP rank ``dst_tp % src.tp`` (spreads the
    sends over the sender's TP ranks) and, under context parallelism, its own cp rank (equal cp on
    both stages: the sequence positions are the cp rank's). Both ends compute the same ordered list."""
    a, b = plan.stages[src], plan.stages[dst]
    if a.cp != b.cp:
        raise ValueError(f"stages {src} and {dst}: cp {a.cp} and {b.cp}; a boundary between context-parallel "
                         f"stages needs equal cp (each cp rank sends its own sequence positions)")
    out = []
    for dst_device in b.devices:
        r_dst, c, t_dst = mesh_coords(b, dst_device)  # cp > 1: cp rank c talks to cp rank c only
        lo, hi = replica_rows(plan, b, r_dst)
        for r_src in range(a.dp):
            s_lo, s_hi = replica_rows(plan, a, r_src)
            start, stop = max(lo, s_lo), min(hi, s_hi)
            if start < stop:
                out.append(Route(a.devices[(r_src * a.cp + c) * a.tp + t_dst % a.tp], dst_device, start, stop))
    return out


def process_groups(plan: Plan) -> list[tuple[str, int, int, list[int]]]:
    """Every sub-group the run needs, in one fixed order (``new_group`` is collective: all ranks
    create all groups in the same order): ("tp", stage, replica·cp + cp_rank, ranks) per replica
    and cp rank with tp > 1, ("dp", stage, tp_rank, ranks) per TP rank with dp·cp > 1 (its dp x cp
    ranks: the gradient all-reduce of context parallelism too), ("embed", 0, 0, ranks) over the first
    and last stage when they hold different devices. A MAP stage with an N-D mesh (N > 1) also
    gets ("map", stage, axis, ranks) for every line along every axis (its DeviceMesh's dim groups,
    executor.map_stage.build_mesh; a rank keeps the one line per axis it is on). A 1-D MAP mesh is
    the stage's "tp" group (tp = all its devices)."""
    rank = rank_of_device(plan)
    out = []
    for s, st in enumerate(plan.stages):
        if st.tp > 1:  # one per (replica, cp rank): index replica·cp + cp_rank (the replica at cp 1)
            for r in range(st.dp * st.cp):
                out.append(("tp", s, r, [rank[d] for d in st.devices[r * st.tp:(r + 1) * st.tp]]))
        if st.dp * st.cp > 1:  # the gradient all-reduce spans the dp x cp ranks of one tp rank
            for t in range(st.tp):
                out.append(("dp", s, t, [rank[d] for d in st.devices[t::st.tp]]))
        shapes = {tuple(x.mesh) for x in st.sharding}
        if len(shapes) == 1 and len(next(iter(shapes))) > 1:  # several shapes: map_exec refuses the stage
            shape = next(iter(shapes))
            for axis in range(len(shape)):
                for line in mesh_lines(st.devices, shape, axis):
                    out.append(("map", s, axis, [rank[d] for d in line]))
    first, last = set(plan.stages[0].devices), set(plan.stages[-1].devices)
    if not first & last:  # Megatron's embedding group: first and last stage (tied embeddings)
        out.append(("embed", 0, 0, sorted(rank[d] for d in first | last)))
    return out


def message_tag(kind: str, stage: int, microbatch: int, microbatches: int) -> int:
    """gloo tag of a boundary message: unique per (act|grad, sending stage, microbatch)."""
    return (stage * 2 + (kind == "grad")) * microbatches + microbatch
