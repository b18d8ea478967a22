"""policy=auto with STRONGHOLD's data- and tensor-parallel windows and multi-stream (issue 25).

A stage of dp x tp devices takes a window as policy=stronghold's layouts do (STRONGHOLD §III-F):
each dp replica streams its own window and all-reduces its streamed layers' host gradients before
their CPU steps (priced in the window walk: simulator.window.host_ring), a tp rank streams its
shard of every layer. A one-stage windowed candidate gets its streams (§IV-A,
planners/stronghold/streams.choose_streams) before it is simulated.
"""
from __future__ import annotations

import pytest

from costs import window as win
from costs.params import layer_params_on_device
from planners.auto.realise import with_streams
from planners.auto.search import auto_search
from planners.baselines.partition import plan_balanced
from planners.policy import AutoPolicy, BalancedPolicy
from planners.stronghold.planner import price, price_base
from planners.stronghold.stage_window import window_blockers, window_stage
from planners.verdict import peaks
from simulator import simulate
from specs import HardwareSpec, TrainingSpec
from specs.plan import ScheduleSpec, validate_plan
from tests.conftest import conf
from tests.unit.auto.auto_cases import ONE_F_ONE_B, spec

GIB = 1 << 30
V100 = conf("hardware", "v100_single")
TRAINING = TrainingSpec(global_batch=32, microbatch_size=8, precision="fp16")


def v100s(n: int, host_link_gbps: float | None = None) -> HardwareSpec:
    """``n`` V100-32GB on STRONGHOLD's host (one node); ``host_link_gbps``: the node's host-side
    path (intra_node.fallback), what the host all-reduce of a dp window is bound by."""
    data = {**V100, "devices_per_node": n}
    if host_link_gbps is not None:
        data["intra_node"] = {**V100["intra_node"], "fallback": {**V100["intra_node"]["fallback"],
                                                                 "bw_gbps": host_link_gbps}}
    return HardwareSpec.model_validate(data)


@pytest.fixture(scope="module")
def gpt_5b3():
    return spec("gpt_5b3", TRAINING)


def one_stage(model, hw, dp=1, tp=1):
    return plan_balanced(BalancedPolicy(pp=1, dp=dp, tp=tp, recompute="full"), model, hw, TRAINING,
                         ScheduleSpec(kind="1f1b"))


def test_a_dp2_window_stage_is_accepted_and_priced_with_the_host_allreduce(gpt_5b3):
    """GPT 5.3B, one stage of two data-parallel V100s (85 GiB of state per replica): the window is
    accepted, fits, validates; its price is the window walk with the host all-reduce of every
    streamed layer's gradient (§III-F), strictly slower than the same walk without it on a host
    path slow enough that the all-reduce shows, and the slower that path the longer the stage."""
    cap = 32 * GIB
    times = []
    for gbps in (2.0, 0.5):
        hw = v100s(2, gbps)
        plan = one_stage(gpt_5b3, hw, dp=2)
        assert window_blockers(plan, 0, gpt_5b3) is None
        sw = window_stage(plan, gpt_5b3, hw, 0, cap)
        assert sw is not None and sw.fits and sw.host_fits, sw.reason
        validate_plan(sw.plan, gpt_5b3, hw)
        st = sw.plan.stages[0]
        assert (st.dp, st.tp, st.offload.window_layers) == (2, 1, sw.window_layers)
        sc, passes, ring = price_base(sw.plan, gpt_5b3, hw, 0)
        assert ring is not None and set(ring.ns) == set(win.streamed_params(gpt_5b3, st))
        assert min(ring.ns.values()) > 0
        with_ring = price(sw.plan, gpt_5b3, hw, 0, base=(sc, passes, ring), capacity_bytes=cap)
        without = price(sw.plan, gpt_5b3, hw, 0, base=(sc, passes, None), capacity_bytes=cap)
        assert sw.price.time_s == with_ring.time_s  # window_stage priced it with the all-reduce
        assert with_ring.time_s > without.time_s, "the host all-reduce of the streamed gradients was not priced"
        times.append((hw, sw))
    (fast_hw, fast), (slow_hw, slow) = times
    assert slow.price.time_s > fast.price.time_s
    # the simulator agrees: the same plan on the slower host path takes longer
    fast_sim = simulate(fast.plan, gpt_5b3, fast_hw, trace=False).result.iteration_time_s
    slow_sim = simulate(fast.plan, gpt_5b3, slow_hw, trace=False).result.iteration_time_s
    assert slow_sim > fast_sim


