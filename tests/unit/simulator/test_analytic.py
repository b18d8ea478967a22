"""Analytic estimate against closed forms (the oracles of STYLE.md)."""
from __future__ import annotations

import pytest

from planners import make_plan, parse_policy
from simulator.analytic import estimate, iteration_time_s
from specs import ScheduleKind, ScheduleSpec, TrainingSpec
import costs.activations
import costs.collectives
import costs.layer_time
from tests.conftest import make_hardware, make_model


def plan_for(kind: str, p: int = 4, m: int = 8, model=None, hardware=None, policy=None, mb: int = 2, **training_kw):
    model = model or make_model(num_layers=8)
    hardware = hardware or make_hardware(devices=p, bw_gbps=1e9, latency_s=0.0)
    training = TrainingSpec(global_batch=mb * m, microbatch_size=mb, **training_kw)
    plan = make_plan(parse_policy(policy or {"kind": "even"}), model, hardware, training,
                     ScheduleSpec(kind=ScheduleKind(kind)))
    return plan, model, hardware


@pytest.mark.parametrize("bpp", [None, 16, 18])
def test_static_memory_is_18_bytes_per_param_mixed_adam_by_default(bpp):
    """Megatron's 18 B/param (fp32 main grads) by default; ZeRO's 16 when asked."""
    plan, model, hw = plan_for("1f1b", **({} if bpp is None else {"mixed_bytes_per_param": bpp}))
    res = estimate(plan, model, hw)
    per_device_params = model.total_params // 4
    for d in res.devices:
        b = d.breakdown
        assert b.parameters_bytes + b.gradients_bytes + b.optimizer_bytes == (bpp or 18) * per_device_params


def test_zero_shards_over_dp():
    hw = make_hardware(devices=8, bw_gbps=1e9, latency_s=0.0)
    plan, model, _ = plan_for("1f1b", hardware=hw, policy={"kind": "even", "pp": 2, "dp": 4, "zero_stage": 3}, mb=4)
    b = estimate(plan, model, hw).devices[0].breakdown
    params = 4 * model.layers[0].params
    assert (b.parameters_bytes, b.gradients_bytes, b.optimizer_bytes) == (2 * params / 4, 4 * params / 4, 12 * params / 4)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_in_flight_activations(kind):
    p, m = 4, 8
    plan, model, hw = plan_for(kind, p=p, m=m)
    res = estimate(plan, model, hw)
    for i, d in enumerate(res.devices):
        st = plan.stages[i]
        per_mb = costs.activations.stage_activation_bytes(model, plan, st)
        expect = m if kind == "gpipe" else min(p - i, m)
        # on top of the held microbatches: the first backward's workspace, or the last forward's
        # output while it is sent (released once sent, training.deallocate_pipeline_outputs)
        on_top = max(costs.activations.backward_workspace_bytes(model, plan, st), costs.activations.sent_output_bytes(model, plan, st))
        assert d.breakdown.activations_bytes == expect * per_mb + on_top


def test_pipedream_stashes_p_minus_i_versions():
    p = 4
    plan, model, hw = plan_for("pipedream_async", p=p)
    for i, d in enumerate(estimate(plan, model, hw).devices):
        versions = 1 + d.breakdown.stashed_weights_bytes // d.breakdown.parameters_bytes
        assert versions == p - i


@pytest.mark.parametrize("p,m", [(4, 8), (2, 16), (8, 8)])
def test_bubble_fraction_without_communication(p, m):
    model = make_model(num_layers=8)
    hw = make_hardware(devices=p, bw_gbps=1e12, latency_s=0.0)
    plan, _, _ = plan_for("gpipe", p=p, m=m, model=model, hardware=hw)
    fwd, bwd = costs.layer_time.stage_pass_times_s(model, plan, hw, plan.stages[0])
    sync = costs.layer_time.optimizer_step_s(model, plan, hw, plan.stages[0])
    pipe = iteration_time_s(plan, model, hw) - sync
    bubble = 1 - m * (fwd + bwd) / pipe
    assert bubble == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)


def test_ring_allreduce_closed_form():
    link = make_hardware().intra_node.fallback
    n, nbytes = 4, 1e9
    expect = 2 * (n - 1) / n * nbytes / (link.total_bw_gbps * 1e9) + 2 * (n - 1) * link.latency_s
    assert costs.collectives.ring_allreduce_s(nbytes, n, link) == pytest.approx(expect)


def test_recompute_lowers_peak_and_costs_time():
    base, model, hw = plan_for("1f1b")
    rec, _, _ = plan_for("1f1b", policy={"kind": "even", "recompute": "full"})
    a, b = estimate(base, model, hw), estimate(rec, model, hw)
    assert b.devices[0].peak_bytes < a.devices[0].peak_bytes
    assert b.iteration_time_s > a.iteration_time_s


def test_oom_flagged_with_excess():
    hw = make_hardware(devices=4, memory_bytes=10 << 20)
    plan, model, _ = plan_for("gpipe", hardware=hw)
    d = estimate(plan, model, hw).devices[0]
    assert d.oom and d.oom_over_bytes == d.peak_bytes - d.capacity_bytes > 0
