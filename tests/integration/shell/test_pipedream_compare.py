"""schedule=pipedream_async with mode=compare / mode=execute (issue #22): the executor runs 1F1B
with a flush there, not PipeDream's asynchronous schedule, so the run says so in one line and
compare claims no numerics for a schedule that did not run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import run
from modes import pipedream_note
from specs.plan import ScheduleSpec

ROOT = Path(run.__file__).resolve().parent
SMALL = ["+hardware=local_cpu", "+model=gpt_tiny", "schedule=pipedream_async", "training.global_batch=8",
         "execute.iterations=1", "execute.warmup=0"]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "run", *SMALL, *args, f"hydra.run.dir={tmp_path / 'out'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_note_is_for_pipedream_async_only():
    class _Plan:  # pipedream_note reads plan.schedule only
        def __init__(self, kind):
            self.schedule = ScheduleSpec(kind=kind)

    for mode in ("compare", "execute"):
        line = pipedream_note(_Plan("pipedream_async"), mode)
        assert "1F1B with a flush" in line and "PipeDream" in line and "\n" not in line
        assert pipedream_note(_Plan("1f1b"), mode) is None
    assert "numerics are not checked" in pipedream_note(_Plan("pipedream_async"), "compare")
    assert "not comparable" in pipedream_note(_Plan("pipedream_async"), "compare")


@pytest.mark.slow
def test_compare_says_the_executor_ran_1f1b_and_claims_no_numerics(tmp_path):
    proc = _run(tmp_path, "mode=compare")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if "1F1B with a flush" in line]
    assert len(notes) == 1 and "not comparable" in notes[0] and "numerics are not checked" in notes[0], proc.stdout
    assert "PASS" not in proc.stdout and "numerics: loss" not in proc.stdout
    assert "iteration time: simulated" in proc.stdout  # the comparison itself is still printed and written
    assert (tmp_path / "out" / "compare.json").exists()


@pytest.mark.slow
def test_execute_says_the_executor_ran_1f1b(tmp_path):
    proc = _run(tmp_path, "mode=execute")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if "1F1B with a flush" in line]
    assert len(notes) == 1 and "not PipeDream's" in notes[0], proc.stdout
