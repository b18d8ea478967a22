"""Megatron's distributed optimizer (ZeRO-1 over data parallelism) and the overlapped gradient
reduction / parameter all-gather (issue 27): memory per parameter against Megatron's closed form,
reduce-scatter + all-gather against one ring all-reduce, overlap never slower, the parameter
gather hiding at most the first forward, and the simulator against the analytic estimate."""
from __future__ import annotations

import math
import pathlib

import pytest
import yaml

import costs.collectives
import costs.layer_time
import costs.params
import costs.static
from costs.families import build_model, parse_model_config
from planners.layout import assemble, device_groups, megatron_split
from simulator import simulate
from simulator.analytic import iteration_time_s
from specs import HardwareSpec, ScheduleSpec, TrainingSpec, validate_plan

ROOT = pathlib.Path(__file__).resolve().parents[3]


def gpt(layers: int = 8):
    return build_model(parse_model_config({"family": "gpt", "name": "gpt_t", "num_layers": layers, "hidden": 1024,
                                           "heads": 16, "seq_len": 512, "vocab": 8192}), 2)


def selene(nodes: int = 1) -> HardwareSpec:
    hw = yaml.safe_load((ROOT / "conf/hardware/selene.yaml").read_text())
    hw["nodes"] = nodes
    return HardwareSpec(**hw)


def make(model, hw, pp=1, dp=8, zero=1, m=4, precision="fp16", mixed=18, grad=False, gather=False,
         recompute="none"):
    training = TrainingSpec(global_batch=m * dp, microbatch_size=dp, precision=precision,
                            mixed_bytes_per_param=mixed)
    tp = hw.num_devices // (pp * dp)  # the rest of the devices tensor-parallel
    plan = assemble("test", model, hw, training, ScheduleSpec(kind="1f1b"), megatron_split(model, pp),
                    device_groups(hw, pp, dp, tp), dp, tp, recompute, zero,
                    overlap_grad_reduce=grad, overlap_param_gather=gather)
    return validate_plan(plan, model, hw)


# Megatron-LM docs/source/api-guide/dist_optimizer.md, "Data flow" table: bytes per parameter
# (non-distributed, distributed over d ranks). fp16 params + fp16 grads keep fp32 main grads in
# the optimizer (20 = 2 + 2 + 4 + 4 + 8); memwall's training spec has no fp16-grad-plus-fp32-main
# form, so its 16 B/param mode (ZeRO §3.1: 2 + 2 + 12) is the ZeRO paper's row.
MEGATRON = {("fp16", 18): lambda d: 6 + 12 / d,   # bf16/fp16 param, fp32 grads (theoretical_memory_usage.py)
            ("fp32", 18): lambda d: 8 + 8 / d,    # fp32 param, fp32 grads
            ("fp16", 16): lambda d: 4 + 12 / d}   # ZeRO-1 (ZeRO §5, Pos)


@pytest.mark.parametrize("precision,mixed", sorted(MEGATRON))
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_zero1_static_bytes_per_parameter_are_megatrons(precision, mixed, dp):
    model, hw = gpt(), selene()
    plan = make(model, hw, dp=dp, precision=precision, mixed=mixed)
    stage = plan.stages[0]
    mem, host = costs.static.stage_static(model, plan, stage)
    params = costs.params.stage_params_on_device(model, plan, stage)
    total = mem.parameters_bytes + mem.gradients_bytes + mem.optimizer_bytes
    assert host == 0
    # ceil per category: at most 1 byte off the real-valued closed form
    assert abs(total - MEGATRON[(precision, mixed)](dp) * params) <= 1
    # and not the replicated 18 / 16: the optimizer state alone is 1/d
    plain = costs.static.stage_static(model, make(model, hw, dp=dp, zero=0, precision=precision, mixed=mixed),
                                      stage)[0]
    assert mem.optimizer_bytes == math.ceil(plain.optimizer_bytes / dp)
    assert (mem.parameters_bytes, mem.gradients_bytes) == (plain.parameters_bytes, plain.gradients_bytes)


