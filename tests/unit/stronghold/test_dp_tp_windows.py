"""STRONGHOLD windows with data and tensor parallelism (issue 25 item 2; STRONGHOLD §III-E2, §III-F).

Each dp replica streams its own window and its streamed layers' host gradients are all-reduced
over the replicas, layer by layer, between the gradient copy and the CPU step (costs.window
.host_allreduce_s, simulator.window.HostRing); a tp rank streams its shard of every layer.
"""
from __future__ import annotations

import pytest

from costs import window as win
from costs.families import build_model, parse_model_config
from planners import parse_policy
from planners.stronghold.layouts import simulated_iteration_s
from planners.stronghold.planner import price_base, stronghold_search
from simulator.links import Links
from simulator.window import Clock, WindowWalk, drive, resources, walk_passes
from specs.hardware import HardwareSpec
from specs.plan import Plan, ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import CPU_TRAINING, LOCAL_CPU, conf, make_hardware, make_model

A10 = HardwareSpec.model_validate(conf("hardware", "a10_cluster"))


def gpt(name: str):
    return build_model(parse_model_config(conf("model", name)))


def windowed(model, hardware, training, **degrees):
    pol = parse_policy({"kind": "stronghold", "pp": 1, "window_layers": 1, "resident_first_window": False,
                        "streams": 1, **degrees})  # one worker: the walk below times microbatches
    return stronghold_search(pol, model, hardware, training, ScheduleSpec())


@pytest.mark.parametrize("degrees", [{"dp": 2, "tp": 1}, {"dp": 1, "tp": 2}, {"dp": 2, "tp": 2}])
def test_plan_validation_accepts_dp_and_tp_windows(degrees):
    out = windowed(gpt("gpt_tiny"), LOCAL_CPU, CPU_TRAINING, **degrees)
    st = out.plan.stages[0]
    assert (st.dp, st.tp, st.offload.window_layers) == (degrees["dp"], degrees["tp"], 1)
    Plan.model_validate(out.plan.model_dump())  # round trip through validation
    with pytest.raises(ValueError, match="ZeRO sharding"):
        Plan.model_validate({**out.plan.model_dump(), "zero_stage": 1})


def test_a_tp_rank_streams_its_shard():
    """The unit of offload is the layer's shard: slots and host state per rank are 1/tp."""
    model = make_model(8, params=4_000_000)
    hw = make_hardware(4)
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")
    one, two = (windowed(model, hw, training, dp=1, tp=tp).plan for tp in (1, 2))
    assert win.slot_params(model, two.stages[0]) * 2 == win.slot_params(model, one.stages[0])
    assert win.window_static(model, two, two.stages[0])[3] * 2 == win.window_static(model, one, one.stages[0])[3]


class Trace:
    def __init__(self):
        self.slices = []

    def slice(self, device, stream, name, start, dur, cat):
        self.slices.append((stream, name, start, dur))


