"""policy=auto's MAP sharding for any model (issue 26): MAP's single and its per-stage mixing
(planners/auto/map_mix.py) plan memwall's Wide-ResNet and MoE and a user's torch_module model from
their traced operator graphs, not only GPT / BERT; and where only a sharded stage fits, auto picks
a plan with one, which validates and fits in a fresh simulation."""
from __future__ import annotations

import contextlib
import io
from dataclasses import replace
import sys
from pathlib import Path

import pytest

from costs.families import parse_model_config
from executor.op_graph import model_op_graphs
from planners.auto.map_mix import map_base, map_mixed
from planners.auto.search import auto_search
from planners.policy import AutoPolicy
from specs.plan import validate_plan
from tests.conftest import CPU_TRAINING, GIB, LOCAL_CPU, conf
from tests.unit.auto.auto_cases import ONE_F_ONE_B, simulated_fit, spec


def with_graphs(model, cfg, microbatch: int, dtype: str):
    """``model`` with its operator graphs traced as the shell attaches them (model_costs.with_op_graphs)."""
    graphs, keys = model_op_graphs(cfg, microbatch, dtype)
    return model.model_copy(update={"op_graphs": graphs, "op_graph_microbatch": microbatch, "layers": [
        layer.model_copy(update={"op_graph": k}) for layer, k in zip(model.layers, keys)]})


def sharded(plan) -> list[int]:
    return [i for i, st in enumerate(plan.stages) if st.sharding]


_SEARCHED: dict[str, tuple] = {}


def searched_family(name: str):
    """(model with op graphs, outcome) of auto on ``name`` (local_cpu, fp32), singles balanced and map."""
    if name not in _SEARCHED:
        model = with_graphs(spec(name, CPU_TRAINING), parse_model_config(conf("model", name)),
                            CPU_TRAINING.samples_per_microbatch, CPU_TRAINING.precision.value)
        # at the traced microbatch only: the layouts map_mixed takes (its graphs' size)
        policy = AutoPolicy(singles=["balanced", "map"], microbatch_sizes=[CPU_TRAINING.samples_per_microbatch])
        _SEARCHED[name] = model, auto_search(policy, model, LOCAL_CPU, CPU_TRAINING, ONE_F_ONE_B)
    return _SEARCHED[name]


@pytest.mark.parametrize("name", ["wresnet_tiny", "moe_tiny"])
def test_maps_single_plans_a_non_gpt_family(name):
    """MAP's single is not refused for a Wide-ResNet or MoE with operator graphs: it plans one
    sharded mesh stage, which validates against the graphs."""
    model, out = searched_family(name)
    single = next(s for s in out.singles if s.name == "map")
    assert single.error is None and single.candidate is not None, single.error
    assert sharded(single.candidate.plan), single.candidate.plan.stages
    validate_plan(single.candidate.plan, model, LOCAL_CPU)


@pytest.mark.parametrize("name", ["wresnet_tiny", "moe_tiny"])
def test_map_mixing_shards_each_multi_device_stage_of_a_non_gpt_plan(name):
    """map_mixed on a pipeline of multi-device stages at the traced microbatch: every such stage is
    tried as MAP's sharding of its devices (the others unchanged), each mixed plan valid."""
    model, out = searched_family(name)
    base = min((c for c in out.candidates if c.layout is not None and len(c.plan.stages) >= 2
                and c.plan.training.samples_per_microbatch == CPU_TRAINING.samples_per_microbatch
                and c.plan.schedule.virtual_stages == 1 and all(len(st.devices) >= 2 for st in c.plan.stages)),
               key=lambda c: (c.time_s, c.how))
    got = map_mixed(base, model, LOCAL_CPU, out.capacity_bytes)
    assert {i for c in got for i in sharded(c.plan)} == set(range(len(base.plan.stages)))
    for c in got:
        validate_plan(c.plan, model, LOCAL_CPU)
        assert c.how.startswith(base.how)
        for i in set(range(len(base.plan.stages))) - set(sharded(c.plan)):
            assert c.plan.stages[i].devices == base.plan.stages[i].devices


