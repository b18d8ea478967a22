"""policy=stronghold's streams (§IV-A, planners/stronghold/streams.py): the fastest simulated S that
fits (the paper's memory bound), 1 unless more gain over PLATEAU; forced values and plans refused
by the field's name where the contract (specs.plan_memory.OffloadPolicy.streams) does not allow them."""
from __future__ import annotations

import pytest

from planners import PlanningError, parse_policy
from planners.stronghold.planner import PLATEAU, stronghold_search, summary_lines, report
from planners.stronghold.streams import choose_streams, price_streams, with_streams
from simulator import simulate
from specs.plan import OffloadPolicy, Plan, PlanError, ScheduleSpec, StagePlan, validate_plan
from specs.training import TrainingSpec
from tests.conftest import make_hardware, make_model

MODEL = make_model(6, params=10_000_000, flops=2e11)
TRAIN = TrainingSpec(global_batch=8, microbatch_size=1, precision="fp16")  # 8 microbatches: S in 1, 2, 4, 8


def hw(pcie_gbps: float, memory_bytes: int | None = None):
    h = make_hardware(1) if memory_bytes is None else make_hardware(1, memory_bytes=memory_bytes)
    return h.model_copy(update={"host": h.host.model_copy(update={"pcie_gbps": pcie_gbps})})


def windowed(streams: int = 1, training: TrainingSpec = TRAIN) -> Plan:
    st = StagePlan(layer_start=0, layer_stop=6, devices=[0],
                   offload=OffloadPolicy(window_layers=2, resident_layers=[0, 5], streams=streams))
    return Plan(planner="manual", model=MODEL.name, hardware="toyhw", num_devices=1, training=training, stages=[st])


def test_the_planners_price_of_each_s_is_the_simulators_iteration():
    """A one-stage pipeline: the planner's arithmetic walk (planner.price) and the simpy engine give
    the same iteration for every S, nanosecond for nanosecond."""
    h = hw(2.0)
    for S, p in price_streams(windowed(), MODEL, h, 0, h.device.memory_bytes):
        assert round(p.time_s * 1e9) == round(simulate(windowed(S), MODEL, h).result.iteration_time_s * 1e9)


def test_a_pcie_bound_window_takes_the_fastest_s_that_fits():
    """2 GB/s: the fetches bind; one fetch per group pass amortises them, so S = 8 is fastest."""
    h = hw(2.0)
    plan, why = choose_streams(windowed(), MODEL, h, 0, h.device.memory_bytes)
    times = {S: simulate(windowed(S), MODEL, h).result.iteration_time_s for S in (1, 2, 4, 8)}
    best = min(times.values())
    chosen = plan.stages[0].offload.streams
    assert chosen == min(S for S, t in times.items() if t <= best * (1 + PLATEAU))
    assert chosen > 1 and times[1] > best * (1 + PLATEAU)
    assert why.startswith(f"streams {chosen}:") and "faster than one stream" in why


