"""Issue 22 through the command line: ``python -m run experiment=mpress_*`` runs the emulator loop to
convergence by default, prints why it stopped, writes it to mpress.json with the simulations and
rounds, and gives byte-identical files for the same inputs; a tiny ``policy.max_simulations`` is
reported as the reason it stopped.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[3]


def run_cli(out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "run", "experiment=mpress_gpt_10b3_dgx1", *args,
                           f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_the_preset_converges_says_why_and_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run_cli(a)
    run_cli(b)
    rep = json.loads((a / "mpress.json").read_text())
    assert re.fullmatch(r"converged: round \d+ improved \d+\.\d\d % < 0\.5 %", rep["stop_reason"]), rep["stop_reason"]
    assert rep["rounds"] and rep["simulations"] == rep["rounds"][-1]["simulations"]
    assert f"stopped: {rep['stop_reason']}" in proc.stdout
    assert f"after {rep['simulations']} simulations, {len(rep['rounds'])} round" in proc.stdout
    for name in ("mpress.json", "plan.json", "results.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_tiny_cap_is_printed_as_the_reason(tmp_path):
    proc = run_cli(tmp_path / "c", "policy.max_simulations=3")
    rep = json.loads((tmp_path / "c" / "mpress.json").read_text())
    assert rep["simulations"] == 3
    assert rep["stop_reason"].startswith("safety cap of 3 simulations reached")
    assert "stopped: safety cap of 3 simulations reached" in proc.stdout
