"""A candidate stage's place and its costed numbers, the vocabulary of planners.baselines.stagetable.

``Placed`` says which layers a stage holds on which GPUs with which (dp, tp); ``StageCost`` holds
what the stage table computed for it; ``stage_plan`` turns a placement into the pydantic
``StagePlan`` the costs functions and the final plan take; ``link_key`` names a link by what its
cost depends on (a placement's cost depends on its links, not on the devices themselves).
"""
from __future__ import annotations

from dataclasses import dataclass

from planners.layout import recompute_actions
from specs.model import ModelSpec
from specs.plan import StagePlan


@dataclass(frozen=True)
class Placed:
    """One stage of a candidate plan: layers [start, stop) on GPUs [gpu, gpu + degree).

    ``parallelism`` "pp" (degree 1), "dp", "tp", or "hybrid": dp = degree / tp replicas of a
    ``tp``-way tensor-parallel group (TP ranks adjacent, Megatron's order), as Alpa's (n, k)
    sub-meshes of whole nodes need at scale. ``tp`` is read only for "hybrid"."""

    start: int
    stop: int
    parallelism: str  # "pp" | "dp" | "tp" | "hybrid"
    degree: int
    gpu: int
    tp: int = 1

    @property
    def degrees(self) -> tuple[int, int]:
        """(dp, tp) of the stage."""
        if self.parallelism == "dp":
            return self.degree, 1
        if self.parallelism == "tp":
            return 1, self.degree
        if self.parallelism == "hybrid":
            return self.degree // self.tp, self.tp
        return 1, 1


@dataclass(frozen=True)
class StageCost:
    work_s: float            # forward + backward of one microbatch
    sync_s: float            # gradient all-reduce + optimizer step
    static_bytes: int        # weights + gradients + optimizer state
    weights_bytes: int
    act_bytes: int           # resident activations of one microbatch
    transient_bytes: int     # workspace (scratch, recomputed activations) + swap-in during one backward
    allreduce_bytes: int     # flat gradient copy during the dp all-reduce (0 without dp)
    buffer_bytes: int        # the received boundary gradient (the sent one is grad_bytes)
    out_bytes: int           # boundary activation sent downstream per microbatch (per replica)
    grad_bytes: int = 0      # the input gradient sent back: from the end of the first backward on
    update_flat_bytes: int = 0  # PipeDream: the flat copy of each update's dp all-reduce (0 without dp)


def stage_plan(p: Placed, model: ModelSpec, recompute: str = "none") -> StagePlan:
    dp, tp = p.degrees
    return StagePlan(layer_start=p.start, layer_stop=p.stop, devices=list(range(p.gpu, p.gpu + p.degree)),
                     dp=dp, tp=tp, memory=recompute_actions(model, p.start, p.stop, recompute))


def link_key(link) -> tuple | None:
    return None if link is None else (link.kind, link.count, link.bw_gbps, link.latency_s)
