"""Host traffic measured (issue 25 item 4; issue 24's weight swap): real gloo runs of gpt_tiny on
local_cpu whose STRONGHOLD window (executor.window) or MPress weight swap (executor.weight_swap)
stamps every fetch, gradient copy and CPU step into the iteration's timeline. The measured trace
holds them on the simulator's streams under the simulator's names, as many per iteration as the
simulator books (the same contract walked twice), each with a positive duration, and the
per-action table of mode=compare shows their time error."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from costs.families import build_model
from executor import execute_run, measured_timeline
from planners import make_plan, parse_policy
from simulator import simulate
from specs.compare import action_of, layer_stages, slice_action_errors, trace_slices
from specs.plan import OffloadPolicy, Plan, ScheduleSpec, StagePlan, validate_plan
from specs.training import TrainingSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

pytestmark = pytest.mark.slow
SPEC = build_model(GPT_TINY, 4)
HEAD = len(SPEC.layers) - 1
ROOT = Path(__file__).resolve().parents[3]
HOST_ACTIONS = {"fetch", "grad_copy", "cpu_step"}
#: weight swap: 8 microbatches (PipeDream's stage 0 reaches its steady state, as test_weight_swap_exec)
WS_TRAINING = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")


def window_plan() -> tuple[Plan, object]:
    """One stage, a window of 2 over the 4 blocks (embedding and head resident: they are tied)."""
    p = Plan(planner="manual", model=SPEC.name, hardware=LOCAL_CPU.name, num_devices=LOCAL_CPU.num_devices,
             training=CPU_TRAINING, schedule=ScheduleSpec(kind="1f1b"),
             stages=[StagePlan(layer_start=0, layer_stop=HEAD + 1, devices=[0], dp=1,
                               offload=OffloadPolicy(window_layers=2, resident_layers=[0, HEAD]))])
    return validate_plan(p, SPEC, LOCAL_CPU), LOCAL_CPU


def swap_plan(kind: str) -> tuple[Plan, object]:
    """Two stages, the first two blocks of each weight-swapped (not the tied embedding/head)."""
    hw = LOCAL_CPU.model_copy(update={"devices_per_node": 2})
    plan = make_plan(parse_policy({"kind": "even", "pp": 2}), SPEC, hw, WS_TRAINING, ScheduleSpec(kind=kind))
    stages = [st.model_copy(update={"offload": st.offload.model_copy(update={
        "weight_swap_layers": [i for i in st.layers if i not in (0, HEAD)][:2]})}) for st in plan.stages]
    return validate_plan(plan.model_copy(update={"stages": stages}), SPEC, hw), hw


def host_names(rows, stages) -> Counter:
    """(device-independent) names of the host-traffic slices among ``(stream, name, ...)`` rows."""
    return Counter(r[1] for r in rows if (a := action_of(r[1], r[0], stages)) and a[0] in HOST_ACTIONS)


@pytest.fixture(scope="module", params=["window", "swap_1f1b", "swap_pipedream_async"])
def run(request):
    plan, hw = window_plan() if request.param == "window" else swap_plan(request.param[5:])
    result, out = execute_run(plan, GPT_TINY, hw, iterations=2, warmup=1, timeout_s=120, device="cpu")
    assert result.failure is None, result.failure
    return plan, hw, out


def test_measured_trace_holds_every_fetch_copy_and_step_the_simulator_books(run):
    plan, hw, out = run
    stages = layer_stages(plan)
    sim = simulate(plan, SPEC, hw)
    simulated = host_names(trace_slices(sim.trace), stages)
    kinds = {a[0] for stream, name, *_ in trace_slices(sim.trace) if (a := action_of(name, stream, stages))}
    assert kinds >= HOST_ACTIONS
    _, rep, every = measured_timeline(plan, out, warmup=1)
    measured = host_names([r for rows in rep.values() for r in rows], stages)
    assert measured == simulated  # one iteration: the same names, as many of each
    assert host_names(every, stages) == Counter({n: 2 * c for n, c in simulated.items()})  # 2 timed iterations
    for rows in rep.values():
        for stream, name, start, dur, _ in rows:
            if name in simulated:
                assert stream in ("h2d", "d2h", "cpu") and start >= 0 and dur > 0, (stream, name, start, dur)


def test_action_table_has_the_time_error_of_each_host_action(run):
    plan, hw, out = run
    sim = simulate(plan, SPEC, hw)
    _, _, every = measured_timeline(plan, out, warmup=1)
    rows = {(e.action, e.stage): e for e in slice_action_errors(trace_slices(sim.trace), every, plan)}
    for s, st in enumerate(plan.stages):
        if st.offload.window_layers is None and not st.offload.weight_swap_layers:
            continue
        for action in HOST_ACTIONS:
            e = rows[(action, s)]
            assert e.measured_count == 2 * e.simulated_count > 0, (action, s)
            assert e.measured_mean_s > 0 and e.error_pct is not None, (action, s)


def test_mode_compare_prints_the_windows_fetch_copy_and_step_errors(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", "+model=gpt_tiny", "mode=compare",
                           "policy=stronghold", "policy.pp=1", "policy.dp=1", "policy.tp=1",  # one stage: one row per action
                           "execute.iterations=1", f"hydra.run.dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    actions = {a["action"]: a for a in json.loads((out / "compare.json").read_text())["actions"]}
    assert set(actions) >= HOST_ACTIONS
    for action in HOST_ACTIONS:
        assert actions[action]["error_pct"] is not None, action
        row = next(line for line in proc.stdout.splitlines() if line.split()[1:2] == [action])
        assert f"{actions[action]['error_pct']:+.1f}" in row, row  # the printed error is compare.json's
    trace = json.loads((out / "trace_measured.json").read_text())
    streams = {stream for stream, *_ in trace_slices(trace)}
    assert {"h2d", "d2h", "cpu"} <= streams
