"""A failing rank ends the whole run within the timeout, and the Result names it: an exception,
a rank killed by a signal, a rank that hangs. Never a hang, never a silent success."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor import execute
from planners import make_plan, parse_policy
from costs.families import build_model
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

pytestmark = pytest.mark.slow



ROOT = Path(__file__).resolve().parents[3]
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


@pytest.mark.parametrize("kind", ["hang", "stop"])
def test_the_rank_that_stopped_making_progress_is_named(kind):
    # hang: sleeps inside its first backward; stop: SIGSTOPs itself there (a frozen process).
    # 30 s leaves start-up (~10 s on 2 loaded cores) room to reach the fault.
    result, took = run_with({"rank": 3, "kind": kind}, timeout_s=30)
    first = result.failure.splitlines()[0] if result.failure else ""
    stopped = " (process stopped, state T)" if kind == "stop" else ""
    assert first.startswith(f'timeout after 30 s: rank 3{stopped} stopped making progress'), result.failure
    assert 'at "B stage 3 microbatch 0" (iteration 0)' in first, first
    assert "ranks 0, 1, 2 were waiting" in first and 'from stage 3 (rank 3)"' in first, first
    assert took < 45  # torn down at the timeout, a stopped rank included


def test_plan_the_executor_cannot_honour_fails_without_running():
    # ZeRO-1's overlapped all-gather after the step, which FSDP2 (gathering per unit) does not have
    plan = PLAN.model_copy(update={"zero_stage": 3, "overlap_param_gather": True})
    result = execute(plan, CFG, HW, iterations=1, warmup=0, device="cpu")
    assert result.failure is not None and "overlap_param_gather" in result.failure
    assert "zero_stage 3" in result.failure


def test_rank_over_its_memory_budget_fails_like_an_oom():
    # a budget between the smallest and largest measured peak of the same run: a rank over it must
    # be the one that fails, with the CPU analogue of a CUDA OOM, and no rank under it may be named
    free = execute(PLAN, CFG, HW, iterations=1, warmup=0, timeout_s=60, device="cpu")
    assert free.failure is None, free.failure
    peaks = [d.peak_bytes for d in free.devices]
    budget = (min(peaks) + max(peaks)) // 2
    over = [r for r, p in enumerate(peaks) if p > budget]
    assert 0 < len(over) < len(peaks), peaks
    small = HW.model_copy(update={"device": HW.device.model_copy(update={"memory_bytes": budget})})
    result = execute(PLAN, CFG, small, iterations=1, warmup=0, timeout_s=60, device="cpu")
    assert result.failure is not None
    first = result.failure.splitlines()[0]
    assert first.startswith(tuple(f"rank {r} (device {r}): MemoryBudgetExceeded" for r in over)), (first, peaks)
    assert f"memory_bytes {budget}" in first


def _session(sid: int) -> dict[int, tuple[int, str]]:
    """Live processes of session ``sid``: pid -> (parent pid, state), from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            out[int(name)] = (int(fields[1]), fields[0])
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_a_killed_parent(tmp_path):
    """SIGKILL of ``python -m run ... mode=execute`` (no chance to clean up) leaves no rank alive
    after 5 s: each rank watches the launcher's pid (executor.liveness.die_with)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "run", "+hardware=local_cpu", "+model=gpt_tiny", "mode=execute",
         "execute.iterations=2000", "execute.timeout_s=900", f"hydra.run.dir={tmp_path / 'o'}"],
        cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        ranks: set[int] = set()
        while len(ranks) < 4:  # ranks: children of the forkserver, itself a child of the launcher
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.3)
            procs = _session(proc.pid)
            servers = {pid for pid, (ppid, _) in procs.items() if ppid == proc.pid}
            ranks = {pid for pid, (ppid, _) in procs.items() if ppid in servers}
        time.sleep(2)  # let them get into the process group / the iterations
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        while ranks & set(_session(proc.pid)) and time.monotonic() - killed < 5:
            time.sleep(0.1)
        left = ranks & set(_session(proc.pid))
        assert not left, f"ranks {sorted(left)} still alive {time.monotonic() - killed:.1f} s after the parent died"
        while _session(proc.pid) and time.monotonic() - killed < 10:  # the forkserver follows its ranks
            time.sleep(0.1)
        assert not _session(proc.pid), _session(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run we started
        proc.wait()
