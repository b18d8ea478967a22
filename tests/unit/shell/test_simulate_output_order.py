"""mode=simulate prints its numbers and writes its JSON files before it draws the figures: the
figures are most of a large run's wall time, and a failure while drawing must not lose the rest."""
from __future__ import annotations

import json

import pytest

import modes
from runconfig import compose

ARGS = ("+hardware=local_cpu", "+model=gpt_tiny", "estimator=analytic")


def test_the_table_is_printed_before_the_figures_are_drawn(tmp_path, monkeypatch, capsys):
    seen = {}

    def drawing(outdir, result, trace=None):
        seen["printed"] = capsys.readouterr().out  # what the user had on screen when drawing began
        seen["files"] = sorted(p.name for p in tmp_path.iterdir())
        return []

    monkeypatch.setattr(modes, "write_figures", drawing)
    result = modes.run(compose(*ARGS), tmp_path)
    assert "iteration" in seen["printed"] and "peak MiB" in seen["printed"]
    assert {"plan.json", "results.json"} <= set(seen["files"])
    assert json.loads((tmp_path / "results.json").read_text())["iteration_time_s"] == result.iteration_time_s


def test_a_failure_while_drawing_keeps_the_numbers_and_the_files(tmp_path, monkeypatch, capsys):
    def broken(outdir, result, trace=None):
        raise RuntimeError("no display")

    monkeypatch.setattr(modes, "write_figures", broken)
    with pytest.raises(RuntimeError, match="no display"):
        modes.run(compose(*ARGS), tmp_path)
    assert "iteration" in capsys.readouterr().out
    assert (tmp_path / "plan.json").exists() and (tmp_path / "results.json").exists()


def test_the_figures_are_named_on_their_own_line(tmp_path, capsys):
    modes.run(compose(*ARGS), tmp_path)
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last == f"wrote {tmp_path / 'memory.png'}"
    assert (tmp_path / "memory.png").stat().st_size > 0
