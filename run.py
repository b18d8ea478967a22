"""memwall's command line: the one Hydra shell around the pure planners and simulator.

    python -m run +hardware=dgx1 +model=gpt                  # plan + estimate, write outputs
    python -m run -m +hardware=dgx1,dgx2 +model=gpt,bert     # sweep: one output dir per job

It composes the config once, validates it into pydantic once, and hands objects and an explicit
output directory onward; nothing below this file knows about Hydra.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from pydantic import Field, ValidationError

from planners import PlanningError, PolicyConfig, make_plan
from planners.analytic import estimate
from specs._base import Spec
from specs.families import ModelConfig, build_model
from specs.hardware import HardwareSpec
from specs.model import ModelSpec
from specs.outputs import summary, write_run
from specs.plan import Plan, PlanError, ScheduleSpec
from specs.result import Result
from specs.training import TrainingSpec

CONF_DIR = Path(__file__).resolve().parent / "conf"
NOT_YET = {"execute": "issue #4 (executor)", "compare": "issue #4 (executor and compare)",
           "profile": "issue #5 (profiling)", "calibrate": "issue #5 (calibration)"}


class ExperimentInfo(Spec):
    name: str
    description: str = ""


class RunConfig(Spec):
    """The whole composed config, validated once."""

    mode: Literal["simulate", "execute", "compare", "profile", "calibrate"] = "simulate"
    estimator: Literal["analytic", "simulator"] = "simulator"
    training: TrainingSpec
    model: ModelConfig
    hardware: HardwareSpec
    policy: PolicyConfig
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    experiment: ExperimentInfo | None = None


class UsageError(Exception):
    """Bad input: printed as one clear message, exit status 2."""


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


def plan_for(cfg: RunConfig) -> tuple[ModelSpec, Plan]:
    """Model spec and validated plan for the composed config (any planner error -> UsageError)."""
    model = build_model(cfg.model, cfg.training.act_dtype_bytes)
    try:
        return model, make_plan(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule)
    except (PlanningError, PlanError) as exc:
        raise UsageError(f"policy {cfg.policy.kind!r} cannot plan {model.name} on {cfg.hardware.name}: {exc}") from None


def run_simulate(cfg: RunConfig, outdir: Path) -> Result:
    """Plan, simulate (or estimate), write plan.json + results.json (+ trace.json) into outdir."""
    model, plan = plan_for(cfg)
    trace = None
    if cfg.estimator == "simulator":
        from simulator import simulate  # imported lazily: the analytic path needs no simpy

        sim = simulate(plan, model, cfg.hardware)
        result, trace = sim.result, sim.trace
    else:
        result = estimate(plan, model, cfg.hardware)
    written = write_run(outdir, plan, result, trace)
    print(summary(plan, result, written))
    return result


def not_yet(cfg: RunConfig, outdir: Path) -> Result:
    raise UsageError(f"mode={cfg.mode} is not available yet ({NOT_YET[cfg.mode]}); available: "
                     + ", ".join(m for m in MODE_RUNNERS if MODE_RUNNERS[m] is not not_yet))


#: one function per mode; each takes the validated config and the output directory
MODE_RUNNERS = {
    "simulate": run_simulate,
    "execute": not_yet,
    "compare": not_yet,
    "profile": not_yet,
    "calibrate": not_yet,
}


def run(cfg: RunConfig, outdir: Path) -> Result:
    return MODE_RUNNERS[cfg.mode](cfg, outdir)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    outdir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run(validate_config(cfg), outdir)
    except UsageError as exc:
        print(f"memwall: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
