"""`python -m run` end to end, as a user types it, from a directory outside the repo."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specs import Plan, Result


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "run", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_main_job_writes_plan_and_results_for_8_devices(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    plan = Plan.model_validate_json((out / "plan.json").read_text())
    result = Result.model_validate_json((out / "results.json").read_text())
    raw = json.loads((out / "results.json").read_text())
    assert [d["device"] for d in raw["devices"]] == list(range(8))
    assert all(d["peak_bytes"] > 0 for d in raw["devices"])
    assert raw["iteration_time_s"] > 0 and raw["samples_per_s"] > 0
    assert result.plan_id == plan.id and plan.hardware == "dgx1"
    assert "peak GiB" in proc.stdout and "samples/s" in proc.stdout
    assert "dp x tp" in proc.stdout and "memory" in proc.stdout


def test_table_shows_a_tensor_parallel_stage_as_dp_x_tp(tmp_path):
    out = tmp_path / "tp"
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "policy=manual", "policy.tp=8", "policy.recompute=full",
                   "estimator=analytic", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.strip().startswith("0-7 "))
    assert " 1x8 " in row and "recompute " in row, proc.stdout


def test_missing_hardware_lists_the_options(tmp_path):
    proc = run_cli(tmp_path, "+model=gpt", f"hydra.run.dir={tmp_path / 'o'}")
    assert proc.returncode != 0
    assert "+hardware=NAME" in proc.stderr and "dgx1" in proc.stderr and "local_cpu" in proc.stderr


def test_missing_model_lists_the_options(tmp_path):
    proc = run_cli(tmp_path, "+hardware=dgx1", f"hydra.run.dir={tmp_path / 'o'}")
    assert proc.returncode != 0 and "+model=NAME" in proc.stderr and "gpt3_175b" in proc.stderr


def test_typo_in_a_key_is_rejected(tmp_path):
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "polcy=even", f"hydra.run.dir={tmp_path / 'o'}")
    assert proc.returncode != 0 and "polcy" in proc.stderr
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "+policy.ppp=2", f"hydra.run.dir={tmp_path / 'o'}")
    assert proc.returncode != 0 and "policy" in proc.stderr and "ppp" in proc.stderr


def test_bad_value_names_the_field(tmp_path):
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "training.precision=fp8",
                   f"hydra.run.dir={tmp_path / 'o'}")
    assert proc.returncode == 2 and "training.precision" in proc.stderr and "bf16" in proc.stderr


def test_unplannable_request_says_why(tmp_path):
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "policy=manual", "policy.pp=3",
                   f"hydra.run.dir={tmp_path / 'o'}")
    assert proc.returncode == 2 and "policy.pp (3)" in proc.stderr


def test_execute_refuses_hardware_this_machine_lacks(tmp_path):
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "mode=execute", f"hydra.run.dir={tmp_path / 'o'}")
    assert proc.returncode == 2 and "needs 8 GPUs" in proc.stderr and "local_cpu" in proc.stderr


@pytest.mark.slow
def test_compare_on_local_cpu_within_10_percent(tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli(tmp_path, "+hardware=local_cpu", "+model=gpt_tiny", "mode=compare", "execute.iterations=2",
                   f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    cmp = json.loads((out / "compare.json").read_text())
    assert [r["rank"] for r in cmp["ranks"]] == [0, 1, 2, 3]
    for r in cmp["ranks"]:
        assert {"rank", "simulated_peak_bytes", "measured_peak_bytes", "error_pct"} <= set(r)
        assert r["measured_peak_bytes"] > 0 and abs(r["error_pct"]) <= 10.0, r
    assert cmp["measured_iteration_time_s"] > 0 and "time_error_pct" in cmp
    assert Result.model_validate_json((out / "measured.json").read_text()).source == "measured"
    assert (out / "compare.png").stat().st_size > 10_000


@pytest.mark.slow
def test_multirun_2x2_gives_4_result_files(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli(tmp_path, "-m", "+hardware=dgx1,dgx2", "+model=gpt,bert", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    results = sorted(sweep.rglob("results.json"))
    assert len(results) == 4
    pairs = {(Result.model_validate_json(p.read_text()).hardware, Result.model_validate_json(p.read_text()).model)
             for p in results}
    assert {hw for hw, _ in pairs} == {"dgx1", "dgx2"} and len(pairs) == 4


def peaks(tmp_path: Path, name: str, *args: str, status: int = 0) -> list[int]:
    """Per-device peaks of a dgx1 gpt run that exits with ``status`` (modes.NOT_FIT_STATUS: a plan
    that does not fit, still written)."""
    out = tmp_path / name
    proc = run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", *args, f"hydra.run.dir={out}")
    assert proc.returncode == status, proc.stderr
    return [d.peak_bytes for d in Result.model_validate_json((out / "results.json").read_text()).devices]


@pytest.mark.slow
def test_gpipe_first_stage_peaks_above_1f1b_and_1f1b_first_above_last(tmp_path):
    from modes import NOT_FIT_STATUS

    # GPipe holds every microbatch's activations: on a DGX-1 it runs out of memory (exit status 3)
    # without recompute (pinned: the default, null, would pick the recompute that fits)
    gpipe = peaks(tmp_path, "g", "schedule=gpipe", "policy.recompute=none", status=NOT_FIT_STATUS)
    one_f = peaks(tmp_path, "o", "schedule=1f1b", "policy.recompute=none")
    assert gpipe[0] > one_f[0]
    assert one_f[0] > one_f[-1]


@pytest.mark.slow
def test_simulator_is_default_writes_valid_trace_and_is_deterministic(tmp_path):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", f"hydra.run.dir={out}").returncode == 0
        outs.append(out)
    trace = json.loads((outs[0] / "trace.json").read_text())
    assert trace["traceEvents"] and {"X", "C", "M"} <= {e["ph"] for e in trace["traceEvents"]}
    assert json.loads((outs[0] / "results.json").read_text())["source"] == "simulated"
    for f in ("results.json", "trace.json", "plan.json"):
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes()


def test_analytic_estimator_selectable(tmp_path):
    out = tmp_path / "an"
    assert run_cli(tmp_path, "+hardware=dgx1", "+model=gpt", "estimator=analytic", f"hydra.run.dir={out}").returncode == 0
    assert json.loads((out / "results.json").read_text())["source"] == "predicted-by-analytic"
    assert not (out / "trace.json").exists()


def test_help_describes_memwall_its_modes_and_groups(tmp_path):
    proc = run_cli(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("memwall") and "Powered by Hydra" not in text
    for word in ("+hardware=NAME +model=NAME", "simulate", "execute", "compare", "profile", "calibrate",
                 "python -m run +hardware=dgx1 +model=gpt", "policy.memory_budget_gib", "policy.window_layers",
                 "stronghold_gpt_l500 39.5B", "gpt3_175b 174.6B"):
        assert word in text, word
    policies = text.split("Policies (policy=NAME)")[1].split("Models (+model=NAME)")[0]
    for name in ("balanced", "even", "manual", "throughput", "capture", "mpress", "stronghold", "map", "auto"):
        assert f"\n  {name} " in policies, name
    groups = {line.split(":")[0]: line for line in text.splitlines() if ": " in line}
    assert "dgx1" in groups["hardware"] and "gpt_tiny" in groups["model"] and "capture" in groups["policy"]


def test_a_tiny_model_reads_in_mib_not_zero_gib(tmp_path):
    out = tmp_path / "tiny"
    proc = run_cli(tmp_path, "+hardware=local_cpu", "+model=gpt_tiny", "estimator=analytic", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert "peak MiB" in proc.stdout and "cap GiB" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert len(rows) == 4 and not any(" 0.00 " in r for r in rows), proc.stdout


@pytest.mark.slow
def test_wresnet_symbolic_costs_profile_in_the_run_dtype(tmp_path):
    """The symbolic profiler feeds images in the run's dtype (fp16 by default): a conv whose
    weights are fp16 used to refuse the fp32 images (issue #10)."""
    out = tmp_path / "wr"
    proc = run_cli(tmp_path, "+hardware=local_cpu", "+model=wresnet_tiny", "model_costs=symbolic", "estimator=analytic",
                   f"profile_cache={tmp_path / 'cache'}", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert "[profile] tracing layer" in proc.stdout and (out / "results.json").exists()


def test_capture_report_says_when_the_plans_it_compares_run_out_of_memory():
    from planning import planner_lines

    def entry(peak_gib: float, oom: int) -> dict:
        return {"plan_id": "x", "stages": [[0, 1, 1, 1]] * 4, "peak_bytes": int(peak_gib * 2**30),
                "min_peak_bytes": 0, "oom_devices": oom, "over_bytes": int(max(0.0, peak_gib - 40) * 2**30),
                "iteration_time_s": 1.0, "samples_per_s": 10.0}

    class Hw:  # planner_lines reads the node count only
        nodes = 4

    report = {"capture": {**entry(45, 3), "predicted_peak_bytes": 45 * 2**30}, "throughput": entry(50, 2),
              "peak_reduction_pct": 10.0, "throughput_loss_pct": 5.0, "source": "simulated",
              "smallest_fit": {"capture": {"nodes": 2, "devices": 8, "peak_bytes": 30 * 2**30, "samples_per_s": 6.5},
                               "throughput": None}}
    text = planner_lines(report, Hw, Path("planners.json"))
    assert "both plans run out of memory" in text and "CAPTURE over by 5.0 GiB on 3 device(s)" in text
    assert "throughput over by 10.0 GiB on 2 device(s)" in text and "plans that do not fit" in text
    assert "smallest hardware under CAPTURE: 2 node(s) = 8 devices" in text and "{" not in text
    assert "no node count up to 4 fits" in text
    report["capture"] = {**entry(30, 0), "predicted_peak_bytes": 30 * 2**30}
    assert "the throughput plan runs out of memory" in planner_lines(report, Hw, Path("p"))
