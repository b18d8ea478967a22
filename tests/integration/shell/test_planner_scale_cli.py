"""Issue #10's GPT-3 175B commands through the real shell: seconds, and a plain verdict."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ISSUE = ["+hardware=selene", "+model=gpt3_175b", "policy=throughput", "training.global_batch=512",
         "training.microbatch_size=8"]


def run_cli(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "run", *args, f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    return proc, time.perf_counter() - t0  # wall time, for messages


def test_175b_on_32_gpus_says_no_plan_fits_and_still_writes_the_closest_plan(tmp_path):
    proc, wall_s = run_cli(tmp_path, *ISSUE, "hardware.nodes=4", "estimator=analytic")
    assert proc.returncode == 3, proc.stderr  # modes.NOT_FIT_STATUS: written and printed, then "does not fit"
    assert "NO PLAN FITS: the lowest peak found is" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith("memwall: plan ")
    assert "policy.recompute=full" in proc.stdout and "more devices" in proc.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert all(d["oom"] for d in results["devices"])  # results.json still marks every OOM device


def test_175b_on_1024_gpus_plans_a_fitting_plan(tmp_path):
    proc, wall_s = run_cli(tmp_path, *ISSUE, "hardware.nodes=128", "estimator=analytic")
    assert proc.returncode == 0, proc.stderr
    assert "NO PLAN FITS" not in proc.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(results["devices"]) == 1024 and not any(d["oom"] for d in results["devices"])


def test_a_billion_microbatches_is_refused_before_simulating(tmp_path):
    proc, wall_s = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "training.global_batch=1000000000",
                           "training.microbatch_size=1")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "training.global_batch" in line and "estimator=analytic" in line
