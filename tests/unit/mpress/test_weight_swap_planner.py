"""The MPress planner's weight swap (planners/mpress/weights.py, MPress §II-D: GPU-CPU swap of live
model data): added only where a stage still overflows with its activations compacted, least
exposed cost per freed byte first, said in the log, the why texts and mpress.json, and the plan
it makes fits when simulated."""
from __future__ import annotations

import pytest

from model_costs import model_spec
from planners.mpress.outcome import report
from planners.mpress.planner import mpress_search
from planners.mpress.weights import exposed_s, freed_bytes
from planners.policy import MPressPolicy
from runconfig import compose
from simulator import simulate
from specs.plan import validate_plan

SMALL = ("+hardware=local_cpu", "+model=gpt_tiny", "training.global_batch=16")


def _search(budget: int, schedule: str = "1f1b", techniques=("recompute", "cpu_swap", "d2d_swap")):
    cfg = compose(*SMALL, f"schedule={schedule}", f"hardware.device.memory_bytes={budget}")
    model = model_spec(cfg)
    policy = MPressPolicy(techniques=list(techniques))
    return cfg, model, mpress_search(policy, model, cfg.hardware, cfg.training, cfg.schedule)


def _static_bytes(cfg, model) -> int:
    """The smallest per-device static model state of gpt_tiny's base pipeline: a budget below the
    base's activations but above it leaves the planner activations to compact first."""
    import costs.static
    from planners.mpress.base import base_plan

    base = base_plan(MPressPolicy(), model, cfg.hardware, cfg.training, cfg.schedule)
    return min(costs.static.stage_static(model, base, st)[0].total_bytes for st in base.stages)


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream_async"])
def test_no_weight_swap_where_the_activations_suffice(schedule):
    cfg, model, out = _search(2_400_000, schedule)
    assert out.fits
    assert not any(st.offload.weight_swap_layers for st in out.plan.stages)
    assert report(out)["weight_swap"] == {}


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream_async"])
def test_weight_swap_makes_a_tight_budget_fit(schedule):
    cfg0 = compose(*SMALL, f"schedule={schedule}")
    # a third above the smallest stage's model state: PipeDream's stage 0 keeps its tied
    # embedding (never weight-swapped) and its tied-gradient messages beside it
    budget = _static_bytes(cfg0, model_spec(cfg0)) * 4 // 3
    cfg, model, out = _search(budget, schedule)
    swapped = {s: st.offload.weight_swap_layers for s, st in enumerate(out.plan.stages)
               if st.offload.weight_swap_layers}
    assert swapped, out.log
    assert out.fits
    plan = validate_plan(out.plan, model, cfg.hardware)
    res = simulate(plan, model, cfg.hardware).result
    assert not any(d.oom for d in res.devices)
    # and it was needed: the same plan with the weights at home on the devices runs out of memory
    home = plan.model_copy(update={"stages": [st.model_copy(update={"offload": st.offload.model_copy(
        update={"weight_swap_layers": []})}) for st in plan.stages]})
    assert any(d.oom for d in simulate(home, model, cfg.hardware).result.devices)
    rep = report(out)
    assert {int(s): [x["layer"] for x in v] for s, v in rep["weight_swap"].items()} == \
        {s: sorted(ls) for s, ls in swapped.items()}
    assert all("MPress §II-D" in x["why"] for v in rep["weight_swap"].values() for x in v)
    assert any("weight swap" in line for line in out.log)


def test_the_least_exposed_layer_per_byte_goes_first():
    """Re-derive the ranking: on a stage the planner gave weight swap, the layer it chose first
    has the least exposed seconds per freed byte among that stage's untied layers (ties: lower)."""
    from planners.mpress.assign import Assignment

    cfg0 = compose(*SMALL, "schedule=1f1b")
    budget = _static_bytes(cfg0, model_spec(cfg0))
    cfg, model, out = _search(budget)
    assert out.weight_swap
    s, first, _ = out.weight_swap[0]
    base = out.plan.model_copy(update={"stages": [st.model_copy(update={"offload": st.offload.model_copy(
        update={"weight_swap_layers": []})}) for st in out.plan.stages]})
    st = Assignment(base, model, {}, out.mapping, [], budget)
    owners = {model.tied_owner(c) for c in model.tied_layers} | set(model.tied_layers)
    cands = [l for l in base.stages[s].layers if l not in owners]
    rank = {l: exposed_s(st, cfg.hardware, s, l) / freed_bytes(st, s, l) for l in cands}
    assert first == min(cands, key=lambda l: (rank[l], l))


def test_gpu_cpu_swap_alone_uses_weight_swap_and_is_deterministic():
    cfg0 = compose(*SMALL, "schedule=1f1b")
    budget = _static_bytes(cfg0, model_spec(cfg0))
    a = _search(budget, techniques=("cpu_swap",))[2]
    b = _search(budget, techniques=("cpu_swap",))[2]
    assert a.plan.model_dump_json() == b.plan.model_dump_json()
    assert any(st.offload.weight_swap_layers for st in a.plan.stages)
