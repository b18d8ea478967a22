"""Host traffic in the measured timeline (issue 25 item 4): a STRONGHOLD window's and a weight
swap's fetches, gradient copies and CPU steps stamped by executor.timeline.Stamps, named as the
simulator names them (simulator/window.py, simulator/weightswap.py), and matched by
specs.compare's per-action table, each on its layer's stage. Pure: no ranks, no torch."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from executor.timeline import HOST_KINDS, NO_STAMPS, Recorder, Stamps, slices
from simulator.trace import TraceBuilder
from specs.compare import action_of, action_table, layer_stages, slice_action_errors, trace_slices

#: two stages: layers 0..2 and 3..5
PLAN = SimpleNamespace(stages=[SimpleNamespace(layer_start=0, layer_stop=3),
                               SimpleNamespace(layer_start=3, layer_stop=6)])


def test_host_events_are_named_and_placed_as_the_simulator_does():
    # (kind, stage, microbatch, layer, start, end): the fourth field is the layer for these kinds
    events = [("window_fetch", 0, -1, 2, 10, 30), ("window_grads", 0, 1, 2, 40, 45),
              ("window_cpu_step", 0, -1, 2, 45, 90), ("swap_fetch_memcpy", 1, 0, 4, 0, 7), ("swap_grads", 1, 3, 4, 8, 9), ("swap_cpu_step", 1, 5, 4, 9, 20),
              ("swap_cpu_step", 1, -1, 3, 9, 12)]
    got = slices(events)
    assert got == [("h2d", "fetch L2", 10, 20, "window"), ("d2h", "grads L2 mb1", 40, 5, "window"),
                   ("cpu", "cpu step L2", 45, 45, "optimizer_step"), ("h2d", "fetch L4 mb0 (memcpy)", 0, 7, "swap"),
                   ("d2h", "grads L4 mb3", 8, 1, "swap"), ("cpu", "cpu step L4 mb5", 9, 11, "optimizer_step"),
                   ("cpu", "cpu step L3", 9, 3, "optimizer_step")]
    assert {stream for stream, _, _ in HOST_KINDS.values()} == {"h2d", "d2h", "cpu"}


def test_stamps_record_host_intervals_relative_to_the_iteration_origin():
    rec = Recorder(t0_ns=1_000)
    stamps = Stamps(rec, stage=3)
    t = stamps.begin()
    stamps.end("window_fetch", -1, 7, t)
    kind, stage, k, layer, start, end = rec.events[0]
    assert (kind, stage, k, layer) == ("window_fetch", 3, -1, 7)
    assert start == t - 1_000 and end >= start


def test_timed_stamps_the_work_when_it_runs_and_returns_its_value():
    rec = Recorder(t0_ns=0)
    step = Stamps(rec, 0).timed(lambda x: x + 1, "swap_cpu_step", 2, 5)
    assert rec.events == []  # submitting stamps nothing
    assert step(41) == 42
    assert [e[:4] for e in rec.events] == [("swap_cpu_step", 0, 2, 5)]
    fn = lambda: None  # noqa: E731
    assert NO_STAMPS.timed(fn, "swap_cpu_step", 0, 0) is fn  # the tracked iteration: the bare call
    NO_STAMPS.end("window_fetch", 0, 0, NO_STAMPS.begin())


class _Event:
    """A timing event's interface (torch.cuda.Event): elapsed_time in ms from self to other."""

    def __init__(self, at_ms: float, done: bool = True):
        self.at_ms, self.done, self.stream = at_ms, done, None

    def record(self, stream=None):
        self.stream = stream

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other) -> float:
        return other.at_ms - self.at_ms


