"""Chrome / Perfetto trace (JSON object format): one process per simulated device, one thread
per stream, "X" slices for passes, transfers and swaps, "C" counters per memory category.

Timestamps are microseconds (the format's unit) computed from integer nanoseconds, so the JSON is
identical run to run. Thread ids are fixed per stream name so they do not depend on event order.
"""
from __future__ import annotations

import bisect

from specs.result import CATEGORIES

#: "recv" (time blocked in a receive) is written by measured traces only (executor.timeline):
#: the simulator's compute stream simply shows a gap there
STREAMS = ("compute", "send_fwd", "send_bwd", "collective", "h2d", "d2h", "recv", "cpu")  # cpu: host optimizer
_TID = {name: i for i, name in enumerate(STREAMS)}
PEER_TID_BASE = 100  # "peer->D" streams (d2d stripes to device D) get 100 + D


def tid_of(stream: str) -> int:
    tid = _TID.get(stream)
    if tid is None:  # "peer->123"
        tid = PEER_TID_BASE + int(stream.split(">", 1)[1])
    return tid


#: the most "X" slices plus "C" counter points a trace holds: ~100 bytes each in trace.json (120 with
#: long names and timestamps), so trace.json stays under ~36 MB (issue 22: <= 50 MB); Megatron's
#: 1T on 512 GPUs (260,804 events) is whole. A longer run keeps its first and last
#: MAX_TRACE_EVENTS / 2 events by time and says so in ``otherData`` (Chrome's trace format's
#: metadata; see :func:`reduce_events`); the Result is computed from every event.
MAX_TRACE_EVENTS = 300_000


class TraceBuilder:
    def __init__(self) -> None:
        self.slices: list[tuple[int, str, str, int, int, str]] = []  # pid, stream, name, start, dur, cat

    def slice(self, pid: int, stream: str, name: str, start_ns: int, dur_ns: int, cat: str) -> None:
        self.slices.append((pid, stream, name, start_ns, dur_ns, cat))

    def build(self, devices: dict[int, str], counters: dict[int, list[tuple[int, int, int]]],
              max_events: int | None = None) -> dict:
        """``devices``: pid -> process name; ``counters``: pid -> counter_series output. More than
        ``max_events`` (default :data:`MAX_TRACE_EVENTS`) slices and counter points: reduced
        (:func:`reduce_events`)."""
        if max_events is None:
            max_events = MAX_TRACE_EVENTS
        events: list[dict] = []
        for pid, name in sorted(devices.items()):
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}})
        slices, note = self.slices, None
        if len(slices) + sum(len(c) for c in counters.values()) > max_events:
            slices, counters, note = reduce_events(slices, counters, max_events)
        streams: dict[int, set[str]] = {pid: set() for pid in devices}
        for pid, stream in {(e[0], e[1]) for e in slices}:
            streams.setdefault(pid, set()).add(stream)
        tids = {stream: tid_of(stream) for stream in {e[1] for e in slices}}
        for pid in sorted(streams):
            for stream in sorted(streams[pid], key=tid_of):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid_of(stream),
                               "args": {"name": stream}})
        body = [{"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tids[stream],
                 "ts": start / 1000, "dur": dur / 1000} for pid, stream, name, start, dur, cat in slices]
        keys = [(pid, start / 1000, tids[stream], "X", name) for pid, stream, name, start, _, _ in slices]
        for pid in sorted(counters):
            series = counters[pid]
            body += [{"ph": "C", "name": CATEGORIES[cat], "pid": pid, "tid": 0, "ts": t / 1000,
                      "args": {"bytes": value}} for t, cat, value in series]
            keys += [(pid, t / 1000, 0, "C", CATEGORIES[cat]) for t, cat, _ in series]
        # by (pid, ts, tid, ph, name), ties in the order built (a stable sort of the indices)
        body = [body[i] for i in sorted(range(len(body)), key=keys.__getitem__)]
        trace = {"traceEvents": events + body, "displayTimeUnit": "ns"}
        if note is not None:
            trace["otherData"] = note
        return trace