def test_a_tp2_window_stage_streams_the_shard(gpt_5b3):
    """One stage of two tensor-parallel V100s: each rank streams its half of every layer, so a
    slot holds 1/tp of the largest streamed layer's parameters, and each device's peak is the
    window's price."""
    hw = v100s(2)
    cap = 32 * GIB
    plan1, plan2 = one_stage(gpt_5b3, v100s(1)), one_stage(gpt_5b3, hw, tp=2)
    assert window_blockers(plan2, 0, gpt_5b3) is None
    sw = window_stage(plan2, gpt_5b3, hw, 0, cap)
    assert sw is not None and sw.fits, sw.reason
    validate_plan(sw.plan, gpt_5b3, hw)
    st2 = sw.plan.stages[0]
    st1 = plan1.stages[0].model_copy(update={"offload": st2.offload})
    one, two = win.slot_params(gpt_5b3, st1), win.slot_params(gpt_5b3, st2)
    # a slot: the largest streamed layer's shard (Megatron shards the GEMM weights; the LayerNorms
    # and the row-parallel biases stay replicated on every rank: 30,720 of 315 M parameters here)
    assert two == max(layer_params_on_device(gpt_5b3.layers[i], 2) for i in st2.streamed_layers)
    assert one / 2 <= two <= one / 2 * (1 + 1e-3), (one, two)
    streamed1, streamed2 = win.streamed_params(gpt_5b3, st1), win.streamed_params(gpt_5b3, st2)
    assert streamed1.keys() == streamed2.keys()
    assert all(streamed1[k] / 2 <= streamed2[k] <= streamed1[k] / 2 * (1 + 1e-3) for k in streamed1)
    # the device holds tp2's slots: its window costs half the slot bytes tp1's would
    assert win.window_static(gpt_5b3, sw.plan, st2)[0] < win.window_static(gpt_5b3, sw.plan, st1)[0]
    device_peaks = peaks(sw.plan, gpt_5b3, hw)
    assert max(device_peaks[d] for d in st2.devices) == sw.price.peak_bytes <= cap


@pytest.fixture(scope="module")
def thirteen_b_on_two_v100s():
    """GPT-3 13B on two V100-32GB (one node), STRONGHOLD's setting doubled: 208 GB of state, so
    no layout fits without offload of the state itself or heavy compaction."""
    hw = v100s(2)
    training = TrainingSpec(global_batch=8, microbatch_size=8, precision="fp16", mixed_bytes_per_param=16)
    model = spec("gpt3_13b", training)
    out = auto_search(AutoPolicy(singles=["stronghold"]), model, hw, training, ONE_F_ONE_B)
    return model, hw, out


def _dp_tp_window(plan) -> bool:
    return any(st.offload.window_layers and st.dp * st.tp > 1 for st in plan.stages)


@pytest.mark.slow  # GPT-3 13B's auto search: 10-40 s on 2 shared cores
def test_auto_finds_a_dp_tp_window_itself_and_it_wins(thirteen_b_on_two_v100s):
    """The joint search (not only the STRONGHOLD single) builds a window over a dp or tp stage; the
    chosen plan has one, it fits, it is at least as fast as policy=stronghold's own plan (whose
    null dp / tp search the same windows), and faster than every fitting plan without a window
    (the compacted tp2 and pp2 layouts)."""
    model, hw, out = thirteen_b_on_two_v100s
    assert out.fits and _dp_tp_window(out.plan), out.winner.how
    own = [c for c in out.candidates if c.fits and _dp_tp_window(c.plan)]
    assert own, "no auto candidate with a dp/tp window"
    [single] = [s for s in out.singles if s.name == "stronghold"]
    assert single.candidate is not None and single.candidate.fits
    assert min(c.time_s for c in own) <= single.candidate.time_s * (1 + 1e-9)
    assert out.winner.time_s <= single.candidate.time_s
    plain = [c for c in out.everything if c.fits and not any(st.offload.window_layers for st in c.plan.stages)]
    assert plain and out.winner.time_s < min(c.time_s for c in plain)
    # what auto reports is what the simulator says of the plan
    again = simulate(validate_plan(out.plan, model, hw), model, hw, trace=False).result
    assert again.iteration_time_s == out.winner.time_s


