"""planners/mpress/compact.py: MPress's per-layer compaction (§III-C/D) of a given layout.

What a caller (policy=auto's layout search) relies on: a layout with data- or tensor-parallel
stages over a memory budget comes back fitting on the simulated timeline, on the same devices, as
a valid plan; a layout that fits comes back as it was; D2D swaps leave only one-device stages
(the executor would send every replica's stripes, the simulator counts one share); the same
inputs give the same plan. Every peak checked here is simulated again on the real hardware.
"""
from __future__ import annotations

import pytest

from costs.families import build_model, parse_model_config
from planners.layout import assemble
from planners.mpress.compact import FITS_AS_IS, compact
from planners.mpress.mapping import search_mapping
from simulator import simulate
from specs import HardwareSpec, TrainingSpec
from specs.plan import MemoryAction, OffloadPolicy, Plan, ScheduleSpec, StagePlan, validate_plan
from tests.conftest import conf

GIB = 1 << 30
DGX1 = HardwareSpec.model_validate(conf("hardware", "dgx1"))
TRAINING = TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")  # conf/config.yaml defaults
ONE_F_ONE_B = ScheduleSpec(kind="1f1b")


def gpt(name: str):
    return build_model(parse_model_config(conf("model", name)), TRAINING.act_dtype_bytes)


