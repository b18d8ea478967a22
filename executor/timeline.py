"""What each rank did and when: the measured counterpart of the simulator's trace (issue #11).

A rank's :class:`Recorder` stamps every action of an iteration with ``time.perf_counter_ns``
relative to the moment it left the barrier that starts the iteration (``t0_ns``, reported too).
perf_counter_ns is CLOCK_MONOTONIC, one clock for all ranks of a host, so :func:`aligned` puts
every rank on the earliest rank's origin and a send and its receive compare directly. Events are
plain tuples ``(kind, stage, microbatch, peer_stage, start_ns, end_ns)`` so they travel on the
report queue cheaply (~100 ns per stamp; a pass of a tiny layer is ~100 µs).

:func:`slices` turns one iteration's events of one rank into trace slices named exactly as the
simulator names them (``simulator/walk.py``, ``transfers.py``, ``optimizer.py``: ``F s0 mb1``, ``act s0->s1 mb1``,
``allreduce_grads s0``, ...) on the same streams, plus what only a measurement sees: the time a
rank sat in a receive (``recv`` stream, category ``recv``). A send's slice runs from its isend
to the completion of its ``wait()`` in the SendReaper thread (gloo: the bytes left this rank).
Pure except :class:`Recorder`'s clock; no torch.
"""
from __future__ import annotations

import time

#: kind of the event that closes an iteration (after the rank drained its sends)
END = "end"
_COMPUTE = {"forward": ("F", "forward"), "backward": ("B", "backward")}


class Recorder:
    """Collects one iteration's events on one rank (see module docstring)."""

    def __init__(self, t0_ns: int):
        self.t0_ns = t0_ns
        self.events: list[tuple] = []

    def now(self) -> int:
        return time.perf_counter_ns()

    def action(self, a, start_ns: int) -> None:
        """Record action ``a`` (a specs.schedule.Action; None: the iteration's end) from ``start_ns``."""
        end = time.perf_counter_ns() - self.t0_ns
        if a is None:
            self.events.append((END, -1, -1, -1, end, end))
            return
        kind = a.kind.value
        if kind.startswith("send_"):  # the isend call only; the transfer is recorded by sent()
            return
        self.events.append((kind, a.stage, -1 if a.microbatch is None else a.microbatch,
                            -1 if a.peer_stage is None else a.peer_stage, start_ns - self.t0_ns, end))

    def sent(self, a):
        """A callback for the send of ``a``: records the send from now to the callback's call."""
        start = time.perf_counter_ns() - self.t0_ns
        events, t0, key = self.events, self.t0_ns, (a.kind.value, a.stage, a.microbatch, a.peer_stage)

        def done() -> None:  # runs in the SendReaper thread; list.append is atomic under the GIL
            events.append((*key, start, time.perf_counter_ns() - t0))
        return done


class NoRecorder:
    """Recorder interface that records nothing (the tracked iteration, or timelines off)."""

    def now(self) -> int:
        return 0

    def action(self, a, start_ns: int) -> None:
        pass

    def sent(self, a):
        return None


def slices(events: list[tuple]) -> list[tuple[str, str, int, int, str]]:
    """One rank's iteration as trace slices ``(stream, name, start_ns, dur_ns, category)``, named
    and placed as the simulator does (``simulator/transfers.py``), receives on a ``recv`` stream."""
    out = []
    for kind, s, k, peer, start, end in events:
        dur = max(0, end - start)
        if kind in _COMPUTE:
            letter, cat = _COMPUTE[kind]
            out.append(("compute", f"{letter} s{s} mb{k}", start, dur, cat))
        elif kind in ("send_act", "send_grad"):
            fwd = kind == "send_act"
            out.append(("send_fwd" if fwd else "send_bwd", f"{'act' if fwd else 'grad'} s{s}->s{peer} mb{k}",
                        start, dur, "p2p"))
        elif kind in ("recv_act", "recv_grad"):
            what = "act" if kind == "recv_act" else "grad"
            out.append(("recv", f"wait {what} s{peer}->s{s} mb{k}", start, dur, "recv"))
        elif kind == "allreduce_grads":
            out.append(("collective", f"allreduce_grads s{s}", start, dur, "allreduce_grads"))
        elif kind == "optimizer_step":
            out.append(("compute", f"optimizer_step s{s}", start, dur, "optimizer_step"))
    return out


def aligned(lines: list[dict]) -> list[list[tuple]]:
    """Each rank's ``{"t0_ns", "events"}`` of one iteration, shifted onto a common origin (the
    earliest rank's barrier exit; same-host ranks only: one CLOCK_MONOTONIC)."""
    origin = min(line["t0_ns"] for line in lines)
    out = []
    for line in lines:
        d = line["t0_ns"] - origin
        out.append([(*e[:4], e[4] + d, e[5] + d) for e in line["events"]])
    return out


def iteration_end_ns(events: list[tuple]) -> int:
    """When the rank finished the iteration (its END event; the last event's end without one)."""
    ends = [e[5] for e in events if e[0] == END]
    return ends[-1] if ends else max((e[5] for e in events), default=0)


def representative_iteration(times_s: list[float], timed: list[int]) -> int:
    """Index (among ``timed``) of the iteration whose time is the median: the one whose trace
    is written (an odd count gives the exact median, an even one the lower middle)."""
    order = sorted(timed, key=lambda i: times_s[i])
    return order[(len(order) - 1) // 2]