def reduce_events(slices: list[tuple[int, str, str, int, int, str]], counters: dict[int, list[tuple[int, int, int]]],
                  max_events: int) -> tuple[list, dict, dict]:
    """A trace past ``max_events`` slices and counter points, cut to size: the first and the last
    events by time are kept, half the budget each, so the warm-up and the flush show in full; every
    track's slices in between become one "omitted" slice spanning them (its name counts them), and
    counter points in between are left out. Events are ranked by (time, slices before counters,
    order recorded), so the cut is deterministic; only the timestamps are sorted (memory: one list
    of ints beside the events). Returns (slices, counters, the ``otherData`` note saying what was
    left out)."""
    tracks = {(e[0], e[1]) for e in slices}
    half = max(1, (max_events - len(tracks)) // 2)  # one "omitted" slice per track at most
    times = [e[3] for e in slices]
    for pid in counters:
        times += [point[0] for point in counters[pid]]
    times.sort()
    n = len(times)
    t_a, t_b = times[half - 1], times[n - half]  # the last time kept at the head, the first at the tail
    first = {t_a: bisect.bisect_left(times, t_a), t_b: bisect.bisect_left(times, t_b)}  # rank of a tie's first
    del times
    seen: dict[int, int] = {}

    def keep(t: int) -> bool:
        if t < t_a or t > t_b:
            return True
        if t != t_a and t != t_b:
            return False
        q = seen.get(t, 0)  # ties at a boundary: by rank (slices, then counters, in recorded order)
        seen[t] = q + 1
        rank = first[t] + q
        return rank < half or rank >= n - half

    kept: list[tuple[int, str, str, int, int, str]] = []
    gaps: dict[tuple[int, str], list[int]] = {}  # track -> [count, first start, last end]
    for e in slices:
        if keep(e[3]):
            kept.append(e)
            continue
        pid, stream, _, start, dur, _ = e
        gap = gaps.get((pid, stream))
        if gap is None:
            gaps[(pid, stream)] = [1, start, start + dur]
        else:
            gap[0] += 1
            gap[1], gap[2] = min(gap[1], start), max(gap[2], start + dur)
    omitted_slices = len(slices) - len(kept)
    kept += [(pid, stream, f"{count:,} slices omitted (trace reduced)", t0, t1 - t0, "omitted")
             for (pid, stream), (count, t0, t1) in sorted(gaps.items())]
    kept_counters = {pid: [point for point in counters[pid] if keep(point[0])] for pid in sorted(counters)}
    omitted_counters = n - len(slices) - sum(len(c) for c in kept_counters.values())
    note = {
        "reduced": True,
        "events_recorded": n,
        "events_kept": n - omitted_slices - omitted_counters + len(gaps),
        "max_events": max_events,
        "omitted_from_us": t_a / 1000, "omitted_to_us": t_b / 1000,
        "omitted_slices": omitted_slices, "omitted_counter_points": omitted_counters,
        "note": (f"trace reduced to its first and last {half:,} events by time (of {n:,}): {omitted_slices:,} "
                 f"slices between {t_a / 1e3:,.0f} and {t_b / 1e3:,.0f} us are one 'omitted' slice per track, "
                 f"{omitted_counters:,} memory counter points there are left out; results.json's peaks and "
                 "times count every event"),
    }
    return kept, kept_counters, note


def x_slices(trace: dict) -> list[tuple[int, str, str, int, str]]:
    """The "X" slices of a trace dict as ``(pid, name, start_ns, dur_ns, category)``."""
    return [(e["pid"], e["name"], round(e["ts"] * 1000), round(e["dur"] * 1000), e.get("cat", ""))
            for e in trace["traceEvents"] if e.get("ph") == "X"]


def side_by_side(simulated: dict, measured: dict, pid_offset: int = 1000) -> dict:
    """One trace holding both: simulated processes first ("simulated: ..."), then measured ones
    with pids shifted by ``pid_offset`` ("measured: ..."), so Perfetto shows each device's
    predicted and measured tracks one above the other."""
    events = []
    for label, trace, shift in (("simulated", simulated, 0), ("measured", measured, pid_offset)):
        for e in trace["traceEvents"]:
            e = {**e, "pid": e["pid"] + shift}
            if e.get("ph") == "M" and e["name"] == "process_name":
                e["args"] = {"name": f"{label}: {e['args']['name']}"}
            elif e.get("ph") == "M" and e["name"] == "process_sort_index":
                e["args"] = {"sort_index": e["args"]["sort_index"] * 2 + (shift > 0)}
            events.append(e)
    meta = [e for e in events if e.get("ph") == "M"]
    body = sorted((e for e in events if e.get("ph") != "M"),
                  key=lambda e: (e["pid"], e["ts"], e["tid"], e["ph"], e["name"]))
    return {"traceEvents": meta + body, "displayTimeUnit": "ns"}
