"""policy=stronghold (planners/stronghold/planner.py): the window it picks is the one the simulator finds.

The planner prices a window by walking the stage's passes with the simulator's own window
mechanism (simulator/window.py) driven by plain arithmetic; on a single stage nothing else runs
on the device, so its stalls must equal the simpy engine's exactly. The test simulates EVERY
window and checks the planner's choice against the smallest stall-free one that fits.
"""
from __future__ import annotations

import pytest

from planners import make_plan, parse_policy
from planners.layout import PlanningError
from costs import window as win
from planners.stronghold.planner import PLATEAU, resident_of, stronghold_search
from simulator.engine import Engine
from simulator.report import build_result
from costs.families import build_model, parse_model_config
from specs.hardware import HardwareSpec
from specs.plan import OffloadPolicy, ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf, make_hardware, make_model

V100 = HardwareSpec.model_validate(conf("hardware", "v100_single"))


def gpt(name: str):
    return build_model(parse_model_config(conf("model", name)))


def policy(**kw):
    return parse_policy({"kind": "stronghold", **kw})


def _engine(plan, model, hardware, w, resident=None):
    st = plan.stages[0]
    off = st.offload.model_copy(update={"window_layers": w,
                                        **({"resident_layers": resident} if resident is not None else {})})
    plan = plan.model_copy(update={"stages": [st.model_copy(update={"offload": off})]})
    engine = Engine(plan, model, hardware)
    engine.run()
    return engine


def simulate_window(plan, model, hardware, w, first_window=True):
    """(result, host-link stall ns after the cold start) of the simpy engine with ``w`` slots and
    the resident layers the planner gives window ``w`` (the embedding/head, and with
    ``first_window`` the first working window, §III-E1). The cold start is what the engine's
    compute waits for the host link with EVERY streamed layer in a slot (each fetched once, as the
    iteration starts): the stall no window hides (planner.cold_start_ns). Waits for the previous
    iteration's CPU steps (eq. 3, ``cpu_hold_ns``) are not the window's and are left out."""
    keep = resident_of(plan, 0, win.default_resident(model, plan.stages[0]), w, first_window)
    engine = _engine(plan, model, hardware, w, keep)
    result, _ = build_result(engine, model)
    link = lambda e: e.windows[0].stall_ns - e.windows[0].cpu_hold_ns  # noqa: E731
    cold = link(_engine(plan, model, hardware, plan.stages[0].num_layers - len(keep), keep))
    return result, link(engine) - min(cold, link(engine))


def one_gpu(hw: HardwareSpec, **host) -> HardwareSpec:
    return hw.model_copy(update={"nodes": 1, "devices_per_node": 1,
                                 "host": hw.host.model_copy(update=host) if host else hw.host})


CASES = [
    # (model, hardware, training, schedule): fetch vs compute ratios on both sides of 1
    ("toy_compute_bound", make_model(12, params=20_000_000, flops=4e11), one_gpu(make_hardware(1), pcie_gbps=12),
     TrainingSpec(global_batch=4, microbatch_size=2, precision="fp16"), "1f1b"),
    # device memory for a few slots only (2 resident layers x 18 B/param = 6.7 GiB, 1.1 GiB a slot)
    ("toy_pcie_bound", make_model(12, params=200_000_000, flops=1e11),
     one_gpu(make_hardware(1, memory_bytes=11 << 30), pcie_gbps=12),
     TrainingSpec(global_batch=4, microbatch_size=2, precision="fp16"), "1f1b"),
    ("toy_gpipe", make_model(10, params=50_000_000, flops=3e11), one_gpu(make_hardware(1), pcie_gbps=6),
     TrainingSpec(global_batch=6, microbatch_size=2, precision="fp16"), "gpipe"),
    ("gpt_1b7_b8", gpt("stronghold_gpt_l20"), V100,
     TrainingSpec(global_batch=8, microbatch_size=8, precision="fp16", mixed_bytes_per_param=16), "1f1b"),
    ("gpt_1b7_b2", gpt("stronghold_gpt_l20"), V100,
     TrainingSpec(global_batch=4, microbatch_size=2, precision="fp16"), "1f1b"),
]


