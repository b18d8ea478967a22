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

Host-memory traffic (issue 25 item 4): a STRONGHOLD window (executor.window) and MPress's weight
swap (executor.weight_swap) stamp each weight fetch (h2d), gradient copy (d2h) and CPU optimizer
step through a :class:`Stamps` bound to their stage, named as simulator/window.py and
simulator/weightswap.py name the same action (:data:`HOST_KINDS`). Such an event's fourth field
is the layer (not a peer stage). On a CPU rank every interval is the work itself, timed on the
host around it (a window's copy in its copy-engine thread, a weight swap's memcpy on the compute
thread, a CPU step in its pool thread). On CUDA a copy is asynchronous: the copy's stream records
a timing event before and after it (``torch.cuda.Event(enable_timing=True)``, a few µs of host
time per copy, the factory handed in by the worker), and :meth:`Recorder.resolve` turns the pairs
into nanoseconds once the device is synchronized, from an anchor event the worker recorded on the
idle device right after the barrier (its host stamp is the GPU clock's origin, to within the
launch latency, a few µs). CPU steps are host work on both. Each event goes to the recorder of
the iteration that issued it (the window passes its stamps along with a queued copy): a CPU step
or gradient copy that STRONGHOLD's eq. 3 lets run on into the next iteration stays in its own
iteration's trace, past that iteration's end.

Multi-streamed windows (STRONGHOLD §IV-A, ``offload.streams`` S > 1; executor.window_streams):
a group pass is one action, labelled in the events with the group and its microbatches,
``g{g} (mb {first}-{last})`` (a string in the microbatch field), so its slices are named as
simulator/window.py's :func:`group_name` names them ("F s0 g1 (mb 2-3)", "grads L4 g1 (mb 2-3)").
MAP layout conversions (issue 26 item 4; executor.map_layout.planned_redistribute): each
conversion a MAP layer runs, forward or its gradient's, is one event of kind ``convert`` /
``convert_grad`` (:data:`CONVERSION_KINDS`), its fourth field the layer, its microbatch field the
label "<group> in<k> <src>-><dst>" (or "<group> <param> ..."); :func:`conversion_events` turns a
layer's drained ``conv_events`` into such events. They run inside the pass that reads the value,
so their slices go on the ``collective`` stream (a stream of simulator/trace.py's: "convert L3
linear in0 S0R->RS0", "convert grad L3 linear in0 RS0->S0R"; category ``conversion``).

Pure except :class:`Recorder`'s clock; no torch.
"""
from __future__ import annotations

import time

#: kind of the event that closes an iteration (after the rank drained its sends)
END = "end"
_COMPUTE = {"forward": ("F", "forward"), "backward": ("B", "backward"), "backward_weight": ("W", "backward")}
#: host-traffic event kind -> (stream, name format, category), the simulator's names: a window's
#: fetch carries no microbatch (simulator/window.py: "fetch L<l>"), a weight swap's does; a CPU
#: rank's weight-swap copies are memcpys on the compute thread, "(memcpy)" as simulator/weightswap.py
#: names them; a CPU step names its microbatch only under PipeDream (an update per backward: the
#: event's microbatch is -1 otherwise)
HOST_KINDS = {
    "window_fetch": ("h2d", "fetch L{layer}", "window"),
    "window_grads": ("d2h", "grads L{layer} {mb}", "window"),
    "window_cpu_step": ("cpu", "cpu step L{layer}", "optimizer_step"),
    "swap_fetch": ("h2d", "fetch L{layer} {mb}", "swap"),
    "swap_fetch_memcpy": ("h2d", "fetch L{layer} {mb} (memcpy)", "swap"),
    "swap_grads": ("d2h", "grads L{layer} {mb}", "swap"),
    "swap_grads_memcpy": ("d2h", "grads L{layer} {mb} (memcpy)", "swap"),
    "swap_cpu_step": ("cpu", "cpu step L{layer}", "optimizer_step"),
}


#: conversion event kind -> slice name prefix (module docstring)
CONVERSION_KINDS = {"convert": "convert", "convert_grad": "convert grad"}


def conversion_events(drained, stage: int, t0_ns: int) -> list[tuple]:
    """A MAP layer's ``conv_events`` ``(kind, layer, label, start_ns, end_ns)`` (absolute
    perf_counter_ns) as this module's events of ``stage`` on the iteration's origin ``t0_ns``."""
    return [(kind, stage, label, layer, start - t0_ns, end - t0_ns)
            for kind, layer, label, start, end in drained if kind in CONVERSION_KINDS]


def conversion_name(kind: str, layer: int, label: str) -> str:
    """A conversion slice's name: ``convert L{layer} {label}`` (``convert grad ...`` backward)."""
    return f"{CONVERSION_KINDS[kind]} L{layer} {label}"


