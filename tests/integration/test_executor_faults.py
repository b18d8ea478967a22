"""A failing rank ends the whole run within the timeout, and the Result names it: an exception,
a rank killed by a signal, a rank that hangs. Never a hang, never a silent success."""
from __future__ import annotations

import time

import pytest

from executor import execute
from planners import make_plan, parse_policy
from specs.families import build_model
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU
from specs.plan import ScheduleSpec

pytestmark = pytest.mark.slow



CFG, HW = GPT_TINY, LOCAL_CPU
TRAINING = CPU_TRAINING
PLAN = make_plan(parse_policy({"kind": "even", "pp": 4}), build_model(CFG, 4), HW, TRAINING, ScheduleSpec(kind="1f1b"))


def run_with(fault: dict, timeout_s: float):
    t0 = time.monotonic()
    result = execute(PLAN, CFG, HW, iterations=1, warmup=0, timeout_s=timeout_s, fault=fault, device="cpu")
    return result, time.monotonic() - t0


def test_exception_on_one_rank_is_recorded_with_its_rank():
    result, took = run_with({"rank": 1, "kind": "raise"}, timeout_s=60)
    assert result.failure is not None
    first = result.failure.splitlines()[0]
    assert first.startswith("rank 1 (device 1): InjectedFault"), result.failure
    assert result.iteration_time_s == 0 and all(d.peak_bytes == 0 for d in result.devices)
    assert took < 30  # torn down at once, not at the 60 s timeout


def test_killed_rank_is_recorded():
    result, took = run_with({"rank": 2, "kind": "kill"}, timeout_s=60)
    assert result.failure is not None
    assert result.failure.startswith("rank 2 (device 2): process exited with code -9"), result.failure
    assert took < 30


def test_hanging_rank_hits_the_timeout():
    result, took = run_with({"rank": 3, "kind": "hang"}, timeout_s=12)
    assert result.failure is not None and result.failure.startswith("timeout after 12 s"), result.failure
    assert "3" in result.failure.splitlines()[0]
    assert took < 25


def test_plan_the_executor_cannot_honour_fails_without_running():
    plan = PLAN.model_copy(update={"zero_stage": 1})
    result = execute(plan, CFG, HW, iterations=1, warmup=0, device="cpu")
    assert result.failure is not None and "zero_stage: 1" in result.failure


def test_rank_over_its_memory_budget_fails_like_an_oom():
    # 1 MiB per device: the embedding and head stages fit (< 0.6 MB), the block stages (> 2.8 MB) do not
    small = HW.model_copy(update={"device": HW.device.model_copy(update={"memory_bytes": 1 << 20})})
    result = execute(PLAN, CFG, small, iterations=1, warmup=0, timeout_s=60, device="cpu")
    assert result.failure is not None
    first = result.failure.splitlines()[0]
    assert first.startswith(("rank 1 (device 1): MemoryBudgetExceeded", "rank 2 (device 2): MemoryBudgetExceeded")), first
    assert "memory_bytes 1048576" in first
