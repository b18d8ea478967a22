"""memwall's command line: the one Hydra shell around the pure planners and simulator.

    python -m run +hardware=dgx1 +model=gpt                  # plan + estimate, write outputs
    python -m run -m +hardware=dgx1,dgx2 +model=gpt,bert     # sweep: one output dir per job

It composes the config once, validates it into pydantic once (runconfig.RunConfig), and hands objects
and an explicit output directory to modes.run; nothing below this file knows about Hydra.

Every input ends in a Result or one line on stderr (issue #10): bad input (a Hydra override, an
interpolation, a value out of range) prints ``memwall: <field>: <what is allowed>`` and exits 2;
a bug prints ``memwall: internal error: ...`` with where the full traceback was written
(``<outdir>/error.log``) and exits 1; Ctrl-C exits 130. HYDRA_FULL_ERROR=1 shows tracebacks.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import tempfile
import traceback
from pathlib import Path

if __name__ == "__main__":  # `python -m run` only, before the imports below: never in an importer
    # the command allocates a million small objects (Hydra's and pydantic's classes and config nodes,
    # the figures' artists) and keeps most of them: CPython's default cyclic-GC thresholds (700, 10,
    # 10) spend ~8 % of a llama3_70b run re-scanning them, and the collections at interpreter exit
    # another ~8 % (issue 27: plan + simulate + print in < 5 s). Collect 14x less often (garbage is
    # still collected: a sweep runs its jobs in one process) and, as the last exit handler (the
    # first registered), freeze what is left so exit frees it without cycle scans: every file is
    # closed by then (atomic writes; logging's handler closes its own). Nothing memwall computes
    # depends on when the collector runs.
    gc.set_threshold(10_000, 10, 10)
    atexit.register(gc.freeze)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from modes import PlanDoesNotFit, run
from runconfig import (  # noqa: F401 - CONF_DIR, options, RunConfig: re-exported for tests and tools
    CONF_DIR, RunConfig, UsageError, from_hydra, null_group, one_line, options, validate_config,
)
from reports.files import write_text
from reports.outputs import GIB
from reports.sweep import NOT_FIT_FILE, find_jobs, job_exit_status, write_sweep_summary

def _error_log(outdir: Path | None, text: str) -> Path:
    """Write ``text`` to ``<outdir>/error.log`` (atomically), else to a temp file; return the path."""
    if outdir is not None:
        try:
            return write_text(Path(outdir) / "error.log", text)
        except OSError:
            pass
    fd, name = tempfile.mkstemp(prefix="memwall-error-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(name)


class JobFailed(SystemExit):
    """The SystemExit report_errors raises: ``code`` is the exit status, ``line`` the one line
    printed for it (a sweep keeps it in the job's error.txt and summary.csv's error column)."""

    def __init__(self, code: int, line: str) -> None:
        super().__init__(code)
        self.line = line


def _fail(code: int, line: str):
    print(line, file=sys.stderr)
    raise JobFailed(code, line)


def report_errors(fn, outdir: Path | None):
    """Run ``fn()``; turn what escapes into one line on stderr and an exit status:
    UsageError -> 2, KeyboardInterrupt -> 130, anything else -> 1 with the traceback in a file."""
    try:
        return fn()
    except UsageError as exc:
        _fail(2, f"memwall: {one_line(str(exc))}")
    except KeyboardInterrupt:
        _fail(130, "memwall: interrupted")
    except Exception as exc:  # noqa: BLE001 - the one place every bug is caught and reported
        _internal_error(exc, outdir)


def _internal_error(exc: BaseException, outdir: Path | None) -> None:
    path = _error_log(outdir, "".join(traceback.format_exception(exc)))
    msg = one_line(str(exc))
    msg = msg if len(msg) <= 300 else msg[:297] + "..."
    _fail(1, f"memwall: internal error: {type(exc).__name__}: {msg} (full traceback in {path})")


class SweepSummary(Callback):
    """Registered in conf/config.yaml (hydra.callbacks). After a multirun it writes summary.csv
    and summary.png at the sweep root, one row per job. It reads each job's
    .hydra/overrides.yaml and results.json from disk, so it works whichever launcher ran the jobs
    (joblib and submitit run them in other processes, where this object's state is not shared)."""

    # the exit status of the sweep that just ended: the largest of its failed jobs' statuses (0 when
    # none failed). Class-level, because Hydra builds the callback itself; cli() exits with it.
    exit_status: int = 0

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # resolve ${now:...} once, before the sweeper does, so start and end agree on the path
        self.sweep_dir = Path(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = self.sweep_dir or Path(config.hydra.sweep.dir)
        jobs = [(name, [str(o) for o in OmegaConf.load(f)], f.parent.parent) for name, f in find_jobs(sweep_dir)]
        if jobs:
            written = write_sweep_summary(sweep_dir, jobs)
            failed = [(name, job_dir) for name, _, job_dir in jobs if not (job_dir / "results.json").exists()
                      and not (job_dir / "measured.json").exists()]
            note = (f" ({len(failed)} failed: {', '.join(n for n, _ in failed)}; see summary.csv's error column)"
                    if failed else "")
            print(f"memwall: {len(jobs)} jobs{note}; wrote {', '.join(str(p) for p in written)}")
            # a sweep with a failed job is a failed command: exit with the worst job's status
            SweepSummary.exit_status = max((max(1, job_exit_status(d)) for _, d in failed), default=0)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Returns the largest per-device peak in GiB, so a sweeper (Optuna) can minimise it."""
    hc = HydraConfig.get()
    outdir = Path(hc.runtime.output_dir)
    try:
        result = report_errors(lambda: run(validate_config(cfg), outdir), outdir)
    except SystemExit as exc:
        if hc.mode != RunMode.MULTIRUN or exc.code in (0, None, 130):
            raise
        if isinstance(exc, PlanDoesNotFit):
            # not a failed job: its files are written; summary.csv marks it "does not fit" with the
            # line (reports.sweep.sweep_row); a sweeper (Optuna) still gets the peak it minimises
            write_text(outdir / NOT_FIT_FILE, f"{exc.line}\n")
            return exc.result.max_peak_bytes / GIB
        # one bad job must not end a sweep: its line is printed (above), its error is kept in the
        # job's directory, and summary.csv marks it "failed"; the other jobs go on
        line = getattr(exc, "line", "") or f"exit status {exc.code}"
        write_text(outdir / "error.txt", f"exit status {exc.code}\n{line}\n")
        return float("nan")
    return result.max_peak_bytes / GIB if result is not None else float("nan")


def cli() -> None:
    """``python -m run``: Hydra's main, with Hydra's own errors (unknown config group option, an
    override it cannot parse) reported as one line, exit 2, instead of Hydra's multi-line text."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":  # the user asked for Hydra's full tracebacks
        main()
        return
    problem = null_group(sys.argv[1:])
    if problem:
        print(f"memwall: {problem}", file=sys.stderr)
        sys.exit(2)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra raise to us rather than print and exit 1
    # the callback class Hydra instantiates (`_target_: run.SweepSummary`): under `python -m run`
    # this file is __main__ and that is a second copy, the module `run`
    from run import SweepSummary as callback

    callback.exit_status = 0
    try:
        main()
    except KeyboardInterrupt:
        print("memwall: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001
        if not from_hydra(exc):
            _internal_error(exc, None)
        # raised while composing the config, before main's body runs: bad overrides or YAML
        print(f"memwall: invalid override or config: {one_line(str(exc))}", file=sys.stderr)
        sys.exit(2)
    if callback.exit_status:
        sys.exit(callback.exit_status)


if __name__ == "__main__":
    cli()
