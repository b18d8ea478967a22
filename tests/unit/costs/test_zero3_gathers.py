"""ZeRO-3 / FSDP's parameter all-gathers in time and memory (issue 27: "FSDP2 in torchtitan, in
time and memory"): every layer's weights gathered over the dp group before its forward and again
before its backward, prefetched one layer ahead (costs.layer_time.sharded_dp_comm_s), and the
unsharded buffers they need in each layer's backward (costs.sharded_dp.zero3_backward_bytes)."""
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


def test_unsharded_buffers_are_held_in_each_layers_backward():
    """FSDP2's backward of unit u (costs.sharded_dp): u's weights, the next unit's prefetched
    gather, the reduce-scatter input of the unit before; nothing at rest or at ZeRO <= 2."""
    import costs.activations
    from costs.sharded_dp import zero3_backward_bytes

    plan, hw = plan_of(zero_stage=3)
    z1, _ = plan_of(zero_stage=1)
    st = plan.stages[0]
    per = zero3_backward_bytes(MODEL, plan, st)
    w_b, g_b, _ = TRAINING.bytes_per_param()
    ls = list(st.layers)  # llama3_8b: untied, one unit per layer
    n = {l: layer_params_on_device(MODEL.layers[l], 1) for l in ls}
    for i, l in enumerate(ls):
        want = w_b * n[l] + (w_b * n[ls[i - 1]] if i else 0) + (g_b * n[ls[i + 1]] if i + 1 < len(ls) else 0)
        assert per[l] == want, (l, per[l], want)
    assert zero3_backward_bytes(MODEL, z1, z1.stages[0]) == {}
    extra = (costs.activations.backward_workspace_bytes(MODEL, plan, st)
             - costs.activations.backward_workspace_bytes(MODEL, z1, z1.stages[0]))
    assert min(per.values()) <= extra <= max(per.values())
    buffers = {d.device: d.breakdown.buffers_bytes for d in estimate(plan, MODEL, hw).devices}
    buffers_z1 = {d.device: d.breakdown.buffers_bytes for d in estimate(z1, MODEL, hw).devices}
    assert buffers == buffers_z1  # nothing held for the iteration


def test_a_tied_pair_on_one_stage_is_one_unit_open_through_the_backward():
    """GPT's embedding and LM head on one stage: one FSDP unit (executor.fsdp._units), unsharded
    from the head's backward to the embedding's, with the head's gradient of the tied weight."""
    from costs.params import layer_params_of_stage
    from costs.sharded_dp import fsdp_units, zero3_backward_bytes

    gpt = build_model(parse_model_config(conf("model", "gpt_tiny")), 4)
    hw = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")
    plan = make_plan(parse_policy({"kind": "manual", "pp": 1, "dp": 2, "zero_stage": 3}), gpt, hw, training,
                     ScheduleSpec(kind="1f1b"))
    st = plan.stages[0]
    head, embed = st.layers[-1], st.layers[0]
    units = fsdp_units(gpt, plan, st)
    assert units[0] == (head, embed) and all(len(u) == 1 for u in units[1:])
    per = zero3_backward_bytes(gpt, plan, st)
    w = {l: layer_params_of_stage(gpt, plan, st, l) * 4 for l in st.layers}
    tied_unit = w[head] + w[embed]
    head_grad = layer_params_on_device(gpt.layers[head], 1) * 4  # the tied weight's share included
    top_block = st.layers[-2]
    assert per[head] == tied_unit + w[top_block]  # the unit, the top block's prefetched gather
    assert per[top_block] == tied_unit + head_grad + w[top_block] + w[st.layers[-3]]
    assert per[embed] == tied_unit + head_grad + 4 * layer_params_of_stage(gpt, plan, st, st.layers[1])


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
