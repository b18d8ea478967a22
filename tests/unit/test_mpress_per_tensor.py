"""MPress decides per tensor (§III-D; Table III's t1-t6): planners/mpress/{facts,assign,choice}.py
with ``LayerSpec.saved_tensors``.

The model is GPT-10.3B's closed form with its blocks' saved tensors given here (four tensors, saved
at 10/40/70/90 % of the block's forward, 40/30/20/10 % of its interior bytes), so the tests do not
depend on any particular tensor list. The facts (bytes, seconds) are built from those tensors on the
real base pipeline, as tests/unit/mpress/test_tie_rules.py does; the capacity is set a given number
of bytes below stage 0's closed-form peak, so "the need" is known.
"""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
import costs.activations
import costs.params
from planners.mpress import choice
from planners.mpress.assign import Assignment
from planners.mpress.base import base_plan
from planners.mpress.choice import choices, fill, hiding_tensors
from planners.mpress.facts import CPU, D2D, RC, LayerFacts, TensorFacts, tensor_live_s
from planners.mpress.mapping import Mapping
from planners.mpress.outcome import report, why_conflicts
from planners.mpress.planner import mpress_search
from planners.policy import MPressPolicy
from simulator import simulate
from specs import HardwareSpec, TrainingSpec
from specs.model import LayerKind, SavedTensorSpec
from specs.plan import PlanError, ScheduleSpec, validate_plan
from tests.conftest import conf

DGX1 = HardwareSpec.model_validate(conf("hardware", "dgx1"))
TRAINING = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")
ONE_F_ONE_B = ScheduleSpec(kind="1f1b")
FRACTIONS = (0.1, 0.4, 0.7, 0.9)   # where in the forward each tensor is saved
SHARES = (0.4, 0.3, 0.2, 0.1)      # of the block's interior bytes
#: saved earlier in the forward, used later in the backward: longer-lived (SavedTensorSpec)
LONGEST_LIVED_FIRST = sorted(range(len(FRACTIONS)), key=lambda i: FRACTIONS[i])


def with_tensors(model):
    """``model`` with every transformer block's interior split into the four tensors above."""
    layers = []
    for spec in model.layers:
        tensors = []
        if spec.kind is LayerKind.transformer_block:
            interior = spec.saved_bytes_per_sample - (spec.output_bytes_per_sample if spec.saves_input else 0)
            tensors = [SavedTensorSpec(name=f"t{i}", bytes_per_sample=int(interior * share), fwd_fraction=fr)
                       for i, (share, fr) in enumerate(zip(SHARES, FRACTIONS))]
        layers.append(spec.model_copy(update={"saved_tensors": tensors}))
    return model.model_copy(update={"layers": layers})


def without_tensors(model):
    return model.model_copy(update={"layers": [l.model_copy(update={"saved_tensors": []}) for l in model.layers]})


@pytest.fixture(scope="module")
def base():
    model = with_tensors(build_model(parse_model_config(conf("model", "gpt_10b3")), TRAINING.act_dtype_bytes))
    return model, base_plan(MPressPolicy(), model, DGX1, TRAINING, ONE_F_ONE_B)


def layer_facts(model, plan, s, l, *, live_s=1.0, fwd_s=0.004, bwd_s=0.008, cpu_gbps=10.0, d2d_gbps=100.0,
                slow=()) -> LayerFacts:
    """A layer's facts on ``plan``: bytes from the model (costs.activations), times from the given
    rates; tensors in ``slow`` move 1000x slower (their swap does not hide), and the layer's own
    transfer is its tensors' plus its boundaries'. A layer without saved tensors (the embedding)
    lives 0 s: its swap costs, so the blocks are the ones chosen."""
    stage = plan.stages[s]
    b = costs.params.samples_per_replica(plan, stage)
    spec = model.layers[l]
    tensors = tuple(
        TensorFacts(index=i, name=t.name, nbytes=(n := costs.activations.tensor_bytes(spec, i, b, stage.tp)),
                    live_s=tensor_live_s(live_s, fwd_s, bwd_s, t.fwd_fraction),
                    cpu_s=n / (cpu_gbps * 1e9) * (1000 if i in slow else 1), d2d_s=n / (d2d_gbps * 1e9))
        for i, t in enumerate(spec.saved_tensors))
    nbytes = costs.activations.layer_saved_bytes(spec, b, stage.tp)
    rest = nbytes - sum(t.nbytes for t in tensors)  # the boundaries
    return LayerFacts(stage=s, layer=l, saved_bytes=nbytes, fwd_s=fwd_s, live_s=live_s if tensors else 0.0,
                      cpu_s=rest / (cpu_gbps * 1e9) + sum(t.cpu_s for t in tensors),
                      d2d_s=rest / (d2d_gbps * 1e9) + sum(t.d2d_s for t in tensors), tensors=tensors)


