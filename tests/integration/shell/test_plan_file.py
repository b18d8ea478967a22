"""``python -m run ... plan_file=PATH`` (issue #22): a plan written by one run, simulated again by the
next, gives the same results.json byte for byte; a bad file (each plan-file case of the issue, bad
JSON, a missing file, a plan for another model or hardware) ends in one line naming plan_file and
the field, exit status 2. Also ``executor.torchrun``'s check of a MAP plan (it traces the op graphs
the plan is validated against, as the shell does)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli_asserts

ROOT = Path(__file__).resolve().parents[3]


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def one_line_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A plan file's error: one line naming ``plan_file``, exit 2."""
    return cli_asserts.one_line_exit_2(proc, *needles, prefix="memwall: plan_file: ")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two plans written by ordinary runs: the default (dgx1, gpt) and a MAP plan (local_cpu, gpt_tiny)."""
    tmp = tmp_path_factory.mktemp("plans")
    cache = tmp / "cache"
    jobs = {"dgx1": ["+hardware=dgx1", "+model=gpt", "policy=manual", "policy.pp=4", "policy.tp=2", "policy.dp=1"],
            "map": ["+hardware=local_cpu", "+model=gpt_tiny", "policy=map", f"profile_cache={cache}"]}
    for name, args in jobs.items():
        proc = run_cli(tmp, *args, f"hydra.run.dir={tmp / name}")
        assert proc.returncode == 0, proc.stderr
    return tmp, jobs, cache


@pytest.mark.parametrize("name", ["dgx1", "map"])
def test_a_written_plan_simulates_to_the_same_results(written, name):
    tmp, jobs, cache = written
    again = tmp / f"{name}_again"
    args = [a for a in jobs[name] if not a.startswith("policy")]  # the plan, not a planner, decides now
    proc = run_cli(tmp, *args, f"plan_file={tmp / name / 'plan.json'}", "mode=simulate", f"hydra.run.dir={again}")
    assert proc.returncode == 0, proc.stderr
    assert "not planned" in proc.stdout
    for f in ("plan.json", "results.json"):
        assert (again / f).read_bytes() == (tmp / name / f).read_bytes(), f


def mutate(written, name: str, edit) -> Path:
    tmp, _, _ = written
    plan = json.loads((tmp / name / "plan.json").read_text())
    out = edit(copy.deepcopy(plan))
    path = tmp / f"case_{len(list(tmp.glob('case_*')))}.json"
    path.write_text(out if isinstance(out, str) else json.dumps(out, ensure_ascii=False), encoding="utf-8")
    return path


def _mesh_mix(p):
    p["stages"][0]["sharding"][1]["mesh"] = [2, 2]
    return p


def _window_zero(p):
    # a window on a stage of a ZeRO plan: the window keeps the streamed layers' state on the host,
    # ZeRO's sharding does not apply (a tp window is valid since issue 25: each rank streams its shard)
    p["stages"][1]["offload"]["window_layers"] = 2
    p["zero_stage"] = 1
    return p


def _optimizer_swap(p):
    p["stages"][0]["offload"]["optimizer_swap"] = True
    return p


def _fullwidth(p):
    p["stages"][0]["sharding"][1]["nodes"][1]["params"]["attn.q.weight"] = "S\uff10R"
    return p


def _duplicate(p):
    return json.dumps(p).replace('"zero_stage": 0', '"zero_stage": 3, "zero_stage": 0')


#: (name, the run's plan to mutate, the edit, what the one line must name)
CASES = [
    ("a_deep", "dgx1", lambda p: '{"stages": ' + "[" * 1000 + "]" * 1000 + "}", ["nested 1001 levels deep"]),
    ("b_mesh_mix", "map", _mesh_mix, ["stages.0.sharding", "one mesh"]),
    ("c_window_zero", "dgx1", _window_zero, ["stages[1].offload.window_layers", "zero_stage 1"]),
    ("d_optimizer_swap", "map", _optimizer_swap, ["stages.0.offload.optimizer_swap"]),
    ("e_fullwidth_axis", "map", _fullwidth, ["attn.q.weight", "not a sharding spec"]),
    ("f_duplicate_key", "dgx1", _duplicate, ["'zero_stage' appears twice"]),
    ("bad_json", "dgx1", lambda p: json.dumps(p)[:-3], ["Expecting"]),
    ("unknown_field", "dgx1", lambda p: p | {"stagez": []}, ["stagez"]),
    ("layer_past_the_model", "dgx1", lambda p: (p["stages"][-1].update(layer_stop=99), p)[1],
     ["stages[3].layer_stop", "past the model's last layer"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_bad_plan_file_is_one_line_exit_2(written, case):
    _, base, edit, needles = case
    tmp, jobs, _ = written
    path = mutate(written, base, edit)
    args = [a for a in jobs[base] if not a.startswith("policy")]
    proc = run_cli(tmp, *args, f"plan_file={path}", f"hydra.run.dir={tmp / 'bad'}")
    one_line_exit_2(proc, str(path), *needles)


def test_a_plan_for_another_model_or_hardware_or_a_missing_file(written):
    tmp, _, _ = written
    plan = tmp / "dgx1" / "plan.json"
    one_line_exit_2(run_cli(tmp, "+hardware=dgx1", "+model=bert", f"plan_file={plan}", f"hydra.run.dir={tmp / 'x'}"),
                    "model: plan is for model 'gpt3_2b6'")
    one_line_exit_2(run_cli(tmp, "+hardware=dgx2", "+model=gpt", f"plan_file={plan}", f"hydra.run.dir={tmp / 'x'}"),
                    "hardware: plan is for 'dgx1'")
    one_line_exit_2(run_cli(tmp, "+hardware=dgx1", "+model=gpt", f"plan_file={tmp / 'nope.json'}",
                            f"hydra.run.dir={tmp / 'x'}"), "cannot read", "nope.json")
    one_line_exit_2(run_cli(tmp, "+hardware=dgx1", "+model=gpt", f"plan_file={plan}", "mode=profile",
                            f"hydra.run.dir={tmp / 'x'}"), "mode=profile")


def test_the_executor_checks_a_map_plan_against_its_op_graphs(written):
    """g) ``python -m executor.torchrun DIR`` refused every MAP plan ("has no op graph")."""
    from executor.torchrun import check_inputs, load_inputs
    from runconfig import compose

    tmp, _, _ = written
    cfg = compose("+hardware=local_cpu", "+model=gpt_tiny")
    (tmp / "map" / "model.json").write_text(cfg.model.model_dump_json())
    (tmp / "map" / "hardware.json").write_text(cfg.hardware.model_dump_json())
    plan, model_cfg, hardware = load_inputs(*(tmp / "map" / f"{n}.json" for n in ("plan", "model", "hardware")))
    assert any(st.sharding for st in plan.stages)
    assert check_inputs(plan, model_cfg, hardware, len(plan.used_devices())) == []
    bad = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={"sharding": [
        s.model_copy(update={"nodes": s.nodes[1:]}) for s in plan.stages[0].sharding]})]})
    problems = check_inputs(bad, model_cfg, hardware, len(plan.used_devices()))
    assert problems and all("nodes must be the op graph's" in p for p in problems), problems
