"""Chrome / Perfetto trace (JSON object format): one process per simulated device, one thread
per stream, "X" slices for passes, transfers and swaps, "C" counters per memory category.

Timestamps are microseconds (the format's unit) computed from integer nanoseconds, so the JSON is
identical run to run. Thread ids are fixed per stream name so they do not depend on event order.
"""
from __future__ import annotations

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


class TraceBuilder:
    def __init__(self) -> None:
        self.slices: list[tuple[int, str, str, int, int, str]] = []  # pid, stream, name, start, dur, cat

    def slice(self, pid: int, stream: str, name: str, start_ns: int, dur_ns: int, cat: str) -> None:
        self.slices.append((pid, stream, name, start_ns, dur_ns, cat))

    def build(self, devices: dict[int, str], counters: dict[int, list[tuple[int, int, int]]]) -> dict:
        """``devices``: pid -> process name; ``counters``: pid -> counter_series output."""
        events: list[dict] = []
        streams: dict[int, set[str]] = {pid: set() for pid in devices}
        for pid, name in sorted(devices.items()):
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}})
        body: list[dict] = []
        for pid, stream, name, start, dur, cat in self.slices:
            streams.setdefault(pid, set()).add(stream)
            body.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid_of(stream),
                         "ts": start / 1000, "dur": dur / 1000})
        for pid in sorted(streams):
            for stream in sorted(streams[pid], key=tid_of):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid_of(stream),
                               "args": {"name": stream}})
        for pid in sorted(counters):
            for t, cat, value in counters[pid]:
                body.append({"ph": "C", "name": CATEGORIES[cat], "pid": pid, "tid": 0,
                             "ts": t / 1000, "args": {"bytes": value}})
        body.sort(key=lambda e: (e["pid"], e["ts"], e["tid"], e["ph"], e["name"]))
        return {"traceEvents": events + body, "displayTimeUnit": "ns"}


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
