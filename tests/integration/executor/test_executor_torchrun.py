"""The multi-node entry point on one host: ``torchrun --standalone --nproc-per-node 4 -m
executor.torchrun`` runs a heterogeneous plan and rank 0 writes measured.json in the shared schema."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from costs.families import parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import Plan, ScheduleSpec, StagePlan
from specs.result import Result
from specs.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
pytestmark = pytest.mark.slow
CFG = parse_model_config(yaml.safe_load((ROOT / "conf/model/gpt_tiny.yaml").read_text()))
HW = HardwareSpec.model_validate(yaml.safe_load((ROOT / "conf/hardware/local_cpu.yaml").read_text()))


def test_torchrun_runs_a_heterogeneous_plan(tmp_path):
    cfg = parse_model_config(yaml.safe_load((ROOT / "conf/model/gpt_tiny.yaml").read_text()))
    hw = HardwareSpec.model_validate(yaml.safe_load((ROOT / "conf/hardware/local_cpu.yaml").read_text()))
    plan = Plan(planner="manual", model=cfg.name, hardware=hw.name, num_devices=4,
                training=TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32"),
                schedule=ScheduleSpec(kind="1f1b"),
                stages=[StagePlan(layer_start=0, layer_stop=3, devices=[0, 1], dp=2),
                        StagePlan(layer_start=3, layer_stop=6, devices=[2, 3], tp=2)])
    for name, obj in (("plan", plan), ("model", cfg), ("hardware", hw)):
        (tmp_path / f"{name}.json").write_text(obj.model_dump_json())
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "executor.torchrun", str(tmp_path), "--iterations", "1", "--warmup", "0"],  # the run-dir form
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    result = Result.model_validate_json((tmp_path / "measured.json").read_text())
    assert result.source == "measured" and result.plan_id == plan.id and result.failure is None
    assert [d.device for d in result.devices] == [0, 1, 2, 3]
    assert all(d.peak_bytes > 0 for d in result.devices) and result.iteration_time_s > 0
    # the two data-parallel replicas of stage 0 hold the same bytes, as do the two TP ranks
    assert result.devices[0].breakdown.parameters_bytes == result.devices[1].breakdown.parameters_bytes
    assert result.devices[2].breakdown.parameters_bytes == result.devices[3].breakdown.parameters_bytes


def _plan(**stage1) -> Plan:
    return Plan(planner="manual", model=CFG.name, hardware=HW.name, num_devices=4,
                training=TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32"),
                schedule=ScheduleSpec(kind="1f1b"),
                stages=[StagePlan(layer_start=0, layer_stop=3, devices=[0, 1], dp=2),
                        StagePlan(**{"layer_start": 3, "layer_stop": 6, "devices": [2, 3], "tp": 2, **stage1})])


@pytest.mark.parametrize("stage1, expected", [
    ({"devices": [2, 7]}, "stages[1].devices[1]: device 7 is not in hardware 'local_cpu' (0..3)"),
    ({"layer_stop": 99}, "stages[1].layer_stop: 99 is past the model's last layer"),
])
def test_torchrun_refuses_a_plan_that_does_not_fit_before_starting(tmp_path, stage1, expected):
    """Checked like `python -m run` checks a plan, on every rank, before any process group: one
    line and status 2 instead of 'device 7' in the results or an IndexError on every rank."""
    for name, obj in (("plan", _plan(**stage1)), ("model", CFG), ("hardware", HW)):
        (tmp_path / f"{name}.json").write_text(obj.model_dump_json())
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}  # what torchrun sets; no peers needed
    proc = subprocess.run([sys.executable, "-m", "executor.torchrun", "--plan", str(tmp_path / "plan.json"),
                           "--model", str(tmp_path / "model.json"), "--hardware", str(tmp_path / "hardware.json"),
                           "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("executor.torchrun: cannot run plan"), proc.stderr
    assert expected in lines[0]
    assert not (tmp_path / "out").exists()


def test_torchrun_names_a_missing_input(tmp_path):
    from executor.torchrun import InputError, load_inputs

    (tmp_path / "plan.json").write_text(_plan().model_dump_json())
    with pytest.raises(InputError, match="cannot read the model config .*model.json.*mode=execute"):
        load_inputs(tmp_path / "plan.json", tmp_path / "model.json", tmp_path / "hardware.json")


def test_mode_execute_writes_what_torchrun_reads_and_refuses_what_cannot_run(tmp_path):
    """+model=gpt on local_cpu: the simulation says 10× the rank budget and hours per iteration, so
    mode=execute refuses with the numbers before starting a rank; the plan, model and hardware it
    wrote load and check cleanly in executor.torchrun (e.g. to run on a machine where it fits)."""
    from executor.torchrun import check_inputs, load_inputs

    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", "+model=gpt", "mode=execute",
                           f"hydra.run.dir={out}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    msg = proc.stderr.strip().splitlines()[-1]
    assert "not starting plan" in msg and "execute.force=true" in msg, msg
    assert "memory: simulated peak" in msg and "× the device budget 4.00 GiB" in msg, msg
    assert "host RAM:" in msg and "time: simulated" in msg and "> execute.timeout_s 300 s" in msg, msg
    assert not (out / "measured.json").exists()
    plan, cfg, hw = load_inputs(out / "plan.json", out / "model.json", out / "hardware.json")
    assert cfg.name == "gpt3_2b6" and hw.name == "local_cpu" and plan.model == cfg.name
    assert check_inputs(plan, cfg, hw, world=len(plan.used_devices())) == []
