"""The multi-node entry point on one host: ``torchrun --standalone --nproc-per-node 4 -m
executor.torchrun`` runs a heterogeneous plan and rank 0 writes measured.json in the shared schema."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specs.families import parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import Plan, ScheduleSpec, StagePlan
from specs.result import Result
from specs.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


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
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "executor.torchrun", "--plan", str(tmp_path / "plan.json"), "--model", str(tmp_path / "model.json"),
         "--hardware", str(tmp_path / "hardware.json"), "--out", str(tmp_path / "out"),
         "--iterations", "1", "--warmup", "0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = Result.model_validate_json((tmp_path / "out" / "measured.json").read_text())
    assert result.source == "measured" and result.plan_id == plan.id and result.failure is None
    assert [d.device for d in result.devices] == [0, 1, 2, 3]
    assert all(d.peak_bytes > 0 for d in result.devices) and result.iteration_time_s > 0
    # the two data-parallel replicas of stage 0 hold the same bytes, as do the two TP ranks
    assert result.devices[0].breakdown.parameters_bytes == result.devices[1].breakdown.parameters_bytes
    assert result.devices[2].breakdown.parameters_bytes == result.devices[3].breakdown.parameters_bytes
