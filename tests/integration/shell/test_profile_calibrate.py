"""mode=profile (symbolic, CAPTURE with resume) and mode=calibrate through `python -m run`."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specs.hardware import HardwareSpec
from specs.profile import Profile


def run_cli(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_capture_profile_of_gpt_tiny_resumes_from_its_log(tmp_path):
    out = tmp_path / "out"
    args = ("mode=profile", "policy=capture", "policy.backend=simulator", "policy.scenarios=[pp,tp2]",
            "+hardware=local_cpu", "+model=gpt_tiny", f"hydra.run.dir={out}", f"profile_cache={tmp_path / 'pc'}")
    first = run_cli(tmp_path, *args)
    assert first.returncode == 0, first.stderr
    prof = Profile.model_validate_json((out / "profile.json").read_text())
    cap = prof.capture
    assert cap is not None and cap.paper_runs == 10 * (6 - 1)
    # default training: 32 microbatches of 2 -> microbatches 1 and 2 at the target's count (64, 32 samples)
    assert {(s.scenario, s.batch_size) for s in cap.scenarios} == {(s, b) for s in ("pp", "tp2") for b in (64, 32)}
    assert all(len(s.layers) == 6 and all(x.M_i_bytes > 0 for x in s.layers) for s in cap.scenarios)
    assert re.search(r"\[capture \d+/\d+\]", first.stdout)  # progress is visible in logs
    log = (out / "capture_runs.jsonl").read_text().splitlines()
    assert len(log) == cap.runs
    # drop the last 3 records as if killed there: the rerun does exactly those 3 runs
    (out / "capture_runs.jsonl").write_text("\n".join(log[:-3]) + "\n")
    again = run_cli(tmp_path, *args)
    assert again.returncode == 0, again.stderr
    assert f"resuming: {cap.runs - 3} runs" in again.stdout and "(3 this time)" in again.stdout
    assert Profile.model_validate_json((out / "profile.json").read_text()).capture.scenarios == cap.scenarios


@pytest.mark.slow
def test_calibrate_writes_a_hardware_config_the_next_run_uses(tmp_path):
    out = tmp_path / "cal"
    proc = run_cli(tmp_path, "mode=calibrate", "+hardware=local_cpu", "+model=gpt_tiny", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    path = out / "hardware" / "local_cpu_calibrated.yaml"
    text = path.read_text()
    hw = HardwareSpec.model_validate(yaml.safe_load(text))
    assert hw.name == "local_cpu_calibrated" and hw.device.peak_tflops["fp32"] > 0
    assert "residuals" in text and "busbw" in text and "[calibrate 1/3]" in proc.stdout
    nxt = run_cli(tmp_path, "+hardware=local_cpu_calibrated", f"hydra.searchpath=[file://{out}]", "+model=gpt_tiny",
                  f"hydra.run.dir={tmp_path / 'next'}")
    assert nxt.returncode == 0, nxt.stderr
    assert json.loads((tmp_path / "next" / "plan.json").read_text())["hardware"] == "local_cpu_calibrated"
