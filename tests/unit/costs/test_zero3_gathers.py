"""ZeRO-3 / FSDP's parameter all-gathers in time and memory (issue 27: "FSDP2 in torchtitan, in
time and memory"): every layer's weights gathered over the dp group before its forward and again
before its backward, prefetched one layer ahead (costs.layer_time.sharded_dp_comm_s), and the
unsharded buffers they need (costs.buffers.zero3_gather_bytes)."""
from __future__ import annotations

import pytest

import costs.buffers
import costs.collectives
import costs.layer_time
from costs.families import build_model, parse_model_config
from costs.params import layer_params_on_device
from planners import make_plan, parse_policy
from simulator.analytic import estimate
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf

MODEL = build_model(parse_model_config(conf("model", "llama3_8b")), 2)
TRAINING = TrainingSpec(global_batch=16, microbatch_size=8, precision="bf16", mixed_bytes_per_param=16)


def plan_of(nodes: int = 1, **policy):
    hw = HardwareSpec.model_validate({**conf("hardware", "h100_node"), "nodes": nodes})
    training = TRAINING.model_copy(update={"global_batch": 16 * nodes, "microbatch_size": 8 * nodes})
    plan = make_plan(parse_policy({"kind": "manual", "pp": 1, "dp": 8 * nodes, **policy}), MODEL, hw, training,
                     ScheduleSpec(kind="1f1b"))
    return plan, hw


def test_gathers_hide_behind_the_previous_layer_but_the_first():
    plan, hw = plan_of(zero_stage=3)
    st = plan.stages[0]
    fwd, bwd = costs.layer_time.sharded_dp_comm_s(MODEL, plan, hw, st)
    link = costs.collectives.allreduce_link(hw, st.devices[:: st.tp])
    first = costs.collectives.ring_allreduce_s(layer_params_on_device(MODEL.layers[st.layers[0]], 1) * 2, 8, link) / 2
    total = sum(costs.collectives.ring_allreduce_s(layer_params_on_device(MODEL.layers[l], 1) * 2, 8, link) / 2
                for l in st.layers)
    assert first <= fwd < total and 0 < bwd < total
    assert costs.layer_time.sharded_dp_comm_s(MODEL, plan_of(zero_stage=1)[0], hw, st) == (0.0, 0.0)


def test_a_slow_fabric_exposes_more_of_them():
    """Over a slow inter-node link the gathers outlast the passes they hide behind."""
    fast, hw = plan_of(nodes=2, zero_stage=3)
    slow_hw = hw.model_copy(update={"inter_node": hw.inter_node.model_copy(update={"bw_gbps": 1.0})})
    st = fast.stages[0]
    f_fast, b_fast = costs.layer_time.sharded_dp_comm_s(MODEL, fast, hw, st)
    f_slow, b_slow = costs.layer_time.sharded_dp_comm_s(MODEL, fast, slow_hw, st)
    assert f_slow > f_fast and b_slow > b_fast


def test_unsharded_buffers_are_counted():
    plan, hw = plan_of(zero_stage=3)
    z1, _ = plan_of(zero_stage=1)
    extra = costs.buffers.zero3_gather_bytes(MODEL, plan, plan.stages[0])
    sizes = sorted(layer_params_on_device(MODEL.layers[l], 1) for l in plan.stages[0].layers)
    w_b, g_b, _ = TRAINING.bytes_per_param()
    assert extra == w_b * (sizes[-1] + sizes[-2]) + g_b * sizes[-1]
    assert costs.buffers.zero3_gather_bytes(MODEL, z1, z1.stages[0]) == 0
    buffers = {d.device: d.breakdown.buffers_bytes for d in estimate(plan, MODEL, hw).devices}
    buffers_z1 = {d.device: d.breakdown.buffers_bytes for d in estimate(z1, MODEL, hw).devices}
    assert all(buffers[d] - buffers_z1[d] == extra for d in buffers)


