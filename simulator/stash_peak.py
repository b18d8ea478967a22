"""Closed-form peak of a PipeDream position, whose memory moves after every backward: its stashed
weight versions come and go with the updates, may be swapped to the host
(``offload.stash_swap_layers``, MPress §II-D), and the optimizer state may be streamed through the
device for each update (``offload.optimizer_swap``, now once per backward: PipeDream §3.3 updates
after every backward).

The walk is simulator.stash's rules over the position's pass order (specs.schedule, the order the
simulator walks), without times: per pass it tracks the microbatches held, the stashed versions
kept on the device (``kept_bytes`` each, one per distinct stale version: below), the swapped
versions on the device (``swap_bytes`` each: a fetched copy from the start of the pass before its
backward to that backward's end; a stale version from its update's end while its device->host
copy runs) and the optimizer chunks of an update. One assumption replaces the times: a version's
device->host copy is still running when the next pass starts and has ended before that pass ends
(a copy that hides in one pass, what planners/mpress/stash.py chooses); a copy that starts later
(the pass waited for its input) or runs longer makes the simulator's peak lower or higher.

Candidates, in walk order: a forward's start (the versions just fetched beside the copy going
out), its end (its activations and its output being sent), a backward's start (with its
workspace), an update's all-reduce (its flat copy) and step (with ``opt_bytes``), as
:func:`pipedream_moments` (cached: planners/baselines/stage_memory.py prices many stages with the
same p - i and m). O(min(m, 4p)) passes: the steady state repeats from
its second pair on, as simulator.analytic.activation_peak argues.

Stashed versions are counted as executor.pipedream holds them: DISTINCT versions that in-flight
microbatches' forwards used, other than the live one. An update after every backward (PipeDream
§3.3) replaces the live weights out of place only when an in-flight microbatch holds them (the old
ones become a stashed version, from the update's start); a version goes at the end of the backward
of the last in-flight microbatch that used it. The warm-up's forwards all run before the first
update and share one version, so with few microbatches (m < 2(p - i) - 2 on stage i) fewer than
the steady state's p - i - 1 are ever stashed (:func:`stashed_version_counts`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from specs.plan import Plan, ScheduleKind
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


class Moment(NamedTuple):
    """A candidate moment of a PipeDream position's walk, as counts of its parts: held
    microbatches, whether a backward's workspace / a forward's sent output / the sent input
    gradient / an update's optimizer chunks / a per-update all-reduce's flat copy are there (0 or
    1), stashed versions kept on the device, swapped versions on the device."""

    held: int
    workspace: int
    sent: int
    grads: int
    kept: int
    swapped: int
    opt: int
    flat: int


def pipedream_peak(plan: Plan, position: int, act_bytes: int, workspace_bytes: int, sent_bytes: int,
                   grad_bytes: int, kept_bytes: int, swap_bytes: int, opt_bytes: int,
                   allreduce_bytes: int = 0) -> PeakParts:
    """The first largest moment of PipeDream position ``position`` (one stage): ``act_bytes`` per
    held microbatch, ``workspace_bytes`` during a backward, ``sent_bytes`` at a forward's end,
    ``grad_bytes`` (the input gradient sent back) from the first backward's end on, ``kept_bytes``
    per stashed version kept on the device, ``swap_bytes`` per swapped version on the device,
    ``opt_bytes`` during each update (an optimizer swap's resident chunks), ``allreduce_bytes``
    during each update's data-parallel all-reduce (its flat copy: simulator/walk.py ``_update``)."""
    best = PeakParts()
    for c in pipedream_moments(plan.pipeline_depth, plan.training.microbatches, position,
                               bool(swap_bytes), bool(opt_bytes), bool(allreduce_bytes)):
        parts = PeakParts(c.held * act_bytes + c.workspace * workspace_bytes + c.sent * sent_bytes,
                          c.grads * grad_bytes + c.flat * allreduce_bytes,
                          c.kept * kept_bytes + c.swapped * swap_bytes, c.opt * opt_bytes)
        if parts.total_bytes > best.total_bytes:
            best = parts
    return best


@lru_cache(maxsize=4096)
def pipedream_moments(p: int, m: int, position: int, swap: bool = False, opt: bool = False,
                      allreduce: bool = False) -> tuple[Moment, ...]:
    """The candidate moments of PipeDream position ``position`` of ``p`` with ``m`` microbatches,
    in walk order, without repeats (module docstring); ``swap``: stashed versions swapped to the
    host, ``opt``: optimizer chunks streamed per update, ``allreduce``: a per-update all-reduce."""
    if m > 4 * p:  # the steady state's candidates repeat (module docstring)
        m = 4 * p
    order = list(iter_compute_order(ScheduleKind.pipedream_async, p, m, 1, position))
    held = kept = dev = pending = grads = 0
    live = 0
    version: dict[int, int] = {}       # microbatch -> version its forward used
    users: dict[int, int] = {}         # version -> in-flight microbatches that used it
    awaiting: set[int] = set()         # backward next while its version was live
    fetched: set[int] = set()          # microbatches with a copy on the device
    out: dict[Moment, None] = {}

    def consider(n: int, workspace: int = 0, sent: int = 0, o: int = 0, flat: int = 0) -> None:
        out.setdefault(Moment(n, workspace, sent, grads, kept, dev + pending, o, flat))

    for idx, (kind, _, k) in enumerate(order):
        nxt = order[idx + 1] if idx + 1 < len(order) else None
        if kind == "F":
            version[k] = live
            users[live] = users.get(live, 0) + 1
        if swap and nxt is not None and nxt[0] == "B":  # prefetch for the next backward
            j = nxt[2]
            if version[j] == live:
                awaiting.add(j)
            else:
                dev += 1
                fetched.add(j)
        if kind == "F":
            consider(held)
            pending = 0  # the copy going out ends inside this pass
            held += 1
            consider(held, sent=1)
            continue
        consider(held, workspace=1)
        pending = 0
        held -= 1
        v = version.pop(k)
        users[v] -= 1
        if not users[v]:  # its last in-flight microbatch is done: a stale version goes
            del users[v]
            kept -= v != live
        awaiting.discard(k)
        if k in fetched:
            fetched.discard(k)
            dev -= 1
        grads = 1  # the input gradient sent back exists from the first backward's end on
        if allreduce:  # the microbatch's gradient summed over the replicas first
            consider(held, flat=1)
        stale = users.get(live, 0)  # in-flight microbatches on the live weights: replaced out of place
        kept += stale > 0           # (executor.pipedream._update), a stashed version from then on
        if opt:
            consider(held, o=1)
        live += 1  # the update: the version it replaces goes stale
        if swap and stale:
            for j in sorted(awaiting):
                if version[j] == live - 1:  # its backward is next: kept on the device
                    awaiting.discard(j)
                    fetched.add(j)
                    dev += 1
                    stale -= 1
            if stale:
                pending = 1
    return tuple(out)


def stashed_version_counts(p: int, m: int, position: int) -> list[int]:
    """Stashed weight versions of PipeDream position ``position`` (of ``p``, ``m`` microbatches,
    one stage per position) during each of its passes, in pass order (specs.schedule's 1F1B
    order): the distinct versions in-flight microbatches' forwards used, other than the live one
    (module docstring; executor.pipedream). A pass's count holds from its start to its end (a
    backward frees its version, an update stashes the live one, only after it)."""
    live, counts = 0, []
    version: dict[int, int] = {}  # microbatch -> the version its forward used
    users: dict[int, int] = {}    # version -> in-flight microbatches that used it
    for kind, _, k in iter_compute_order(ScheduleKind.pipedream_async, p, m, 1, position):
        if kind == "F":
            version[k] = live
            users[live] = users.get(live, 0) + 1
        counts.append(len(users) - (live in users))
        if kind == "B":
            v = version.pop(k)
            users[v] -= 1
            if not users[v]:
                del users[v]
            live += 1  # PipeDream's update after every backward (§3.3)
    return counts


def max_stashed_versions(p: int, m: int, position: int) -> int:
    """The most stashed versions position ``position`` of a PipeDream pipeline holds at once
    (:func:`stashed_version_counts`): p - i - 1 in the steady state, fewer when the microbatches
    are too few to reach it (the warm-up's forwards share one version). O(min(m, 4p)) passes."""
    return max(stashed_version_counts(p, min(m, 4 * p), position), default=0)
