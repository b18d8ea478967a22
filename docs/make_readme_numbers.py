"""The numbers README.md and docs/*.md quote, from one place (issue 22).

    python docs/make_readme_numbers.py                 # print every number as `key value`
    python docs/make_readme_numbers.py --write         # and rewrite the marked numbers in README.md, docs/*.md
    python docs/make_readme_numbers.py --measured compare=DIR --write   # also a measured run's (see below)

A quoted number sits between markers, ``<!-- num:KEY -->VALUE<!-- /num -->`` (HTML comments: GitHub
renders only VALUE). Two kinds of key:

* **deterministic** (every key not starting with ``measured.``): simulate-mode runs of the figures'
  own commands (``bash docs/make_figures.sh``), computed here through the library (compose, plan,
  simulate). The same on every machine; ``tests/unit/shell/test_readme_numbers.py`` checks that every
  marked number equals what :func:`deterministic` computes now.
* **measured** (``measured.<run>.*``): read from a real run's ``compare.json`` (``--measured NAME=DIR``:
  ``compare``, the ``mode=compare`` run behind docs/compare.png; ``byom`` and ``byom_pp2dp2``,
  docs/byom.md's Hugging Face GPT-2 runs). CPU times and gloo's buffers vary from run to run, so these
  are written with the date of the run (``measured.<run>.date``), the text says "measured on" that
  date, and the test checks only that they are so labelled, not their values. make_figures.sh runs
  all three and passes their directories.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARK = re.compile(r"<!-- num:(?P<key>[A-Za-z0-9_.]+) -->(?P<value>.*?)<!-- /num -->")
GIB = float(1 << 30)

# the figures' runs (docs/make_figures.sh runs the same overrides through `python -m run`)
# (no recompute pinned where the figures show running out of memory: the default, null, would pick one)
GPIPE = ("+hardware=dgx1", "+model=gpt", "schedule=gpipe", "policy.recompute=none")
MAIN = ("+hardware=dgx1", "+model=gpt")
SWEEP = [(s, mb) for s in ("gpipe", "1f1b") for mb in (1, 2, 4)]


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _simulate(*overrides: str):
    """(cfg, model, plan, result) of ``python -m run OVERRIDES`` in simulate mode, quietly."""
    from planning import plan_for
    from runconfig import compose
    from simulator import simulate

    cfg = compose(*overrides)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        model, plan = plan_for(cfg, Path(tmp))  # gpipe prints "THE PLAN DOES NOT FIT": not ours to show
        result = simulate(plan, model, cfg.hardware).result
    return cfg, model, plan, result


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def deterministic() -> dict[str, str]:
    """Every deterministic quoted number, formatted as the docs quote it."""
    out: dict[str, str] = {}
    # memory.png: GPipe on the main job
    cfg, model, plan, res = _simulate(*GPIPE)
    worst = max(res.devices, key=lambda d: d.peak_bytes)
    stage = plan.stages[worst.stages[0]]
    out["gpipe.microbatches"] = str(cfg.training.global_batch // cfg.training.microbatch_size)
    out["gpipe.layers"] = str(len(model.layers))
    out["gpipe.oom_devices"] = str(sum(d.oom for d in res.devices))
    out["gpipe.devices"] = str(len(res.devices))
    out["gpipe.worst_stage"] = str(worst.stages[0])
    out["gpipe.worst_stage_layers"] = str(stage.layer_stop - stage.layer_start)
    out["gpipe.peak_gib"] = _gib(worst.peak_bytes)
    out["gpipe.over_gib"] = _gib(worst.oom_over_bytes)
    out["gpipe.capacity_gib"] = _gib(worst.capacity_bytes)
    # timeline.png: the main job
    cfg, model, plan, res = _simulate(*MAIN)
    out["main.iteration_s"] = f"{res.iteration_time_s:.3f}"
    out["main.samples_per_s"] = f"{res.samples_per_s:.2f}"
    out["main.tflops_per_device"] = f"{res.tflops_per_device:.2f}"
    top = max(res.devices, key=lambda d: d.peak_bytes)
    out["main.max_peak_gib"] = _gib(top.peak_bytes)
    out["main.max_peak_stage"] = str(top.stages[0])
    out["main.stages"] = str(len(plan.stages))
    # summary.png: the 2 x 3 sweep
    for schedule, mb in SWEEP:
        _, _, _, res = _simulate(*MAIN, f"schedule={schedule}", f"training.microbatch_size={mb}",
                                 "policy.recompute=none")
        key = f"sweep.{schedule}.mb{mb}"
        out[f"{key}.samples_per_s"] = f"{res.samples_per_s:.1f}"
        out[f"{key}.max_peak_gib"] = _gib(max(d.peak_bytes for d in res.devices))
        out[f"{key}.oom_devices"] = str(sum(d.oom for d in res.devices))
    return out


def _run_date(run_dir: Path) -> str:
    stamp = (run_dir / "compare.json").stat().st_mtime
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d")


def measured(name: str, run_dir: Path) -> dict[str, str]:
    """A mode=compare run's numbers (``measured.<name>.*``), dated by its compare.json."""
    cmp = json.loads((run_dir / "compare.json").read_text())
    errors = [r["error_pct"] for r in cmp["ranks"] if r.get("error_pct") is not None]
    key = f"measured.{name}"
    return {
        f"{key}.date": _run_date(run_dir),
        f"{key}.ranks": str(len(cmp["ranks"])),
        f"{key}.memory_abs_error_pct_mean": f"{cmp['memory_abs_error_pct_mean']:.1f}",
        f"{key}.memory_abs_error_pct_max": f"{cmp['memory_abs_error_pct_max']:.1f}",
        f"{key}.memory_error_pct_worst": f"{max(errors, key=abs):+.1f}".replace("-", "−"),
        f"{key}.time_error_pct": f"{cmp['time_error_pct']:+.1f}".replace("-", "−"),
        f"{key}.simulated_iteration_ms": f"{cmp['simulated_iteration_time_s'] * 1e3:.1f}",
        f"{key}.measured_iteration_ms": f"{cmp['measured_iteration_time_s'] * 1e3:.1f}",
    }