def assignment(base, need_bytes: int = 0, **kw) -> Assignment:
    """Stage 0 stripes onto stage 1 (ample spare there); capacity ``need_bytes`` below stage 0's peak."""
    model, plan = base
    p = len(plan.stages)
    targets = tuple(((1, 1.0),) if s == 0 else () for s in range(p))
    mapping = Mapping(device_of_stage=tuple(range(p)), targets=targets, stripe_bytes=tuple(() for _ in range(p)),
                      placed_bytes=(0.0,) * p, swap_time_s=(0.0,) * p, boundary_time_s=0.0, candidates=1, exact=True)
    facts = {(s, l): layer_facts(model, plan, s, l, **kw) for s, stage in enumerate(plan.stages) for l in stage.layers}
    st = Assignment(plan, model, facts, mapping, [RC, CPU, D2D], 1 << 50)
    st.capacity = st.own_peak(0) - need_bytes
    st.spare_left = {s: (1 << 40) if s == 1 else 0 for s in range(p)}
    st.fwd_s = {s: 0.5 for s in range(p)}  # swap channels far below a pass: no forward stalls
    st.bwd_s = {s: 1.0 for s in range(p)}
    return st


def first_block(plan) -> int:
    return plan.stages[0].layers[-1]


def block_interior(st: Assignment, key) -> int:
    return sum(t.nbytes for t in st.facts[key].tensors)


def swapped_keys(st: Assignment, s: int) -> list:
    return [k for k, a in st.actions.items() if k[0] == s and a in (CPU, D2D)]


def test_tensor_live_interval_is_the_layers_plus_the_in_layer_parts():
    # saved at 10 % of a 4 ms forward, used 90 % into an 8 ms backward: 0.9 * (4 + 8) ms longer
    assert tensor_live_s(1.0, 0.004, 0.008, 0.1) == pytest.approx(1.0 + 0.9 * 0.012)
    assert tensor_live_s(1.0, 0.004, 0.008, 1.0) == pytest.approx(1.0)  # saved last, used first


def test_a_need_below_one_layer_swaps_the_longest_lived_tensors_that_cover_it(base):
    model, plan = base
    probe = assignment(base)
    key = (0, first_block(plan))
    one_mb = block_interior(probe, key)
    need = int(0.5 * one_mb)  # half of one microbatch's interior of one block: less than one layer
    st = assignment(base, need)
    assert st.over()[0] == need
    fill(st, {0: need}, [CPU])
    swaps = swapped_keys(st, 0)
    assert len(swaps) == 1, swaps
    k = swaps[0]
    sub = st.tensors[k]  # a per-tensor swap, not the whole layer
    order = LONGEST_LIVED_FIRST
    assert list(sub) == sorted(order[:len(sub)])  # the longest-lived first
    assert st.over()[0] <= 0  # covers the need ...
    if len(sub) > 1:  # ... and not with more than one tensor beyond it
        st.set(k, CPU, "", tuple(order[:len(sub) - 1]))
        assert st.over()[0] > 0
    plan_now = validate_plan(st.plan_now(), model, DGX1)
    item = plan_now.stages[0].action_of(k[1])
    assert item.tensors == list(sub) and item.microbatch_period == 1
    assert item.tensors_of == len(model.layers[k[1]].saved_tensors)  # the executor checks the count
    memory = [m.model_copy(update={"tensors_of": m.tensors_of + 1}) if m.tensors else m
              for m in plan_now.stages[0].memory]
    stages = [plan_now.stages[0].model_copy(update={"memory": memory}), *plan_now.stages[1:]]
    wrong = plan_now.model_copy(update={"stages": stages})
    with pytest.raises(PlanError, match="tensors_of"):
        validate_plan(wrong, model, DGX1)


def test_a_tensor_whose_swap_does_not_hide_is_left_when_a_hidden_one_exists(base):
    # t0 (the longest-lived) moves 1000x slower: its round trip does not hide; the others' do
    probe = assignment(base, slow=(0,))
    key = (0, first_block(base[1]))
    assert not probe.facts[key].tensors[0].hides(CPU) and probe.facts[key].tensors[1].hides(CPU)
    assert probe.facts[key].cost_s(CPU) > 0  # t0's slowness makes the whole layer's swap costly
    need = int(0.2 * block_interior(probe, key))
    st = assignment(base, need, slow=(0,))
    fill(st, {0: need}, [CPU])
    for k in swapped_keys(st, 0):
        sub = st.tensors.get(k)
        assert sub is not None and 0 not in sub
        assert all(t.hides(CPU) for t in st.facts[k].subset(sub))
    assert st.over()[0] <= 0


