"""Pre-flight check before mode=execute/compare: a run the simulation says will not fit the
device budget or host RAM, or not finish within execute.timeout_s, is refused with the numbers;
one that fits passes. ``executor.preflight.check`` is pure: these tests start nothing."""
from __future__ import annotations

import re

import pytest

from executor.preflight import (
    RANK_RUNTIME_BYTES,
    STARTUP_S,
    check,
    host_available_bytes,
)
from specs.result import DeviceResult, Result
from tests.conftest import GIB, LOCAL_CPU, make_hardware


def sim(peaks: list[int], time_s: float = 0.1, hardware=LOCAL_CPU) -> Result:
    cap = hardware.device.memory_bytes
    return Result(source="simulated", plan_id="p", model="m", hardware=hardware.name,
                  devices=[DeviceResult(device=d, rank=d, capacity_bytes=cap, peak_bytes=p, oom=p > cap)
                           for d, p in enumerate(peaks)],
                  iteration_time_s=time_s, samples_per_s=8 / time_s, tflops_per_device=0.01)


def problems(result: Result, hardware=LOCAL_CPU, iterations=5, warmup=1, timeout_s=300.0, host=20 * GIB):
    return check(result, hardware, iterations=iterations, warmup=warmup, timeout_s=timeout_s,
                 host_available_bytes=host)


def test_a_run_that_fits_passes():
    assert problems(sim([1 * GIB] * 4)) == []


def test_peak_over_the_device_budget_is_refused_with_the_ratio():
    cap = LOCAL_CPU.device.memory_bytes  # 4 GiB per rank
    (msg,) = problems(sim([1 * GIB, int(6.7 * cap), 2 * cap, GIB]), host=None)
    assert msg.startswith("memory:") and "device 1" in msg and "6.7×" in msg
    assert "26.80 GiB" in msg and "4.00 GiB" in msg and "hardware.device.memory_bytes" in msg
    assert "2 of 4 devices" in msg


def test_host_ram_counts_every_rank_plus_its_runtime():
    peaks = [3 * GIB] * 4  # each fits its 4 GiB budget, but 4 x (3 + 0.25) GiB = 13 GiB
    need = 4 * (3 * GIB + RANK_RUNTIME_BYTES)
    assert problems(sim(peaks), host=need) == []
    (msg,) = problems(sim(peaks), host=need - 1)
    assert msg.startswith("host RAM:") and "13.00 GiB" in msg and "MemAvailable" in msg
    assert problems(sim(peaks), host=None) == []  # unknown: not checked


def test_host_ram_is_not_checked_for_gpus():
    gpus = make_hardware(devices=4, memory_bytes=40 * GIB)
    assert problems(sim([30 * GIB] * 4, hardware=gpus), hardware=gpus, host=1 * GIB) == []


def test_estimated_time_over_the_timeout_is_refused():
    # 2e5 s per iteration x (1 warm-up + 1 tracked + 5 timed) -- the gpt on local_cpu
    (msg,) = problems(sim([GIB] * 4, time_s=2e5))
    assert msg.startswith("time:") and "× 7 iterations" in msg and "execute.timeout_s 300" in msg
    assert re.search(r"= 1\.4e\+06 s", msg), msg
    # the boundary: iterations x time + start-up just fits
    t = (300 - STARTUP_S) / 7
    assert problems(sim([GIB] * 4, time_s=t * 0.99)) == []
    assert len(problems(sim([GIB] * 4, time_s=t * 1.01))) == 1
    assert problems(sim([GIB] * 4, time_s=t * 1.01), timeout_s=600) == []
    assert problems(sim([GIB] * 4, time_s=t * 1.01), iterations=4) == []


def test_every_problem_is_listed_at_once():
    found = problems(sim([10 * GIB] * 4, time_s=1e4), host=8 * GIB)
    assert [m.split(":")[0] for m in found] == ["memory", "host RAM", "time"]


def test_host_available_bytes_reads_meminfo():
    avail = host_available_bytes()
    if avail is None:
        pytest.skip("no /proc/meminfo")
    assert 64 << 20 < avail < 1 << 50
