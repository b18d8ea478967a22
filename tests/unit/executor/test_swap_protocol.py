"""executor.swap and executor.d2d without process groups: the stripe arithmetic, the order a d2d
target expects (replayed from the source's action list), and a stage run alone in this process
with swapped layers — bit-exact gradients, lower device peak, host bytes reported."""
from __future__ import annotations

import pytest
import torch

from executor.d2d import stripe_bounds, swap_pairs, target_events
from executor.single import run_stage_alone
from planners import make_plan, parse_policy
import costs.activations
from costs.families import build_model
from specs.plan import D2DTarget, LayerMemory, MemoryAction, ScheduleSpec, validate_plan
from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

SPEC = build_model(GPT_TINY, 4)


def pp4(schedule: str = "1f1b"):
    """embed+block0 | block1, block2 | block3 | head on devices 0..3."""
    return make_plan(parse_policy({"kind": "manual", "pp": 4, "layers_per_stage": [2, 2, 1, 1]}), SPEC, LOCAL_CPU,
                     CPU_TRAINING, ScheduleSpec(kind=schedule))


def with_memory(plan, memory: dict[int, list[LayerMemory]]):
    stages = [st.model_copy(update={"memory": memory.get(i, st.memory)}) for i, st in enumerate(plan.stages)]
    return validate_plan(plan.model_copy(update={"stages": stages}), SPEC, LOCAL_CPU)


def d2d(layer: int, targets=((2, 1.0), (3, 3.0))) -> LayerMemory:
    return LayerMemory(layer=layer, action=MemoryAction.d2d_swap,
                       targets=[D2DTarget(device=d, weight=w) for d, w in targets])


@pytest.mark.parametrize("nbytes", [0, 1, 7, 1000, 12345])
@pytest.mark.parametrize("weights", [[1.0], [1.0, 3.0], [2.0, 1.0, 1.0], [1e-6, 1.0]])
def test_stripes_tile_the_buffer_in_weight_proportion(nbytes, weights):
    bounds = stripe_bounds(nbytes, weights)
    assert bounds[0][0] == 0 and bounds[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no overlap
    for (lo, hi), w in zip(bounds[:-1], weights):
        assert abs((hi - lo) - nbytes * w / sum(weights)) <= 0.5  # rounded share; the last takes the rest


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "pipedream_async"])
def test_target_sees_each_swap_out_then_its_request_in_backward_order(schedule):
    plan = with_memory(pp4(schedule), {0: [d2d(0), LayerMemory(layer=1, action=MemoryAction.cpu_swap)],
                                      1: [d2d(2), d2d(3, ((3, 1.0),))]})
    assert swap_pairs(plan) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    m = plan.training.microbatches
    for src, dst, layers in [(0, 2, [0]), (0, 3, [0]), (1, 2, [2]), (1, 3, [3, 2])]:
        events = target_events(plan, src, dst)
        outs = [e[1:] for e in events if e[0] == "out"]
        ins = [e[1:] for e in events if e[0] == "in"]
        stage = plan.stages_on(src)[0]
        assert sorted(outs) == sorted(ins) == sorted((stage, k, l) for k in range(m) for l in layers)
        for e in outs:
            assert events.index(("out", *e)) < events.index(("in", *e))  # out before its fetch
        for k in range(m):  # a microbatch's layers come back last layer first
            assert [l for s, kk, l in ins if kk == k] == sorted(layers, reverse=True)
    assert target_events(plan, 2, 3) == []  # device 2 swaps nothing


def test_gpipe_fetches_next_microbatch_first_layer_one_pass_ahead():
    """GPipe: B1's swap_in entries sit before B0 (one pass ahead), so device 3 gets B1's first
    request before B0's second: the order the source's prefetch issues them."""
    plan = with_memory(pp4("gpipe"), {1: [d2d(2, ((3, 1.0),)), d2d(3, ((3, 1.0),))]})
    ins = [e[1:] for e in target_events(plan, 1, 3) if e[0] == "in"]
    assert ins[:4] == [(1, 0, 3), (1, 1, 3), (1, 0, 2), (1, 2, 3)]