def test_a_whole_layer_that_does_not_hide_offers_its_hiding_tensors(base):
    # the layer's own round trip (every tensor plus its boundaries) exceeds its live interval,
    # the tensors saved early live long enough (1 ms layer live + 90 % of 0.3 s of passes)
    st = assignment(base, live_s=0.001, fwd_s=0.1, bwd_s=0.2, cpu_gbps=3.0)
    key = (0, first_block(base[1]))
    f = st.facts[key]
    assert f.cost_s(CPU) > 0
    sub = hiding_tensors(st, key, CPU)
    assert sub and len(sub) < len(f.tensors)
    cost, a, tensors = choices(st, key, [CPU])[0]
    assert a is CPU and tensors == tuple(sorted(sub)) and cost == pytest.approx(0.0)


def test_cpu_over_d2d_when_both_hide_per_tensor(base):
    # every tensor's CPU and D2D round trips hide; the whole layer's CPU swap does not
    st = assignment(base, live_s=0.001, fwd_s=0.1, bwd_s=0.2, cpu_gbps=3.0, d2d_gbps=1000.0)
    key = (0, first_block(base[1]))
    f = st.facts[key]
    hide_both = [t.index for t in f.tensors if t.hides(CPU) and t.hides(D2D)]
    assert hide_both and f.cost_s(CPU) > 0
    cost, a, tensors = choices(st, key, [D2D, CPU])[0]
    assert a is CPU and cost == pytest.approx(0.0)  # Table III t1: D2D is kept for harder cases
    assert set(tensors) <= set(hide_both)


def test_recompute_over_d2d_when_cheaper_per_tensor(base):
    # D2D this slow hides no tensor and costs more than one more forward
    st = assignment(base, live_s=0.001, fwd_s=0.004, bwd_s=0.008, d2d_gbps=0.1)
    key = (0, first_block(base[1]))
    assert not hiding_tensors(st, key, D2D)
    ranked = choices(st, key, [D2D, RC])
    assert ranked[0][1] is RC and ranked[0][0] < ranked[1][0]


def test_recompute_over_d2d_at_equal_cost(base):
    st = assignment(base)
    key = (0, first_block(base[1]))
    f = st.facts[key]
    # the layer's D2D round trip exceeds its live interval by exactly one forward (Table III t3)
    from dataclasses import replace
    st.facts[key] = replace(f, live_s=0.010, fwd_s=0.004, d2d_s=0.007, tensors=())
    ranked = choices(st, key, [D2D, RC])
    assert ranked[0][1] is RC and ranked[1][1] is D2D


def test_d2d_short_of_spare_moves_fewer_tensors_not_every_nth_microbatch(base):
    st = assignment(base)
    key = (0, first_block(base[1]))
    whole = st.held_bytes(key, 1, None)
    st.spare_left[1] = whole // 2  # room for half of the layer's in-flight bytes
    st.set(key, D2D, "")
    assert st.period.get(key, 1) == 1
    sub = st.tensors[key]
    assert st.held_bytes(key) <= whole // 2
    assert list(sub) == sorted(LONGEST_LIVED_FIRST[:len(sub)])


def test_planning_with_saved_tensors_fits_and_says_which_tensors_move(base):
    model, _ = base
    out = mpress_search(MPressPolicy(), model, DGX1, TRAINING, ONE_F_ONE_B)
    assert out.fits
    result = simulate(validate_plan(out.plan, model, DGX1), model, DGX1).result
    assert not any(d.oom for d in result.devices)
    items = [(s, m) for s, st in enumerate(out.plan.stages) for m in st.memory]
    assert not any(m.tensors is not None and m.microbatch_period > 1 for _, m in items)
    assert why_conflicts(out) == []
    rep = report(out)
    for s, m in items:
        row = next(r for r in rep["stages"][str(s)] if r["layer"] == m.layer)
        if m.tensors is None:
            assert row["tensors"] is None
        else:
            names = [model.layers[m.layer].saved_tensors[i].name for i in m.tensors]
            assert [t["name"] for t in row["tensors"]] == names
            assert all(n in row["why"] for n in names)


def test_a_model_without_saved_tensors_plans_as_the_per_layer_planner(base, monkeypatch):
    # the per-tensor branches switched off (choices = options, no trim) give the same plan
    model = without_tensors(base[0])
    out = mpress_search(MPressPolicy(), model, DGX1, TRAINING, ONE_F_ONE_B)
    assert not any(m.tensors is not None for st in out.plan.stages for m in st.memory)
    import planners.mpress.improve as improve

    def layer_only(st, key, techniques):
        return [(c, a, None) for c, a in choice.options(st, key, techniques)]

    monkeypatch.setattr(choice, "choices", layer_only)
    monkeypatch.setattr(improve, "choices", layer_only)
    monkeypatch.setattr(choice, "trim", lambda st, key, a, tensors: tensors)
    again = mpress_search(MPressPolicy(), model, DGX1, TRAINING, ONE_F_ONE_B)
    assert again.plan.model_dump_json() == out.plan.model_dump_json()
    assert again.iteration_s == out.iteration_s