def pp4(model, dp: int, tp: int) -> Plan:
    """Four stages of two devices each on the DGX-1 (pairs 0-1, 2-3, ...), layers split evenly."""
    n = model.num_layers
    counts = [n // 4 + (i < n % 4) for i in range(4)]
    return assemble("test", model, DGX1, TRAINING, ONE_F_ONE_B, counts, [[2 * i, 2 * i + 1] for i in range(4)],
                    dp, tp, "none", 0)


def mixed(model) -> Plan:
    """One-device stages (d0, d3) in front of a tp2 (d1+d2, both NVLink peers of d0 and d3), a dp2 and
    a tp2 stage: 1F1B's early stages are the heavy ones."""
    groups = [([0], 1, 1), ([3], 1, 1), ([1, 2], 1, 2), ([4, 5], 2, 1), ([6, 7], 1, 2)]
    n = model.num_layers
    stages, start = [], 0
    for i, (devices, dp, tp) in enumerate(groups):
        stop = start + n // 5 + (i < n % 5)
        stages.append(StagePlan(layer_start=start, layer_stop=stop, devices=devices, dp=dp, tp=tp))
        start = stop
    return Plan(planner="test", model=model.name, hardware=DGX1.name, num_devices=DGX1.num_devices,
                training=TRAINING, schedule=ONE_F_ONE_B, stages=stages)


def peaks(plan: Plan, model) -> dict[int, int]:
    result = simulate(validate_plan(plan, model, DGX1), model, DGX1, trace=False).result
    return {d.device: d.peak_bytes for d in result.devices}


@pytest.mark.parametrize("name, dp, tp, capacity", [
    ("gpt_10b3", 1, 2, DGX1.device.memory_bytes),  # tp2 x pp4: 36.6 GiB without actions
    ("gpt_5b3", 2, 1, 28 * GIB),                    # dp2 x pp4: 32.3 GiB, under a user budget
])
def test_a_parallel_layout_over_its_budget_comes_back_fitting_on_its_devices(name, dp, tp, capacity):
    model = gpt(name)
    plan = pp4(model, dp, tp)
    assert max(peaks(plan, model).values()) > capacity  # the premise: it does not fit as given
    out = compact(plan, model, DGX1, capacity)
    assert out is not None and out.fits, out.stop
    assert [s.devices for s in out.plan.stages] == [s.devices for s in plan.stages]
    assert [(s.dp, s.tp) for s in out.plan.stages] == [(dp, tp)] * 4
    for device, peak in peaks(out.plan, model).items():  # validates, and simulated on the real device
        assert peak <= capacity, f"device {device} at {peak / GIB:.2f} GiB over {capacity / GIB:.2f} GiB"
    assert {d.capacity_bytes for d in out.result.devices} == {capacity}
    assert max(d.peak_bytes for d in out.result.devices) <= capacity
    assert out.stop != FITS_AS_IS and out.simulations > 1 and out.log


def test_a_layout_that_fits_comes_back_unchanged():
    model = gpt("gpt_5b3")
    plan = pp4(model, 1, 2)  # 19.5 GiB of 32
    out = compact(plan, model, DGX1, DGX1.device.memory_bytes)
    assert out.fits and out.stop == FITS_AS_IS and out.simulations == 1
    assert out.plan.model_dump_json() == plan.model_dump_json()


def test_d2d_swaps_leave_one_device_stages_only_for_peers():
    model = gpt("gpt_5b3")
    plan = mixed(model)
    out = compact(plan, model, DGX1, 19 * GIB)  # tight enough that a one-device stage needs its peers
    assert out.fits, out.stop
    for device, peak in peaks(out.plan, model).items():
        assert peak <= 19 * GIB, f"device {device} over the budget"
    d2d = [(i, m) for i, st in enumerate(out.plan.stages) for m in st.memory if m.action is MemoryAction.d2d_swap]
    assert d2d, "no layer was D2D-swapped: the rule below is not exercised"
    for i, m in d2d:
        stage = out.plan.stages[i]
        assert stage.dp * stage.tp == 1, f"stage {i} of dp {stage.dp} x tp {stage.tp} D2D-swaps layer {m.layer}"
        assert all(DGX1.is_peer(stage.devices[0], t.device) for t in m.targets)


def test_same_inputs_give_the_same_plan():
    model = gpt("gpt_5b3")
    a = compact(mixed(model), model, DGX1, 24 * GIB)
    b = compact(mixed(model), model, DGX1, 24 * GIB)
    assert a.plan.model_dump_json() == b.plan.model_dump_json()
    assert (a.stop, a.simulations, a.log) == (b.stop, b.simulations, b.log)


def test_plans_it_does_not_take_give_none():
    model = gpt("gpt_5b3")
    n = model.num_layers
    stages = [StagePlan(layer_start=j * n // 8, layer_stop=(j + 1) * n // 8, devices=[j % 4]) for j in range(8)]
    interleaved = Plan(planner="test", model=model.name, hardware=DGX1.name, num_devices=DGX1.num_devices,
                       training=TRAINING, schedule=ScheduleSpec(kind="interleaved_1f1b", virtual_stages=2),
                       stages=stages)
    assert compact(interleaved, model, DGX1, 8 * GIB) is None
    plan = mixed(model)
    windowed = plan.model_copy(update={"stages": [plan.stages[0].model_copy(
        update={"offload": OffloadPolicy(window_layers=2)})] + plan.stages[1:]})
    assert compact(windowed, model, DGX1, 8 * GIB) is None


def test_capacity_above_the_device_is_an_error():
    model = gpt("gpt_5b3")
    with pytest.raises(ValueError, match="capacity_bytes"):
        compact(pp4(model, 1, 2), model, DGX1, DGX1.device.memory_bytes + 1)


def test_pairs_keep_stripes_off_forbidden_targets():
    # identity over d0, d3, d1: d0 may stripe to both peers; forbidding 0->2 leaves only d3
    free = search_mapping(DGX1, (0, 3, 1), [8 * GIB, 0, 0], [0, 4 * GIB, 4 * GIB], mode="identity")
    assert [t for t, _ in free.targets[0]] == [1, 2]
    pairs = [[False, True, False], [False] * 3, [False] * 3]
    ruled = search_mapping(DGX1, (0, 3, 1), [8 * GIB, 0, 0], [0, 4 * GIB, 4 * GIB], mode="identity", pairs=pairs)
    assert [t for t, _ in ruled.targets[0]] == [1]
    with pytest.raises(ValueError, match="pairs"):
        search_mapping(DGX1, (0, 3, 1), [8 * GIB, 0, 0], [0, 4 * GIB, 4 * GIB], pairs=pairs)
