"""MAP's cluster detector, the measurement (MAP §4.2): 4 gloo ranks time every pair, one at a time."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calibration.cluster import measure_pairs
from planners.map.cluster import cluster_report, detect_mesh

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow


def _finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_four_gloo_ranks_measure_every_pair_with_positive_alpha_and_beta():
    table = measure_pairs(4, quick=True, backend="gloo")
    assert [(p["a"], p["b"]) for p in table["pairs"]] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    for p in table["pairs"]:
        assert len(p["one_way_s"]) == len(table["message_bytes"]) and all(map(_finite_positive, p["one_way_s"]))
        assert _finite_positive(p["alpha_s"]) and _finite_positive(p["beta_bytes_per_s"]), p
        # loopback TCP between processes: between 10 MB/s and 1 TB/s whatever the load
        assert 1e7 < p["beta_bytes_per_s"] < 1e12
    beta, alpha = table["beta_bytes_per_s"], table["alpha_s"]
    assert all(beta[i][j] == beta[j][i] for i in range(4) for j in range(4))
    found = detect_mesh(beta, alpha)  # whatever the noise, a mesh over all four ranks comes out
    assert found.mesh.num_devices == 4 and sorted(found.devices) == [0, 1, 2, 3]
    json.dumps(cluster_report(beta, alpha, table["devices"]), allow_nan=False)  # strict JSON


def test_cli_writes_cluster_json_with_the_yaml_check(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "calibration.cluster", "--world", "2", "--hardware",
                           str(ROOT / "conf" / "hardware" / "map_8xa100.yaml"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "cluster.json").read_text())
    assert out["mesh"]["shape"] == [2] and out["hardware_mesh"]["shape"] == [2]
    # two CPU processes are no NVLink bridge: the YAML's 300 GB/s for 0-1 is reported, not fatal
    assert len(out["link_disagreements"]) == 1 and "devices 0-1" in out["link_disagreements"][0]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_nccl_pairs_on_gpus():
    n = min(torch.cuda.device_count(), 8)
    table = measure_pairs(n, quick=True)
    assert table["backend"] == "nccl"
    assert all(_finite_positive(p["alpha_s"]) and _finite_positive(p["beta_bytes_per_s"]) for p in table["pairs"])
