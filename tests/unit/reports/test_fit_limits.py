"""The console table, the summary line and the exit status agree on whether a plan fits, measured
against what the user asked for (issue 22): ``policy=map policy.memory_budget_gib=2`` printed
"NO PLAN FITS", then use % 19.0 against the 32 GiB device and "| fits", exit 0; a STRONGHOLD plan
whose host state exceeds the node's RAM said "fits" too."""
from __future__ import annotations

import re

from reports.outputs import Limits, fit_check, summary, table_rows
from specs import DeviceResult, MemoryBreakdown, Result
from specs.plan import Plan, StagePlan
from specs.training import TrainingSpec
from tests.conftest import make_hardware

GIB = 1 << 30


def result_of(peak: int, host: int = 0, devices: int = 8, cap: int = 32 * GIB, host_oom: bool = False) -> Result:
    return Result(source="simulated", plan_id="abc123", model="toy", hardware="toyhw", iteration_time_s=2.0,
                  samples_per_s=16.0, tflops_per_device=1.0,
                  devices=[DeviceResult(device=i, stages=[0], layers=[(0, 4)], capacity_bytes=cap, peak_bytes=peak,
                                        breakdown=MemoryBreakdown(), host_bytes=host, host_oom=host_oom,
                                        oom=peak > cap, oom_over_bytes=max(0, peak - cap))
                           for i in range(devices)])


def plan_of(devices: int = 8) -> Plan:
    return Plan(planner="map", model="toy", hardware="toyhw", num_devices=devices,
                training=TrainingSpec(global_batch=8, microbatch_size=2),
                stages=[StagePlan(layer_start=0, layer_stop=4, devices=list(range(devices)), dp=1, tp=devices)])


def tail(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("iteration "))


def test_a_plan_over_the_users_budget_does_not_fit_it_in_the_table_or_the_summary():
    hw = make_hardware(devices=8)
    res = result_of(int(6.08 * GIB))
    limits = Limits(budget_bytes=2 * GIB, hardware=hw)
    (oom, cells), = table_rows(res, plan_of(), limits)
    assert cells[6] == "2.0" and float(cells[7]) > 300  # cap and use % against the 2 GiB asked for
    assert oom and "budget" in cells[8]
    fit = fit_check(res, limits)
    assert not fit.fits
    line = tail(summary(plan_of(), res, [], limits))
    assert line.endswith("does not fit the 2.00 GiB budget (8 device(s) over it, by up to 4.1 GiB)")
    assert not re.search(r"\| fits\b", line)


def test_within_the_budget_the_summary_says_so_and_without_one_nothing_changes():
    hw = make_hardware(devices=8)
    res = result_of(int(1.5 * GIB))
    assert tail(summary(plan_of(), res, [], Limits(budget_bytes=2 * GIB, hardware=hw))).endswith(
        "| fits the 2.00 GiB budget")
    assert tail(summary(plan_of(), res, [])).endswith("| fits")
    assert fit_check(res, Limits(budget_bytes=2 * GIB, hardware=hw)).fits
    # a budget above the device's memory: the device is the limit
    (_, cells), = table_rows(res, plan_of(), Limits(budget_bytes=64 * GIB, hardware=hw))
    assert cells[6] == "32.0"


def test_host_ram_short_on_a_node_does_not_fit_and_names_the_bytes():
    hw = make_hardware(devices=8)  # 512 GiB of host RAM per node
    res = result_of(10 * GIB, host=80 * GIB)  # 8 x 80 = 640 GiB on node 0
    fit = fit_check(res, Limits(hardware=hw))
    assert not fit.fits
    line = tail(summary(plan_of(), res, [], Limits(hardware=hw)))
    assert "does not fit host RAM: node 0 needs 640.0 GiB, has 512.0 GiB" in line
    assert not re.search(r"\| fits\b", line)
    # the simulator's own host_oom flag counts as well (it sums host peaks per node)
    assert not fit_check(result_of(10 * GIB, host_oom=True), Limits(hardware=hw)).fits


def test_device_oom_still_reads_as_before():
    res = result_of(40 * GIB)
    assert tail(summary(plan_of(), res, [], Limits(hardware=make_hardware(devices=8)))).endswith(
        "| OOM on 8 device(s)")
    assert not fit_check(res, Limits()).fits
