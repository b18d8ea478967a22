"""Sweep summaries: summary.csv (one row per job of a Hydra multirun, its overrides, results and,
when it ran, measured and compare columns; a failed job's one line in ``error``) and summary.png.
run.SweepSummary calls :func:`write_sweep_summary` after every multirun."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from reports import figures_sweep
from reports.files import write_text
from reports.outputs import GIB, load_result, save_figure
from specs.result import Result


SWEEP_COLUMNS = ("job", "status", "error", "overrides")
RESULT_COLUMNS = ("model_name", "hardware_name", "plan_id", "devices", "max_peak_gib", "min_peak_gib",
                  "capacity_gib", "oom_devices", "iteration_time_s", "samples_per_s", "tflops_per_device")
MEASURED_COLUMNS = ("measured_max_peak_gib", "measured_min_peak_gib", "measured_oom_devices",
                    "measured_iteration_time_s", "measured_samples_per_s", "peak_error_pct", "time_error_pct")


def override_key(override: str) -> tuple[str, str]:
    """'+hardware=dgx1' -> ('hardware', 'dgx1'); 'policy.pp=4' -> ('policy.pp', '4')."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _result_columns(r: Result, prefix: str = "") -> dict:
    peaks = [d.peak_bytes for d in r.devices] or [0]
    cols = {"max_peak_gib": round(max(peaks) / GIB, 6), "min_peak_gib": round(min(peaks) / GIB, 6),
            "oom_devices": len(r.oom_devices), "iteration_time_s": r.iteration_time_s,
            "samples_per_s": r.samples_per_s}
    if not prefix:
        cols.update(model_name=r.model, hardware_name=r.hardware, plan_id=r.plan_id, devices=len(r.devices),
                    capacity_gib=round(max((d.capacity_bytes for d in r.devices), default=0) / GIB, 6),
                    tflops_per_device=r.tflops_per_device)
    return {prefix + k: v for k, v in cols.items()}


def _pct(a, b) -> float | str:
    return round(100.0 * (a - b) / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else ""


#: a sweep job whose plan does not fit its limits leaves its one line here (run.py)
NOT_FIT_FILE = "does_not_fit.txt"


def _error_lines(job_dir: Path) -> list[str]:
    try:
        return (Path(job_dir) / "error.txt").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []


def job_error(job_dir: Path) -> str:
    """The one line a failed sweep job printed (run.py keeps it in the job's error.txt), or a note
    that the job left no results and no error (killed before it could write one)."""
    lines = _error_lines(job_dir)
    return lines[1] if len(lines) > 1 else "no results.json and no error.txt: the job was killed or lost"


def job_exit_status(job_dir: Path) -> int:
    """A failed sweep job's exit status from its error.txt (first line "exit status N"); 1 when the
    job left none."""
    lines = _error_lines(job_dir)
    try:
        return int(lines[0].rsplit(" ", 1)[-1]) if lines else 1
    except ValueError:
        return 1


def sweep_row(job: str, overrides: list[str], job_dir: Path) -> dict:
    """One summary.csv row: the job's overrides (joined, and one column per key), its results.json
    (peak over devices, OOM count, time), and measured.json / compare.json when the job has them."""
    job_dir = Path(job_dir)
    row: dict = {"job": job, "overrides": " ".join(overrides)}
    row.update(override_key(o) for o in overrides)
    if (job_dir / "results.json").exists():
        row.update(status="ok", **_result_columns(load_result(job_dir / "results.json")))
        if (job_dir / NOT_FIT_FILE).exists():  # run.py: the plan does not fit (exit status 3 alone)
            row.update(status="does not fit", error=(job_dir / NOT_FIT_FILE).read_text().strip())
    else:
        row.update(status="failed", error=job_error(job_dir))
    if (job_dir / "measured.json").exists():
        row.update(_result_columns(load_result(job_dir / "measured.json"), "measured_"))
        row["peak_error_pct"] = _pct(row.get("max_peak_gib"), row["measured_max_peak_gib"])
        row["time_error_pct"] = _pct(row.get("iteration_time_s"), row["measured_iteration_time_s"])
    if (job_dir / "compare.json").exists():
        data = json.loads((job_dir / "compare.json").read_text())
        if isinstance(data, dict):
            row.update({f"compare_{k}": v for k, v in data.items() if isinstance(v, (int, float, str, bool))})
    return row


def _job_order(job: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in job.split("/"))


def write_sweep_summary(sweep_dir: Path, jobs: list[tuple[str, list[str], Path]]) -> list[Path]:
    """summary.csv (one row per job, in job order) and summary.png (the swept keys: those whose
    value differs between jobs) at ``sweep_dir``. ``jobs``: (job name, override strings, job dir)."""
    sweep_dir = Path(sweep_dir)
    rows = [sweep_row(*j) for j in sorted(jobs, key=lambda j: _job_order(j[0]))]
    keys = list(dict.fromkeys(k for r in rows for k, _ in map(override_key, r["overrides"].split())))
    swept = [k for k in keys if len({r.get(k) for r in rows}) > 1]
    extra = sorted({k for r in rows for k in r if k.startswith("compare_")})
    columns = list(SWEEP_COLUMNS) + keys + list(RESULT_COLUMNS)
    if any("measured_max_peak_gib" in r for r in rows):
        columns += list(MEASURED_COLUMNS)
    columns += extra
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path = sweep_dir / "summary.csv"
    write_text(path, buf.getvalue())
    paths = [path]
    if rows:
        paths.append(save_figure(sweep_dir / "summary.png", figures_sweep.summary_figure(rows, swept)))
    return paths


def find_jobs(sweep_dir: Path) -> list[tuple[str, Path]]:
    """(job name, overrides.yaml) for every job under a multirun directory (Hydra writes
    <job>/.hydra/overrides.yaml whichever launcher ran it)."""
    sweep_dir = Path(sweep_dir)
    found = []
    for f in sweep_dir.glob("**/.hydra/overrides.yaml"):
        job_dir = f.parent.parent
        if job_dir != sweep_dir:
            found.append((job_dir.relative_to(sweep_dir).as_posix(), f))
    return sorted(found, key=lambda j: _job_order(j[0]))