def test_the_walk_all_reduces_each_streamed_layer_before_its_cpu_step():
    """Ring all-reduce 2(n-1)/n bytes / bw + 2(n-1) latency (Thakur et al.) of each streamed
    layer's gradient shard over the replicas' hosts, after its last gradient copy, before its CPU
    step; nothing with one replica."""
    model = make_model(6, params=3_000_000)
    hw = make_hardware(devices=1, nodes=4)  # one GPU per node: the host ring crosses inter_node
    training = TrainingSpec(global_batch=8, microbatch_size=4, precision="fp32")
    plan = windowed(model, hw, training, dp=4, tp=1).plan
    sc, passes, ring = price_base(plan, model, hw, 0)
    link = hw.inter_node
    n, nbytes = 4, 4 * 3_000_000  # fp32 gradients
    by_hand_ns = round((2 * (n - 1) / n * nbytes / (link.bw_gbps * 1e9) + 2 * (n - 1) * link.latency_s) * 1e9)
    streamed = [lc.layer for lc in sc.layers if lc.streamed]
    assert streamed and all(ring.ns[l] == by_hand_ns for l in streamed)
    trace, clock = Trace(), Clock()
    walk = WindowWalk(sc, Links(hw), *resources(hw, sc), training.microbatches, clock, trace, steady=False, ring=ring)
    walk_passes(walk, passes, clock)
    drive(walk.step(), clock)
    ends = {name.split()[1]: s + d for stream, name, s, d in trace.slices if stream == "collective"}
    copies = {}
    for stream, name, s, d in trace.slices:
        if stream == "d2h":
            copies[name.split()[1]] = max(copies.get(name.split()[1], 0), s + d)
    steps = {name.split()[2]: s for stream, name, s, d in trace.slices if stream == "cpu"}
    assert sorted(ends) == sorted(f"L{l}" for l in streamed)
    for layer, end in ends.items():
        assert end - by_hand_ns >= copies[layer]  # issued after the layer's last gradient copy
        assert steps[layer] >= end                # the CPU step reads the reduced gradient
    one = windowed(model, hw, training, dp=1, tp=1).plan
    assert price_base(one, model, hw, 0)[2] is None


def test_the_all_reduce_inside_a_node_never_rides_a_gpu_peer_link():
    """Host buffers go host to host: priced with the node's host path (fallback), not NVLink."""
    hw = make_hardware(4)  # NVLink pairs (0, 1), (2, 3); PCIe fallback
    link = win.host_allreduce_link(hw, [0, 1])
    assert link.kind.value == "pcie" and link.bw_gbps == hw.intra_node.fallback.bw_gbps


def test_replicas_on_one_node_share_its_cpu_and_ram():
    """Each replica keeps its own host copy and steps it: a node with k ranks of the stage steps
    k copies of each layer on its cores, and holds k host copies."""
    model = make_model(8, params=4_000_000)
    hw = make_hardware(4)
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")
    one, two = (windowed(model, hw, training, dp=dp, tp=1) for dp in (1, 2))
    params = 4_000_000
    for out, k in ((one, 1), (two, 2)):
        st = out.plan.stages[0]
        assert win.cpu_step_s(out.plan, hw, st, params) == pytest.approx(k * params / hw.host.cpu_adam_params_per_s)
    assert two.host_bytes_per_node[0] == 2 * one.host_bytes_per_node[0]


def test_the_planner_uses_all_eight_a10s_for_gpt3_13b():
    """`+hardware=a10_cluster +model=gpt3_13b policy=stronghold` (issue 25): one A10 is enough
    with a window but 8 are faster, so the layout spans all 8 devices (dp or tp), and its
    simulated iteration is shorter than half the one-device plan's."""
    model = gpt("gpt3_13b")
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp16")
    free = stronghold_search(parse_policy({"kind": "stronghold"}), model, A10, training, ScheduleSpec())
    assert free.fits and free.plan.used_devices() == list(range(8))
    assert any(st.dp * st.tp > 1 for st in free.plan.stages)
    single = stronghold_search(parse_policy({"kind": "stronghold", "dp": 1, "tp": 1}), model, A10, training,
                               ScheduleSpec())
    assert single.fits and single.plan.used_devices() == [0]
    assert simulated_iteration_s(free, model, A10) < simulated_iteration_s(single, model, A10) / 2
    assert any("chosen" in n for n in free.notes)


def test_given_degrees_are_kept():
    model = gpt("gpt3_13b")
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp16")
    out = stronghold_search(parse_policy({"kind": "stronghold", "dp": 2}), model, A10, training, ScheduleSpec())
    assert all(st.dp == 2 for st in out.plan.stages)
    with pytest.raises(Exception, match="policy.dp"):
        stronghold_search(parse_policy({"kind": "stronghold", "pp": 1, "dp": 4, "tp": 1}), model, A10, training,
                          ScheduleSpec())
