"""Pipeline schedules as data: one ordered list of actions per pipeline position.

``build_schedule(plan)`` returns ``{position: [Action, ...]}`` for positions 0..p-1. Every device of
a position's group (all dp replicas and tp ranks) walks the same list; the simulator walks it for
one representative and the executor walks it on every rank, so the list is explicit and complete.

Ordering rules (why the lists cannot deadlock):
- ``send_*`` is non-blocking (isend: the sender goes on at once); ``recv_*`` blocks until the
  matching send has arrived. A recv sits immediately before the compute that consumes it, a send
  immediately after the compute that produced it. With non-blocking sends the only waits are
  recv -> send edges, and in GPipe, 1F1B and Megatron's interleaved order every such edge points
  to a compute that precedes, in its own list, anything waiting on the receiver — so no cycle.
  An executor that uses blocking NCCL send/recv must batch them (batch_isend_irecv) to keep this.
- Matching: ``send_act(stage=s, peer_stage=s+1, mb=k)`` pairs with ``recv_act(stage=s+1,
  peer_stage=s, mb=k)``; ``send_grad(stage=s, peer_stage=s-1)`` with ``recv_grad(stage=s-1,
  peer_stage=s)``. :func:`pairs` gives the key both ends share.
- ``swap_out`` (per swapped layer) follows the forward that produced the activations; its copy
  runs asynchronously on a copy engine. ``swap_in`` (prefetch) is issued one compute action
  before the backward that needs it (MPress §IV: overlap the copy with the preceding pass), but
  never before its own swap_out. ``recompute`` entries sit right before their backward in reverse
  layer order: the backward re-runs those layers' forwards from their checkpointed inputs.
- ``allreduce_grads`` and ``optimizer_step`` close the iteration, one per stage on the position,
  after the position's last backward (the flush; PipeDream async charges them once per iteration
  too, see :func:`build_schedule`).
"""
from __future__ import annotations

from enum import Enum

from pydantic import Field

from specs._base import Spec
from specs.plan import MemoryAction, Plan, ScheduleKind, stage_for_microbatch

SWAPS = (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme)


class ActionKind(str, Enum):
    forward = "forward"
    backward = "backward"
    send_act = "send_act"
    recv_act = "recv_act"
    send_grad = "send_grad"
    recv_grad = "recv_grad"
    swap_out = "swap_out"
    swap_in = "swap_in"
    recompute = "recompute"
    allreduce_grads = "allreduce_grads"
    optimizer_step = "optimizer_step"


class Action(Spec):
    """One step of a position's list. ``stage`` is the (chunk) stage index acting on this
    position; ``peer_stage`` the stage at the other end of a send/recv."""

    kind: ActionKind
    stage: int = Field(ge=0)
    microbatch: int | None = Field(None, ge=0)
    layer: int | None = Field(None, ge=0)
    peer_stage: int | None = Field(None, ge=0)


def compute_order(kind: ScheduleKind, p: int, m: int, v: int, i: int) -> list[tuple[str, int, int]]:
    """Order of passes on position ``i`` of ``p``: [("F"|"B", stage, microbatch), ...]."""
    if kind is ScheduleKind.gpipe:
        # GPipe §2.2: all forwards, then all backwards, then one flush.
        return [("F", i, k) for k in range(m)] + [("B", i, k) for k in range(m)]
    if kind is ScheduleKind.interleaved_1f1b:
        return _interleaved(p, m, v, i)
    # 1F1B (PipeDream-Flush / DAPPLE) and PipeDream async share the order: p - i - 1 warm-up
    # forwards, then one forward + one backward, then the cool-down backwards (PipeDream-2BW §3),
    # so at most min(p - i, m) microbatches are in flight on position i.
    warm = min(p - i - 1, m)
    ops = [("F", i, k) for k in range(warm)]
    for j in range(m - warm):
        ops += [("F", i, warm + j), ("B", i, j)]
    ops += [("B", i, k) for k in range(m - warm, m)]
    return ops


