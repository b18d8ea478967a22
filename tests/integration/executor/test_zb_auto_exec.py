"""schedule=zb_auto in the executor: the searched ZB-1p / ZB-2p orders (Qi et al. 2024 §3.1, written
into ``schedule.order`` by planners.zero_bubble) walked by gloo ranks, float64, against the
single-process reference (losses, gradients within the reduction-order bound), with torch's B
(retained graph until W) and with the weight store; one W per stage, microbatch and iteration.
"""
from __future__ import annotations

import pytest
import torch

from costs.families import build_model
from executor.reference import train_reference
from executor.split_backward import unsupported
from planners import make_plan, parse_policy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.schedule import ActionKind, build_schedule, compute_order
from tests.integration.executor.test_executor_numerics import assert_matches
from tests.conftest import CPU_TRAINING, GPT_TINY, conf, longest_reduction, reorder_rtol, run_plan_float64

TRAINING = CPU_TRAINING
HW2 = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})
HW4 = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
F64 = torch.float64
STEPS = 2


def _plan(limit: float, store: bool, pp: int = 2):
    hw = HW2 if pp == 2 else HW4
    return make_plan(parse_policy({"kind": "even", "pp": pp}), build_model(GPT_TINY, 4), hw, TRAINING,
                     ScheduleSpec(kind="zb_auto", zb_memory_limit=limit, weight_store=store))


@pytest.fixture(scope="module")
def gpt_reference() -> dict:
    return train_reference(GPT_TINY, TRAINING, STEPS, dtype=F64)


@pytest.mark.slow
@pytest.mark.parametrize("limit,store,pp", [(2.0, False, 2), (2.0, True, 2), (1.0, False, 4)],
                         ids=["zb2p", "zb2p-store", "zb1p-pp4"])
def test_searched_order_matches_reference(limit, store, pp, gpt_reference):
    plan = _plan(limit, store, pp)
    assert plan.schedule.order is not None and len(plan.schedule.order) == pp
    assert not unsupported(plan, GPT_TINY)
    m = TRAINING.microbatches
    # the executor's lists are the plan's order, pass for pass
    lists = build_schedule(plan)
    for i, acts in lists.items():
        passes = [("FBW"[[ActionKind.forward, ActionKind.backward, ActionKind.backward_weight].index(a.kind)],
                   a.stage, a.microbatch) for a in acts
                  if a.kind in (ActionKind.forward, ActionKind.backward, ActionKind.backward_weight)]
        assert passes == compute_order(plan.schedule.kind, pp, m, 1, i, plan.schedule.order)
    out = run_plan_float64(plan, GPT_TINY, iterations=STEPS)
    assert out.failure is None, out.failure
    assert sorted(k for rep in out.reports.values() for k in rep["grads"]) == sorted(gpt_reference["grads"])
    assert_matches(out, gpt_reference, reorder_rtol(longest_reduction(GPT_TINY, TRAINING)), params=False)
    assert sum(rep["w_passes"] for rep in out.reports.values()) == STEPS * pp * m
