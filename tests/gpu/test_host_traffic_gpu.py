"""Host traffic measured on CUDA (issue 25 item 4; executor.timeline.Stamps): a one-stage gpt_tiny
plan with a STRONGHOLD window, and one with two weight-swapped blocks, run on one GPU. Each copy is
timed by a pair of timing events on its copy stream and resolved against the iteration's anchor
event, each CPU step on the host: the measured trace holds every fetch, gradient copy and CPU
step the simulator books (its names; a CPU rank's "(memcpy)" is a copy stream's transfer here),
on the h2d, d2h and cpu streams, with positive durations inside the iteration. Skipped without
CUDA; ``-s`` prints the per-action table."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from costs.families import build_model
from executor import execute_run, measured_timeline
from simulator import simulate
from specs.compare import action_of, action_table, layer_stages, slice_action_errors, trace_slices
from specs.plan import OffloadPolicy, Plan, ScheduleSpec, StagePlan, validate_plan
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SPEC = build_model(GPT_TINY, 4)
HEAD = len(SPEC.layers) - 1
HOST_ACTIONS = {"fetch", "grad_copy", "cpu_step"}


def _plan(offload: OffloadPolicy) -> Plan:
    p = Plan(planner="manual", model=SPEC.name, hardware=LOCAL_CPU.name, num_devices=LOCAL_CPU.num_devices,
             training=CPU_TRAINING, schedule=ScheduleSpec(kind="1f1b"),
             stages=[StagePlan(layer_start=0, layer_stop=HEAD + 1, devices=[0], dp=1, offload=offload)])
    return validate_plan(p, SPEC, LOCAL_CPU)


def _names(rows, stages) -> Counter:
    return Counter(r[1].removesuffix(" (memcpy)") for r in rows
                   if (a := action_of(r[1], r[0], stages)) and a[0] in HOST_ACTIONS)


@pytest.mark.parametrize("offload", [OffloadPolicy(window_layers=2, resident_layers=[0, HEAD]),
                                     OffloadPolicy(weight_swap_layers=[1, 2])], ids=["window", "weight_swap"])
def test_cuda_trace_times_every_fetch_copy_and_step(offload):
    plan = _plan(offload)
    stages = layer_stages(plan)
    result, out = execute_run(plan, GPT_TINY, LOCAL_CPU, iterations=2, warmup=1, timeout_s=300, device="cuda")
    assert result.failure is None, result.failure
    sim = simulate(plan, SPEC, LOCAL_CPU)
    _, rep, every = measured_timeline(plan, out, warmup=1)
    rows = rep[0]
    assert _names(rows, stages) == _names(trace_slices(sim.trace), stages)
    end = max(s + d for stream, _, s, d, _ in rows if stream == "compute")
    for stream, name, start, dur, _ in rows:
        if (a := action_of(name, stream, stages)) and a[0] in HOST_ACTIONS:
            assert start >= 0 and dur > 0, (stream, name, start, dur)
            if a[0] != "cpu_step":  # a copy is over before the iteration's synchronize
                assert start + dur <= end + 1_000_000, (name, start, dur, end)  # + 1 ms: the anchor's launch
    errors = slice_action_errors(trace_slices(sim.trace), every, plan)
    print("\n" + action_table(errors))
    assert {e.action for e in errors if e.measured_mean_s and e.simulated_mean_s} >= HOST_ACTIONS
