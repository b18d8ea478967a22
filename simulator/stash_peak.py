"""Closed-form peak of a PipeDream position whose memory moves after every backward: stashed
weight versions swapped to the host (``offload.stash_swap_layers``, MPress §II-D) and/or the
optimizer state streamed through the device for each update (``offload.optimizer_swap``, now once
per backward: PipeDream §3.3 updates after every backward).

The walk is simulator.stash's rules over the position's pass order (specs.schedule, the order the
simulator walks), without times: per pass it tracks the microbatches held, the stashed versions
kept on the device (``kept_bytes`` each, one per in-flight microbatch but the newest), the swapped
versions on the device (``swap_bytes`` each: a fetched copy from the start of the pass before its
backward to that backward's end; a stale version from its update's end while its device->host
copy runs) and the optimizer chunks of an update. One assumption replaces the times: a version's
device->host copy is still running when the next pass starts and has ended before that pass ends
(a copy that hides in one pass, what planners/mpress/stash.py chooses); a copy that starts later
(the pass waited for its input) or runs longer makes the simulator's peak lower or higher.

Candidates, in walk order: a forward's start (the versions just fetched beside the copy going
out), its end (its activations and its output being sent), a backward's start (with its
workspace), an update (with ``opt_bytes``). O(min(m, 4p)) passes: the steady state repeats from
its second pair on, as simulator.analytic.activation_peak argues.
"""
from __future__ import annotations

from dataclasses import dataclass

from specs.plan import Plan
from specs.schedule import iter_compute_order


@dataclass(frozen=True)
class PeakParts:
    """Bytes at the peak moment, by category (static bytes not included)."""

    activations_bytes: int = 0
    buffers_bytes: int = 0
    stashed_weights_bytes: int = 0
    optimizer_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.activations_bytes + self.buffers_bytes + self.stashed_weights_bytes + self.optimizer_bytes


def pipedream_peak(plan: Plan, position: int, act_bytes: int, workspace_bytes: int, sent_bytes: int,
                   grad_bytes: int, kept_bytes: int, swap_bytes: int, opt_bytes: int) -> PeakParts:
    """The first largest moment of PipeDream position ``position`` (one stage): ``act_bytes`` per
    held microbatch, ``workspace_bytes`` during a backward, ``sent_bytes`` at a forward's end,
    ``grad_bytes`` (the input gradient sent back) from the first backward's end on, ``kept_bytes``
    per stashed version kept on the device, ``swap_bytes`` per swapped version on the device,
    ``opt_bytes`` during each update (an optimizer swap's resident chunks)."""
    p, m = plan.pipeline_depth, plan.training.microbatches
    if m > 4 * p:  # the steady state's candidates repeat (module docstring)
        m = 4 * p
    order = list(iter_compute_order(plan.schedule.kind, p, m, 1, position))
    held = in_flight = kept = dev = pending = 0
    grads = 0
    live = 0
    version: dict[int, int] = {}       # microbatch -> version its forward used
    live_users = 0
    awaiting: set[int] = set()         # backward next while its version was live
    fetched: set[int] = set()          # microbatches with a copy on the device
    best = PeakParts()

    def consider(acts: int, extra_buffers: int = 0, opt: int = 0) -> None:
        nonlocal best
        parts = PeakParts(acts, grads + extra_buffers, kept * kept_bytes + (dev + pending) * swap_bytes, opt)
        if parts.total_bytes > best.total_bytes:
            best = parts

    for idx, (kind, _, k) in enumerate(order):
        nxt = order[idx + 1] if idx + 1 < len(order) else None
        if kind == "F":
            if in_flight:
                kept += 1
            in_flight += 1
            version[k] = live
            live_users += 1
        if swap_bytes and nxt is not None and nxt[0] == "B":  # prefetch for the next backward
            j = nxt[2]
            if version[j] == live:
                awaiting.add(j)
            else:
                dev += 1
                fetched.add(j)
        if kind == "F":
            consider(held * act_bytes)
            pending = 0  # the copy going out ends inside this pass
            held += 1
            consider(held * act_bytes + sent_bytes)
            continue
        consider(held * act_bytes + workspace_bytes)
        pending = 0
        held -= 1
        in_flight -= 1
        if in_flight:
            kept -= 1
        if version.pop(k) == live:
            live_users -= 1
        awaiting.discard(k)
        if k in fetched:
            fetched.discard(k)
            dev -= 1
        grads = grad_bytes  # the input gradient sent back exists from the first backward's end on
        if opt_bytes:
            consider(held * act_bytes, opt=opt_bytes)
        live += 1  # the update: the version it replaces goes stale
        users, live_users = live_users, 0
        if swap_bytes and users:
            for j in sorted(awaiting):
                if version[j] == live - 1:  # its backward is next: kept on the device
                    awaiting.discard(j)
                    fetched.add(j)
                    dev += 1
                    users -= 1
            if users:
                pending = 1
    return best
