"""executor.timeline (measured action records -> trace slices) and specs.compare's per-action
error table: pure pieces of issue #11's measured timelines."""
from __future__ import annotations

import pytest

from executor.timeline import END, aligned, iteration_end_ns, representative_iteration, slices
from specs.compare import action_errors, action_of


def test_slices_are_named_and_placed_as_the_simulator_does():
    events = [("recv_act", 1, 0, 0, 0, 50), ("forward", 1, 0, -1, 50, 150), ("send_act", 1, 0, 2, 150, 400),
              ("backward", 1, 0, -1, 500, 800), ("allreduce_grads", 1, -1, -1, 800, 900),
              ("optimizer_step", 1, -1, -1, 900, 950), (END, -1, -1, -1, 960, 960)]
    got = slices(events)
    assert ("recv", "wait act s0->s1 mb0", 0, 50, "recv") in got
    assert ("compute", "F s1 mb0", 50, 100, "forward") in got
    assert ("send_fwd", "act s1->s2 mb0", 150, 250, "p2p") in got
    assert ("compute", "B s1 mb0", 500, 300, "backward") in got
    assert ("collective", "allreduce_grads s1", 800, 100, "allreduce_grads") in got
    assert ("compute", "optimizer_step s1", 900, 50, "optimizer_step") in got
    assert iteration_end_ns(events) == 960


def test_aligned_puts_ranks_on_the_earliest_origin():
    a = {"t0_ns": 1_000, "events": [("forward", 0, 0, -1, 0, 10)]}
    b = {"t0_ns": 1_300, "events": [("forward", 1, 0, -1, 0, 10)]}
    ea, eb = aligned([a, b])
    assert ea[0][4:] == (0, 10) and eb[0][4:] == (300, 310)


def test_representative_iteration_is_the_median_timed_one():
    assert representative_iteration([9.0, 5.0, 3.0, 4.0, 1.0], [2, 3, 4]) == 2  # 3.0 is the median


def test_action_errors_average_per_stage_and_name_missing_sides():
    sim = [("F s0 mb0", 1_000_000), ("F s0 mb1", 1_000_000), ("B s0 mb0", 2_000_000)]
    meas = [("F s0 mb0", 2_000_000), ("F s0 mb1", 2_000_000), ("wait grad s1->s0 mb0", 500_000)]
    rows = {(e.action, e.stage): e for e in action_errors(sim, meas)}
    assert rows[("forward", 0)].error_pct == pytest.approx(-50.0)
    assert rows[("forward", 0)].simulated_count == 2 and rows[("forward", 0)].measured_count == 2
    assert rows[("backward", 0)].measured_mean_s is None and rows[("backward", 0)].error_pct is None
    assert rows[("recv_wait", 0)].simulated_mean_s is None
    assert action_of("swap_out L3 mb1") is None
