"""The executor's alternate mode (issue 27; executor.worker's ``opts["alternate"]``, used by
benchmarks/zero_bubble_bubble.py): iteration i runs schedule kinds[i % n] on the same ranks and
stages, the 1F1B iterations with the backward whole (the split off), the zb_h1 ones as B and W.

- 2 gloo ranks on gpt_tiny, float64, 1f1b and zb_h1 in turn for 4 iterations: the losses of every
  iteration and the final weights are the single-process reference's (within the reduction-order
  bound), and each rank ran one W pass per microbatch in the 2 zb_h1 iterations only.
- A V-shaped plan (zbv) refuses the mode with a ValueError that names ``alternate``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from costs.families import build_model
from executor.launch import launch
from executor.reference import train_reference
from executor.worker import _alternate
from planners import make_plan, parse_policy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, conf, longest_reduction, reorder_rtol

CFG, TRAINING = GPT_TINY, CPU_TRAINING
HW = HardwareSpec.model_validate({**conf("hardware", "local_cpu"), "devices_per_node": 2})  # 2 ranks
SPEC = build_model(CFG, TRAINING.microbatch_size)
KINDS = ["1f1b", "zb_h1"]
ITERATIONS = 4  # two cycles: iterations 1 and 3 run zb_h1


def _plan(schedule: str):
    return make_plan(parse_policy({"kind": "even", "pp": 2}), SPEC, HW, TRAINING, ScheduleSpec(kind=schedule))


@pytest.mark.slow
def test_alternate_1f1b_zb_h1_matches_reference():
    plan = _plan("zb_h1")  # the plan's own kind must split for its stages to hold the B/W state
    assert len(plan.used_devices()) == 2 and len(plan.stages) == 2
    opts = {"iterations": ITERATIONS, "collect": True, "memory_iteration": None, "track_memory": False,
            "fault": None, "seed": 0, "device": "cpu", "threads": 1, "capacity_bytes": None,
            "dtype": "float64", "alternate": KINDS}
    out = launch(plan, CFG, opts, 180.0)
    assert out.failure is None, out.failure
    ref = train_reference(CFG, TRAINING, ITERATIONS, dtype=torch.float64)
    tol = reorder_rtol(longest_reduction(CFG, TRAINING))
    assert len(out.losses) == ITERATIONS
    np.testing.assert_allclose(out.losses, ref["losses"], rtol=tol)
    got = {k: v for rep in out.reports.values() for k, v in rep["params"].items()}
    assert sorted(got) == sorted(ref["params"]), "every parameter is owned by exactly one stage"
    scale = max(float(np.abs(v).max()) for v in ref["params"].values())
    for key, want in ref["params"].items():
        np.testing.assert_allclose(got[key], want, rtol=tol, atol=tol * scale, err_msg=key)
    # W passes only in the zb_h1 iterations: one per microbatch on each rank's one stage
    zb_iterations = sum(KINDS[i % len(KINDS)] == "zb_h1" for i in range(ITERATIONS))
    assert zb_iterations == 2
    per_rank = [rep["w_passes"] for rep in out.reports.values()]
    assert per_rank == [zb_iterations * TRAINING.microbatches] * len(plan.stages), per_rank


def test_alternate_refuses_a_v_plan():
    """zbv places two chunks per rank; the alternate mode swaps action lists of one-chunk-per-rank
    schedules only, so it refuses before any iteration runs and names the option."""
    plan = _plan("zbv")
    with pytest.raises(ValueError, match="alternate"):
        _alternate(plan, 0, KINDS)


def test_alternate_refuses_a_split_kind_on_an_unsplit_plan():
    """A 1F1B plan's stages hold no B/W state: zb_h1 in the list is refused, naming the option."""
    with pytest.raises(ValueError, match="alternate: zb_h1"):
        _alternate(_plan("1f1b"), 0, KINDS)


def test_alternate_keeps_a_searched_plans_own_order():
    """A zb_auto plan (ZB-2p, benchmarks/zero_bubble_bubble.py --schedules 1f1b,zb_2p) alternates with
    1F1B: its own iterations walk the plan's searched order (schedule.order), the 1F1B ones 1F1B's."""
    from executor.worker import group_actions

    plan = make_plan(parse_policy({"kind": "even", "pp": 2}), SPEC, HW, TRAINING,
                     ScheduleSpec(kind="zb_auto", zb_memory_limit=2.0))
    assert plan.schedule.order is not None
    for pos in range(2):
        (split_1f1b, acts_1f1b), (split_zb, acts_zb) = _alternate(plan, pos, ["1f1b", "zb_auto"])
        assert (split_1f1b, split_zb) == (False, True)
        assert acts_zb == group_actions(plan, pos)
        one = plan.model_copy(update={"schedule": ScheduleSpec(kind="1f1b")})
        assert acts_1f1b == group_actions(one, pos)


def test_alternate_refuses_zb_auto_on_a_plan_without_its_order():
    with pytest.raises(ValueError, match="alternate: zb_auto runs the plan's own searched order"):
        _alternate(_plan("zb_h1"), 0, ["zb_h1", "zb_auto"])
