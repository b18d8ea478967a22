"""Megatron's distributed optimizer (ZeRO-1) with tensor parallelism executed (issue 27,
executor.zero1): real gloo ranks with gpt_tiny, tp 2 x dp 2. Each tp rank's flat buffers hold
its parameters' local DTensor shards and its dp group (the ranks of its tp rank) reduce-scatters
and all-gathers them. (a) float64 weights after two iterations equal the single-process
reference, with and without sequence parallelism (whose norm weights are replicated over tp: a
tp rank that stepped them apart would change the second iteration's gradients, so this checks
that they stay equal), and bit for bit the replicated optimizer's; (b) pp 2 with the tied
embedding/head split over the stages (Megatron's embedding group on reduce-scattered vocabulary
shards); (c) each rank holds its 1/d share of the Adam state and the measured peak is within 5 %
of the simulated one."""
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
ZERO1 = {"distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}


def plan_of(pp: int = 1, **policy):
    hw = LOCAL_CPU.model_copy(update={"devices_per_node": 4 * pp})  # pp 2 x tp 2 x dp 2: 8 gloo ranks
    plan = make_plan(parse_policy({"kind": "manual", "pp": pp, "tp": 2, "dp": 2, **policy}), SPEC, hw,
                     TRAINING, ScheduleSpec(kind="1f1b"))
    return validate_plan(plan, SPEC, hw)


@pytest.mark.parametrize("sp", [False, True])
def test_zero1_with_tp_weights_equal_the_reference_and_the_replicated_optimizer(sp):
    plan = plan_of(sequence_parallel=sp, **ZERO1)
    assert plan.zero_stage == 1 and plan.stages[0].tp == 2 and not unsupported(plan, GPT_TINY)
    got = params_of(run_plan_float64(plan, GPT_TINY, iterations=2, timeout_s=240))
    want = train_reference(GPT_TINY, TRAINING, 2, dtype=torch.float64)
    assert worst_rel(got, want["params"]) <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))
    # a reduce-scatter of 2 ranks adds what the all-reduce adds, Adam is elementwise: bit for bit
    kept = params_of(run_plan_float64(plan_of(sequence_parallel=sp), GPT_TINY, iterations=2, timeout_s=240))
    assert all(np.array_equal(got[k], kept[k]) for k in kept)


def test_zero1_with_tp_and_a_tied_embedding_over_two_stages():
    plan = plan_of(pp=2, distributed_optimizer=True)
    assert not unsupported(plan, GPT_TINY)
    got = params_of(run_plan_float64(plan, GPT_TINY, iterations=2, timeout_s=400))
    want = train_reference(GPT_TINY, TRAINING, 2, dtype=torch.float64)
    assert worst_rel(got, want["params"]) <= reorder_rtol(longest_reduction(GPT_TINY, TRAINING))


@pytest.mark.parametrize("sp", [False, True])
def test_each_tp_rank_holds_its_share_of_the_optimizer_state_and_the_simulated_peak(sp):
    from executor.profile_symbolic import profile_model
    from simulator import simulate
    from specs.profile import apply_profile

    plan = plan_of(sequence_parallel=sp, distributed_optimizer=True, overlap_grad_reduce=True)
    out = run_plan(plan, GPT_TINY, iterations=2, memory_iteration=1)
    assert out.failure is None, out.failure
    base = run_plan(plan_of(sequence_parallel=sp), GPT_TINY, iterations=2, memory_iteration=1)
    assert base.failure is None, base.failure
    traced = apply_profile(SPEC, profile_model(GPT_TINY, microbatch=TRAINING.samples_per_microbatch, dtype="fp32"))
    sim = {d.device: d for d in simulate(plan, traced, LOCAL_CPU).result.devices}
    buckets = len(plan.stages[0].layers)
    for rank, rep in out.reports.items():
        opt, replicated = rep["breakdown"]["optimizer"], base.reports[rank]["breakdown"]["optimizer"]
        params = rep["breakdown"]["parameters"] // 4  # fp32 weights: this tp rank's shards, whole over dp
        # 1/d of the Adam state of the tp rank's shards (< d elements of padding per bucket, step counters)
        assert abs(opt - OPT_BYTES * params / 2) <= buckets * (OPT_BYTES * 2 + 8), (rank, opt, params)
        assert replicated >= OPT_BYTES * params and opt < 0.51 * replicated
        simulated = sim[rep["device"]].peak_bytes
        assert abs(rep["peak_bytes"] - simulated) <= 0.05 * simulated, (rank, rep["peak_bytes"], simulated)
