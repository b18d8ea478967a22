"""``schedule.weight_store`` in the executor (executor.weight_store: the Zero Bubble paper's own
WeightGradStore, Qi et al. 2024): B is the stage's whole backward with each Linear's weight
gradient deferred, W computes dW = dY^T X from the stored pairs.

- A split-backward stage built with the field runs executor.weight_store.WeightStore (without it,
  executor.split_backward.SplitBackward).
- gloo ranks, float64, against the single-process reference (losses, gradients, weights within
  the reduction-order bound; one W per stage, microbatch and iteration): gpt_tiny pp 2 zb_h1;
  llama_tiny pp 2 zbv (a V: chunks 0 and 3 on rank 0, handed over in memory on rank 1) with one
  recomputed layer; gpt_tiny pp 2 zb_h1 and dualpipev; gpt_tiny pp 2 x dp 2 with
  overlap_grad_reduce under zb_h1 (buckets reduced as W completes them; also with the distributed
  optimizer) and zbv (the V's shared embedding/head reduced at the flush, after both stages' sums).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from costs.families import build_model, parse_model_config
from executor.memtrack import NullTracker
from executor.reference import train_reference
from executor.split_backward import SplitBackward, unsupported
from executor.stage import StageRuntime
from executor.weight_store import WeightStore
from planners import make_plan, parse_policy
from specs.hardware import HardwareSpec
from specs.plan import SPLIT_BACKWARD, LayerMemory, MemoryAction, ScheduleSpec
from specs.schedule import ActionKind, build_schedule
from tests.conftest import CPU_TRAINING, GPT_TINY, conf, longest_reduction, reorder_rtol, run_plan_float64

TRAINING = CPU_TRAINING
LLAMA_TINY = parse_model_config(conf("model", "llama_tiny"))
HW2 = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})  # 2 ranks
HW4 = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
F64 = torch.float64
STEPS = 2


def _plan(cfg, schedule: str, hw=HW2, store: bool = True, **policy):
    return make_plan(parse_policy({"kind": "manual" if hw is HW4 else "even", "pp": 2, **policy}),
                     build_model(cfg, 4), hw, TRAINING, ScheduleSpec(kind=schedule, weight_store=store))


@pytest.mark.parametrize("store", [True, False])
def test_stage_runs_the_weight_store_when_planned(store):
    plan = _plan(GPT_TINY, "zb_h1", store=store)
    rt = StageRuntime(plan, GPT_TINY, 1, plan.stages[1].devices[0], {d: d for d in plan.used_devices()}, {},
                      torch.device("cpu"), 0, NullTracker(), F64)
    assert type(rt.split) is (WeightStore if store else SplitBackward)


def _check_run(plan, cfg, reference, what: str = "grads") -> None:
    assert plan.schedule.kind in SPLIT_BACKWARD and plan.schedule.weight_store
    assert not unsupported(plan, cfg)
    lists = build_schedule(plan)
    w = [(a.stage, a.microbatch) for acts in lists.values() for a in acts if a.kind is ActionKind.backward_weight]
    assert sorted(set(w)) == [(s, k) for s in range(len(plan.stages)) for k in range(TRAINING.microbatches)]
    out = run_plan_float64(plan, cfg, iterations=STEPS)
    assert out.failure is None, out.failure
    tol = reorder_rtol(longest_reduction(cfg, TRAINING))
    np.testing.assert_allclose(out.losses, reference["losses"], rtol=tol)
    for kind in sorted({what, "params"}):
        got = {k: v for rep in out.reports.values() for k, v in rep[kind].items()}
        assert sorted(got) == sorted(reference[kind])
        scale = max(float(np.abs(v).max()) for v in reference[kind].values())
        for key, want in reference[kind].items():
            np.testing.assert_allclose(got[key], want, rtol=tol, atol=tol * scale, err_msg=f"{kind} {key}")
    # every B had its W: one W pass per stage, microbatch and iteration on each replica
    replicas = plan.stages[0].dp
    assert sum(rep["w_passes"] for rep in out.reports.values()) == \
        STEPS * len(plan.stages) * TRAINING.microbatches * replicas


@pytest.fixture(scope="module")
def gpt_reference() -> dict:
    return train_reference(GPT_TINY, TRAINING, STEPS, dtype=F64)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb_h1", "dualpipev"])
def test_gpt_pp2_matches_reference(schedule, gpt_reference):
    _check_run(_plan(GPT_TINY, schedule), GPT_TINY, gpt_reference)


@pytest.mark.slow
def test_llama_zbv_with_a_recomputed_layer_matches_reference():
    """llama_tiny on a V (zbv), the last block of rank 1's first chunk recomputed
    (``torch.utils.checkpoint``): W's X is the one B's unpack re-made."""
    plan = _plan(LLAMA_TINY, "zbv")
    assert len(plan.used_devices()) == 2 and len(plan.stages) == 4
    i = next(i for i, st in enumerate(plan.stages) if st.layer_stop - st.layer_start >= 1 and 0 < i < 3)
    st = plan.stages[i]
    memory = [LayerMemory(layer=st.layer_stop - 1, action=MemoryAction.recompute)]
    plan = plan.model_copy(update={"stages": [s if j != i else st.model_copy(update={"memory": memory})
                                              for j, s in enumerate(plan.stages)]})
    _check_run(plan, LLAMA_TINY, train_reference(LLAMA_TINY, TRAINING, STEPS, dtype=F64))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,zero1", [("zb_h1", False), ("zbv", False), ("zb_h1", True)],
                         ids=["zb_h1", "zbv", "zb_h1-zero1"])
def test_gpt_pp2_dp2_overlapped_reduction_matches_reference(schedule, zero1, gpt_reference):
    """Overlapped dp reduction (executor.zero1), also with the distributed optimizer (ZeRO-1: each
    reduced gradient lives in its rank's shard only, so the weights are compared)."""
    plan = _plan(GPT_TINY, schedule, hw=HW4, dp=2, overlap_grad_reduce=True, distributed_optimizer=zero1)
    assert plan.overlap_grad_reduce and len(plan.used_devices()) == 4 and (plan.zero_stage == 1) == zero1
    _check_run(plan, GPT_TINY, gpt_reference, what="params" if zero1 else "grads")
