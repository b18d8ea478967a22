"""ZeRO-3 (FSDP2, executor.fsdp) of a weight tied over pipeline stages: gpt_tiny's embedding on the
first stage and its LM head on the last, pp 2 x dp 2, each stage sharding its copy over its own dp
group; Megatron's embedding group sums the two stages' matching gradient shards before the step
(executor.stage_grads ``_sum_tied_dtensor_shards``). Real gloo ranks:
(a) float64 losses, gradients and weights after two iterations equal the single-process reference,
and the two copies are bit for bit equal after the steps (the same summed gradient, so the same
Adam state and update); also with tp 2 (torchtitan's 2-D [dp, tp] layout, test_fsdp_tp_exec.py:
each rank's shard of the vocab-parallel copy is _StridedShard rows, placed at their global offset);
(b) every rank's measured peak is within 5 % of the simulated one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from costs.families import build_model, parse_model_config
from executor import unsupported
from executor.reference import train_reference
from planners import make_plan, parse_policy
from specs.plan import ScheduleSpec, validate_plan
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU, longest_reduction, reorder_rtol, run_plan_float64
from tests.integration.executor.test_executor_numerics import assert_matches

pytestmark = pytest.mark.slow
SCHEDULES = ["1f1b", "gpipe"]
EIGHT_RANKS = LOCAL_CPU.model_copy(update={"devices_per_node": 8})


def plan_of(schedule: str, tp: int = 1):
    hardware = EIGHT_RANKS if tp > 1 else LOCAL_CPU
    spec = build_model(GPT_TINY, 4)
    plan = make_plan(parse_policy({"kind": "manual", "pp": 2, "dp": 2, "tp": tp, "zero_stage": 3}), spec, hardware,
                     CPU_TRAINING, ScheduleSpec(kind=schedule))
    return validate_plan(plan, spec, hardware)


@pytest.mark.parametrize("schedule,tp", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2)], ids=["1f1b", "gpipe", "1f1b-tp2"])
def test_tied_weight_over_stages_matches_the_reference(schedule, tp):
    plan = plan_of(schedule, tp)
    assert plan.zero_stage == 3 and [(st.dp, st.tp) for st in plan.stages] == [(2, tp), (2, tp)]
    assert GPT_TINY.tie_embeddings and not unsupported(plan, GPT_TINY)
    out = run_plan_float64(plan, GPT_TINY, iterations=2, timeout_s=180.0)
    reference = train_reference(GPT_TINY, CPU_TRAINING, 2, dtype=torch.float64)
    assert_matches(out, reference, reorder_rtol(longest_reduction(GPT_TINY, CPU_TRAINING)))
    params = {k: v for rep in out.reports.values() for k, v in rep["params"].items()}
    embed, head = params["embed.wte.weight"], params["head.decoder.weight"]  # stage 0's copy, stage 1's
    assert np.array_equal(embed, head)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tied_weight_over_stages_peak_is_the_simulated_one(schedule):
    from tests.integration.executor.test_fsdp_exec import assert_peaks_are_the_simulated_ones

    assert_peaks_are_the_simulated_ones(plan_of(schedule), GPT_TINY, LOCAL_CPU)


def test_a_user_model_over_stages_is_refused_by_name():
    """A user model's weights tied over stages are summed as whole gradients (executor.user_model),
    which FSDP2 does not keep."""
    user = parse_model_config({"family": "torch_module", "name": "tiny_rope_layers",
                               "factory": "tests.byom_models:layered"})
    assert any(p.startswith("model.family: a user model over 2 pipeline stages with zero_stage 3")
               for p in unsupported(plan_of("1f1b"), user))
