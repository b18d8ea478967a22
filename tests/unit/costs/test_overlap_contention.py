"""Compute beside an overlapped collective runs slower (``DeviceSpec.overlap_compute_slowdown``;
Lee et al. 2025, arXiv 2507.03114): a compute interval of c seconds beside o seconds of a
collective takes c + slowdown * o. Applied where memwall overlaps collectives with compute: the
ZeRO-2/3 (FSDP) stream (costs.layer_time._stream_exposed_s), overlap_grad_reduce's buckets
(costs.collectives.grad_reduce_exposed_s; simulator/optimizer.py) and overlap_param_gather's
all-gather (costs.collectives.param_gather_exposed_s). Closed forms worked by hand, the bounds
that keep overlap never slower than blocking, and the simulator against the analytic estimate."""
from __future__ import annotations

import pydantic
import pytest

import costs.layer_time
from costs.collectives import contention_s, grad_reduce_exposed_s, param_gather_exposed_s
from costs.families import build_model, parse_model_config
from costs.layer_time import _stream_exposed_s
from planners import make_plan, parse_policy
from simulator import simulate
from simulator.analytic import iteration_time_s
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf

# sums of a handful of floats of order 1: a few ulps
EPS = 1e-12


def test_contention_is_the_slowdown_times_the_overlap():
    assert contention_s([(1.0, 2.0), (3.0, 5.0)], 1.5, 4.0, 0.5) == pytest.approx(0.5 * (0.5 + 1.0), abs=EPS)
    assert contention_s([(1.0, 2.0)], 2.0, 4.0, 0.5) == 0.0  # touching, not overlapping
    assert contention_s([(0.0, 9.0)], 1.0, 2.0, 0.0) == 0.0


def test_stream_hand_worked():
    order = [0, 1, 2]
    # compute-bound (gathers 0.2, passes 1): the first gather exposed, then each of the first two
    # passes runs 0.2 s beside the next gather: + 0.5 x 0.2 each; the last overlaps nothing
    assert _stream_exposed_s(order, [0.2] * 3, [0.0] * 3, [1.0] * 3, 0.5) == pytest.approx(0.2 + 0.1 + 0.1, abs=EPS)
    assert _stream_exposed_s(order, [0.2] * 3, [0.0] * 3, [1.0] * 3) == pytest.approx(0.2, abs=EPS)
    # communication-bound (gathers 1, passes 0.5): each pass waits for its gather anyway, so the
    # slower compute ends before the stream does and costs nothing
    assert _stream_exposed_s(order, [1.0] * 3, [0.0] * 3, [0.5] * 3, 0.5) == pytest.approx(2.0, abs=EPS)
    # reduce-scatters queued after each pass run beside the next one
    assert _stream_exposed_s(order, [0.0] * 3, [0.3] * 3, [1.0] * 3, 0.5) == pytest.approx(0.3 + 2 * 0.15, abs=EPS)


def test_grad_reduce_hand_worked():
    # buckets hidden (0.1 s each behind 1 s passes): the second runs past the backward, exposed
    # 0.1; the first ran beside it for 0.1 s, + 0.05: the larger of the two is what is lost
    assert grad_reduce_exposed_s([0.1, 0.1], [1.0, 1.0], 0.5) == pytest.approx(0.1, abs=EPS)
    # the last layer's bucket (1 s) runs wholly beside the first layer's 2 s backward: nothing
    # left after it, but the backward is 0.5 x 1 longer
    assert grad_reduce_exposed_s([0.0, 1.0], [2.0, 1.0], 0.5) == pytest.approx(0.5, abs=EPS)
    assert grad_reduce_exposed_s([0.0, 1.0], [2.0, 1.0]) == 0.0


def test_param_gather_hand_worked():
    # gathers of 0.2 each, both issued at the step: layer 0 waits 0.2, then runs 0.2 s beside
    # the second gather (+ 0.1); layer 1's gather is done by then
    assert param_gather_exposed_s([0.2, 0.2], [1.0, 1.0], 0.5) == pytest.approx(0.3, abs=EPS)
    assert param_gather_exposed_s([0.2, 0.2], [1.0, 1.0]) == pytest.approx(0.2, abs=EPS)


CASES = [([0.3, 0.1, 0.4], [0.2, 0.5, 0.1]), ([1.0], [0.0]), ([0.0, 0.2], [0.3, 0.3]),
         ([0.5, 0.5, 0.5, 0.5], [0.1, 0.9, 0.1, 0.9]), ([0.05, 0.7, 0.05], [1.0, 0.2, 1.0])]