def test_stream_model_closed_forms():
    """The one FIFO stream (costs.layer_time._stream_exposed_s): gathers alone expose the first
    and whatever a gather outlasts the pass before it; a reduce-scatter queued after each pass
    exposes only the last one when the passes are long, all of them when the passes are free."""
    from costs.layer_time import _stream_exposed_s

    order, ulp = [0, 1, 2], 1e-12  # sums of a few float64 seconds of order 1
    assert _stream_exposed_s(order, [1.0, 1.0, 1.0], [0.0] * 3, [0.5] * 3) == pytest.approx(2.0, abs=ulp)
    assert _stream_exposed_s(order, [0.2] * 3, [0.0] * 3, [1.0] * 3) == pytest.approx(0.2, abs=ulp)
    assert _stream_exposed_s(order, [0.0] * 3, [0.3] * 3, [1.0] * 3) == pytest.approx(0.3, abs=ulp)
    assert _stream_exposed_s(order, [0.0] * 3, [0.3] * 3, [0.0] * 3) == pytest.approx(0.9, abs=ulp)


def test_zero2_and_zero3_reduce_in_every_backward_not_at_the_flush():
    """ZeRO-2/3 partition the gradients, so each layer's is reduce-scattered in every microbatch's
    backward (Rajbhandari et al. §5.2; FSDP2's post-backward): the flush reduces nothing, ZeRO-2
    still all-gathers its parameters after the step, and each backward carries the reduce-scatters'
    exposed tail (more over a slow fabric)."""
    for stage_no in (2, 3):
        plan, hw = plan_of(nodes=2, zero_stage=stage_no)
        st = plan.stages[0]
        red, gat = costs.collectives.dp_reduce_gather_s(MODEL, plan, hw, st)
        assert red == 0.0 and (gat > 0) == (stage_no == 2)
        assert not any(costs.collectives.dp_allreduce_buckets_s(MODEL, plan, hw, st))
        fwd, bwd = costs.layer_time.sharded_dp_comm_s(MODEL, plan, hw, st)
        assert bwd > 0 and (fwd > 0) == (stage_no == 3)
        slow_hw = hw.model_copy(update={"inter_node": hw.inter_node.model_copy(update={"bw_gbps": 1.0})})
        assert costs.layer_time.sharded_dp_comm_s(MODEL, plan, slow_hw, st)[1] > bwd
    z1, hw = plan_of(nodes=2, zero_stage=1)
    assert costs.layer_time.sharded_dp_comm_s(MODEL, z1, hw, z1.stages[0]) == (0.0, 0.0)


def test_zero2_holds_one_layers_whole_gradient_in_its_backward_only():
    """ZeRO-2 (executor.zero2): a layer's whole gradient lives from its backward to its
    reduce-scatter, on top of that backward's scratch; nothing for ZeRO 0/1/3 or one replica."""
    import costs.activations
    from costs.params import layer_params_of_stage

    z2, _ = plan_of(zero_stage=2)
    st = z2.stages[0]
    g_b = z2.training.bytes_per_param()[1]
    grads = [costs.activations.zero2_layer_grad_bytes(MODEL, z2, st, l) for l in st.layers]
    assert grads == [layer_params_of_stage(MODEL, z2, st, l) * g_b for l in st.layers] and min(grads) > 0
    for z in (0, 1, 3):
        other, _ = plan_of(zero_stage=z)
        assert all(costs.activations.zero2_layer_grad_bytes(MODEL, other, other.stages[0], l) == 0 for l in st.layers)
    one = make_plan(parse_policy({"kind": "manual", "pp": 8, "dp": 1, "zero_stage": 2}), MODEL,
                    plan_of()[1], TRAINING.model_copy(update={"microbatch_size": 1}), ScheduleSpec(kind="1f1b"))
    assert all(costs.activations.zero2_layer_grad_bytes(MODEL, one, s, l) == 0 for s in one.stages for l in s.layers)
    z1, _ = plan_of(zero_stage=1)
    extra = (costs.activations.backward_workspace_bytes(MODEL, z2, st)
             - costs.activations.backward_workspace_bytes(MODEL, z1, z1.stages[0]))
    assert min(grads) <= extra <= max(grads)
