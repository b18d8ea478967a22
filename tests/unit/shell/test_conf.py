"""Every YAML under conf/ (policy, schedule, experiment, and full compositions) validates."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import run
from planners import PlanningError, make_plan, parse_policy
from planners.policy import ThroughputPolicy
from specs import ScheduleSpec, TrainingSpec
from costs.families import build_model

CONF = Path(run.__file__).resolve().parent / "conf"


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(*overrides: str) -> run.RunConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return run.validate_config(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("name", names("policy"))
def test_policy_yaml_validates(name):
    assert parse_policy(OmegaConf.to_container(OmegaConf.load(CONF / "policy" / f"{name}.yaml"))).kind == name


@pytest.mark.parametrize("name", names("policy"))
def test_policy_yaml_states_the_codes_defaults(name):
    """`policy=NAME` and a bare {kind: NAME} plan alike: the YAML a user reads is what the code does.
    One field differs on purpose: the command line's recompute is null (the fastest setting that fits,
    planners.recompute_choice) where a policy built in Python keeps none, as it asked."""
    yaml = parse_policy(OmegaConf.to_container(OmegaConf.load(CONF / "policy" / f"{name}.yaml")))
    if name in ("balanced", "even", "manual"):
        assert yaml.recompute is None
        yaml = yaml.model_copy(update={"recompute": "none"})
    assert yaml == parse_policy({"kind": name})


@pytest.mark.parametrize("name", names("schedule"))
def test_schedule_yaml_validates(name):
    assert ScheduleSpec.model_validate(OmegaConf.to_container(OmegaConf.load(CONF / "schedule" / f"{name}.yaml")))


@pytest.mark.parametrize("name", names("experiment"))
def test_experiment_composes_and_plans(name):
    """Every preset validates and plans; CAPTURE presets plan their throughput baseline here
    (CAPTURE itself needs a profile: tests/integration/capture/test_capture_planner.py)."""
    cfg = composed(f"experiment={name}")
    model = build_model(cfg.model, cfg.training.act_dtype_bytes)
    policy = cfg.policy
    if policy.kind == "capture":
        policy = ThroughputPolicy(recompute=policy.recompute, pipeline_only=policy.pipeline_only)
    if policy.kind == "map":  # MAP plans on the operator graphs (traced on FakeTensor)
        from model_costs import with_op_graphs

        model = with_op_graphs(cfg, model)
    make_plan(policy, model, cfg.hardware, cfg.training, cfg.schedule)


@pytest.fixture(scope="module")
def shipped():
    """Every shipped model and hardware, composed once through Hydra (bare names use defaults)."""
    models = {m: composed(f"+model={m}", "+hardware=dgx1").model for m in names("model")}
    hardware = {h: composed("+model=gpt_tiny", f"+hardware={h}").hardware for h in names("hardware")}
    return models, hardware


@pytest.mark.parametrize("policy", ["even", "balanced", "manual"])
def test_every_shipped_pair_plans_or_says_why(shipped, policy):
    models, hardware = shipped
    training = TrainingSpec(global_batch=64, microbatch_size=2)
    planned = fillable = 0
    for model_name, model_cfg in models.items():
        model = build_model(model_cfg, training.act_dtype_bytes)
        for hw in hardware.values():
            # pp <= layers and dp <= the microbatch's samples: more devices than that cannot all be used
            fillable += model.num_layers * training.microbatch_size >= hw.num_devices
            try:
                plan = make_plan(parse_policy({"kind": policy}), model, hw, training, ScheduleSpec())
            except PlanningError as exc:
                assert "policy." in str(exc) or "training." in str(exc), str(exc)
                continue
            assert plan.used_devices() == list(range(hw.num_devices))
            planned += 1
    if policy != "manual":  # manual with its defaults (pp=dp=tp=1) only fits 1-device hardware
        assert planned >= fillable


def test_missing_groups_name_the_options():
    with pytest.raises(run.UsageError, match=r"\+hardware=NAME, one of: .*dgx1"):
        composed("+model=gpt")


def test_node_count_override_scales_the_hardware():
    assert composed("+model=gpt", "+hardware=selene", "hardware.nodes=128").hardware.num_devices == 1024


@pytest.mark.parametrize("name", names("experiment"))
def test_every_experiment_composes_with_policy_auto(name, capsys):
    """``experiment=X policy=auto``: the preset's own policy fields (pp, recompute, devices, ...)
    are dropped with a note naming them; auto's knobs are untouched."""
    import yaml

    theirs = set((yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text()).get("policy") or {}))
    rc = composed(f"experiment={name}", "policy=auto", "policy.max_layouts=5")
    assert rc.policy.kind == "auto" and rc.policy.max_layouts == 5
    out = capsys.readouterr().out
    for field in theirs - set(type(rc.policy).model_fields):
        assert f"policy.{field}" in out


def test_policy_auto_still_refuses_a_mistyped_knob_under_an_experiment():
    with pytest.raises(run.UsageError, match="policy.auto.max_layout"):
        composed("experiment=megatron_gpt3_175b", "policy=auto", "+policy.max_layout=5")
