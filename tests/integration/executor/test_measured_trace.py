"""The executor's measured timeline (executor.timeline) in the simulator's trace schema: one F and
one B slice per (stage, microbatch) per rank, monotone per track, names the simulator also uses,
and the per-action error table of mode=compare built from both (issue #11)."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from executor import execute_run, measured_timeline
from planners import make_plan, parse_policy
from simulator import simulate
from simulator.trace import TraceBuilder, side_by_side, x_slices
from specs.compare import ACTIONS, slice_action_errors
from costs.families import build_model
from specs.plan import ScheduleSpec
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

pytestmark = pytest.mark.slow
SPEC = build_model(GPT_TINY, 4)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", params=["1f1b", "interleaved_1f1b"])
def run(request):
    hw = LOCAL_CPU.model_copy(update={"devices_per_node": 2}) if request.param != "1f1b" else LOCAL_CPU
    policy = {"kind": "manual", "pp": 2, "dp": 2} if request.param == "1f1b" else {"kind": "manual", "pp": 2}
    plan = make_plan(parse_policy(policy), SPEC, hw, CPU_TRAINING,
                     ScheduleSpec(kind=request.param, virtual_stages=2 if request.param != "1f1b" else 1))
    result, out = execute_run(plan, GPT_TINY, hw, iterations=2, warmup=1, timeout_s=120, device="cpu")
    assert result.failure is None, result.failure
    return plan, out, hw


def test_measured_trace_has_one_f_and_one_b_per_stage_and_microbatch_on_every_rank(run):
    plan, out, hw = run
    names, rep, every = measured_timeline(plan, out, warmup=1)
    builder = TraceBuilder()
    for pid, rows in rep.items():
        for stream, name, start, dur, cat in rows:
            builder.slice(pid, stream, name, start, dur, cat)
    trace = json.loads(json.dumps(builder.build(names, {})))  # what trace_measured.json holds
    slices = x_slices(trace)
    m = plan.training.microbatches
    for d in plan.used_devices():
        mine = Counter(name for pid, name, _, _, _ in slices if pid == d)
        for s in plan.stages_on(d):
            for k in range(m):
                assert mine[f"F s{s} mb{k}"] == 1 and mine[f"B s{s} mb{k}"] == 1, (d, s, k)
    # 2 timed iterations of every rank: twice as many passes
    passes = Counter(name.split()[0] for name, _ in ((n, 0) for _, n, _, _, _ in every))
    per_iteration = sum(len(plan.stages_on(d)) for d in plan.used_devices()) * m
    assert passes["F"] == passes["B"] == 2 * per_iteration


def test_tracks_are_monotone_and_compute_slices_do_not_overlap(run):
    plan, out, hw = run
    _, rep, _ = measured_timeline(plan, out, warmup=1)
    for pid, rows in rep.items():
        for stream in {r[0] for r in rows if r[0] in ("compute", "recv")}:  # one thread walks these
            spans = [(start, start + dur) for st, _, start, dur, _ in rows if st == stream]
            assert spans == sorted(spans)
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (pid, stream)
        assert all(start >= 0 and dur >= 0 for _, _, start, dur, _ in rows)


def test_measured_names_are_the_simulators_and_the_action_table_covers_both(run):
    plan, out, hw = run
    sim = simulate(plan, SPEC, hw)
    sim_names = {name for _, name, _, _, _ in x_slices(sim.trace)}
    _, rep, every = measured_timeline(plan, out, warmup=1)
    measured_passes = {name for rows in rep.values() for _, name, _, _, cat in rows if cat in ("forward", "backward")}
    assert measured_passes == {n for n in sim_names if n.split()[0] in ("F", "B")}
    errors = slice_action_errors(x_slices(sim.trace), every)
    got = {(e.action, e.stage) for e in errors if e.simulated_mean_s and e.measured_mean_s}
    for s in range(len(plan.stages)):
        assert {("forward", s), ("backward", s)} <= got
    assert {e.action for e in errors} <= set(ACTIONS)
    merged = side_by_side(sim.trace, sim.trace)
    assert len(x_slices(merged)) == 2 * len(x_slices(sim.trace))


def test_mode_compare_writes_both_traces_and_the_action_table(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", "+model=gpt_tiny", "mode=compare",
                           "policy=manual", "policy.pp=2", "policy.dp=2", "training.global_batch=8", "execute.iterations=1",
                           f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("trace_simulated.json", "trace_measured.json", "trace_compare.json", "compare.json"):
        assert (out / name).exists(), name
    assert "simulated ms" in proc.stdout and "forward" in proc.stdout
    actions = json.loads((out / "compare.json").read_text())["actions"]
    assert {a["action"] for a in actions} >= {"forward", "backward", "send_act", "send_grad"}
