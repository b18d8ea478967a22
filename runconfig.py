"""The whole composed config of one ``python -m run``, validated once: :class:`RunConfig`, the
validation that turns a composed Hydra config into it (bad input -> :class:`UsageError` naming the
field and the allowed values), and :func:`compose` for library callers (benchmarks, notebooks) that
want the config ``python -m run OVERRIDES`` would run, without the shell. Shell level: it names
every config group's type; run.py (Hydra's main) and modes.py use it.
"""
from __future__ import annotations

import re
import traceback
from pathlib import Path
from typing import Literal

import yaml
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import Field, ValidationError

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
    # a plan.json to simulate / execute / compare instead of planning (planning.plan_from_file)
    plan_file: str | None = Field(None, min_length=1)


class UsageError(Exception):
    """Bad input: printed as one clear message, exit status 2."""


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


def field_errors(exc: ValidationError) -> str:
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
    if note := _auto_over_experiment(data):
        print(note)
    try:
        rc = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise UsageError("invalid config: " + field_errors(exc)) from None
    if rc.plan_file is not None and rc.mode not in ("simulate", "execute", "compare"):
        raise UsageError(f"plan_file: mode={rc.mode} makes no plan and reads none; use mode=simulate, execute or "
                         "compare with plan_file")
    if rc.mode in _PREDICTING_MODES and rc.training.precision.value != "fp32" and rc.plan_file is None:
        missing = rc.hardware.device.missing_dtype(rc.training.precision.value)
        if missing is not None:
            raise UsageError(missing)
    return rc


def _auto_over_experiment(data: dict) -> str | None:
    """``experiment=X policy=auto``: the preset's own policy fields (``policy.pp``,
    ``policy.recompute``, ...) belong to the policy it was written for; auto chooses them itself, so
    they are dropped with a note instead of refusing the run. Only fields the preset's YAML sets
    and AutoPolicy does not know are dropped: a mistyped auto knob is still refused."""
    from planners.policy import AutoPolicy

    policy, exp = data.get("policy"), data.get("experiment")
    if not (isinstance(policy, dict) and policy.get("kind") == "auto" and isinstance(exp, dict)):
        return None
    path = CONF_DIR / "experiment" / f"{exp.get('name')}.yaml"
    if not path.is_file():
        return None
    preset = yaml.safe_load(path.read_text()) or {}
    theirs = set((preset.get("policy") or {}) if isinstance(preset, dict) else {})
    dropped = sorted(k for k in theirs & set(policy) if k not in AutoPolicy.model_fields)
    for k in dropped:
        del policy[k]
    return (f"note: policy=auto chooses these itself; ignoring experiment {exp['name']}'s "
            f"{', '.join('policy.' + k for k in dropped)}") if dropped else None


def from_hydra(exc: BaseException) -> bool:
    """True if ``exc`` was raised by Hydra, OmegaConf or the YAML parser (composing the config from
    the overrides and YAML files), i.e. it is about the input, not about memwall's code."""
    if isinstance(exc, (HydraException, OmegaConfBaseException, yaml.YAMLError)):  # YAML: a config file's syntax
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and re.search(r"[/\\](hydra|omegaconf)[/\\]", frames[-1].filename) is not None


def null_group(argv: list[str]) -> str | None:
    """``+hardware=null`` (or ``model=``) would fail inside Hydra with a ValueError that names
    neither the group nor the options; say what to write instead."""
    for arg in argv:
        m = re.match(r"^[+~]*(hardware|model)=(null|None|~)?$", arg)
        if m:
            group = m.group(1)
            return f"{group}: {arg!r} names no {group}; use +{group}=NAME, one of: {', '.join(options(group))}"
    return None


def compose(*overrides: str) -> RunConfig:
    """The validated config ``python -m run OVERRIDES`` would run (Hydra's compose API over conf/,
    then :func:`validate_config`), e.g. ``compose("experiment=mpress_gpt_10b3_dgx1")``. Raises
    UsageError on bad input, as the command line reports it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    problem = null_group(list(overrides))
    if problem:
        raise UsageError(problem)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return validate_config(hydra_compose("config", overrides=list(overrides)))
