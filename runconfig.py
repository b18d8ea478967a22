"""The whole composed config of one ``python -m run``, validated once (run.py composes it with
Hydra; modes.py and model_costs.py read it). Shell level: it names every config group's type."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from costs.families import ModelConfig
from planners import PolicyConfig
from specs._base import Spec
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec


class ExperimentInfo(Spec):
    name: str
    description: str = ""


class ExecuteOptions(Spec):
    """How mode=execute / mode=compare run the plan on this machine."""

    iterations: int = Field(5, ge=1, description="timed iterations (median reported)")
    warmup: int = Field(1, ge=0)
    timeout_s: float = Field(300.0, gt=0, description="the whole run is torn down after this")
    force: bool = Field(False, description="run even when the pre-flight check (executor.preflight) refuses")


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
    execute: ExecuteOptions = Field(default_factory=ExecuteOptions)
    # symbolic: from the torch modules (issue #5); auto: symbolic when this run executes those
    # modules (execute, compare), closed forms otherwise (model_costs.costs_source)
    model_costs: Literal["auto", "closed_form", "symbolic"] = "auto"
    profile_cache: str | None = None  # symbolic-profile cache dir; None: ~/.cache/memwall/profiles
