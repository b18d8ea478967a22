"""benchmarks/fuzz_inputs.py saves every failing case so it can be replayed (issue #22: it had
reported ``hangs=1`` without the case that hung). No fuzz run here: fake failing cases go through
``save_case`` and ``--replay``, and ``main`` with a stubbed case runner."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import fuzz_inputs as fz


def _replay(path, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as done:
        fz.main(["--replay", str(path)])
    return done.value.code, capsys.readouterr().out


def test_a_saved_cli_case_replays_as_it_ran(tmp_path, capsys):
    args = ["+hardware=dgx1", "+model=gpt_tiny", "estimator=analytic"]
    path = fz.save_case(tmp_path, {"kind": "cli", "index": 3, "status": "hang", "detail": "over 120 s", "seed": 11,
                                   "args": args, "subprocess": False, "slow_s": 60.0, "kill_s": 120.0,
                                   "traceback": "Traceback ...\nDeadline: over 120 s\n"})
    assert path.name == "cli_0003_hang.json"
    saved = json.loads(path.read_text())
    assert saved["args"] == args and saved["seed"] == 11 and "Deadline" in saved["traceback"]
    code, out = _replay(path, capsys)
    assert code == 0, out  # the run ends in a Result now
    assert "replaying" in out and "which was hang" in out and "[cli ok]" in out and "no longer failing" in out


def test_a_saved_plan_case_keeps_its_exact_text_and_replays(tmp_path, capsys):
    plan, _, _ = fz.base_plans([fz.BASE_SETS[0]])[0]
    bad = json.loads(json.dumps(plan))
    bad["training"]["global_batch"] = float("nan")  # a mutation the fuzzer makes: NaN must survive the file
    text = json.dumps(bad)
    path = fz.save_case(tmp_path, {"kind": "plan", "index": 12, "status": "traceback", "detail": "ValueError: x",
                                   "seed": 5, "base": 0, "base_sets": fz.BASE_SETS, "simulate": False,
                                   "kill_s": 120.0, "plan": bad, "plan_text": text, "traceback": "Traceback ..."})
    saved = json.loads(path.read_text())
    assert saved["plan_text"] == text and math.isnan(saved["plan"]["training"]["global_batch"])
    code, out = _replay(path, capsys)
    assert code == 0, out  # refused with a message now: not a failure
    assert "[plan rejected]" in out and "no longer failing" in out

    ok = fz.save_case(tmp_path, {"kind": "plan", "index": 13, "status": "hang", "detail": "over 30 s", "base": 0,
                                 "plan": plan, "plan_text": None})
    code, out = _replay(ok, capsys)
    assert code == 0 and "[plan ok]" in out


def test_a_case_that_still_fails_replays_with_its_traceback(tmp_path, capsys, monkeypatch):
    def still_hangs(p, text, model, hardware, kill_s, simulate, info=None):
        info["traceback"] = "Traceback (most recent call last):\n  File \"simulator/engine.py\"\nDeadline: over 30 s"
        return "hang", f"over {kill_s} s"

    monkeypatch.setattr(fz, "check_plan", still_hangs)
    path = fz.save_case(tmp_path, {"kind": "plan", "index": 0, "status": "hang", "detail": "over 30 s", "base": 0,
                                   "plan": {}, "plan_text": "{}", "kill_s": 120.0})
    code, out = _replay(path, capsys)
    assert code == 1
    assert "[plan hang] over 30.0 s" in out and "simulator/engine.py" in out and "still failing" in out


def test_main_prints_and_saves_every_failing_case(tmp_path, capsys, monkeypatch):
    outcomes = iter([("hang", "over 30 s"), ("ok", ""), ("nonsense", "analytic: iteration_time_s=nan")])

    def fake_case(rng, base, kill_s, simulate, info=None):
        info.update(plan={"planner": "fake"}, plan_text='{"planner": "fake"}', traceback="where it hung")
        return next(outcomes)

    monkeypatch.setattr(fz, "plan_case", fake_case)
    monkeypatch.setattr(fz, "base_plans", lambda sets=None: [("plan", "model", "hardware")])
    counts = fz.main(["--cli", "0", "--plans", "3", "--seed", "4", "--out", str(tmp_path / "cases")])
    out = capsys.readouterr().out.strip().splitlines()
    assert counts["plan_hang"] == 1 and counts["plan_nonsense"] == 1
    files = sorted((tmp_path / "cases").iterdir())
    assert [f.name for f in files] == ["plan_0000_hang.json", "plan_0002_nonsense.json"]
    hang = json.loads(files[0].read_text())
    assert hang["seed"] == 4 and hang["plan_text"] == '{"planner": "fake"}' and hang["traceback"] == "where it hung"
    assert "[plan hang] over 30 s" in out and any(line.startswith("  saved ") and "--replay" in line for line in out)
    assert "2 failing case(s) saved in" in "\n".join(out)
    assert out[-1] == "tracebacks=0 slow=0 hangs=1 nonsense=1 wrong_accepted=0 multiline_errors=0"  # still the last line
