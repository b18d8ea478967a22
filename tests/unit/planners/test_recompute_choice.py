"""policy.recompute=null (conf/policy's default for even/balanced/manual): no recompute when the plan
fits, else the fastest setting that fits, checked here against every setting priced one by one."""
from __future__ import annotations

import pytest

from model_costs import model_spec
from planners import choose_plan, make_plan
from planners.layout import RECOMPUTED_KINDS, PlanningError
from planners.verdict import peaks
from runconfig import compose
from simulator.analytic import iteration_time_s


def _setup(*overrides):
    cfg = compose(*overrides)
    return cfg, model_spec(cfg)


def _choose(cfg, model, **update):
    policy = cfg.policy.model_copy(update=update)
    return choose_plan(policy, model, cfg.hardware, cfg.training, cfg.schedule)


def _priced(cfg, model, **update):
    plan = make_plan(cfg.policy.model_copy(update=update), model, cfg.hardware, cfg.training, cfg.schedule)
    return plan, max(peaks(plan, model, cfg.hardware).values()), iteration_time_s(plan, model, cfg.hardware)


def test_the_cli_default_is_null_for_the_uniform_policies():
    for policy in ("balanced", "even", "manual"):
        assert compose("+hardware=dgx1", "+model=gpt", f"policy={policy}").policy.recompute is None


def test_a_plan_that_fits_without_recompute_is_the_none_plan_and_says_nothing():
    cfg, model = _setup("+hardware=dgx1", "+model=gpt")
    choice = _choose(cfg, model, recompute=None)
    none, peak, _ = _priced(cfg, model, recompute="none")
    assert peak <= cfg.hardware.device.memory_bytes
    assert choice.plan.model_dump_json() == none.model_dump_json()
    assert choice.policy.recompute == "none" and choice.note == ""


@pytest.mark.parametrize("overrides", [("+hardware=h100_node", "+model=llama3_8b"),
                                       ("+hardware=h100_node", "hardware.nodes=8", "+model=llama3_70b"),
                                       ("+hardware=dgx1", "+model=gpt", "training.microbatch_size=8")])
def test_over_memory_it_takes_the_fastest_setting_that_fits(overrides):
    cfg, model = _setup(*overrides)
    capacity = cfg.hardware.device.memory_bytes
    none, peak, _ = _priced(cfg, model, recompute="none")
    assert peak > capacity  # the case this test is about
    # every setting, one by one (full on the first N blocks for every N, not bisected)
    candidates = [{"recompute": r} for r in ("selective", "op_sac", "full")]
    most = max(sum(1 for i in range(s.layer_start, s.layer_stop) if model.layers[i].kind in RECOMPUTED_KINDS)
               for s in none.stages)
    candidates += [{"recompute": "full", "recompute_num_layers": n} for n in range(1, most)]
    priced = []
    for update in candidates:
        try:
            priced.append((update, *_priced(cfg, model, **update)))
        except PlanningError:
            continue
    fitting = [p for p in priced if p[2] <= capacity]
    assert fitting
    fastest = min(p[3] for p in fitting)
    choice = _choose(cfg, model, recompute=None)
    chosen_peak = max(peaks(choice.plan, model, cfg.hardware).values())
    assert chosen_peak <= capacity
    assert iteration_time_s(choice.plan, model, cfg.hardware) == fastest
    assert choice.policy.recompute != "none" and choice.policy.recompute is not None
    assert "the fastest that fits" in choice.note and f"policy.recompute={choice.policy.recompute}" in choice.note
    # fewer blocks recomputed never lowers the peak: what the bisection over N relies on
    by_n = [p[2] for p in priced if "recompute_num_layers" in p[0]]
    assert by_n == sorted(by_n, reverse=True)


def test_when_nothing_fits_it_returns_the_lowest_peak_and_says_so():
    cfg, model = _setup("+hardware=h100_node", "+model=llama3_70b")  # 70B's model state alone is over 8 devices
    choice = _choose(cfg, model, recompute=None)
    lowest = min(_priced(cfg, model, recompute=r)[1] for r in ("none", "selective", "op_sac", "full"))
    assert max(peaks(choice.plan, model, cfg.hardware).values()) == lowest > cfg.hardware.device.memory_bytes
    assert "no recompute setting fits" in choice.note


def test_recompute_num_layers_or_every_alone_means_full():
    cfg, model = _setup("+hardware=dgx1", "+model=gpt")
    assert _choose(cfg, model, recompute=None, recompute_num_layers=1).policy.recompute == "full"
    assert _choose(cfg, model, recompute=None, recompute_every=2).policy.recompute == "full"


def test_a_pinned_setting_is_kept_even_when_it_does_not_fit():
    cfg, model = _setup("+hardware=h100_node", "+model=llama3_8b")
    choice = _choose(cfg, model, recompute="none")
    assert choice.policy.recompute == "none" and choice.note == ""
    assert max(peaks(choice.plan, model, cfg.hardware).values()) > cfg.hardware.device.memory_bytes
