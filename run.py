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

import os
import re
import sys
import tempfile
import traceback
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from modes import UsageError, run
from runconfig import RunConfig
from reports.files import write_text
from reports.outputs import GIB, find_jobs, write_sweep_summary

CONF_DIR = Path(__file__).resolve().parent / "conf"
#: modes that predict for the precision the config names (execute/compare switch to fp32 first;
#: calibrate measures, it predicts nothing)
_PREDICTING_MODES = ("simulate", "profile")
#: at most this many field errors are named in the one line
_MAX_ERRORS = 4


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def one_line(text: str) -> str:
    """A multi-line message as one line: ``a:\\n  b`` -> ``a: b``, an indented list -> ``x, y``,
    other breaks -> ``; ``. Hydra's "Config search path" trailer is dropped."""
    text = text.split("\nConfig search path")[0]
    out = ""
    prev_indented = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        indented = raw[:1] in (" ", "\t")
        if not out:
            out = line
        elif out.endswith(":"):
            out += " " + line
        elif indented and prev_indented:
            out += ", " + line
        else:
            out += "; " + line
        prev_indented = indented
    return out


def _field_errors(exc: ValidationError) -> str:
    """Pydantic errors as ``path: message`` joined on one line (at most _MAX_ERRORS of them)."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        # a model validator names its field in the message ("peak_tflops: ...", "training.x: ...")
        m = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", msg)
        if m and loc:
            head, rest = m.groups()
            last = loc.rsplit(".", 1)[-1]
            head = head[len(last) + 1:] if head.startswith(last + ".") else head
            loc, msg = f"{loc}.{head}", rest
        parts.append(f"{loc}: {one_line(msg)}" if loc else one_line(msg))
    more = len(parts) - _MAX_ERRORS
    return "; ".join(parts[:_MAX_ERRORS]) + (f" (and {more} more)" if more > 0 else "")


def validate_config(cfg: DictConfig) -> RunConfig:
    """Composed Hydra config -> RunConfig, or UsageError naming the field and the allowed values."""
    try:
        for group in ("hardware", "model"):
            if group not in cfg or cfg[group] is None:
                raise UsageError(f"missing {group}: add +{group}=NAME, one of: {', '.join(options(group))}")
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # ${nonexistent.key}, a bad resolver, ...
        key = getattr(exc, "full_key", None)
        msg = one_line(str(exc)).split("; full_key:")[0]
        raise UsageError(f"{key + ': ' if key else ''}cannot resolve the config: {msg}") from None
    if not isinstance(data, dict):
        raise UsageError(f"the config must be a mapping, got {type(data).__name__}")
    data.pop("hydra", None)
    try:
        rc = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise UsageError("invalid config: " + _field_errors(exc)) from None
    if rc.mode in _PREDICTING_MODES and rc.training.precision.value != "fp32":
        missing = rc.hardware.device.missing_dtype(rc.training.precision.value)
        if missing is not None:
            raise UsageError(missing)
    return rc


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


def report_errors(fn, outdir: Path | None):
    """Run ``fn()``; turn what escapes into one line on stderr and an exit status:
    UsageError -> 2, KeyboardInterrupt -> 130, anything else -> 1 with the traceback in a file."""
    try:
        return fn()
    except UsageError as exc:
        print(f"memwall: {one_line(str(exc))}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("memwall: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the one place every bug is caught and reported
        _internal_error(exc, outdir)


def _internal_error(exc: BaseException, outdir: Path | None) -> None:
    path = _error_log(outdir, "".join(traceback.format_exception(exc)))
    msg = one_line(str(exc))
    msg = msg if len(msg) <= 300 else msg[:297] + "..."
    print(f"memwall: internal error: {type(exc).__name__}: {msg} (full traceback in {path})", file=sys.stderr)
    sys.exit(1)


def _from_hydra(exc: BaseException) -> bool:
    """True if ``exc`` was raised by Hydra, OmegaConf or the YAML parser (composing the config from
    the overrides and YAML files), i.e. it is about the input, not about memwall's code."""
    if isinstance(exc, (HydraException, OmegaConfBaseException, yaml.YAMLError)):  # YAML: a config file's syntax
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and re.search(r"[/\\](hydra|omegaconf)[/\\]", frames[-1].filename) is not None


class SweepSummary(Callback):
    """Registered in conf/config.yaml (hydra.callbacks). After a multirun it writes summary.csv
    and summary.png at the sweep root, one row per job. It reads each job's
    .hydra/overrides.yaml and results.json from disk, so it works whichever launcher ran the jobs
    (joblib and submitit run them in other processes, where this object's state is not shared)."""

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
            failed = [name for name, _, job_dir in jobs if not (job_dir / "results.json").exists()
                      and not (job_dir / "measured.json").exists()]
            note = f" ({len(failed)} failed: {', '.join(failed)}; see each job's error above)" if failed else ""
            print(f"memwall: {len(jobs)} jobs{note}; wrote {', '.join(str(p) for p in written)}")


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
        # one bad job must not end a sweep: its line is printed (above), its error is kept in the
        # job's directory, and summary.csv marks it "failed"; the other jobs go on
        write_text(outdir / "error.txt", f"exit status {exc.code}\n")
        return float("nan")
    return result.max_peak_bytes / GIB if result is not None else float("nan")


def _null_group(argv: list[str]) -> str | None:
    """``+hardware=null`` (or ``model=``) would fail inside Hydra with a ValueError that names
    neither the group nor the options; say what to write instead."""
    for arg in argv:
        m = re.match(r"^[+~]*(hardware|model)=(null|None|~)?$", arg)
        if m:
            group = m.group(1)
            return f"{group}: {arg!r} names no {group}; use +{group}=NAME, one of: {', '.join(options(group))}"
    return None


def cli() -> None:
    """``python -m run``: Hydra's main, with Hydra's own errors (unknown config group option, an
    override it cannot parse) reported as one line, exit 2, instead of Hydra's multi-line text."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":  # the user asked for Hydra's full tracebacks
        main()
        return
    problem = _null_group(sys.argv[1:])
    if problem:
        print(f"memwall: {problem}", file=sys.stderr)
        sys.exit(2)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra raise to us rather than print and exit 1
    try:
        main()
    except KeyboardInterrupt:
        print("memwall: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001
        if not _from_hydra(exc):
            _internal_error(exc, None)
        # raised while composing the config, before main's body runs: bad overrides or YAML
        print(f"memwall: invalid override or config: {one_line(str(exc))}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