class Recorder:
    """Collects one iteration's events on one rank (see module docstring)."""

    def __init__(self, t0_ns: int, streams: int = 1):
        """``streams``: S > 1 labels each microbatch ``k`` (a group's first) as its group (module
        docstring)."""
        self.t0_ns, self.streams = t0_ns, streams
        self.events: list[tuple] = []
        self.pending: list[tuple] = []  # CUDA: (kind, stage, k, layer, start event, end event)
        self.anchor = None  # CUDA: (timing event, the host perf_counter_ns it was recorded at)

    def now(self) -> int:
        return time.perf_counter_ns()

    def interval(self, kind: str, stage: int, k: int, layer: int, start_ns: int, end_ns: int) -> None:
        """A host-traffic event (:data:`HOST_KINDS`) from absolute ``perf_counter_ns`` stamps;
        any thread (list.append is atomic under the GIL)."""
        self.events.append((kind, stage, self.label(k), layer, start_ns - self.t0_ns, end_ns - self.t0_ns))

    def label(self, k: int):
        """Microbatch ``k`` as events carry it: ``k``, or with S > 1 workers its group's label."""
        s = self.streams
        if s <= 1 or k is None or k < 0:
            return k
        g = k // s
        return f"g{g} (mb {g * s}-{g * s + s - 1})"

    def resolve(self) -> bool:
        """CUDA: the recorded event pairs as intervals, on :attr:`anchor` (a timing event recorded
        on the idle device at host time ``anchor_ns``, absolute perf_counter_ns). Call once the
        device is synchronized; a pair whose copy has not run yet stays pending (resolve again
        later). Returns whether nothing is pending."""
        pending, self.pending = self.pending, []
        if not pending:
            return True
        anchor, anchor_ns = self.anchor
        for kind, stage, k, layer, ev0, ev1 in pending:
            if not ev1.query():
                self.pending.append((kind, stage, k, layer, ev0, ev1))
                continue
            start = anchor_ns + round(anchor.elapsed_time(ev0) * 1e6)  # elapsed_time: ms
            self.interval(kind, stage, k, layer, start, start + round(ev0.elapsed_time(ev1) * 1e6))
        return not self.pending

    def action(self, a, start_ns: int) -> None:
        """Record action ``a`` (a specs.schedule.Action; None: the iteration's end) from ``start_ns``."""
        end = time.perf_counter_ns() - self.t0_ns
        if a is None:
            self.events.append((END, -1, -1, -1, end, end))
            return
        kind = a.kind.value
        if kind.startswith("send_"):  # the isend call only; the transfer is recorded by sent()
            return
        self.events.append((kind, a.stage, -1 if a.microbatch is None else self.label(a.microbatch),
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


class Stamps:
    """One stage's handle on the iteration's :class:`Recorder` for host traffic (a window's, a
    weight swap's). ``event``: CUDA, a factory of timing events (None: host stamps only).

    ``t = begin(stream)`` before the work and ``end(kind, k, layer, t, stream)`` after it: with a
    ``stream`` on CUDA an event pair on that stream, else host ``perf_counter_ns`` stamps.
    ``timed(fn, kind, k, layer)``: ``fn`` stamped when it runs (a CPU step in a pool thread: the
    recorder is the one current when it was submitted)."""

    __slots__ = ("rec", "stage", "event")

    def __init__(self, rec: Recorder, stage: int, event=None):
        self.rec, self.stage, self.event = rec, stage, event

    def begin(self, stream=None):
        if stream is not None and self.event is not None:
            ev = self.event()
            ev.record(stream)
            return ev
        return time.perf_counter_ns()

    def end(self, kind: str, k: int, layer: int, start, stream=None) -> None:
        if stream is not None and self.event is not None:
            ev = self.event()
            ev.record(stream)
            self.rec.pending.append((kind, self.stage, k, layer, start, ev))
        else:
            self.rec.interval(kind, self.stage, k, layer, start, time.perf_counter_ns())

    def timed(self, fn, kind: str, k: int, layer: int):
        def run(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.end(kind, k, layer, t)
        return run


class NoStamps:
    """:class:`Stamps` that records nothing (the tracked iteration, timelines off, set-up)."""

    __slots__ = ()

    def begin(self, stream=None):
        return None

    def end(self, kind: str, k: int, layer: int, start, stream=None) -> None:
        pass

    def timed(self, fn, kind: str, k: int, layer: int):
        return fn


NO_STAMPS = NoStamps()


def _mb(k) -> str:
    """A slice name's microbatch part: ``mb{k}``, or a group's label as recorded (S > 1)."""
    return k if isinstance(k, str) else f"mb{k}"


def slices(events: list[tuple]) -> list[tuple[str, str, int, int, str]]:
    """One rank's iteration as trace slices ``(stream, name, start_ns, dur_ns, category)``, named
    and placed as the simulator does (``simulator/transfers.py``; host traffic: :data:`HOST_KINDS`),
    receives on a ``recv`` stream."""
    out = []
    for kind, s, k, peer, start, end in events:
        dur = max(0, end - start)
        if kind in _COMPUTE:
            letter, cat = _COMPUTE[kind]
            out.append(("compute", f"{letter} s{s} {_mb(k)}", start, dur, cat))
        elif kind in ("send_act", "send_grad"):
            fwd = kind == "send_act"
            out.append(("send_fwd" if fwd else "send_bwd", f"{'act' if fwd else 'grad'} s{s}->s{peer} {_mb(k)}",
                        start, dur, "p2p"))
        elif kind in ("recv_act", "recv_grad"):
            what = "act" if kind == "recv_act" else "grad"
            out.append(("recv", f"wait {what} s{peer}->s{s} {_mb(k)}", start, dur, "recv"))
        elif kind == "allreduce_grads":
            out.append(("collective", f"allreduce_grads s{s}", start, dur, "allreduce_grads"))
        elif kind == "optimizer_step":
            out.append(("compute", f"optimizer_step s{s}", start, dur, "optimizer_step"))
        elif kind in CONVERSION_KINDS:  # ``peer`` is the layer, ``k`` the conversion's label
            out.append(("collective", conversion_name(kind, peer, k), start, dur, "conversion"))
        elif kind in HOST_KINDS:  # ``peer`` is the layer
            stream, name, cat = HOST_KINDS[kind]
            name = name.format(layer=peer, mb=_mb(k))
            if kind.endswith("cpu_step") and not isinstance(k, str) and k >= 0:  # PipeDream's per-backward step
                name += f" mb{k}"
            out.append((stream, name, start, dur, cat))
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