def test_cuda_event_pairs_resolve_on_the_anchor_and_unfinished_ones_wait():
    rec = Recorder(t0_ns=10_000)
    times = iter([_Event(2.0), _Event(2.5), _Event(3.0), _Event(4.0, done=False)])
    stamps = Stamps(rec, 1, event=lambda: next(times))
    for kind in ("window_fetch", "window_grads"):
        stamps.end(kind, 0, 4, stamps.begin("h2d"), "h2d")
    assert rec.events == [] and len(rec.pending) == 2
    rec.anchor = (_Event(1.0), 20_000)  # recorded at host time 20_000 ns
    assert rec.resolve() is False  # the gradient copy has not run yet: pending
    # fetch: 1 ms after the anchor, 0.5 ms long, relative to t0
    assert rec.events == [("window_fetch", 1, 0, 4, 20_000 + 1_000_000 - 10_000, 20_000 + 1_500_000 - 10_000)]
    assert len(rec.pending) == 1
    rec.pending[0][-1].done = True  # it ran (a later iteration's end resolves it)
    assert rec.resolve() is True
    assert rec.events[-1] == ("window_grads", 1, 0, 4, 20_000 + 2_000_000 - 10_000, 20_000 + 3_000_000 - 10_000)
    assert Recorder(0).resolve() is True  # nothing recorded: no anchor needed
    assert Stamps(rec, 1).begin("h2d") > 0  # without an event factory: host stamps


def test_compare_places_host_traffic_on_the_layers_stage_and_its_own_stream():
    stages = layer_stages(PLAN)
    assert stages == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    assert action_of("fetch L4", "h2d", stages) == ("fetch", 1)
    assert action_of("fetch L1 mb3 (memcpy)", "h2d", stages) == ("fetch", 0)
    assert action_of("grads L5 mb0", "d2h", stages) == ("grad_copy", 1)
    assert action_of("cpu step L2 mb7", "cpu", stages) == ("cpu_step", 0)
    # the compute-stream hold of a CPU rank's memcpy has the copy's name: not a copy
    assert action_of("fetch L1 mb3 (memcpy)", "compute", stages) is None
    assert action_of("wait fetch L1 mb3", "compute", stages) is None
    assert action_of("cpu step s0", "cpu", stages) is None  # ZeRO-Offload's stage step
    assert action_of("fetch L9", "h2d", stages) is None  # not a layer of the plan
    assert action_of("fetch L4", "h2d") is None  # without the plan's layers


def test_action_table_shows_host_traffic_simulated_vs_measured():
    sim = [("h2d", "fetch L1", 0, 400_000, "window"), ("h2d", "fetch L4", 0, 200_000, "window"),
           ("compute", "fetch L1", 0, 999_000_000, "swap"), ("d2h", "grads L1 mb0", 0, 100_000, "window"),
           ("cpu", "cpu step L1", 0, 1_000_000, "optimizer_step")]
    meas = [("h2d", "fetch L1", 5, 500_000, "window"), ("h2d", "fetch L1", 9, 300_000, "window"),
            ("d2h", "grads L1 mb0", 0, 50_000, "window")]
    rows = {(e.action, e.stage): e for e in slice_action_errors(sim, meas, PLAN)}
    fetch = rows[("fetch", 0)]
    assert (fetch.simulated_count, fetch.measured_count) == (1, 2)
    assert fetch.simulated_mean_s == pytest.approx(400e-6) and fetch.measured_mean_s == pytest.approx(400e-6)
    assert fetch.error_pct == pytest.approx(0.0)
    assert rows[("grad_copy", 0)].error_pct == pytest.approx(100.0)
    assert rows[("cpu_step", 0)].measured_mean_s is None and rows[("cpu_step", 0)].error_pct is None
    assert rows[("fetch", 1)].measured_count == 0
    table = action_table(list(rows.values()))
    assert "fetch" in table and "grad_copy" in table and "cpu_step" in table
    # without the plan (or from x_slices' pids) only passes, transfers and steps count
    assert slice_action_errors(sim, meas) == []


def test_trace_slices_read_the_stream_of_each_slice():
    b = TraceBuilder()
    b.slice(0, "h2d", "fetch L1 mb0 (memcpy)", 1_000, 2_000, "swap")
    b.slice(0, "compute", "fetch L1 mb0 (memcpy)", 1_000, 2_000, "swap")
    b.slice(1, "cpu", "cpu step L4", 3_000, 500, "optimizer_step")
    got = sorted(trace_slices(b.build({0: "d0", 1: "d1"}, {})))
    assert got == [("compute", "fetch L1 mb0 (memcpy)", 1_000, 2_000, "swap"), ("cpu", "cpu step L4", 3_000, 500,
                   "optimizer_step"), ("h2d", "fetch L1 mb0 (memcpy)", 1_000, 2_000, "swap")]
    rows = slice_action_errors(got, got, PLAN)
    assert {(e.action, e.stage, e.simulated_count) for e in rows} == {("fetch", 0, 1), ("cpu_step", 1, 1)}
