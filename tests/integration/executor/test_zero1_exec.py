"""Megatron's distributed optimizer (ZeRO-1 over data parallelism) executed (issue 27,
executor.zero1): real gloo ranks with gpt_tiny, pp 2 x dp 2 (the tied embedding/head split over
the two stages, so Megatron's embedding group runs on reduce-scattered shards). (a) float64
weights after two iterations equal the single-process reference, with and without the overlapped
gradient reduce-scatter and parameter all-gather, and bit for bit the replicated optimizer's; (b)
each rank holds its 1/d share of the Adam state; (c) the measured peak is within 5 % of the
simulated one; (d) ZeRO-2 and ZeRO-3 with the weight tied over stages are not refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from costs.families import build_model
from executor import run_plan, unsupported
from executor.reference import train_reference
from planners import make_plan, parse_policy
from specs.plan import ScheduleSpec, validate_plan
from specs.training import TrainingSpec
from tests.conftest import GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, run_plan_float64, params_of, worst_rel

pytestmark = pytest.mark.slow
SPEC = build_model(GPT_TINY, 4)
TRAINING = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")
_, _, OPT_BYTES = TRAINING.bytes_per_param()  # fp32 Adam: exp_avg + exp_avg_sq


def plan_of(**policy):
    plan = make_plan(parse_policy({"kind": "manual", "pp": 2, "dp": 2, **policy}), SPEC, LOCAL_CPU, TRAINING,
                     ScheduleSpec(kind="1f1b"))
    return validate_plan(plan, SPEC, LOCAL_CPU)


@pytest.mark.parametrize("overlap", [{"distributed_optimizer": True},
                                     {"distributed_optimizer": True, "overlap_grad_reduce": True,
                                      "overlap_param_gather": True},
                                     {"overlap_grad_reduce": True}])  # ZeRO-0: bucketed in-place all-reduce
def test_zero1_weights_equal_the_reference_and_the_replicated_optimizer(overlap):
    plan = plan_of(**overlap)
    assert plan.zero_stage == int(overlap.get("distributed_optimizer", False)) and not unsupported(plan, GPT_TINY)
    got = params_of(run_plan_float64(plan, GPT_TINY, iterations=2))
    want = train_reference(GPT_TINY, TRAINING, 2, dtype=torch.float64)
    assert worst_rel(got, want["params"]) <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))
    # a reduce-scatter of 2 ranks adds what the all-reduce adds, Adam is elementwise: bit for bit
    kept = params_of(run_plan_float64(plan_of(), GPT_TINY, iterations=2))
    assert all(np.array_equal(got[k], kept[k]) for k in kept)


def test_each_rank_holds_its_share_of_the_optimizer_state_and_the_simulated_peak():
    from executor.profile_symbolic import profile_model
    from simulator import simulate
    from specs.profile import apply_profile

    plan = plan_of(distributed_optimizer=True, overlap_grad_reduce=True)
    out = run_plan(plan, GPT_TINY, iterations=2, memory_iteration=1)
    assert out.failure is None, out.failure
    base = run_plan(plan_of(), GPT_TINY, iterations=2, memory_iteration=1)
    assert base.failure is None, base.failure
    traced = apply_profile(SPEC, profile_model(GPT_TINY, microbatch=TRAINING.samples_per_microbatch, dtype="fp32"))
    sim = {d.device: d for d in simulate(plan, traced, LOCAL_CPU).result.devices}
    for rank, rep in out.reports.items():
        opt, replicated = rep["breakdown"]["optimizer"], base.reports[rank]["breakdown"]["optimizer"]
        params = rep["breakdown"]["parameters"] // 4  # fp32 weights, all of them on every replica
        # 1/d of the Adam state (< d elements of padding per bucket, and Adam's step counters)
        buckets = len(plan.stages[0].layers) + 1
        assert abs(opt - OPT_BYTES * params / 2) <= buckets * (OPT_BYTES * 2 + 8), (rank, opt, params)
        assert replicated >= OPT_BYTES * params and opt < 0.51 * replicated
        simulated = sim[rep["device"]].peak_bytes
        assert abs(rep["peak_bytes"] - simulated) <= 0.05 * simulated, (rank, rep["peak_bytes"], simulated)


def test_pipelined_zero_2_and_3_with_a_tied_weight_are_not_refused():
    # the tied embedding/head over the two stages: ZeRO-2 (executor.zero2, test_zero2_exec.py) and
    # ZeRO-3 (FSDP2, test_fsdp_tied_exec.py) sum their gradient shards over the embedding group too
    assert not unsupported(plan_of(zero_stage=2), GPT_TINY)
    assert not unsupported(plan_of(zero_stage=3), GPT_TINY)
