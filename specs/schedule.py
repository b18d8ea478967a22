"""Pipeline schedules as data: one ordered list of actions per pipeline position.

``build_schedule(plan)`` returns ``{position: [Action, ...]}`` for positions 0..p-1. Every device of
a position's group (all dp replicas and tp ranks) walks the same list; the simulator walks it for
one representative and the executor walks it on every rank, so the list is explicit and complete.
The list is generated step by step (:func:`position_steps`, compact tuples, O(1) memory in the
microbatch count): the simulator walks the steps as they come, a rank builds its own position's
Actions only (:func:`position_schedule`), and nothing needs all p lists of 2·m·v passes at once.

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
- Zero-bubble schedules (``specs.plan.SPLIT_BACKWARD``: zb_h1, zbv, dualpipev; Qi et al. 2024):
  ``backward`` is the input-gradient pass B (it has the recv_grad before it and the send_grad
  after it, as a whole backward has), ``backward_weight`` the weight-gradient pass W of the same
  (stage, microbatch), later in the list, with no communication. The orders are torch's
  (ScheduleInterleavedZeroBubble with one stage per rank, ScheduleZBVZeroBubble, ScheduleDualPipeV;
  tests/unit/simulator/test_zero_bubble.py compares them). In the V (zbv, dualpipev) chunks p-1
  and p both sit on position p-1: that hand-off is in process, with no send/recv; every other
  edge keeps the rules above, and no recv waits on a send later in its own list (the walk tests
  the lists for many (p, m) on a unit-time walk).
- ``allreduce_grads`` and ``optimizer_step`` close the iteration, one per stage on the position,
  after the position's last backward (the flush; PipeDream async charges them once per iteration
  too, see :func:`build_schedule`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from enum import Enum

from pydantic import Field

from specs._base import Spec
from specs.pass_order import listed_order
from specs.plan import MemoryAction, Plan, ScheduleKind, stage_for_microbatch

SWAPS = (MemoryAction.cpu_swap, MemoryAction.d2d_swap, MemoryAction.nvme)


class ActionKind(str, Enum):
    forward = "forward"
    backward = "backward"          # with a SPLIT_BACKWARD schedule: the input-gradient pass (B) only
    backward_weight = "backward_weight"  # zero-bubble W: the weight gradients of an earlier B (same stage, mb)
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


def compute_order(kind: ScheduleKind, p: int, m: int, v: int, i: int,
                  order: list[str] | None = None, group: int | None = None) -> list[tuple[str, int, int]]:
    """Order of passes on position ``i`` of ``p``: [("F"|"B"|"W", stage, microbatch), ...] (a list of
    2·m·v passes, 3·m·v with a split backward, "W" only then; :func:`iter_compute_order` yields the same without holding them).
    ``order`` is the plan's ``schedule.order`` (zb_auto's searched order; None for the other kinds),
    ``group`` its ``schedule.microbatch_group_size`` (interleaved_1f1b's N; None: p)."""
    return list(iter_compute_order(kind, p, m, v, i, order, group))


def plan_order(plan: Plan, i: int) -> Iterator[tuple[str, int, int]]:
    """:func:`iter_compute_order` of position ``i`` of ``plan``: its kind, depth, microbatches,
    chunks, searched order (zb_auto) and microbatch group (interleaved_1f1b)."""
    sch = plan.schedule
    return iter_compute_order(sch.kind, plan.pipeline_depth, plan.training.microbatches, sch.virtual_stages, i,
                              sch.order, sch.microbatch_group_size)


def iter_compute_order(kind: ScheduleKind, p: int, m: int, v: int, i: int,
                       order: list[str] | None = None, group: int | None = None) -> Iterator[tuple[str, int, int]]:
    """:func:`compute_order`, lazily: O(1) memory however many microbatches."""
    if kind is ScheduleKind.zb_auto:
        if order is None:
            raise ValueError("schedule.order: zb_auto's pass order is searched by the planner "
                             "(planners.zero_bubble.with_zb_order); this plan has none")
        yield from listed_order(order[i], i)
        return
    if kind is ScheduleKind.gpipe:
        # GPipe §2.2: all forwards, then all backwards, then one flush.
        for k in range(m):
            yield ("F", i, k)
        for k in range(m):
            yield ("B", i, k)
        return
    if kind is ScheduleKind.interleaved_1f1b:
        yield from _interleaved(p, m, v, i, group or p)
        return
    if kind in _SPLIT_ORDERS:
        yield from _SPLIT_ORDERS[kind](p, m, i)
        return
    # 1F1B (PipeDream-Flush / DAPPLE) and PipeDream async share the order: p - i - 1 warm-up
    # forwards, then one forward + one backward, then the cool-down backwards (PipeDream-2BW §3),
    # so at most min(p - i, m) microbatches are in flight on position i.
    warm = min(p - i - 1, m)
    for k in range(warm):
        yield ("F", i, k)
    for j in range(m - warm):
        yield ("F", i, warm + j)
        yield ("B", i, j)
    for k in range(m - warm, m):
        yield ("B", i, k)


def _interleaved(p: int, m: int, v: int, i: int, n: int) -> Iterator[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021 §2.2) with Megatron-Core's microbatch
    groups of ``n`` (its get_schedule_table; Llama 3 §3.3.2's N): virtual microbatch u forwards the
    u-th entry of the table that runs each group of n microbatches through chunk 0, then chunk 1, ...
    (the last group takes what is left), and backwards the u-th entry with the chunk mirrored
    (v - 1 - c); warm-up is (p - i - 1)·2 + (v - 1)·n virtual microbatches. n = p is the paper's
    schedule: chunk (u // p) % v on microbatch (u // pv)·p + u % p. validate_plan checks p <= n <= m
    and a last group of 0 or >= p microbatches (Megatron-Core's checks)."""
    total = m * v
    tail = m - ((m - 1) // n) * n  # the last group: m - start of the last group (range(0, m, n))
    last = m - tail

    def entry(u: int) -> tuple[int, int]:  # (chunk, microbatch) of virtual microbatch u, O(1)
        if u < last * v:
            g, r = divmod(u, n * v)
            return r // n, g * n + r % n
        r = u - last * v
        return r // tail, last + r % tail

    def fwd(u: int) -> tuple[str, int, int]:
        c, k = entry(u)
        return "F", c * p + i, k

    def bwd(u: int) -> tuple[str, int, int]:
        c, k = entry(u)
        return "B", (v - 1 - c) * p + i, k

    warm = min((p - i - 1) * 2 + (v - 1) * n, total)
    for u in range(warm):
        yield fwd(u)
    for u in range(total - warm):
        yield fwd(warm + u)
        yield bwd(u)
    for u in range(total - warm, total):
        yield bwd(u)


def interleaved_runs(p: int, m: int, v: int, i: int, n: int | None = None
                     ) -> list[tuple[tuple[tuple[str, int], ...], int]]:
    """:func:`_interleaved`'s order on position ``i`` run-length encoded: [(steps, count), ...],
    ``steps`` one repetition's (kind, stage) passes — ("F", a) in the warm-up, ("F", a), ("B", b)
    in the steady state, ("B", b) in the cool-down — repeated ``count`` times in a row (the
    microbatch indices left out). O(v · m / n) runs, however long each group: what
    costs.activations.activation_peak walks in O(runs) for large groups. Expanded, it is
    :func:`compute_order`'s passes, stage for stage (tests/unit/simulator/test_microbatch_group.py)."""
    n = n or p
    table: list[tuple[int, int]] = []  # (chunk, entries) runs of Megatron-Core's schedule table
    for start in range(0, m, n):
        size = m - start if start + n >= m else n
        table += [(c, size) for c in range(v)]
    total = m * v
    warm = min((p - i - 1) * 2 + (v - 1) * n, total)

    def entries(first: int, last: int):
        """(chunk, count) runs of table entries first .. last - 1."""
        at = 0
        for c, size in table:
            lo, hi = max(first, at), min(last, at + size)
            if lo < hi:
                yield c, hi - lo
            at += size

    fwd = lambda c: ("F", c * p + i)  # noqa: E731
    bwd = lambda c: ("B", (v - 1 - c) * p + i)  # noqa: E731
    runs = [((fwd(c),), k) for c, k in entries(0, warm)]
    f_runs, b_runs = list(entries(warm, total)), list(entries(0, total - warm))
    fi = bi = 0
    f_left = f_runs[0][1] if f_runs else 0
    b_left = b_runs[0][1] if b_runs else 0
    while fi < len(f_runs):
        k = min(f_left, b_left)
        runs.append(((fwd(f_runs[fi][0]), bwd(b_runs[bi][0])), k))
        f_left, b_left = f_left - k, b_left - k
        if not f_left:
            fi += 1
            f_left = f_runs[fi][1] if fi < len(f_runs) else 0
        if not b_left:
            bi += 1
            b_left = b_runs[bi][1] if bi < len(b_runs) else 0
    runs += [((bwd(c),), k) for c, k in entries(total - warm, total)]
    return runs


def _zb_h1(p: int, m: int, i: int) -> Iterator[tuple[str, int, int]]:
    """ZB-H1 (Qi et al. 2024 §2.1): 1F1B's p - i - 1 warm-up forwards and F/B pairs, the backward
    split into B (input gradients) and W (weight gradients); position i runs its first i W passes
    late (W of microbatch j - i after the B of j), and they fill the cool-down bubble. Every position
    then holds at most p microbatches until their W (1F1B's peak on position 0). The order of
    torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one stage per rank."""
    warm = min(p - i - 1, m)
    for k in range(warm):
        yield ("F", i, k)
    w = 0
    for j in range(m):
        if j < m - warm:
            yield ("F", i, warm + j)
        yield ("B", i, j)
        if j >= i:
            yield ("W", i, w)
            w += 1
    for k in range(w, m):
        yield ("W", i, k)


def _zbv(p: int, m: int, i: int) -> Iterator[tuple[str, int, int]]:
    """ZB-V (Qi et al. 2024 §6): chunks i and 2p-1-i of the V on position i; 2(p-i)-1 forwards of
    chunk 0, i (F1, F0) pairs, p-i (F1 B1 W1); then F0 B0 W0 F1 B1 W1 until all forwards are done;
    i (B0 B1) and p-i (B0 W0) pairs, the remaining W1 then W0. Generated for max(2p-1, m)
    microbatches and the passes of microbatches >= m dropped (torch's ScheduleZBVZeroBubble)."""
    n = max(2 * p - 1, m)
    c0, c1 = i, 2 * p - 1 - i
    out: list[tuple[str, int, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - i) - 1):
        out.append(("F", c0, f0))
        f0 += 1
    for _ in range(i):
        out += [("F", c1, f1), ("F", c0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - i):
        out += [("F", c1, f1), ("B", c1, b1), ("W", c1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(("F", c0, f0))
            f0 += 1
        out += [("B", c0, b0), ("W", c0, b0), ("F", c1, f1), ("B", c1, b1), ("W", c1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(i):
        out += [("B", c0, b0), ("B", c1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - i):
        out += [("B", c0, b0), ("W", c0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [("W", c1, k) for k in range(w1, b1)]
    out += [("W", c0, k) for k in range(w0, b0)]
    return iter([step for step in out if step[2] < m])


def _dualpipev(p: int, m: int, i: int) -> Iterator[tuple[str, int, int]]:
    """DualPipeV (DeepSeek-V3 §3.2.1's DualPipe cut in half along the V; torch's
    ScheduleDualPipeV, from deepseek-ai/DualPipe): 8 steps on position i, chunks i (0) and 2p-1-i
    (1). A full backward is B then W at once; DualPipe's overlapped F&B pair (one chunk's forward
    with the other's backward, their communication hidden) is F, then B, W here, one after the
    other on the compute stream. Deferred W passes (of split B passes) run oldest first."""
    c0, c1 = i, 2 * p - 1 - i
    nxt = {("F", c0): 0, ("F", c1): 0, ("B", c0): 0, ("B", c1): 0}
    queue: list[tuple[int, int]] = []  # (stage, microbatch) of B passes whose W waits

    def f(c):
        k = nxt[("F", c)]
        nxt[("F", c)] = k + 1
        yield ("F", c, k)

    def b(c, full: bool):
        k = nxt[("B", c)]
        nxt[("B", c)] = k + 1
        yield ("B", c, k)
        if full:
            yield ("W", c, k)
        else:
            queue.append((c, k))

    def w():
        if queue:
            c, k = queue.pop(0)
            yield ("W", c, k)

    for _ in range(2 * (p - i - 1)):                 # 1: F0
        yield from f(c0)
    for _ in range(i + 1):                           # 2: F0 F1
        yield from f(c0)
        yield from f(c1)
    for _ in range(p - i - 1):                       # 3: B1 W F1 (zero bubble)
        yield from b(c1, False)
        yield from w()
        yield from f(c1)
    for _ in range(m - 2 * p + i + 1):               # 4: F0 B1 | F1 B0 (overlapped pairs)
        yield from f(c0)
        yield from b(c1, True)
        yield from f(c1)
        yield from b(c0, True)
    for _ in range(p - i - 1):                       # 5: B1 | F1 B0
        yield from b(c1, True)
        yield from f(c1)
        yield from b(c0, True)
    split = False
    for j in range(i + 1):                           # 6: B1 B0, the second half split
        if j == (i + 1) // 2 and i % 2 == 1:
            split = True
        yield from b(c1, not split)
        if j == (i + 1) // 2 and i % 2 == 0:
            split = True
        yield from b(c0, not split)
    for _ in range(p - i - 1):                       # 7: W B0
        yield from w()
        yield from b(c0, not split)
    for _ in range(i + 1):                           # 8: W
        yield from w()


_SPLIT_ORDERS = {ScheduleKind.zb_h1: _zb_h1, ScheduleKind.zbv: _zbv, ScheduleKind.dualpipev: _dualpipev}


#: one step of a position's list in compact form, what :func:`position_steps` yields:
#: (kind, stage, microbatch, layer, peer_stage), None where an Action leaves the field unset
Step = tuple

_F, _B, _W = ActionKind.forward, ActionKind.backward, ActionKind.backward_weight
_SA, _SG, _RA, _RG = ActionKind.send_act, ActionKind.send_grad, ActionKind.recv_act, ActionKind.recv_grad
_SO, _SI, _RC = ActionKind.swap_out, ActionKind.swap_in, ActionKind.recompute
_AR, _OPT = ActionKind.allreduce_grads, ActionKind.optimizer_step


class _LayerActions:
    """Per (stage, microbatch): the layers it swaps (forward order) and recomputes, as
    ``stage_for_microbatch`` gives them, computed once per stage and period residue."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.period: list[int] = [
            math.lcm(*(item.microbatch_period for item in stage.memory))
            if any(item.microbatch_period != 1 for item in stage.memory) else 1
            for stage in plan.stages]
        self._hit: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}

    def __call__(self, s: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(swapped layers ascending, swapped layers descending, recomputed layers descending)."""
        key = (s, k % self.period[s])
        hit = self._hit.get(key)
        if hit is None:
            stage = stage_for_microbatch(self.plan.stages[s], k)  # the actions that apply to microbatch k
            swapped = tuple(l for l in stage.layers if stage.action_of(l).action in SWAPS)
            recomputed = tuple(l for l in reversed(stage.layers)
                               if stage.action_of(l).action is MemoryAction.recompute)
            hit = self._hit[key] = (swapped, swapped[::-1], recomputed)
        return hit


def position_steps(plan: Plan, i: int) -> Iterator[Step]:
    """Position ``i``'s action list as compact :data:`Step` tuples, lazily (O(1) memory in the
    microbatch count): what :func:`build_schedule` turns into Actions, and what the simulator walks."""
    last = len(plan.stages) - 1
    # V-shaped schedules: chunks p-1 and p share position p-1, which hands the activation (and the
    # gradient back) to itself in process, so no send/recv pair there (torch's stage-to-rank map)
    local = {s for s in range(last) if plan.device_group_of(s) == plan.device_group_of(s + 1)}
    layer_actions = _LayerActions(plan)
    prev: list[Step] | None = None  # one group per pass (its recvs, itself, its sends), held one pass
    prev_pass = None                # back: a backward may prefetch its swap-ins into it
    for pass_ in plan_order(plan, i):
        kind, s, k = pass_
        swapped, swapped_rev, recomputed = layer_actions(s, k)
        group: list[Step] = []
        if kind == "W":  # zero bubble: the weight gradients of an earlier B; no communication
            group.append((_W, s, k, None, None))
        elif kind == "F":
            if s > 0 and s - 1 not in local:
                group.append((_RA, s, k, None, s - 1))
            group.append((_F, s, k, None, None))
            for l in swapped:
                group.append((_SO, s, k, l, None))
            if s < last and s not in local:
                group.append((_SA, s, k, None, s + 1))
        else:
            swaps = [(_SI, s, k, l, None) for l in swapped_rev]
            if prev is not None and prev_pass != ("F", s, k):
                prev[:0] = swaps  # prefetch one pass ahead
            else:
                group += swaps
            if s < last and s not in local:
                group.append((_RG, s, k, None, s + 1))
            for l in recomputed:
                group.append((_RC, s, k, l, None))
            group.append((_B, s, k, None, None))
            if s > 0 and s - 1 not in local:
                group.append((_SG, s, k, None, s - 1))
        if prev is not None:
            yield from prev
        prev, prev_pass = group, pass_
    if prev is not None:
        yield from prev
    for s in range(len(plan.stages)):
        if plan.device_group_of(s) != i:
            continue
        yield (_AR, s, None, None, None)
        yield (_OPT, s, None, None, None)


def _action(step: Step) -> Action:
    """The Action of a compact step, with the same fields set as the explicit constructor calls
    (unset fields left out, so ``model_fields_set`` and dumps are those of ``Action(...)``)."""
    kind, s, k, layer, peer = step
    fields = {"kind": kind, "stage": s}
    if k is not None:
        fields["microbatch"] = k
    if layer is not None:
        fields["layer"] = layer
    if peer is not None:
        fields["peer_stage"] = peer
    return Action(**fields)


def position_schedule(plan: Plan, i: int) -> list[Action]:
    """Position ``i``'s action list (``build_schedule(plan)[i]``) without building the others'."""
    return [_action(step) for step in position_steps(plan, i)]


def build_schedule(plan: Plan) -> dict[int, list[Action]]:
    """The plan's action list per pipeline position (0..p-1); see the module docstring.

    PipeDream async uses the 1F1B order without flush semantics: the simulator keeps one weight
    version per in-flight microbatch (weight stashing, PipeDream §3.3) and times the iteration as
    its steady state; the closing all-reduce/optimizer entries stand for the per-minibatch updates.
    """
    return {i: position_schedule(plan, i) for i in range(plan.pipeline_depth)}


def pairs(action: Action) -> tuple[str, int, int] | None:
    """Key shared by a send and its recv: (kind, sending stage, microbatch); None otherwise."""
    k = action.kind
    if k is ActionKind.send_act or k is ActionKind.send_grad:
        return (k.value[5:], action.stage, action.microbatch)
    if k is ActionKind.recv_act or k is ActionKind.recv_grad:
        return (k.value[5:], action.peer_stage, action.microbatch)
    return None