def marked(path: Path) -> list[tuple[str, str]]:
    """(key, value) of every marker in a document."""
    return [(m["key"], m["value"]) for m in MARK.finditer(path.read_text())]


def rewrite(path: Path, numbers: dict[str, str]) -> list[str]:
    """Put ``numbers`` between the markers of ``path``; returns the keys changed. Keys not in
    ``numbers`` (measured ones when no run was given) are left as they are."""
    text = path.read_text()
    changed: list[str] = []

    def sub(m: re.Match) -> str:
        key = m["key"]
        if key not in numbers or numbers[key] == m["value"]:
            return m.group(0)
        changed.append(key)
        return f"<!-- num:{key} -->{numbers[key]}<!-- /num -->"

    new = MARK.sub(sub, text)
    if new != text:
        path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the marked numbers in README.md and docs/*.md")
    ap.add_argument("--measured", action="append", default=[], metavar="NAME=DIR",
                    help="a mode=compare run's output dir, quoted as measured.NAME.* (repeatable)")
    args = ap.parse_args(argv)
    numbers = deterministic()
    for item in args.measured:
        name, sep, run_dir = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_]+", name):
            ap.error(f"--measured wants NAME=DIR, got {item!r}")
        numbers.update(measured(name, Path(run_dir)))
    for key, value in numbers.items():
        print(key, value)
    unknown = sorted({k for p in documents() for k, _ in marked(p)
                      if k not in numbers and not k.startswith("measured.")})
    if unknown:
        print(f"marked in the docs but computed nowhere: {', '.join(unknown)}", file=sys.stderr)
        return 1
    if args.write:
        for path in documents():
            if changed := rewrite(path, numbers):
                print(f"rewrote {path.relative_to(ROOT)}: {', '.join(changed)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
