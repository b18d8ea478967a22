"""Every number README.md and docs/*.md quote between ``<!-- num:KEY -->…<!-- /num -->`` markers is
the one docs/make_readme_numbers.py computes today (issue 22); measured ones are dated."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("make_readme_numbers", ROOT / "docs" / "make_readme_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


numbers_script = _script()


@pytest.fixture(scope="module")
def computed() -> dict[str, str]:
    return numbers_script.deterministic()  # the figures' simulate runs through the library, a few seconds


def _marks() -> list[tuple[Path, str, str]]:
    return [(p, k, v) for p in numbers_script.documents() for k, v in numbers_script.marked(p)]


def test_readme_quotes_the_figures_numbers():
    keys = {k for p, k, _ in _marks() if p.name == "README.md"}
    for key in ("gpipe.peak_gib", "gpipe.worst_stage", "main.iteration_s", "main.samples_per_s",
                "sweep.1f1b.mb1.samples_per_s", "sweep.gpipe.mb4.max_peak_gib", "measured.compare.date"):
        assert key in keys, f"README.md no longer marks {key}"


def test_every_simulated_number_is_todays(computed):
    stale = [f"{p.relative_to(ROOT)}: {k} quotes {v!r}, the script computes {computed.get(k)!r}"
             for p, k, v in _marks() if not k.startswith("measured.") and computed.get(k) != v]
    assert not stale, "run `python docs/make_readme_numbers.py --write`:\n" + "\n".join(stale)


def test_every_measured_number_is_dated():
    for path in numbers_script.documents():
        text = path.read_text()
        for paragraph in re.split(r"\n\s*\n", text):
            for m in numbers_script.MARK.finditer(paragraph):
                if not m["key"].startswith("measured."):
                    continue
                run = m["key"].split(".")[1]
                date = re.search(rf"measured on <!-- num:measured\.{run}\.date -->(\d{{4}}-\d\d-\d\d)<!-- /num -->",
                                 paragraph, re.IGNORECASE)
                assert date, f"{path.name}: {m['key']} sits in no paragraph saying 'measured on <its date>'"
                assert re.fullmatch(r"[+−]?\d+(\.\d+)?|\d{4}-\d\d-\d\d", m["value"]), (path.name, m["key"], m["value"])


def test_write_rewrites_only_the_marked_value(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("a <!-- num:main.iteration_s -->4.72<!-- /num --> s, "
                   "b <!-- num:measured.compare.date -->2026-01-01<!-- /num -->, 4.72 unmarked\n")
    assert numbers_script.rewrite(doc, {"main.iteration_s": "2.787"}) == ["main.iteration_s"]
    assert doc.read_text() == ("a <!-- num:main.iteration_s -->2.787<!-- /num --> s, "
                               "b <!-- num:measured.compare.date -->2026-01-01<!-- /num -->, 4.72 unmarked\n")
    assert numbers_script.rewrite(doc, {"main.iteration_s": "2.787"}) == []
