"""schedule=pipedream_async with mode=compare (issue 24): the executor runs PipeDream itself
(executor.pipedream: an update after every backward, weight stashing), so compare checks its
numerics against the stale-weight reference and its memory per rank against the simulator —
also for an MPress plan under a tight budget (recompute/swaps, optimizer swap, stashed versions
in host memory)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import run

ROOT = Path(run.__file__).resolve().parent
SMALL = ["+hardware=local_cpu", "+model=gpt_tiny", "schedule=pipedream_async", "training.global_batch=16",
         "execute.iterations=2", "execute.warmup=0"]


def _compare(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[float]]:
    proc = subprocess.run([sys.executable, "-m", "run", *SMALL, "mode=compare", *args,
                           f"hydra.run.dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = [float(m[1]) for m in re.finditer(r"^\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+([-+]?[\d.]+)$", proc.stdout, re.M)]
    assert len(errors) == 4, proc.stdout
    return proc, errors


@pytest.mark.slow
def test_compare_checks_pipedream_numerics_and_memory(tmp_path):
    proc, errors = _compare(tmp_path)
    assert "1F1B with a flush" not in proc.stdout
    assert re.search(r"numerics: .* PASS", proc.stdout), proc.stdout
    # the stashed versions and tied-gradient messages are booked alike on both sides
    assert max(abs(e) for e in errors) <= 10.0, proc.stdout


@pytest.mark.slow
def test_mpress_under_a_tight_budget_compares_within_ten_percent(tmp_path):
    proc, errors = _compare(tmp_path, "policy=mpress", "hardware.device.memory_bytes=2400000")
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["stages"][0]["offload"]["stash_swap_layers"], "the budget needs stage 0's stashed versions moved"
    assert re.search(r"numerics: .* PASS", proc.stdout), proc.stdout
    assert max(abs(e) for e in errors) <= 10.0, proc.stdout
