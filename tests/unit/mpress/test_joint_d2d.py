"""planners/mpress/joint.py and the remap for the room compaction made: MPress's D2D swap engages
where every stage overflows the base pipeline (issue 24 item 3).

GPT-15.4B under DAPPLE's 1F1B on the DGX-1 (the paper's Fig. 9 model) overflows every stage of the
compute-balanced pipeline, so the base has no spare peer memory; MPress still places D2D swaps
(Table IV: later stages compacted more host the early stages' swaps). The plan is simulated again
here and every D2D target checked against its capacity on the simulated timeline.
"""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
from planners.mpress.assign import Assignment
from planners.mpress.base import base_plan
from planners.mpress.facts import CPU, D2D, RC, LayerFacts
from planners.mpress.joint import load_s, make_room, shortfall, sources
from planners.mpress.mapping import Mapping
from planners.mpress.planner import mpress_search
from planners.policy import MPressPolicy
from simulator import simulate
from specs import HardwareSpec, TrainingSpec
from specs.plan import MemoryAction, ScheduleSpec, validate_plan
from tests.conftest import conf

DGX1 = HardwareSpec.model_validate(conf("hardware", "dgx1"))
TRAINING = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")  # the preset's
ONE_F_ONE_B = ScheduleSpec(kind="1f1b")
MIB = 1 << 20


def gpt(name: str):
    return build_model(parse_model_config(conf("model", name)), TRAINING.act_dtype_bytes)


@pytest.fixture(scope="module")
def gpt_15b4():
    model = gpt("gpt_15b4")
    return model, mpress_search(MPressPolicy(), model, DGX1, TRAINING, ONE_F_ONE_B)


def test_gpt_15b4_on_dgx1_fits_with_d2d_swaps(gpt_15b4):
    model, out = gpt_15b4
    assert out.fits
    d2d = [(s, m) for s, st in enumerate(out.plan.stages) for m in st.memory if m.action is MemoryAction.d2d_swap]
    assert d2d, "no layer was D2D-swapped"
    result = simulate(validate_plan(out.plan, model, DGX1), model, DGX1).result
    assert not any(d.oom for d in result.devices)
    by_device = {d.device: d for d in result.devices}
    for s, m in d2d:
        for t in m.targets:
            assert t.device != out.plan.stages[s].devices[0]
            assert by_device[t.device].peak_bytes <= by_device[t.device].capacity_bytes


def test_gpt_15b4_every_stage_overflows_the_base(gpt_15b4):
    # the situation the joint compaction is for: no stage of the base has spare memory
    model, out = gpt_15b4
    base = base_plan(MPressPolicy(), model, DGX1, TRAINING, ONE_F_ONE_B)
    result = simulate(base, model, DGX1).result
    assert all(d.oom for d in result.devices)


# ---- make_room on constructed facts ---------------------------------------------------------------

@pytest.fixture(scope="module")
def base10():
    model = gpt("gpt_10b3")
    return model, base_plan(MPressPolicy(), model, DGX1, TRAINING, ONE_F_ONE_B)


def assignment(base, src_fwd_s: float = 0.010) -> Assignment:
    """Stage 0 stripes onto stage 1; stage 0's recompute costs ``src_fwd_s`` and its D2D hides; stage 1's
    layers recompute for 4 ms and do not CPU-swap in time; no spare anywhere yet."""
    model, plan = base
    p = len(plan.stages)
    targets = tuple(((1, 1.0),) if s == 0 else () for s in range(p))
    mapping = Mapping(device_of_stage=tuple(range(p)), targets=targets, stripe_bytes=tuple(() for _ in range(p)),
                      placed_bytes=(0.0,) * p, swap_time_s=(0.0,) * p, boundary_time_s=0.0, candidates=1, exact=True)

    def fact(s, l):
        return LayerFacts(stage=s, layer=l, saved_bytes=64 * MIB, fwd_s=src_fwd_s if s == 0 else 0.004, live_s=0.5,
                          cpu_s=1.0, d2d_s=0.001)

    facts = {(s, l): fact(s, l) for s, stage in enumerate(plan.stages) for l in stage.layers}
    st = Assignment(plan, model, facts, mapping, [RC, CPU, D2D], DGX1.device.memory_bytes)
    st.spare_left = {s: 0 for s in range(p)}
    st.fwd_s = {s: 0.050 for s in range(p)}
    st.bwd_s = {s: 0.100 for s in range(p)}
    return st


def test_make_room_recomputes_the_targets_late_layers_until_the_stripes_fit(base10):
    st = assignment(base10)
    src = (0, base10[1].stages[0].layers[0])
    st.set(src, RC, "")
    st.set((0, base10[1].stages[0].layers[1]), RC, "")
    assert sources(st)[0] == src
    lack = shortfall(st, src)[1]
    assert lack == st.held_bytes(src, 1) > 0
    made = make_room(st, src, [RC, CPU, D2D], load_s(st, 0))
    assert made is not None
    t_layers = list(base10[1].stages[1].layers)
    got = [k[1] for k, _, _ in made]
    assert all(a is RC for _, a, _ in made)  # CPU swap does not hide there; D2D is not a target's own move
    assert got == t_layers[::-1][:len(got)]  # latter layers first, consecutive
    assert sum(st.held_bytes(k) for k, _, _ in made) >= lack
    assert st.stripes_for(src) == (((1, 1.0),), 1)


def test_make_room_refuses_to_load_a_target_as_much_as_the_source(base10):
    st = assignment(base10, src_fwd_s=0.006)
    src = (0, base10[1].stages[0].layers[0])
    st.set(src, RC, "")  # source stage load: 6 ms; hosting it takes at least two 4 ms recomputes
    need = -(-st.held_bytes(src, 1) // (st.in_flight[1] * 64 * MIB))
    assert need * 0.004 >= 0.006  # the constructed case is the one it claims to be
    saved = st.snapshot()
    assert make_room(st, src, [RC, CPU, D2D], load_s(st, 0)) is None
    st.restore(saved)
    assert st.actions == {src: RC}
