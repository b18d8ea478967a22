"""Memory as a step function per device: (time_ns, category, delta_bytes) events in time order.

A GPU does not wait for memory, it runs out of it (STYLE simpy notes), so nothing here blocks:
allocations always succeed and the summary records the first moment the total exceeds capacity.
The peak is taken after every single change, so two changes at one timestamp in the order they
happened (e.g. an allocation before a free) count as the transient they are.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from specs.result import CATEGORIES, MemoryBreakdown

CAT = {name: i for i, name in enumerate(CATEGORIES)}
PARAMS, GRADS, OPTIM, ACTS, BUFFERS, SWAPPED, STASHED = range(len(CATEGORIES))


class Timeline:
    """Append-only; ``add`` must be called with non-decreasing times (simpy's clock guarantees it)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[tuple[int, int, int]] = []

    def add(self, t_ns: int, cat: int, delta: int) -> None:
        if delta:
            self.events.append((t_ns, cat, delta))


@dataclass(frozen=True)
class Summary:
    peak_bytes: int
    peak_time_ns: int
    breakdown: MemoryBreakdown
    oom: bool
    oom_time_ns: int | None
    over_bytes: int


def merged(*timelines: Timeline) -> list[tuple[int, int, int]]:
    """Events of several timelines in time order; ties keep argument order (stable, deterministic)."""
    return list(heapq.merge(*(t.events for t in timelines), key=lambda e: e[0]))


def summarize(events: list[tuple[int, int, int]], capacity_bytes: int) -> Summary:
    totals = [0] * len(CATEGORIES)
    total = peak = 0
    peak_t = 0
    peak_totals = list(totals)
    oom_t = None
    for t, cat, delta in events:
        totals[cat] += delta
        total += delta
        if total > peak:
            peak, peak_t, peak_totals = total, t, list(totals)
        if oom_t is None and total > capacity_bytes:
            oom_t = t
    breakdown = MemoryBreakdown(**dict(zip(CATEGORIES, peak_totals)))
    return Summary(peak, peak_t, breakdown, oom_t is not None, oom_t, max(0, peak - capacity_bytes))


def counter_series(events: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(time_ns, category, bytes) after the last change at each timestamp, per category that
    changed — what the trace's counter tracks show."""
    totals = [0] * len(CATEGORIES)
    out: list[tuple[int, int, int]] = []
    append = out.append
    i, n = 0, len(events)
    while i < n:
        t, cat, delta = events[i]
        i += 1
        if i == n or events[i][0] != t:  # the usual case: one change at this timestamp
            totals[cat] += delta
            append((t, cat, totals[cat]))
            continue
        totals[cat] += delta
        changed = {cat}
        while i < n and events[i][0] == t:
            _, cat, delta = events[i]
            totals[cat] += delta
            changed.add(cat)
            i += 1
        out += [(t, c, totals[c]) for c in sorted(changed)]
    return out
