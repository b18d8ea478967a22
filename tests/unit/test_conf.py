"""Every YAML under conf/ (policy, schedule, experiment, and full compositions) validates."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import run
from planners import make_plan, parse_policy
from specs import ScheduleSpec
from specs.families import build_model

CONF = Path(run.__file__).resolve().parent / "conf"


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(*overrides: str) -> run.RunConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return run.validate_config(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("name", names("policy"))
def test_policy_yaml_validates(name):
    assert parse_policy(OmegaConf.to_container(OmegaConf.load(CONF / "policy" / f"{name}.yaml"))).kind == name


@pytest.mark.parametrize("name", names("schedule"))
def test_schedule_yaml_validates(name):
    assert ScheduleSpec.model_validate(OmegaConf.to_container(OmegaConf.load(CONF / "schedule" / f"{name}.yaml")))


@pytest.mark.parametrize("name", names("experiment"))
def test_experiment_composes_and_plans(name):
    cfg = composed(f"experiment={name}")
    model = build_model(cfg.model, cfg.training.act_dtype_bytes)
    make_plan(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule)


@pytest.mark.parametrize("model", ["gpt", "bert", "moe", "wresnet", "gpt_tiny"])
@pytest.mark.parametrize("hardware", ["dgx1", "capture_cluster", "local_cpu"])
def test_default_policy_plans_shipped_pairs(model, hardware):
    cfg = composed(f"+model={model}", f"+hardware={hardware}")
    built = build_model(cfg.model, cfg.training.act_dtype_bytes)
    plan = make_plan(cfg.policy, built, cfg.hardware, cfg.training, cfg.schedule)
    assert plan.used_devices() == list(range(cfg.hardware.num_devices))


def test_missing_groups_name_the_options():
    with pytest.raises(run.UsageError, match=r"\+hardware=NAME, one of: .*dgx1"):
        composed("+model=gpt")


def test_node_count_override_scales_the_hardware():
    assert composed("+model=gpt", "+hardware=selene", "hardware.nodes=128").hardware.num_devices == 1024