@pytest.mark.parametrize("mixed", [16, 18])
def test_reduce_scatter_plus_all_gather_is_one_all_reduce(mixed):
    """16 B/param (gradients and weights both 2 bytes): reduce-scatter + all-gather are one
    all-reduce. 18 B/param: the reduce-scatter is half the fp32 gradients' all-reduce and the
    all-gather half an all-reduce of the 2-byte weights (Megatron gathers its bf16/fp16 parameter
    buffer): its bandwidth term is half the reduce-scatter's, its latency term the same."""
    model, hw = gpt(), selene(nodes=2)
    z0, z1 = make(model, hw, dp=16, zero=0, mixed=mixed), make(model, hw, dp=16, zero=1, mixed=mixed)
    ar, none = costs.collectives.dp_reduce_gather_s(model, z0, hw, z0.stages[0])
    rs, ag = costs.collectives.dp_reduce_gather_s(model, z1, hw, z1.stages[0])
    link = costs.collectives.allreduce_link(hw, z0.stages[0].devices)
    grads = costs.params.dp_grad_bytes(model, z0, z0.stages[0])
    assert ar == pytest.approx(costs.collectives.ring_allreduce_s(grads, 16, link), rel=1e-12)
    assert none == 0.0 and rs == pytest.approx(ar / 2, rel=1e-12)
    weights = costs.params.dp_param_bytes(model, z1, z1.stages[0])
    assert weights * (4 if mixed == 18 else 2) == grads * 2
    assert ag == pytest.approx(costs.collectives.ring_allreduce_s(weights, 16, link) / 2, rel=1e-12)
    if mixed == 16:
        assert rs + ag == pytest.approx(ar, rel=1e-12)
    else:
        lat = 15 * (link.collective_latency_s if link.collective_latency_s is not None else link.latency_s)
        assert ag - lat == pytest.approx((rs - lat) / 2, rel=1e-12)
    # the step is 1/d of the replicated one
    step0 = costs.layer_time.optimizer_step_s(model, z0, hw, z0.stages[0])
    step1 = costs.layer_time.optimizer_step_s(model, z1, hw, z1.stages[0])
    assert step1 == pytest.approx(step0 / 16, rel=1e-3)


def test_zero2_overlapped_parameter_gather_is_priced():
    """ZeRO-2 gathers its updated weights after the step as ZeRO-1 does (Rajbhandari et al. §5.2);
    with overlap_param_gather its per-layer buckets are the weights' (they were the gradient
    reduction's buckets until 2026-11-29, all zero under ZeRO-2: the gather was free), and each
    ZeRO-1/2 bucket is half an all-reduce of that layer's weight bytes."""
    model, hw = gpt(), selene(nodes=2)
    for zero in (1, 2):
        plan = make(model, hw, dp=16, zero=zero, gather=True)
        stage = plan.stages[0]
        buckets = costs.collectives.dp_param_gather_buckets_s(model, plan, hw, stage)
        link = costs.collectives.allreduce_link(hw, stage.devices[:: stage.tp])
        w_b = plan.training.bytes_per_param()[0]
        assert buckets == [pytest.approx(costs.collectives.ring_allreduce_s(
            w_b * costs.params.layer_params_on_device(model.layers[i], stage.tp), 16, link) / 2, rel=1e-12)
            for i in stage.layers]
        assert all(b > 0 for b in buckets)
        # under a forward too short to hide it, the overlapped gather is exposed (ZeRO-2's was 0)
        assert costs.collectives.param_gather_exposed_s(buckets, [0.0] * len(buckets)) == pytest.approx(sum(buckets))


def test_exposed_closed_forms():
    # buckets in stage order; the backward walks them last first
    assert costs.collectives.grad_reduce_exposed_s([1.0, 1.0], [0.5, 0.5]) == pytest.approx(1.5)
    assert costs.collectives.grad_reduce_exposed_s([0.1, 0.1], [1.0, 1.0]) == pytest.approx(0.1)
    # gathers in stage order, layer j waits for gathers 0..j, hidden by forwards 0..j-1
    assert costs.collectives.param_gather_exposed_s([1.0, 1.0, 1.0], [0.5, 0.5, 0.5]) == pytest.approx(2.0)
    assert costs.collectives.param_gather_exposed_s([0.2, 0.2], [1.0, 1.0]) == pytest.approx(0.2)