def test_s_is_1_when_two_workers_do_not_fit():
    """Capacity between one and two workers' peaks: §IV-A's OOM bound keeps one stream."""
    h = hw(2.0)
    peaks = {S: simulate(windowed(S), MODEL, h).result.devices[0].peak_bytes for S in (1, 2)}
    assert peaks[2] > peaks[1]
    plan, why = choose_streams(windowed(), MODEL, h, 0, peaks[1] + (peaks[2] - peaks[1]) // 2)
    assert plan.stages[0].offload.streams == 1 and "do not fit" in why
    plan, _ = choose_streams(windowed(), MODEL, h, 0, peaks[2])  # exactly two workers' peak: 2 fit
    assert plan.stages[0].offload.streams == 2


def test_s_is_1_when_more_workers_gain_under_the_plateau():
    """A fast link and a fast CPU optimizer, GEMM-less layers on a flat curve: a group costs S·t(b),
    the transfers and CPU steps are hidden anyway: nothing to gain, one stream. (With the toy's
    default CPU rate the next forward waits for the CPU steps, eq. 3, and a longer group pass hides
    more of that: 6 % at S = 2, and S = 2 is chosen.)"""
    h = hw(1000.0)
    h = h.model_copy(update={"host": h.host.model_copy(update={"cpu_adam_params_per_s": 1e15})})
    plan, why = choose_streams(windowed(), MODEL, h, 0, h.device.memory_bytes)
    assert plan.stages[0].offload.streams == 1 and "plateau" in why


def test_the_choice_is_deterministic():
    h = hw(2.0)
    a, b = (choose_streams(windowed(), MODEL, h, 0, h.device.memory_bytes) for _ in range(2))
    assert a[0].model_dump_json() == b[0].model_dump_json() and a[1] == b[1]


def test_policy_stronghold_chooses_streams_and_the_window_for_them_and_says_so():
    h = hw(2.0)
    out = stronghold_search(parse_policy({"kind": "stronghold", "pp": 1}), MODEL, h, TRAIN, ScheduleSpec())
    st, choice = out.plan.stages[0], out.stages[0]
    assert st.offload.streams == choice.streams > 1
    validate_plan(out.plan, MODEL, h)
    # the window's price is at the chosen S: the simulator times the plan as priced
    price = next(p for p in choice.prices if p.window == choice.window)
    assert round(price.time_s * 1e9) == round(simulate(out.plan, MODEL, h).result.iteration_time_s * 1e9)
    assert any(f"multi-stream (§IV-A): streams {choice.streams}:" in line for line in summary_lines(out))
    assert report(out)["stages"][0]["streams"] == choice.streams


def test_policy_streams_forces_and_is_refused_by_name():
    h = hw(2.0)
    pol = lambda **kw: parse_policy({"kind": "stronghold", "pp": 1, **kw})  # noqa: E731
    assert stronghold_search(pol(streams=2), MODEL, h, TRAIN, ScheduleSpec()).plan.stages[0].offload.streams == 2
    with pytest.raises(PlanningError, match=r"policy.streams: 3 does not divide the 8 microbatches.*\[1, 2, 4, 8\]"):
        stronghold_search(pol(streams=3), MODEL, h, TRAIN, ScheduleSpec())
    two = make_hardware(2)
    with pytest.raises(PlanningError, match="policy.streams: 2 workers share the window of a one-stage pipeline"):
        stronghold_search(parse_policy({"kind": "stronghold", "pp": 2, "streams": 2}), MODEL, two, TRAIN,
                          ScheduleSpec())


def test_validation_names_the_field_and_the_allowed_values():
    h = hw(12.0)
    with pytest.raises(PlanError) as e:
        validate_plan(windowed(3), MODEL, h)
    assert [loc for loc, _ in e.value.errors] == ["stages[0].offload.streams"]
    assert "allowed: [1, 2, 4, 8]" in e.value.errors[0][1]
    two = make_hardware(2)
    stages = [StagePlan(layer_start=0, layer_stop=3, devices=[0],
                        offload=OffloadPolicy(window_layers=1, resident_layers=[0], streams=2)),
              StagePlan(layer_start=3, layer_stop=6, devices=[1])]
    plan = Plan(planner="manual", model=MODEL.name, hardware="toyhw", num_devices=2, training=TRAIN, stages=stages)
    with pytest.raises(PlanError) as e:
        validate_plan(plan, MODEL, two)
    assert [loc for loc, _ in e.value.errors] == ["stages[0].offload.streams"]
    assert "allowed streams here: 1" in e.value.errors[0][1]
    with pytest.raises(ValueError, match="streams: 2 concurrent workers share a STRONGHOLD window"):
        OffloadPolicy(streams=2)
    validate_plan(windowed(8), MODEL, h)  # every divisor is allowed
    assert with_streams(windowed(), 0, 4).stages[0].offload.streams == 4


def test_the_window_for_the_chosen_streams_is_no_slower_than_the_one_stream_window():
    """The 1.7B in fp16 at microbatch 2 on the V100 (PCIe-bound at one stream): S > 1 is chosen, then
    the window is chosen again for S and kept only if no slower than the one-stream window at S (the
    §III-D rule counts link stalls; a smaller first window leaves more CPU-step wait, eq. 3)."""
    from planners.stronghold.planner import with_window
    from costs import window as win
    from costs.families import build_model, parse_model_config
    from specs.hardware import HardwareSpec
    from tests.conftest import conf

    model = build_model(parse_model_config(conf("model", "stronghold_gpt_l20")))
    v100 = HardwareSpec.model_validate(conf("hardware", "v100_single"))
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp16")
    one = stronghold_search(parse_policy({"kind": "stronghold", "pp": 1, "streams": 1}), model, v100, training,
                            ScheduleSpec())
    out = stronghold_search(parse_policy({"kind": "stronghold", "pp": 1}), model, v100, training, ScheduleSpec())
    S = out.plan.stages[0].offload.streams
    assert S > 1
    at_s = with_streams(one.plan, 0, S)  # the one-stream window and residents, S workers
    t = {k: simulate(p, model, v100, trace=False).result.iteration_time_s for k, p in
         (("chosen", out.plan), ("one-stream window", at_s), ("one stream", one.plan))}
    assert t["chosen"] <= t["one-stream window"] < t["one stream"] / (1 + PLATEAU)
    # and the rule's own window for S, when not kept, is slower
    if out.stages[0].window == one.stages[0].window:
        base = win.default_resident(model, one.plan.stages[0])
        rule = min(p.window for p in out.stages[0].prices if p.stall_s == 0 and p.fits)
        if rule != out.stages[0].window:
            from planners.stronghold.planner import resident_of
            ruled = with_window(at_s, 0, rule, resident_of(at_s, 0, base, rule, True), False)
            assert simulate(ruled, model, v100, trace=False).result.iteration_time_s > t["chosen"]

