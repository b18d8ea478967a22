"""docs/examples/torchtitan_llama.py, torchtitan's eager Llama 3 as a user's model: its RMSNorm
moves what eager PyTorch moves (an fp32 round trip, counted operator by operator, executor.traffic),
and the example plans, runs and matches memwall's reference on a 2-stage pipeline (mode=compare)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from executor.traffic import Traffic

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "docs" / "examples"


def _example():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import torchtitan_llama

    return torchtitan_llama


def test_rmsnorm_moves_the_fp32_round_trip():
    """bf16 x of N elements in R rows: x.float() (2N read, 4N written), pow (4N, 4N), mean (4N, 4R),
    + eps (4R, 4R), rsqrt (4R, 4R), the multiply (4N + 4R, 4N), the cast back (4N, 2N) and the weight
    (2N, 2N; the weight itself is a parameter, not counted): 36 bytes an element and 24 a row,
    where a fused kernel moves 4 (one bf16 read, one write)."""
    norm = _example().RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    traffic = Traffic({StorageWeakRef(p.untyped_storage()) for p in norm.parameters()}, set())
    with traffic:
        norm(x)
    n, rows = x.numel(), x.numel() // 64
    assert traffic.bytes == 36 * n + 24 * rows


@pytest.mark.slow
def test_the_example_runs_and_matches_the_reference(tmp_path):
    """The command its docstring gives: profile, plan, simulate, execute on 4 ranks, compare."""
    _example()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "cmp"
    proc = subprocess.run([sys.executable, "-m", "run", "+hardware=local_cpu", f"hydra.searchpath=[file://{EXAMPLES}]",
                           "+model=torchtitan_llama", "mode=compare", "execute.iterations=1",
                           f"profile_cache={tmp_path / 'cache'}", f"hydra.run.dir={out}"],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["failure"] is None and len(cmp["ranks"]) == 4
    assert "numerics" in proc.stdout and "PASS" in proc.stdout.split("numerics")[-1].splitlines()[0]