def test_microbatch_period_swaps_every_nth_microbatch_only():
    """``microbatch_period`` 2: microbatches 0 and 2 swap layer 0, 1 and 3 keep it."""
    item = d2d(0).model_copy(update={"microbatch_period": 2})
    plan = with_memory(pp4(), {0: [item, d2d(1)]})
    events = target_events(plan, 0, 3)
    assert sorted(e[1:] for e in events if e[0] == "out") == sorted(
        [(0, k, 1) for k in range(4)] + [(0, 0, 0), (0, 2, 0)])
    assert [e for e in events if e[0] == "in" and e[2] == 1] == [("in", 0, 1, 1)]  # only layer 1: fetched first
    before = run_stage_alone(pp4(), GPT_TINY, 0, iterations=2, collect=True)
    after = run_stage_alone(plan, GPT_TINY, 0, iterations=2, collect=True)
    assert all(torch.equal(g, after["grads"][name]) for name, g in before["grads"].items())
    assert after["host_peak_bytes"] > 0


@pytest.mark.parametrize("action", ["cpu_swap", "nvme", "d2d_swap"])
def test_stage_alone_swaps_exactly_and_lowers_its_peak(action):
    """Stage 0 (embed + block 0, 4 microbatches in flight under 1F1B) alone on CPU: the swapped
    run's gradients equal the kept run's bit for bit (a swap copies bytes), its device peak is
    lower, and what left the device is in host memory (d2d_swap too: no peers here)."""
    mem = [LayerMemory(layer=l, action=action, targets=[D2DTarget(device=2, weight=1.0)] if action == "d2d_swap" else [])
           for l in (0, 1)]
    keep, swap = pp4(), with_memory(pp4(), {0: mem})
    a = run_stage_alone(keep, GPT_TINY, 0, iterations=2, collect=True)
    b = run_stage_alone(swap, GPT_TINY, 0, iterations=2, collect=True)
    assert a["grads"].keys() == b["grads"].keys()
    for name, g in a["grads"].items():
        assert torch.equal(g, b["grads"][name]), name
    assert a["host_peak_bytes"] == 0 < b["host_peak_bytes"]
    # at most every in-flight microbatch's saved bytes are on host: min(p - i, m) = 4 on stage 0
    # (the closed form over-counts this CPU's block: no dropout masks, no kept softmax)
    in_flight = costs.activations.in_flight_microbatches(swap, 0)
    assert b["host_peak_bytes"] <= in_flight * sum(costs.activations.layer_saved_bytes(SPEC.layers[l], 2, 1) for l in (0, 1))
    assert b["peak_bytes"] < a["peak_bytes"]
    # memory is moved, not lost: at the kept run's peak every byte is on the device or the host
    assert b["peak_bytes"] + b["host_peak_bytes"] >= a["peak_bytes"]


def test_preflight_counts_swapped_out_bytes_against_host_ram():
    """On CPU ranks a cpu_swap's host copies live in the same RAM as the ranks' "device" memory."""
    from executor.preflight import RANK_RUNTIME_BYTES, check
    from specs.result import DeviceResult, Result

    gib = 1 << 30
    cap = LOCAL_CPU.device.memory_bytes
    devices = [DeviceResult(device=d, rank=d, capacity_bytes=cap, peak_bytes=gib, host_bytes=2 * gib if d == 0 else 0)
               for d in range(4)]
    sim = Result(source="simulated", plan_id="p", model="m", hardware=LOCAL_CPU.name, devices=devices,
                 iteration_time_s=0.1, samples_per_s=80.0, tflops_per_device=0.01)
    need = 4 * (gib + RANK_RUNTIME_BYTES) + 2 * gib
    ok = dict(iterations=1, warmup=1, timeout_s=300.0)
    assert check(sim, LOCAL_CPU, host_available_bytes=need, **ok) == []
    (msg,) = check(sim, LOCAL_CPU, host_available_bytes=need - 1, **ok)
    assert msg.startswith("host RAM:") and "2.00 GiB swapped to host" in msg
