"""planners/mpress/choice.py: MPress's tie rules (§III-D bullets, §IV-D Table III).

Table III t1: a tensor whose CPU swap and D2D swap both hide goes to the host ("D2D swap can be
saved for other tasks with more stringent demands"); t3: recompute and D2D of the same cost pick
recompute ("does not consume limited spare GPU memory"); §III-D: recompute goes to the latter
layers first, and to consecutive layers. The facts are constructed (LayerFacts: bytes, seconds) on
a real base pipeline of GPT-10.3B on the DGX-1, so the choice alone is under test.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from costs.families import build_model, parse_model_config
from planners.mpress.assign import Assignment
from planners.mpress.base import base_plan
from planners.mpress.choice import cheapest_layer, options
from planners.mpress.facts import CPU, D2D, RC, LayerFacts
from planners.mpress.mapping import Mapping
from planners.policy import MPressPolicy
from specs import HardwareSpec, TrainingSpec
from specs.plan import ScheduleSpec
from tests.conftest import conf

DGX1 = HardwareSpec.model_validate(conf("hardware", "dgx1"))
TRAINING = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")
MIB = 1 << 20


@pytest.fixture(scope="module")
def base():
    model = build_model(parse_model_config(conf("model", "gpt_10b3")), TRAINING.act_dtype_bytes)
    return model, base_plan(MPressPolicy(), model, DGX1, TRAINING, ScheduleSpec(kind="1f1b"))


def assignment(base, fact) -> Assignment:
    """Stage 0 stripes onto stage 1 (plenty of spare there); every layer's facts from ``fact(s, l)``."""
    model, plan = base
    p = len(plan.stages)
    targets = tuple(((1, 1.0),) if s == 0 else () for s in range(p))
    mapping = Mapping(device_of_stage=tuple(range(p)), targets=targets, stripe_bytes=tuple(() for _ in range(p)),
                      placed_bytes=(0.0,) * p, swap_time_s=(0.0,) * p, boundary_time_s=0.0, candidates=1, exact=True)
    facts = {(s, l): fact(s, l) for s, stage in enumerate(plan.stages) for l in stage.layers}
    st = Assignment(plan, model, facts, mapping, [RC, CPU, D2D], DGX1.device.memory_bytes)
    st.spare_left = {s: (1 << 40) if s == 1 else 0 for s in range(p)}
    st.fwd_s = {s: 0.050 for s in range(p)}  # swap channels far below a pass: no forward stalls
    st.bwd_s = {s: 0.100 for s in range(p)}
    return st


def facts(s, l, fwd_s=0.004, live_s=1.0, cpu_s=0.010, d2d_s=0.001) -> LayerFacts:
    return LayerFacts(stage=s, layer=l, saved_bytes=64 * MIB, fwd_s=fwd_s, live_s=live_s, cpu_s=cpu_s, d2d_s=d2d_s)


def test_cpu_swap_is_chosen_over_d2d_when_both_hide(base):
    st = assignment(base, facts)  # round trips 20 ms and 2 ms, both in a 1 s live interval
    key = (0, base[1].stages[0].layers[0])
    ranked = options(st, key, [D2D, CPU])
    assert [c for c, _ in ranked] == [0.0, 0.0]
    assert ranked[0][1] is CPU


def test_recompute_is_chosen_over_d2d_at_the_same_cost(base):
    # Table III t3: D2D's round trip exceeds the live interval by exactly recompute's forward (4 ms);
    # CPU swap does not hide at all
    st = assignment(base, lambda s, l: facts(s, l, fwd_s=0.004, live_s=0.010, d2d_s=0.007, cpu_s=0.050))
    key = (0, base[1].stages[0].layers[0])
    ranked = options(st, key, [D2D, CPU, RC])
    assert ranked[0][1] is RC and ranked[1][1] is D2D
    assert ranked[0][0] == pytest.approx(ranked[1][0], abs=1e-9)


def test_recompute_goes_to_the_late_layers_first_then_next_to_them(base):
    # every layer alike and only recompute allowed: the latter layers go first (§III-D), and
    # each next one beside the recomputed ones (consecutive layers)
    st = assignment(base, facts)
    layers = list(base[1].stages[0].layers)
    chosen = []
    for _ in range(3):
        _, key, a, _, _ = cheapest_layer(st, 0, [RC])
        assert a is RC
        st.set(key, a, "")
        chosen.append(key[1])
    assert chosen == layers[-1:-4:-1]


def test_recompute_prefers_a_layer_beside_a_recomputed_one(base):
    st = assignment(base, facts)
    layers = list(base[1].stages[0].layers)
    st.set((0, layers[1]), RC, "")  # recomputed already (e.g. by an earlier repair)
    _, key, _, _, _ = cheapest_layer(st, 0, [RC])
    assert key[1] in (layers[0], layers[2])
    assert key[1] == layers[2]  # of the two neighbours, the later


def test_a_swap_still_goes_to_the_longest_lived_layer(base):
    st = assignment(base, lambda s, l: facts(s, l, live_s=1.0 + l))
    _, key, a, _, _ = cheapest_layer(st, 0, [CPU])
    assert a is CPU and key[1] == base[1].stages[0].layers[-1]
    st2 = assignment(base, lambda s, l: facts(s, l, live_s=10.0 - l))
    _, key2, _, _, _ = cheapest_layer(st2, 0, [CPU])
    assert key2[1] == base[1].stages[0].layers[0]


def test_a_cheaper_d2d_still_wins(base):
    # the tie rules break ties only: a D2D that hides beats a CPU swap that does not
    st = assignment(base, lambda s, l: replace(facts(s, l), live_s=0.010))
    key = (0, base[1].stages[0].layers[0])
    assert options(st, key, [CPU, D2D])[0][1] is D2D
