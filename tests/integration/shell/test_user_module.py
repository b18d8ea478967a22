"""A user's own torch module (family torch_module): profiled, planned, simulated and executed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from costs.families import build_model, parse_model_config

DOCS = Path(__file__).resolve().parents[3] / "docs"
MODEL = '+model={family: torch_module, name: user_mlp, factory: "user_model_example:build", kwargs: {width: 64, depth: 4}}'


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{DOCS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", MODEL, *args,
                           f"profile_cache={tmp_path / 'cache'}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_factory_must_be_an_import_path():
    with pytest.raises(ValidationError, match="factory"):
        parse_model_config({"family": "torch_module", "name": "m", "factory": "no colon here"})
    cfg = parse_model_config({"family": "torch_module", "name": "m", "factory": "pkg.mod:build"})
    with pytest.raises(ValueError, match="symbolic profiler"):
        build_model(cfg)


@pytest.mark.slow
def test_user_module_profiles_and_simulates(tmp_path):
    out = tmp_path / "sim"
    proc = run_cli(tmp_path, "mode=profile", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    prof = json.loads((out / "profile.json").read_text())
    names = [l["name"] for l in prof["layers"]]
    assert names == ["inp", "hidden_00", "hidden_01", "hidden_02", "hidden_03", "loss"]
    width, features, classes = 64, 32, 10
    assert prof["layers"][1]["params"] == 2 * (width * 4 * width) + 4 * width + width  # fc1 + fc2 weights, biases
    assert prof["total_params"] == (features * width + width) + 4 * (8 * width * width + 5 * width) + (width * classes + classes)
    proc = run_cli(tmp_path, f"hydra.run.dir={tmp_path / 'plan'}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "plan" / "results.json").read_text())["model"] == "user_mlp"


@pytest.mark.slow
def test_user_module_executes_and_compares(tmp_path):
    out = tmp_path / "cmp"
    proc = run_cli(tmp_path, "mode=compare", "execute.iterations=1", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    cmp = json.loads((out / "compare.json").read_text())
    assert len(cmp["ranks"]) == 4 and all(r["measured_peak_bytes"] > 0 for r in cmp["ranks"])
    assert cmp["failure"] is None


def test_unimportable_factory_is_reported(tmp_path):
    bad = '+model={family: torch_module, name: x, factory: "no_such_module_xyz:build"}'
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", bad, f"profile_cache={tmp_path}",
                           f"hydra.run.dir={tmp_path / 'o'}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "model.factory" in proc.stderr and "PYTHONPATH" in proc.stderr
    assert "Traceback" not in proc.stderr
