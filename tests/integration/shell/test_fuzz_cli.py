"""Random CLI override sets end in a Result with finite, positive numbers or a one-line error
naming the field (exit 2) -- never a traceback (issue #10).

The random sets run in-process through Hydra's Compose API and the same validate/plan/estimate
path as ``python -m run`` (no files, no figures: fast); the issue's own examples also run as
real subprocesses to check the shell: one line on stderr, exit status 2, no "Traceback".
"""
from __future__ import annotations

import contextlib
import io
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import run
from planning import plan_for, predict
from tests.conftest import deadline

ROOT = Path(run.__file__).resolve().parent
HARDWARE = ["dgx1", "dgx2", "v100_single", "a10_cluster", "capture_cluster", "h100_node", "local_cpu"]
TINY = ["gpt_tiny", "bert_tiny", "moe_tiny", "wresnet_tiny"]
ABSURD = ["0", "-1", "-5", "nan", "inf", "-inf", "1e-300", "1e300", str(2**64), "0.5", "abc", "null",
          "'${nonexistent.key}'", "''", "[1,2]"]
#: field -> sane values (drawn with the absurd ones). Counts stay small so that a run's cost does
#: not depend on the simulator's and planners' scaling (other issues): nodes <= 4, batch <= 128.
FIELDS = {
    "hardware.device.peak_tflops.fp16": ["125", "1e-3", "1e4"],
    "hardware.device.peak_tflops.fp32": ["15.7", "1e-6"],
    "hardware.device.compute_efficiency": ["0.001", "1", "0.3"],
    "hardware.device.memory_bytes": ["1", "1073741824", str(2**42)],
    "hardware.device.hbm_gbps": ["900", "1e-6"],
    "hardware.host.pcie_gbps": ["12", "1e-6", "1e15"],
    "hardware.host.pcie_latency_s": ["0", "1"],
    "hardware.host.nvme_gbps": ["0", "3.2"],
    "hardware.intra_node.fallback.latency_s": ["0", "1e-5", "1"],
    "hardware.intra_node.fallback.bw_gbps": ["10", "1e-6"],
    "hardware.nodes": ["1", "2", "4"],
    "training.global_batch": ["1", "8", "64", "128"],
    "training.microbatch_size": ["1", "2", "4", "8"],
    "training.num_microbatches": ["1", "4", "8"],
    "training.precision": ["fp32", "fp16", "bf16", "fp8"],
    "training.optimizer": ["adam", "sgd"],
    "policy.tp": ["1", "2", "4"],
    "policy.dp": ["1", "2", "4"],
    "policy.pp": ["1", "2", "4", "8"],
    "policy.recompute": ["none", "full"],
    "policy.zero_stage": ["0", "3", "4"],
    "schedule.virtual_stages": ["1", "2", "4"],
}
GROUPS = {"policy": ["even", "balanced", "manual"], "schedule": ["gpipe", "1f1b", "pipedream_async", "interleaved_1f1b"]}



@st.composite
def override_sets(draw) -> list[str]:
    model = draw(st.sampled_from(TINY + ["gpt"]))
    args = [f"+hardware={draw(st.sampled_from(HARDWARE))}", f"+model={model}",
            f"estimator={'simulator' if model in TINY and draw(st.booleans()) else 'analytic'}"]
    for group, names in GROUPS.items():
        if draw(st.booleans()):
            args.append(f"{group}={draw(st.sampled_from(names))}")
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=4, unique=True)):
        args.append(f"{key}={draw(st.sampled_from(FIELDS[key] + ABSURD))}")
    return args


def outcome(args: list[str], outdir: Path) -> str:
    """What ``python -m run`` would end in: "usage" (one line, exit 2) or "result" (checked).
    Anything else -- an exception the shell would report as an internal error -- fails the test."""
    if run.null_group(args):
        return "usage"
    try:
        with initialize_config_dir(config_dir=str(run.CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=args)
    except Exception as exc:  # noqa: BLE001 - the shell reports Hydra's own errors as one line, exit 2
        assert run.from_hydra(exc), repr(exc)
        return "usage"
    try:
        rc = run.validate_config(cfg)
        with contextlib.redirect_stdout(io.StringIO()):
            model, plan = plan_for(rc, outdir)
            result = predict(rc, plan, model, rc.hardware)
    except run.UsageError as exc:
        assert run.one_line(str(exc)) and "Traceback" not in str(exc)
        return "usage"
    for name in ("iteration_time_s", "samples_per_s", "tflops_per_device"):
        assert math.isfinite(getattr(result, name)), (name, result)
    assert result.iteration_time_s > 0 and result.samples_per_s > 0
    achievable = rc.hardware.device.flops_per_s(rc.training.precision.value) / 1e12
    assert result.tflops_per_device <= achievable * 1.001, (result.tflops_per_device, achievable)
    assert result.devices and all(d.peak_bytes >= 0 for d in result.devices)
    return "result"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(args=override_sets())
def test_random_override_sets_end_in_a_result_or_a_usage_error(args, tmp_path):
    with deadline(240):  # a hang guard, not a speed goal (benchmarks/fuzz_inputs.py reports slow runs)
        outcome(args, tmp_path)


@pytest.mark.parametrize("args", [
    ["+hardware=dgx1", "+model=gpt_tiny", "hardware.device.peak_tflops.fp16=125"],
    ["+hardware=local_cpu", "+model=gpt_tiny", "training.precision=fp32"],
    ["+hardware=dgx2", "+model=bert_tiny", "training.precision=bf16", "estimator=simulator"],
])
def test_sane_override_sets_give_results(args, tmp_path):
    assert outcome(args, tmp_path) == "result"


# ---- the examples through the real shell ------------------------------------------------

@pytest.mark.parametrize("arg, names", [
    ("policy.tp='${nonexistent.key}'", "policy.tp"),
    ("hardware.device.peak_tflops.fp16=nan", "finite number in [1e-06, 10000]"),
    ("hardware.intra_node.fallback.latency_s=inf", "latency_s"),
    ("+hardware=null", "+hardware=NAME"),
    ("+hardware=nope", "hardware/nope"),
    ("training.precision=bf16", "training.precision=fp16"),
    ("foo=[", "override"),
])
def test_the_shell_prints_one_line_and_exits_2(tmp_path, arg, names):
    args = ["+model=gpt", arg] if arg.startswith("+hardware") else ["+hardware=dgx1", "+model=gpt", arg]
    proc = subprocess.run([sys.executable, "-m", "run", *args, "estimator=analytic", f"hydra.run.dir={tmp_path}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memwall: ") and names in lines[0], proc.stderr