def _interleaved(p: int, m: int, v: int, i: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021 §2.2): virtual microbatch u runs chunk
    (u // p) % v forward (v - 1 - that backward) on microbatch (u // pv)·p + u % p; warm-up is
    (p - i - 1)·2 + (v - 1)·p virtual microbatches. Needs m % p == 0 (validate_plan checks)."""
    total = m * v
    mb = lambda u: (u // (p * v)) * p + u % p  # noqa: E731
    fwd = lambda u: ("F", ((u // p) % v) * p + i, mb(u))  # noqa: E731
    bwd = lambda u: ("B", (v - 1 - (u // p) % v) * p + i, mb(u))  # noqa: E731
    warm = min((p - i - 1) * 2 + (v - 1) * p, total)
    ops = [fwd(u) for u in range(warm)]
    for u in range(total - warm):
        ops += [fwd(warm + u), bwd(u)]
    ops += [bwd(u) for u in range(total - warm, total)]
    return ops


def build_schedule(plan: Plan) -> dict[int, list[Action]]:
    """The plan's action list per pipeline position (0..p-1); see the module docstring.

    PipeDream async uses the 1F1B order without flush semantics: the simulator keeps one weight
    version per in-flight microbatch (weight stashing, PipeDream §3.3) and times the iteration as
    its steady state; the closing all-reduce/optimizer entries stand for the per-minibatch updates.
    """
    p, m, v = plan.pipeline_depth, plan.training.microbatches, plan.schedule.virtual_stages
    last = len(plan.stages) - 1
    out: dict[int, list[Action]] = {}
    for i in range(p):
        groups: list[list[Action]] = []  # one group per pass: its recvs, itself, its sends
        for pass_, s, k in compute_order(plan.schedule.kind, p, m, v, i):
            stage = stage_for_microbatch(plan.stages[s], k)  # the actions that apply to microbatch k
            group: list[Action] = []
            if pass_ == "F":
                if s > 0:
                    group.append(Action(kind=ActionKind.recv_act, stage=s, microbatch=k, peer_stage=s - 1))
                group.append(Action(kind=ActionKind.forward, stage=s, microbatch=k))
                group += [Action(kind=ActionKind.swap_out, stage=s, microbatch=k, layer=l)
                          for l in stage.layers if stage.action_of(l).action in SWAPS]
                if s < last:
                    group.append(Action(kind=ActionKind.send_act, stage=s, microbatch=k, peer_stage=s + 1))
            else:
                swaps = [Action(kind=ActionKind.swap_in, stage=s, microbatch=k, layer=l)
                         for l in reversed(stage.layers) if stage.action_of(l).action in SWAPS]
                prev = groups[-1] if groups else None
                produced_here = prev is not None and any(
                    a.kind is ActionKind.forward and a.stage == s and a.microbatch == k for a in prev)
                if prev is not None and not produced_here:
                    prev[:0] = swaps  # prefetch one pass ahead
                else:
                    group += swaps
                if s < last:
                    group.append(Action(kind=ActionKind.recv_grad, stage=s, microbatch=k, peer_stage=s + 1))
                group += [Action(kind=ActionKind.recompute, stage=s, microbatch=k, layer=l)
                          for l in reversed(stage.layers) if stage.action_of(l).action is MemoryAction.recompute]
                group.append(Action(kind=ActionKind.backward, stage=s, microbatch=k))
                if s > 0:
                    group.append(Action(kind=ActionKind.send_grad, stage=s, microbatch=k, peer_stage=s - 1))
            groups.append(group)
        actions = [a for g in groups for a in g]
        for s in range(i, len(plan.stages), p):
            actions.append(Action(kind=ActionKind.allreduce_grads, stage=s))
            actions.append(Action(kind=ActionKind.optimizer_step, stage=s))
        out[i] = actions
    return out


def pairs(action: Action) -> tuple[str, int, int] | None:
    """Key shared by a send and its recv: (kind, sending stage, microbatch); None otherwise."""
    k = action.kind
    if k is ActionKind.send_act or k is ActionKind.send_grad:
        return (k.value[5:], action.stage, action.microbatch)
    if k is ActionKind.recv_act or k is ActionKind.recv_grad:
        return (k.value[5:], action.peer_stage, action.microbatch)
    return None
