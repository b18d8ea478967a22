"""Sweeps through Hydra, as a user types them: the SweepSummary callback leaves summary.csv and
summary.png at the sweep root whichever launcher ran the jobs (basic, joblib, submitit_local)."""
from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

COLUMNS = {"job", "status", "overrides", "max_peak_gib", "min_peak_gib", "capacity_gib", "oom_devices",
           "iteration_time_s", "samples_per_s"}


def sweep(tmp_path: Path, *args: str, timeout: int = 240, rc: int = 0) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "run", "-m", *args, f"hydra.sweep.dir={root}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == rc, proc.stderr[-3000:]
    return proc, root


def summary_rows(root: Path) -> list[dict]:
    assert (root / "summary.png").stat().st_size > 8 * 1024
    return list(csv.DictReader((root / "summary.csv").open()))


@pytest.mark.slow
def test_basic_sweep_2x2_writes_summary_with_4_rows(tmp_path):
    proc, root = sweep(tmp_path, "+hardware=dgx1,dgx2", "+model=gpt,bert")
    rows = summary_rows(root)
    assert len(rows) == 4 and COLUMNS | {"hardware", "model"} <= set(rows[0])
    assert {(r["hardware"], r["model"]) for r in rows} == {("dgx1", "gpt"), ("dgx1", "bert"), ("dgx2", "gpt"),
                                                           ("dgx2", "bert")}
    for r in rows:
        assert r["status"] == "ok" and float(r["max_peak_gib"]) >= float(r["min_peak_gib"]) > 0
        assert float(r["samples_per_s"]) > 0 and int(r["oom_devices"]) == 0
    assert "summary.csv" in proc.stdout
    for job in root.glob("[0-9]"):  # every job drew its own pictures too
        assert (job / "memory.png").exists() and (job / "timeline.png").exists()


@pytest.mark.slow
def test_sweep_counts_oom_devices(tmp_path):
    # without recompute (pinned: the default, null, would make gpipe fit with the recompute it picks)
    _, root = sweep(tmp_path, "+hardware=dgx1", "+model=gpt", "schedule=gpipe,1f1b", "estimator=analytic",
                    "policy.recompute=none")
    rows = {r["schedule"]: r for r in summary_rows(root)}
    assert int(rows["gpipe"]["oom_devices"]) > 0 and int(rows["1f1b"]["oom_devices"]) == 0
    assert float(rows["gpipe"]["max_peak_gib"]) > float(rows["gpipe"]["capacity_gib"])
    # a plan that does not fit is not a failed job: the sweep exits 0, the row says why
    assert rows["gpipe"]["status"] == "does not fit" and "OOM on" in rows["gpipe"]["error"]
    assert rows["1f1b"]["status"] == "ok" and rows["1f1b"]["error"] == ""


@pytest.mark.slow
def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path):
    _, root = sweep(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "+hardware=local_cpu,dgx1",
                    "+model=gpt_tiny")
    rows = summary_rows(root)
    assert len(rows) == 2 and {r["hardware"] for r in rows} == {"local_cpu", "dgx1"}
    assert all(r["status"] == "ok" for r in rows)


@pytest.mark.slow
def test_submitit_local_launcher_runs_the_slurm_code_path(tmp_path):
    _, root = sweep(tmp_path, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=3",
                    "hydra.launcher.cpus_per_task=1", "+hardware=local_cpu,dgx1", "+model=gpt_tiny", timeout=300)
    rows = summary_rows(root)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert (root / ".submitit").is_dir()  # the jobs really went through submitit


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
                    reason="hydra-optuna-sweeper not installed (optional: pip install hydra-optuna-sweeper)")
def test_optuna_sweeper_minimises_the_returned_peak(tmp_path):
    _, root = sweep(tmp_path, "+sweep=optuna_peak", "+hardware=dgx1", "+model=gpt", "hydra.sweeper.n_trials=3")
    rows = summary_rows(root)
    assert len(rows) == 3
    best = (root / "optimization_results.yaml").read_text()
    value = float(best.split("best_value:")[1].split()[0])
    assert value == pytest.approx(min(float(r["max_peak_gib"]) for r in rows), rel=1e-5)


@pytest.mark.slow
def test_a_job_with_bad_input_is_reported_and_the_sweep_goes_on(tmp_path):
    """bf16 on a V100 is a usage error (no bf16 rate): that job fails with its one line, the other
    jobs still run, summary.csv marks the failed one with its line in the error column, and the
    sweep exits with the failed job's status (2, a usage error) rather than 0."""
    proc, root = sweep(tmp_path, "+hardware=dgx1", "+model=gpt_tiny", "training.precision=bf16,fp16",
                       "estimator=analytic", rc=2)
    rows = {r["training.precision"]: r for r in summary_rows(root)}
    assert rows["bf16"]["status"] == "failed" and rows["fp16"]["status"] == "ok"
    assert "has no bf16 rate" in rows["bf16"]["error"] and rows["fp16"]["error"] == ""
    assert "has no bf16 rate" in proc.stderr and "Traceback" not in proc.stderr
    assert "1 failed" in proc.stdout
