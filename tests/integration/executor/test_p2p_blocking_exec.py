"""``plan.p2p_blocking`` executed on real gloo ranks (executor.worker._walk): a pass starts only once
the sends issued before it completed, and each rank first posts the receives of its next exchange
(Megatron batches a send with the next step's receives) so neighbours' exchanges pair up. Numerics
in float64 against the single-process reference, under 1F1B and Megatron's interleaved schedule
(two devices exchanging in both directions); the action timeline shows every pass starting after
the rank's earlier sends ended, which the overlapped default does not."""
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
PASSES = ("forward", "backward", "backward_weight")


def _plan(schedule: str, v: int, blocking: bool):
    return make_plan(parse_policy({"kind": "even", "pp": 2, "dp": 2, "p2p_blocking": blocking}),
                     build_model(GPT_TINY, 4), LOCAL_CPU, CPU_TRAINING, ScheduleSpec(kind=schedule, virtual_stages=v))


def _passes_inside_sends(out) -> tuple[int, int]:
    """(passes that started while an earlier send of the same rank was in flight, sends seen),
    over the timed iterations' timelines of every rank."""
    overlapping = sends = 0
    for rep in out.reports.values():
        for tl in rep["timelines"]:
            if tl is None:
                continue
            events = tl["events"]
            flights = [(e[4], e[5]) for e in events if str(e[0]).startswith("send_")]
            sends += len(flights)
            starts = [e[4] for e in events if e[0] in PASSES]
            overlapping += sum(any(s0 < t < s1 for s0, s1 in flights) for t in starts)
    return overlapping, sends


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_blocking_sends_match_reference_and_hold_the_next_pass(schedule, v):
    plan = _plan(schedule, v, True)
    assert plan.p2p_blocking
    reference = train_reference(GPT_TINY, CPU_TRAINING, STEPS, dtype=torch.float64)
    out = run_plan_float64(plan, GPT_TINY, iterations=STEPS, timeout_s=180)
    assert out.failure is None, out.failure
    assert_matches(out, reference, reorder_rtol(longest_reduction(GPT_TINY, CPU_TRAINING)))
    overlapping, sends = _passes_inside_sends(out)
    assert sends > 0
    assert overlapping == 0


def test_overlapped_default_runs_passes_during_sends():
    """The check above can fail: with sends overlapped (the default) some pass starts while a send
    of its rank is still in flight (gloo completes a send once the peer posts its receive)."""
    out = run_plan_float64(_plan("1f1b", 1, False), GPT_TINY, iterations=STEPS, timeout_s=180)
    assert out.failure is None, out.failure
    overlapping, sends = _passes_inside_sends(out)
    assert sends > 0 and overlapping > 0
