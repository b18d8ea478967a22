"""memwall's command line: the one Hydra shell around the pure planners and simulator.

    python -m run +hardware=dgx1 +model=gpt                  # plan + estimate, write outputs
    python -m run -m +hardware=dgx1,dgx2 +model=gpt,bert     # sweep: one output dir per job

It composes the config once, validates it into pydantic once (modes.RunConfig), and hands objects
and an explicit output directory to modes.run; nothing below this file knows about Hydra.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationError

from modes import RunConfig, UsageError, run
from reports.outputs import GIB, find_jobs, write_sweep_summary

CONF_DIR = Path(__file__).resolve().parent / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def validate_config(cfg: DictConfig) -> RunConfig:
    """Composed Hydra config -> RunConfig, or UsageError naming the field and the allowed values."""
    for group in ("hardware", "model"):
        if group not in cfg or cfg[group] is None:
            raise UsageError(f"missing {group}: add +{group}=NAME, one of: {', '.join(options(group))}")
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise UsageError("invalid config:\n" + "\n".join(lines)) from None



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
            print(f"memwall: {len(jobs)} jobs; wrote {', '.join(str(p) for p in written)}")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Returns the largest per-device peak in GiB, so a sweeper (Optuna) can minimise it."""
    outdir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = run(validate_config(cfg), outdir)
    except UsageError as exc:
        print(f"memwall: {exc}", file=sys.stderr)
        sys.exit(2)
    return result.max_peak_bytes / GIB if result is not None else float("nan")


if __name__ == "__main__":
    main()