@pytest.mark.parametrize("name,model,hw,training,schedule", CASES, ids=[c[0] for c in CASES])
def test_choice_is_the_smallest_stall_free_window_simulated(name, model, hw, training, schedule):
    sched = ScheduleSpec(kind=schedule)
    # one worker: the §III-D rule itself (with streams > 1 the window is that rule's only when no
    # slower than the one-stream window: tests/unit/stronghold/test_streams.py)
    outcome = stronghold_search(policy(streams=1), model, hw, training, sched)
    choice = outcome.stages[0].window
    n = outcome.stages[0].streamed
    first = outcome.stages[0].resident != win.default_resident(model, outcome.plan.stages[0])
    sims = {w: simulate_window(outcome.plan, model, hw, w, first) for w in range(1, n + 1)}
    fitting = [w for w, (r, _) in sims.items() if not r.devices[0].oom]
    stall_free = [w for w in fitting if sims[w][1] == 0]
    # the planner's own pricing of each window equals the engine's stalls, nanosecond for nanosecond
    for p in outcome.stages[0].prices:
        assert round(p.stall_s * 1e9) == sims[p.window][1]
        assert p.fits == (p.window in fitting)
    if stall_free:
        assert choice == min(stall_free)
    else:  # none hides the transfers: the plateau of the fitting windows (Fig. 9)
        best = min(sims[w][0].iteration_time_s for w in fitting)
        assert sims[choice][0].iteration_time_s <= best * (1 + PLATEAU) + 1e-9
        assert all(sims[w][0].iteration_time_s > best * (1 + PLATEAU) for w in fitting if w < choice)


def test_both_regimes_are_covered():
    """The cases above include a stall-free choice and a PCIe-bound one (else the test proves little)."""
    kinds = set()
    for name, model, hw, training, schedule in CASES[:2]:
        c = stronghold_search(policy(), model, hw, training, ScheduleSpec(kind=schedule)).stages[0]
        stall = next(p.stall_s for p in c.prices if p.window == c.window)
        kinds.add(stall > 0)
        assert (stall > 0) == ("PCIe" in c.why)
    assert kinds == {True, False}


def test_gpt3_13b_on_one_v100_fits_only_with_a_window():
    """The issue's check: fits under 32 GB with a window smaller than the layer count; balanced
    does not fit; a forced smaller window is slower."""
    from simulator import simulate

    model, training = gpt("gpt3_13b"), TrainingSpec(global_batch=64, microbatch_size=2, precision="fp16")
    sched = ScheduleSpec()
    plan = make_plan(policy(), model, V100, training, sched)
    w = plan.stages[0].offload.window_layers
    assert w < model.num_layers
    result = simulate(plan, model, V100).result
    assert not result.devices[0].oom and not result.devices[0].host_oom
    assert result.devices[0].peak_bytes < V100.device.memory_bytes
    balanced = make_plan(parse_policy({"kind": "balanced"}), model, V100, training, sched)
    assert simulate(balanced, model, V100).result.devices[0].oom
    # the same streams (§IV-A), one slot fewer
    smaller = make_plan(policy(window_layers=max(w - 1, 1), streams=plan.stages[0].offload.streams), model, V100,
                        training, sched)
    assert simulate(smaller, model, V100).result.iteration_time_s > result.iteration_time_s


