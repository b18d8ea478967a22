"""The window choice rule (STRONGHOLD §III-D's P1/P2, planners/stronghold/planner.py) on the audit's
case, the bottleneck the summary names, and the summary's units (issue 25).

The audit found the 1.7B model (Table I: 20 layers, hidden 2560) at microbatch 2, fp16, given window 3
with 1 microbatch and 15 with 4: the same per-microbatch costs. Priced, the candidates show why:
a fetch (13.1 ms) outlasts a forward (4.5 ms), so a forward pass is bound by the host link past the
window. The iteration's first forward starts with every slot stale (the step leaves them so), every
fetch of it is a first fetch and no window hides them (the cold start); with 1 microbatch it is the
only forward, so slots beyond P2's 3 buy nothing. With 4 microbatches the forwards of microbatches
1-3 start warm, after a backward that leaves the lowest w layers in the slots, and stall on every
fetch past them until (n - w) fetches fit behind w forwards: 15.
"""
from __future__ import annotations

import math

import pytest

from costs.families import build_model, parse_model_config
from planners import parse_policy
from planners.stronghold.planner import BOTTLENECK_FRACTION, stronghold_search, summary_lines
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from specs.units import size_text, time_text
from tests.conftest import conf

V100 = HardwareSpec.model_validate(conf("hardware", "v100_single"))
GPT_1B7 = build_model(parse_model_config(conf("model", "stronghold_gpt_l20")))


def _stage(microbatches: int, precision: str = "fp16", microbatch: int = 2, model=GPT_1B7, hw=V100,
           first_window: bool = False, **policy):
    """The audit's cases price the window rule with the embedding/head resident only
    (``first_window=False``: policy.resident_first_window off); the first working window resident
    (§III-E1, the default) is checked where it changes the answer. One worker (``streams`` 1,
    unless given): the rule is about a microbatch's passes; groups of S are test_streams*'s."""
    policy = {"streams": 1, **policy}
    training = TrainingSpec(global_batch=microbatches * microbatch, microbatch_size=microbatch, precision=precision,
                            **({"mixed_bytes_per_param": 16} if precision != "fp32" else {}))
    pol = parse_policy({"kind": "stronghold", "pp": 1, **policy}).model_copy(
        update={"resident_first_window": first_window})
    return stronghold_search(pol, model, hw, training, ScheduleSpec())


@pytest.fixture(scope="module")
def one_and_four():
    return _stage(1).stages[0], _stage(4).stages[0]


def test_the_cold_start_is_the_same_for_every_window(one_and_four):
    """The cold start (the first fetches, which no window hides) does not depend on the window; a
    window's own stalls come on top of it."""
    for c in one_and_four:
        colds = {p.cold_stall_s for p in c.prices}
        assert len(colds) == 1 and colds.pop() > 0
        assert all(p.stall_s >= 0 for p in c.prices)


def test_one_microbatch_extra_slots_buy_nothing(one_and_four):
    one, _ = one_and_four
    t = one.layer_times_s
    assert t["fetch_s"] > t["fwd_s"]  # the regime the audit hit: a forward is bound by the host link
    chosen = next(p for p in one.prices if p.window == one.window)
    below = next(p for p in one.prices if p.window == one.window - 1)
    assert chosen.stall_s == 0 < below.stall_s  # the smallest window whose backward does not stall (P2)
    # P2 in closed form for identical layers: a backward's slot turns over when its gradient copy
    # and the next layer's fetch are done, behind the m - 1 other backwards ((2b) with (2d)'s sum)
    assert one.window == 1 + math.ceil((t["grad_copy_s"] + t["fetch_s"]) / t["bwd_s"])
    # every window above it prices the same iteration: the only forward is the cold one
    _, four = one_and_four
    forced = [_stage(1, window_layers=w).stages[0].prices[0] for w in (one.window, four.window, one.streamed)]
    assert len({p.time_s for p in forced}) == 1 and all(p.stall_s == 0 for p in forced)


def test_four_microbatches_the_warm_forwards_ask_for_more(one_and_four):
    one, four = one_and_four
    assert four.window > one.window
    by_w = {p.window: p for p in four.prices}
    assert by_w[four.window].stall_s == 0 < by_w[four.window - 1].stall_s
    # each slot below the choice stalls in each of the 3 warm forwards: the stall falls with w
    stalls = [by_w[w].stall_s for w in range(one.window, four.window + 1)]
    assert stalls == sorted(stalls, reverse=True) and len(set(stalls)) == len(stalls)
    # and the windows 1 microbatch chose would cost the 4-microbatch iteration: measurably slower
    assert by_w[one.window].time_s > by_w[four.window].time_s * 1.03


def test_a_wait_under_two_percent_is_not_named_the_bottleneck():
    """The fp32 1.7B preset: with the embedding resident only, the next forward waits a few ms for
    the first streamed layer's CPU step (its gradient copy and step follow its backward, only the
    embedding's backward and forward hide them); reported, not named. With the first working
    window resident (§III-E1, the default) it waits nothing: eq. 3 holds for every layer."""
    c = _stage(1, "fp32", microbatch=8).stages[0]
    p = next(x for x in c.prices if x.window == c.window)
    t = c.layer_times_s
    assert t["cpu_step_s"] < t["bwd_s"]  # eq. 3 holds per layer
    assert 0 < p.cpu_wait_s <= t["tail_s"] + 1e-9 and p.cpu_wait_s < BOTTLENECK_FRACTION * p.time_s
    assert c.bottleneck == "none" and "first streamed layer" in c.why
    r = _stage(1, "fp32", microbatch=8, first_window=True).stages[0]
    rp = next(x for x in r.prices if x.window == r.window)
    assert rp.cpu_wait_s == 0 and rp.stall_s == 0 and rp.time_s < p.time_s and r.bottleneck == "none"
    # fp16 at microbatch 2: the CPU step (78.7 ms) outlasts the backward (13.8 ms): the steps queue
    q = _stage(1).stages[0]
    qp = next(x for x in q.prices if x.window == q.window)
    assert qp.cpu_wait_s > BOTTLENECK_FRACTION * qp.time_s and q.bottleneck == "cpu optimizer"
    assert "queue" in q.why


def test_the_summary_reads_a_cpu_run_in_its_own_units():
    model = build_model(parse_model_config(conf("model", "gpt_tiny")))
    hw = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
    outcome = stronghold_search(parse_policy({"kind": "stronghold", "pp": 1}), model, hw,
                                TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32"), ScheduleSpec())
    text = "\n".join(summary_lines(outcome))
    assert "0.0 GiB" not in text and "0.00 GiB" not in text and "MiB" in text
    assert " 0.0 ms" not in text and "µs" in text


@pytest.mark.parametrize("n,want", [(8.5e9, "7.92 GiB"), (1_163_264, "1.11 MiB"), (2048, "2.00 KiB"), (512, "512 B")])
def test_size_text(n, want):
    assert size_text(n) == want


@pytest.mark.parametrize("s,want", [(8.718, "8.72 s"), (0.102, "102 ms"), (0.0262, "26.2 ms"), (3.2e-5, "32.0 µs"),
                                    (0.99996, "1.00 s"), (0, "0 s"), (12345.6, "12346 s"), (1e-7, "100 ns")])
def test_time_text(s, want):
    assert time_text(s) == want