@pytest.fixture(scope="module")
def gpt_1b7_many_microbatches():
    """STRONGHOLD's GPT-1.7B (§V) on one V100 in fp16, 32 microbatches of one sample: small GEMMs,
    low on the V100's efficiency curve, which the streams' grouped kernels climb (§IV-A)."""
    hw = HardwareSpec.model_validate(V100)
    training = TrainingSpec(global_batch=32, microbatch_size=1, precision="fp16")
    model = spec("stronghold_gpt_l20", training)
    out = auto_search(AutoPolicy(singles=["stronghold"]), model, hw, training, ONE_F_ONE_B)
    return model, hw, out


def test_a_one_stage_windowed_candidate_gets_streams_that_pay(gpt_1b7_many_microbatches):
    """Auto's one-stage windowed candidates run several streams where the simulator says it pays;
    the candidate names them, and the plan is faster than the same plan with one stream."""
    model, hw, out = gpt_1b7_many_microbatches
    windowed = [c for c in out.candidates if len(c.plan.stages) == 1 and c.plan.stages[0].offload.window_layers]
    assert windowed
    multi = [c for c in windowed if c.plan.stages[0].offload.streams > 1]
    assert multi, [c.how for c in windowed]
    for c in multi:
        streams = c.plan.stages[0].offload.streams
        assert c.how.endswith(f"streams {streams}") and any(n.startswith(f"streams {streams}:") for n in c.notes)
        assert out.plan.training.microbatches % 1 == 0 and c.plan.training.microbatches % streams == 0
        one = c.plan.model_copy(update={"stages": [c.plan.stages[0].model_copy(update={
            "offload": c.plan.stages[0].offload.model_copy(update={"streams": 1})})]})
        t1 = simulate(validate_plan(one, model, hw), model, hw, trace=False).result.iteration_time_s
        assert c.time_s < t1, f"{c.how}: {c.time_s} s with {streams} streams, {t1} s with one"


def test_streams_stay_one_when_memory_forbids_a_second_worker(gpt_1b7_many_microbatches):
    """The same windowed plan under a capacity equal to its one-stream peak: a second worker's
    activations do not fit (§IV-A's OOM bound), so auto keeps one stream and says why."""
    model, hw, out = gpt_1b7_many_microbatches
    c = next(c for c in out.candidates if len(c.plan.stages) == 1 and c.plan.stages[0].offload.streams > 1)
    one = c.plan.model_copy(update={"stages": [c.plan.stages[0].model_copy(update={
        "offload": c.plan.stages[0].offload.model_copy(update={"streams": 1})})]})
    peak1 = max(peaks(one, model, hw).values())
    got, why = with_streams(one, model, hw, peak1)
    assert got.stages[0].offload.streams == 1 and why.startswith("streams 1") and "do not fit" in why, why
    roomy, why = with_streams(one, model, hw, hw.device.memory_bytes)
    assert roomy.stages[0].offload.streams == c.plan.stages[0].offload.streams, why


@pytest.mark.slow  # shares the 13B search
def test_a_pipeline_keeps_one_stream(thirteen_b_on_two_v100s):
    """Streams share the window of a one-stage pipeline only (the contract): auto's windowed
    pipelines keep one."""
    _, _, out = thirteen_b_on_two_v100s
    piped = [c for c in out.candidates if len(c.plan.stages) > 1 and any(st.offload.window_layers
                                                                          for st in c.plan.stages)]
    assert piped and all(st.offload.streams == 1 for c in piped for st in c.plan.stages)