def test_resident_layers_are_the_embedding_and_tied_head():
    model = gpt("gpt_tiny")
    hw = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
    outcome = stronghold_search(policy(pp=1), model, hw, TrainingSpec(global_batch=8, microbatch_size=2,
                                                                      precision="fp32"), ScheduleSpec())
    off = outcome.plan.stages[0].offload
    # Fig. 3's embedding and tied head, and §III-E1's first working window: the first w blocks
    w = off.window_layers
    assert off.resident_layers == [0, *range(1, 1 + w), model.num_layers - 1]
    assert outcome.plan.stages[0].streamed_layers == list(range(1 + w, model.num_layers - 1))
    # turned off (policy.resident_first_window=false): the embedding and the head only
    plain = stronghold_search(policy(pp=1).model_copy(update={"resident_first_window": False}), model, hw,
                              TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32"), ScheduleSpec())
    assert plain.plan.stages[0].offload.resident_layers == [0, model.num_layers - 1]


def test_pipeline_stages_each_get_a_window():
    model = gpt("gpt3_13b")
    hw = HardwareSpec.model_validate(conf("hardware", "a10_cluster"))
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp16")
    outcome = stronghold_search(policy(pp=8), model, hw, training, ScheduleSpec())
    assert len(outcome.plan.stages) == hw.num_devices
    assert all(st.offload.window_layers for st in outcome.plan.stages)
    # middle stages hold neither embedding nor head: only their first working window is resident
    st = outcome.plan.stages[3]
    keep = min(st.offload.window_layers, st.num_layers - st.offload.window_layers)  # costs.window.first_window
    assert st.offload.resident_layers == list(range(st.layer_start, st.layer_start + keep))


def test_host_ram_short_moves_the_optimizer_state_to_nvme():
    model = gpt("stronghold_gpt_l20")
    training = TrainingSpec(global_batch=8, microbatch_size=8, precision="fp16")
    small = one_gpu(V100, memory_bytes=20 << 30)  # 1.7B x 18 B/param = 28 GiB of streamed state
    outcome = stronghold_search(policy(), model, small, training, ScheduleSpec())
    assert outcome.stages[0].nvme and outcome.plan.stages[0].offload.nvme
    assert outcome.fits
    off = stronghold_search(policy(nvme="off"), model, small, training, ScheduleSpec())
    assert not off.fits and any("host RAM" in n for n in off.notes)
    tiny = one_gpu(V100, memory_bytes=20 << 30, nvme_bytes=1 << 30)
    assert not stronghold_search(policy(), model, tiny, training, ScheduleSpec()).fits


def test_a_window_larger_than_the_streamed_layers_is_refused_by_name():
    model = gpt("gpt_tiny")
    hw = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
    with pytest.raises(PlanningError, match="policy.window_layers"):
        stronghold_search(policy(pp=1, window_layers=9), model, hw,
                          TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32"), ScheduleSpec())


def test_bad_policy_values_name_the_field():
    with pytest.raises(Exception, match="nvme"):
        policy(nvme="maybe")
    with pytest.raises(Exception, match="window_layers"):
        policy(window_layers=0)


def test_offload_policy_contract_is_validated():
    with pytest.raises(ValueError, match="resident_layers"):
        OffloadPolicy(resident_layers=[0])
    with pytest.raises(ValueError, match="nvme"):
        OffloadPolicy(nvme=True)


def test_default_depth_is_the_fewest_stages_that_fit():
    """pp null with dp = tp = 1: a window keeps the model on as few GPUs as fit (STRONGHOLD §VI-D2)."""
    model = gpt("gpt3_13b")
    hw = HardwareSpec.model_validate(conf("hardware", "a10_cluster"))
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp16")
    outcome = stronghold_search(policy(dp=1, tp=1), model, hw, training, ScheduleSpec())
    assert outcome.fits and len(outcome.plan.stages) == 1 and outcome.plan.used_devices() == [0]
    # a toy model whose resident end layers (0 and 11, 3.4 GiB each with their optimizer state) cannot
    # share one 6 GiB device: the fewest stages that fit is 2
    toy = make_model(12, params=200_000_000, flops=1e11)
    small = make_hardware(4, memory_bytes=6 << 30)
    deeper = stronghold_search(policy(dp=1, tp=1), toy, small, training, ScheduleSpec())
    assert deeper.fits and len(deeper.plan.stages) == 2
    assert not stronghold_search(policy(pp=1, dp=1, tp=1), toy, small, training, ScheduleSpec()).fits


def test_nvme_without_a_drive_is_refused_by_name_or_left_off():
    """Issue #22 (seed 9001): policy.nvme=on (or auto with host RAM short) on hardware with no NVMe
    planned NVMe stages that validate_plan then refused once per stage; now ``on`` names
    policy.nvme, and ``auto`` keeps the state in host RAM and says the node has no NVMe."""
    model = gpt("stronghold_gpt_l20")
    training = TrainingSpec(global_batch=8, microbatch_size=8, precision="fp16")
    no_drive = one_gpu(V100, memory_bytes=20 << 30, nvme_bytes=0)
    with pytest.raises(PlanningError, match="policy.nvme: on, but hardware .* has no NVMe"):
        stronghold_search(policy(nvme="on"), model, no_drive, training, ScheduleSpec())
    auto = stronghold_search(policy(), model, no_drive, training, ScheduleSpec())
    assert not auto.plan.stages[0].offload.nvme and not auto.fits
    assert any("has no NVMe" in n for n in auto.notes)


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_a_stages_passes_are_its_forwards_and_backwards_in_schedule_order(kind, v):
    """planners.stronghold.planner._passes reads the compute order alone; it equals the forwards and
    backwards of the stage in the device's full action list (specs.schedule.build_schedule)."""
    from planners.stronghold.planner import _passes
    from specs.schedule import ActionKind, build_schedule

    model = gpt("gpt_tiny")
    hw = make_hardware(4 // v)
    training = TrainingSpec(global_batch=16, microbatch_size=2, precision="fp32")
    sched = ScheduleSpec(kind=kind, virtual_stages=v)
    plan = make_plan(parse_policy({"kind": "even", "pp": 4 // v}), model, hw, training, sched)
    for s in range(len(plan.stages)):
        acts = build_schedule(plan)[plan.device_group_of(s)]
        want = [("F" if a.kind is ActionKind.forward else "B", a.microbatch) for a in acts
                if a.stage == s and a.kind in (ActionKind.forward, ActionKind.backward)]
        assert _passes(plan, s) == want