@pytest.mark.parametrize("comm,passes", CASES)
def test_monotone_in_the_slowdown_and_never_worse_than_blocking(comm, passes):
    """More contention never shortens a pass; at the largest slowdown the schema allows (1: the
    compute stalls for the whole overlap) overlapping still costs no more than running the
    collectives blocking, so ``overlap_grad_reduce`` / FSDP's prefetch stay worth choosing."""
    order = list(range(len(comm)))
    fns = {"grad": lambda s: grad_reduce_exposed_s(comm, passes, s),
           "gather": lambda s: param_gather_exposed_s(comm, passes, s),
           "stream": lambda s: _stream_exposed_s(order, comm, comm, passes, s)}
    blocking = {"grad": sum(comm), "gather": sum(comm), "stream": 2 * sum(comm)}
    for name, f in fns.items():
        values = [f(s) for s in (0.0, 0.1, 0.189, 0.5, 1.0)]
        assert all(a <= b + EPS for a, b in zip(values, values[1:])), (name, values)
        assert values[-1] <= blocking[name] + EPS, (name, values, blocking[name])


def test_the_field_is_bounded_and_named():
    hw = conf("hardware", "h100_node")
    with pytest.raises(pydantic.ValidationError, match="overlap_compute_slowdown"):
        HardwareSpec.model_validate({**hw, "device": {**hw["device"], "overlap_compute_slowdown": 1.5}})
    assert HardwareSpec.model_validate(hw).device.overlap_compute_slowdown > 0  # h100_node cites a value


def test_a_dump_without_it_is_unchanged():
    """At 0 the field stays out of a dump (specs._base.omit_unset), so hardware files, plan ids and
    cache keys written before it existed stay byte-identical; a set value round-trips."""
    cpu = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
    assert "overlap_compute_slowdown" not in cpu.model_dump_json()
    h100 = HardwareSpec.model_validate(conf("hardware", "h100_node"))
    again = HardwareSpec.model_validate_json(h100.model_dump_json())
    assert again.device.overlap_compute_slowdown == h100.device.overlap_compute_slowdown


MODEL = build_model(parse_model_config(conf("model", "llama3_8b")), 2)


def _plan(slowdown: float, **policy):
    raw = conf("hardware", "h100_node")
    hw = HardwareSpec.model_validate({**raw, "nodes": 2, "device": {**raw["device"],
                                                                   "overlap_compute_slowdown": slowdown}})
    training = TrainingSpec(global_batch=64, microbatch_size=16, precision="bf16", mixed_bytes_per_param=16)
    plan = make_plan(parse_policy({"kind": "manual", "pp": 1, "dp": 16, **policy}), MODEL, hw, training,
                     ScheduleSpec(kind="1f1b"))
    return plan, hw


@pytest.mark.parametrize("policy", [{"zero_stage": 3}, {"zero_stage": 2, "overlap_param_gather": True},
                                    {"zero_stage": 1, "overlap_grad_reduce": True, "overlap_param_gather": True},
                                    {"overlap_grad_reduce": True}])
def test_contention_slows_overlapped_plans_and_the_simulator_agrees(policy):
    plan0, hw0 = _plan(0.0, **policy)
    plan1, hw1 = _plan(0.189, **policy)
    t0, t1 = iteration_time_s(plan0, MODEL, hw0), iteration_time_s(plan1, MODEL, hw1)
    assert t1 > t0
    # never more than the slowdown times every collective the device overlaps
    st = plan1.stages[0]
    f0, b0 = costs.layer_time.stage_pass_times_s(MODEL, plan1, hw1, st)
    assert t1 - t0 <= 0.189 * plan1.training.microbatches * (f0 + b0) + EPS * t1
    sim = simulate(plan1, MODEL, hw1).result.iteration_time_s
    # integer-ns rounding per simulated pass and bucket
    tol = 4e-9 * (plan1.training.microbatches + 1) * (len(MODEL.layers) + 2)
    assert abs(sim - t1) <= tol, (sim, t1, tol)


def test_the_benchmarks_breakdown_names_it():
    """validate_published --why shows what the contention costs a row, and its parts still add up
    to the iteration."""
    from benchmarks.validate_published import load, why

    cfg, model, plan = load("published_mpt_7b_h100_128")
    parts = why(model, plan, cfg.hardware)
    total = iteration_time_s(plan, model, cfg.hardware)
    assert parts["overlap_contention"] > 0
    assert sum(parts.values()) == pytest.approx(total, rel=1e-12)
