"""reports.files: writers sharing a path (a parallel sweep sharing a profile cache) never tear a
file, temp names are unique per writer, temps of dead writers are cleaned, a failed write leaves
nothing behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reports.files import atomic_write, clean_stale_temps, write_text

ROOT = Path(__file__).resolve().parents[3]

WRITER = """
import json, sys
from reports.files import write_text
path, me, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    # ~300 KB: far more than one write() call or one pipe buffer, so a torn file would show
    write_text(path, json.dumps({"writer": me, "i": i, "pad": [me] * (60_000 + 1000 * me)}))
"""


def temps(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_concurrent_writers_never_show_a_torn_file(tmp_path):
    path = tmp_path / "profile.json"
    write_text(path, json.dumps({"writer": -1, "i": -1, "pad": []}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), "60"], env=env)
               for w in range(4)]
    reads, seen = 0, set()
    try:
        while any(p.poll() is None for p in writers):
            doc = json.loads(path.read_text())  # a torn file raises here
            assert len(doc["pad"]) == (60_000 + 1000 * doc["writer"] if doc["writer"] >= 0 else 0)
            seen.add(doc["writer"])
            reads += 1
    finally:
        for p in writers:
            p.wait(timeout=120)
    assert all(p.returncode == 0 for p in writers)
    assert reads > 0 and json.loads(path.read_text())["i"] == 59
    assert temps(tmp_path) == []  # every writer renamed or removed its own temp


def test_temp_names_are_unique_and_carry_the_pid(tmp_path):
    names = []
    for _ in range(2):
        atomic_write(tmp_path / "a.json", lambda tmp: (names.append(Path(tmp).name), Path(tmp).write_text("{}")))
    assert names[0] != names[1]
    assert all(n.startswith(f".a.json.{os.getpid()}.") and n.endswith(".tmp") for n in names)


def test_temps_of_dead_writers_are_cleaned_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".plan.json.{dead.pid}.x1y2.tmp"
    live = tmp_path / f".plan.json.{os.getppid()}.z3.tmp"  # a writer still running (our parent)
    other = tmp_path / "notes.tmp"  # not one of ours: never touched
    for p in (stale, live, other):
        p.write_text("partial")
    write_text(tmp_path / "results.json", "{}")  # any write in the directory cleans it
    assert not stale.exists() and live.exists() and other.exists()
    assert clean_stale_temps(tmp_path) == []


def test_failed_write_leaves_no_temp_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "measured.json"
    write_text(path, '{"old": true}')

    def boom(tmp: str) -> None:
        Path(tmp).write_text('{"half": ')
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, boom)
    assert json.loads(path.read_text()) == {"old": True}
    assert temps(tmp_path) == []


def test_parents_are_created(tmp_path):
    path = write_text(tmp_path / "a" / "b" / "c.json", "[]")
    assert json.loads(path.read_text()) == [] and time.time() - path.stat().st_mtime < 60