def test_map_base_is_the_lowest_peak_own_plan_when_none_fits():
    """Where no own plan fits, MAP is tried on the one closest to fitting (its lowest peak)."""
    _, out = searched_family("wresnet_tiny")
    mb = CPU_TRAINING.samples_per_microbatch
    own = [c for c in out.candidates if c.layout is not None and c.plan.training.samples_per_microbatch == mb]
    assert own and all(c.fits for c in own) and len({c.peak for c in own}) > 1
    assert map_base(out.candidates, mb) is min(own, key=lambda c: (c.time_s, c.how))
    over = [replace(c, fits=False) for c in own]
    assert map_base(over, mb) is min(over, key=lambda c: (c.peak, c.time_s, c.how))
    assert map_base([replace(c, layout=None) for c in over], mb) is None  # singles are no base


# ---- the shell: policy=auto traces operator graphs for any family (model_costs.wants_op_graphs) --

@pytest.mark.parametrize("model", ["wresnet_tiny", "moe_tiny", "gpt_tiny"])
def test_auto_asks_for_operator_graphs_for_any_family(model):
    """policy=auto with MAP among its singles traces every model's graphs, not only GPT / BERT's
    (before issue 26 a Wide-ResNet's MAP single said "no operator graphs"); without MAP, none."""
    from model_costs import wants_op_graphs
    from runconfig import compose

    assert wants_op_graphs(compose("+hardware=local_cpu", f"+model={model}", "policy=auto"))
    assert not wants_op_graphs(compose("+hardware=local_cpu", f"+model={model}", "policy=auto",
                                       "policy.singles=[balanced,throughput]"))


# ---- a user's model where only MAP's sharding fits ---------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"


def _resnet18():
    """docs/examples/resnet18.py (family torch_module: no closed-form tensor parallelism, max_tp 1)
    on local_cpu in fp32, its symbolic costs and its operator graphs, as the shell builds them."""
    from model_costs import model_spec, with_op_graphs
    from runconfig import compose

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    cfg = compose("+hardware=local_cpu", f"hydra.searchpath=[file://{EXAMPLES}]", "+model=resnet18", "policy=auto",
                  "training.precision=fp32", "policy.singles=[balanced,throughput,mpress,stronghold,map]")
    with contextlib.redirect_stdout(io.StringIO()):
        model = model_spec(cfg)
        graphs = model if model.op_graphs else with_op_graphs(cfg, model)
    return cfg, model.model_copy(update={"op_graphs": {}, "op_graph_microbatch": None, "layers": [
        layer.model_copy(update={"op_graph": None}) for layer in model.layers]}), graphs


def test_where_only_sharding_fits_a_user_model_auto_picks_maps_sharding():
    """The budget: 0.9 x the largest layer's weights + gradients. No unsharded plan goes below one
    layer's weights and gradients on a device (a layer computes its weight gradient with its
    weights resident: swaps, windows and recompute move everything else), and a torch_module
    layer has no tensor parallelism; MAP splits the layer's parameters over the mesh (MAP §4.1).
    Without the operator graphs no plan of auto's fits; with them auto's answer has a MAP-sharded
    stage, fits, is valid, and a fresh simulation agrees."""
    cfg, plain, model = _resnet18()
    w_b, g_b, _ = cfg.training.bytes_per_param()
    budget_bytes = int(0.9 * max(layer.params for layer in model.layers) * (w_b + g_b))
    policy = cfg.policy.model_copy(update={"memory_budget_gib": budget_bytes / GIB})
    without = auto_search(policy, plain, cfg.hardware, cfg.training, cfg.schedule)
    assert not without.fits, without.winner.how
    out = auto_search(policy, model, cfg.hardware, cfg.training, cfg.schedule)
    assert out.fits and sharded(out.plan), (out.winner.how, [s.row() for s in out.singles])
    fits, time_s, peaks = simulated_fit(out.plan, model, cfg.hardware, out.capacity_bytes)
    assert fits, peaks
    assert time_s == pytest.approx(out.winner.time_s, rel=1e-9)
    fitting = [c for c in out.everything if c.fits]
    assert out.winner.time_s == min(c.time_s for c in fitting)
