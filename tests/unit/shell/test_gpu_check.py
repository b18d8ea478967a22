"""benchmarks/gpu_check.py (issue #22, "ready for the first GPU"): it skips cleanly without CUDA,
covers every one-device CUDA path, reports a failing path and goes on, keeps to its budget, and
its plumbing runs end to end on CPU (``--device cpu``), the only device here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check

SCRIPT = Path(gpu_check.__file__).resolve()
FIVE = {"memtrack", "cpu_swap", "stronghold_window", "optimizer_swap", "calibration"}


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA even on a GPU machine
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=SCRIPT.parents[1])


def test_without_cuda_prints_one_line_and_exits_0():
    proc = _script()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "no CUDA device: nothing to check"


def test_without_cuda_main_returns_0(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--quick"]) == 0
    assert capsys.readouterr().out.strip() == gpu_check.SKIP_LINE


def test_help_lists_the_paths_and_says_d2d_is_not_checked():
    proc = _script("--help")
    assert proc.returncode == 0, proc.stderr
    for name in FIVE:
        assert name in proc.stdout
    assert "two GPUs" in proc.stdout and "--quick" in proc.stdout and "--device" in proc.stdout


def test_the_path_registry_covers_the_five_cuda_paths():
    assert FIVE <= set(gpu_check.PATHS) and FIVE <= set(gpu_check.QUICK)
    assert set(gpu_check.QUICK) <= set(gpu_check.PATHS)
    assert all(callable(f) and f.__doc__ for f in gpu_check.PATHS.values())
    assert "two GPUs" in gpu_check.__doc__ and "not checked" in gpu_check.__doc__.lower()
    assert gpu_check.BUDGET_S <= 7 * 60 and gpu_check.HARD_LIMIT_S <= 8 * 60


def _fake_paths(monkeypatch, calls):
    def boom(setup):
        calls.append("boom")
        raise RuntimeError("boom on purpose")

    def fine(setup):
        calls.append("fine")
        setup.add(gpu_check.Row("fine", "peak", "bytes", 110.0, 100.0))

    monkeypatch.setattr(gpu_check, "PATHS", {"boom": boom, "fine": fine})


def test_a_failing_path_is_reported_and_the_next_one_runs(monkeypatch, capsys, tmp_path):
    calls: list[str] = []
    _fake_paths(monkeypatch, calls)
    rc = gpu_check.main(["--device", "cpu", "--only", "boom,fine", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr()
    assert rc == 1 and calls == ["boom", "fine"]
    assert "FAILED: RuntimeError: boom on purpose" in out.out and "RuntimeError" in out.err  # traceback printed
    assert "summary:" in out.out and "+10.0 %" in out.out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["statuses"]["fine"] == "ok" and saved["statuses"]["boom"].startswith("FAILED")
    assert saved["rows"][0]["predicted"] == 110.0


def test_no_path_starts_past_the_budget(monkeypatch, capsys):
    calls: list[str] = []
    _fake_paths(monkeypatch, calls)
    assert gpu_check.main(["--device", "cpu", "--only", "boom,fine", "--budget-s", "-1"]) == 0
    out = capsys.readouterr().out
    assert calls == [] and "[boom] skipped: past the -1 s budget" in out and "[fine] skipped" in out


def test_unknown_path_is_refused(capsys):
    assert gpu_check.main(["--device", "cpu", "--only", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_cpu_quick_runs_every_path_end_to_end(tmp_path):
    """The same paths on CPU (~4 s): the tracker against the simulator on local_cpu, swaps, the
    window, the optimizer swap, the CPU GEMM sweep; CUDA-only figures are '-'."""
    out = tmp_path / "cpu.json"
    proc = _script("--device", "cpu", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["statuses"] == {name: "ok" for name in gpu_check.QUICK}
    rows = [gpu_check.Row(**r) for r in saved["rows"]]
    assert {r.path for r in rows} == set(gpu_check.QUICK)
    by = {(r.path, r.what): r for r in rows}
    params = by[("memtrack", "at the peak: parameters")]
    assert params.predicted == params.measured > 0  # the tracker's parameters are the closed form's
    assert by[("stronghold_window", "peak, window")].measured < by[("stronghold_window", "peak, no window")].measured
    assert by[("cpu_swap", "gradients vs kept: max |diff|")].measured == 0.0
    assert by[("optimizer_swap", "host bytes at most")].measured > 0
    assert "summary: cpu vs hardware 'local_cpu'" in proc.stdout


@pytest.mark.slow
def test_isolated_paths_run_in_their_own_process(tmp_path):
    out = tmp_path / "iso.json"
    proc = _script("--device", "cpu", "--quick", "--isolate", "--only", "optimizer_swap", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["statuses"] == {"optimizer_swap": "ok"} and len(saved["rows"]) >= 4
    assert "(each in its own process)" in proc.stdout