@pytest.mark.parametrize("grad,gather", [(False, False), (True, False), (False, True), (True, True)])
def test_overlap_is_never_slower_and_gather_hides_at_most_the_first_forward(grad, gather):
    model, hw = gpt(), selene(nodes=2)
    base = make(model, hw, dp=16)
    plan = make(model, hw, dp=16, grad=grad, gather=gather)
    t_base, t = iteration_time_s(base, model, hw), iteration_time_s(plan, model, hw)
    assert t <= t_base + 1e-12
    stage = plan.stages[0]
    rs, ag = costs.collectives.dp_reduce_gather_s(model, plan, hw, stage)
    fwd = costs.layer_time.stage_pass_times_s(model, plan, hw, stage)[0]
    bwd = costs.layer_time.stage_pass_times_s(model, plan, hw, stage)[1]
    # what overlap can hide: the gather at most one forward's worth, the reduction one backward's
    assert t >= t_base - (ag if gather else 0) - (rs if grad else 0) - 1e-12
    if gather:
        assert t >= t_base - min(ag, fwd) - (min(rs, bwd) if grad else 0) - 1e-12


@pytest.mark.parametrize("pp,grad,gather,recompute", [(1, False, False, "none"), (1, True, False, "full"),
                                                      (1, False, True, "none"), (1, True, True, "full"),
                                                      (2, True, True, "none")])
def test_simulator_agrees_with_analytic(pp, grad, gather, recompute):
    model, hw = gpt(), selene(nodes=2)
    plan = make(model, hw, pp=pp, dp=8, grad=grad, gather=gather, recompute=recompute)
    ana = iteration_time_s(plan, model, hw)
    sim = simulate(plan, model, hw).result.iteration_time_s
    # integer-ns rounding per simulated pass and bucket; a pipeline also overlaps its p2p copies
    tol = 4 * plan.training.microbatches * len(plan.stages) * 1e-9 + len(model.layers) * 4e-9
    if pp > 1:
        tol += 2 * sum(costs.collectives.transfer_s(
            costs.params.samples_per_replica(plan, s) * model.layers[s.layer_stop - 1].output_bytes_per_sample,
            hw.link(s.devices[0], n.devices[0])) for s, n in zip(plan.stages, plan.stages[1:])) * pp
        # a later stage's overlapped reduction ends before the first stage's backward does
        tol += max(costs.collectives.dp_allreduce_s(model, plan, hw, s) for s in plan.stages)
    assert abs(sim - ana) <= tol, (sim, ana, tol)


@pytest.mark.parametrize("buckets,passes", [([0.3, 0.1, 0.4], [0.2, 0.5, 0.1]), ([1.0], [0.0]),
                                            ([0.0, 0.2], [0.3, 0.3]), ([0.5, 0.5, 0.5, 0.5], [0.1, 0.9, 0.1, 0.9])])
def test_overlap_hides_at_most_the_passes_and_never_adds_to_its_buckets(buckets, passes):
    """The same buckets blocking take sum(buckets): overlapped they are never exposed longer, and
    never hidden by more than the compute they overlap (the backward; the first forward, less
    its last layer, which needs every gather before it starts). Whether buckets beat one
    stage-wide collective depends on the per-collective latency (each bucket pays its own: on
    local_cpu's gloo one bucket per layer can be slower), which the iteration-time tests price."""
    total = sum(buckets)
    red = costs.collectives.grad_reduce_exposed_s(buckets, passes)
    gat = costs.collectives.param_gather_exposed_s(buckets, passes)
    assert max(total - sum(passes), 0.0) - 1e-12 <= red <= total + 1e-12
    assert max(total - sum(passes[:-1]), 0.0) - 1e-12 <= gat <= total + 1e-12
