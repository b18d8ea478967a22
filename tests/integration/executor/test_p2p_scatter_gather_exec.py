"""Megatron-LM's scatter/gather of pipeline boundaries (Narayanan et al. SC'21 §4.1) executed on
real gloo ranks: each tp rank of the sender sends 1/t of the boundary tensor, the receiving tp
group all-gathers it (executor.stage_comm). Numerics in float64 against the single-process
reference, both directions (activations forward, gradients backward), and under a zero-bubble
schedule whose B pass sends the input gradient."""
from __future__ import annotations

import pytest
import torch

from costs.families import build_model
from executor.reference import train_reference
from planners import make_plan, parse_policy
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, run_plan_float64
from tests.integration.executor.test_executor_numerics import assert_matches

pytestmark = pytest.mark.slow
STEPS = 2


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_scattered_boundaries_match_single_process_reference(schedule):
    plan = make_plan(parse_policy({"kind": "even", "pp": 2, "tp": 2, "p2p_scatter_gather": True}),
                     build_model(GPT_TINY, 4), LOCAL_CPU, CPU_TRAINING, ScheduleSpec(kind=schedule))
    assert plan.p2p_scatter_gather and all(st.tp == 2 and not st.sequence_parallel for st in plan.stages)
    reference = train_reference(GPT_TINY, CPU_TRAINING, STEPS, dtype=torch.float64)
    out = run_plan_float64(plan, GPT_TINY, iterations=STEPS, timeout_s=180)
    assert_matches(out, reference, reorder_rtol(longest_reduction(GPT_TINY, CPU_TRAINING)))
