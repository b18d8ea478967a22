"""policy=mpress swaps PipeDream's stashed weight versions to host memory (MPress §II-D: GPU-CPU swap
applies to all model data; planners/mpress/stash.py) before it assigns activations: Bert-6.2B
under PipeDream on the DGX-1 (the paper's largest Bert, Fig. 7) fits; techniques without CPU swap
and flushing schedules never get it."""
from __future__ import annotations

import pytest

from model_costs import model_spec
from planners.mpress.planner import mpress_search
from planners.mpress.stash import choose_stash_swap
from runconfig import compose
from simulator import simulate

EXPERIMENT = "experiment=mpress_bert_6b2_pipedream"


def _search(*overrides: str):
    cfg = compose(EXPERIMENT, *overrides)
    model = model_spec(cfg)
    return cfg, model, mpress_search(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule)


def _stashed(plan) -> dict[int, list[int]]:
    return {s: st.offload.stash_swap_layers for s, st in enumerate(plan.stages) if st.offload.stash_swap_layers}


def test_bert_6b2_pipedream_fits_with_stash_swap():
    cfg, model, out = _search()
    assert out.fits
    stashed = _stashed(out.plan)
    assert 0 in stashed  # stage 0 keeps p - 1 = 7 versions: the longest-lived, the most bytes
    assert any(line.startswith("stash swap") for line in out.log)
    result = simulate(out.plan, model, cfg.hardware).result
    assert not any(d.oom for d in result.devices)
    # what waits in host memory is counted there (the stages that swap hold host bytes)
    for s in stashed:
        assert next(d for d in result.devices if d.device == out.plan.stages[s].devices[0]).host_bytes > 0


def test_recompute_only_gets_no_stash_swap():
    """Recompute re-runs forwards; it cannot bring back a weight version (§II-B): without cpu_swap
    the plan has no stashed-version swap, and the 6.2B model still does not fit."""
    _, _, out = _search("policy.techniques=[recompute]")
    assert _stashed(out.plan) == {}
    assert not any(line.startswith("stash swap") for line in out.log)
    assert not out.fits


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_flushing_schedules_never_get_stash_swap(schedule):
    _, _, out = _search(f"schedule={schedule}")
    assert _stashed(out.plan) == {}


def test_the_rule_applies_to_pipedream_with_cpu_swap_only():
    cfg = compose(EXPERIMENT)
    model = model_spec(cfg)
    from planners.mpress.base import base_plan

    base = base_plan(cfg.policy, model, cfg.hardware, cfg.training, cfg.schedule)
    sim = simulate(base, model, cfg.hardware)
    demand = [max(0, d.peak_bytes - cfg.hardware.device.memory_bytes) for d in sim.result.devices]
    assert choose_stash_swap(base, model, cfg.hardware, sim.trace, demand, allowed_cpu=False) == ({}, {})
    chosen, _ = choose_stash_swap(base, model, cfg.hardware, sim.trace, demand, allowed_cpu=True)
    assert chosen and all(demand[s] > 0 for s in chosen)
    assert (len(base.stages) - 1) not in chosen  # the last stage stashes nothing


def test_mpress_json_lists_the_stash_swap_as_the_plan_has_it():
    from planners.mpress.outcome import report
    _, _, out = _search()
    assert report(out)["stash_swap"] == {str(s): layers for s, layers in _stashed(out.plan).items()}
