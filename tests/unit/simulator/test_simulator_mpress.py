"""The simulator's MPress mechanisms: optimizer state streamed through host memory, actions on
every n-th microbatch, the forward's wait for swap-outs, PCIe shared by the GPUs of a switch.

Toy specs (tests/conftest.py): 8 layers of 1 M params, 1 MiB saved per sample; expectations are
derived from the mechanism (bytes moved, link rates), not from recorded runs.
"""
from __future__ import annotations

import pytest

from planners import make_plan
from simulator.analytic import device_memory
from planners.policy import BalancedPolicy
from simulator import simulate
from specs import TrainingSpec
import costs.activations
import costs.static
from specs.plan import D2DTarget, LayerMemory, MemoryAction, ScheduleSpec, validate_plan
from tests.conftest import make_hardware, make_model

GIB = 1 << 30


def _plan(model, hw, training, pp=2, **stage0):
    plan = make_plan(BalancedPolicy(pp=pp), model, hw.model_copy(update={"devices_per_node": pp}), training,
                     ScheduleSpec(kind="1f1b"))
    plan = plan.model_copy(update={"num_devices": hw.num_devices})  # the other devices may be D2D targets
    stages = list(plan.stages)
    stages[0] = stages[0].model_copy(update=stage0)
    return validate_plan(plan.model_copy(update={"stages": stages}), model, hw)


def _dev(result, device):
    return next(d for d in result.devices if d.device == device)


def test_optimizer_swap_streams_the_state_and_lowers_the_peak():
    model, hw = make_model(params=50_000_000), make_hardware(devices=2, nvlink_pairs=((0, 1),))
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp16")
    plain = _plan(model, hw, training)
    swapped = _plan(model, hw, training, offload=plain.stages[0].offload.model_copy(update={"optimizer_swap": True}))
    a, b = simulate(plain, model, hw).result, simulate(swapped, model, hw).result
    opt = costs.static.stage_static(model, plain, plain.stages[0])[0].optimizer_bytes
    chunks = costs.static.optimizer_swap_chunks(model, swapped, swapped.stages[0])
    assert sum(chunks) == opt and len(chunks) == plain.stages[0].num_layers
    # resident: at most three layers' state at once instead of all of it
    assert _dev(a, 0).peak_bytes - _dev(b, 0).peak_bytes >= opt - costs.static.OPTIMIZER_SWAP_RESIDENT_CHUNKS * max(chunks)
    assert _dev(b, 0).host_bytes >= opt
    # every byte crosses the host link both ways; in and out use opposite directions, so at least
    # one direction's total is added to the position's critical path
    assert b.iteration_time_s - a.iteration_time_s >= opt / (hw.host.pcie_gbps * 1e9) * 0.99
    # the closed form agrees on the device peak within the chunks it cannot place in time
    closed = device_memory(swapped, model)[0][0].total_bytes
    assert abs(closed - _dev(b, 0).peak_bytes) <= costs.static.OPTIMIZER_SWAP_RESIDENT_CHUNKS * max(chunks)


def test_microbatch_period_swaps_every_nth_microbatch():
    model, hw = make_model(), make_hardware(devices=8, nvlink_pairs=((0, 4), (0, 5), (1, 4)))
    training = TrainingSpec(global_batch=32, microbatch_size=2)
    base = _plan(model, hw, training, pp=4)
    layer = base.stages[0].layer_start + 1

    def peaks(period):
        items = [] if period is None else [LayerMemory(
            layer=layer, action=MemoryAction.d2d_swap, targets=[D2DTarget(device=4, weight=1.0)],
            microbatch_period=period)]
        result = simulate(_plan(model, hw, training, pp=4, memory=items), model, hw).result
        target = next((d.peak_bytes for d in result.devices if d.device == 4), 0)
        return target, _dev(result, 0).peak_bytes

    one = costs.activations.layer_saved_bytes(model.layers[layer], 2, 1)
    n = costs.activations.in_flight_microbatches(base, 0)  # 4 on stage 0 of 4
    (t1, s1), (t2, s2), (_, s0) = peaks(1), peaks(2), peaks(None)
    # on the target's timeline: at least one stripe, never more than every in-flight microbatch's
    # (the closed form's bound: swap-ins are prefetched a pass ahead, so fewer coincide)
    assert one <= t1 <= n * one
    assert one <= t2 <= -(-n // 2) * one and t2 < t1   # every second microbatch only
    assert s1 <= s2 < s0  # the source keeps what it no longer swaps (prefetched copies may even it out)


def test_a_forward_waits_for_the_previous_swap_outs_instead_of_piling_memory():
    model = make_model(saved=64 << 20)  # big activations: a slow PCIe cannot keep up
    hw = make_hardware(devices=2, nvlink_pairs=((0, 1),))
    fast = hw.model_copy(update={"host": hw.host.model_copy(update={"pcie_gbps": 1e4})})
    slow = hw.model_copy(update={"host": hw.host.model_copy(update={"pcie_gbps": 0.5})})
    training = TrainingSpec(global_batch=16, microbatch_size=2)
    items = [LayerMemory(layer=l, action=MemoryAction.cpu_swap) for l in range(4)]
    results = {}
    for name, hw in (("fast", fast), ("slow", slow)):
        plan = _plan(model, hw, training, memory=items)
        sim = simulate(plan, model, hw)
        results[name] = (sim.result, [s for s in sim.trace["traceEvents"] if s.get("cat") == "stall"])
    (rf, stall_f), (rs, stall_s) = results["fast"], results["slow"]
    waited = lambda ev: sum(e["dur"] for e in ev)  # noqa: E731
    assert waited(stall_s) > 100 * waited(stall_f)  # fast PCIe: only the copies' launch latency
    assert rs.iteration_time_s > rf.iteration_time_s
    # bounded: at most the microbatch being swapped out besides what the schedule holds anyway
    swapped = sum(costs.activations.layer_saved_bytes(model.layers[l], 2, 1) for l in range(4))
    assert _dev(rs, 0).peak_bytes <= _dev(rf, 0).peak_bytes + swapped


@pytest.mark.parametrize("per_switch, slower", [(1, False), (2, True)])
def test_gpus_behind_one_pcie_switch_share_it(per_switch, slower):
    model = make_model(saved=64 << 20)
    hw = make_hardware(devices=2, nvlink_pairs=((0, 1),))
    hw = hw.model_copy(update={"host": hw.host.model_copy(update={"gpus_per_pcie_switch": per_switch})})
    training = TrainingSpec(global_batch=16, microbatch_size=2)
    plan = make_plan(BalancedPolicy(pp=2), model, hw, training, ScheduleSpec(kind="1f1b"))
    stages = [st.model_copy(update={"memory": [LayerMemory(layer=l, action=MemoryAction.cpu_swap) for l in st.layers]})
              for st in plan.stages]
    both = validate_plan(plan.model_copy(update={"stages": stages}), model, hw)
    alone = validate_plan(plan.model_copy(update={"stages": [stages[0], plan.stages[1]]}), model, hw)
    trace = simulate(both, model, hw).trace
    swaps = sorted((e["ts"], e["ts"] + e["dur"], e["pid"]) for e in trace["traceEvents"]
                   if e.get("cat") == "swap" and e["name"].startswith("swap_out"))
    overlap = any(a[1] > b[0] and a[2] != b[2] for a, b in zip(swaps, swaps[1:]))
    # one switch: the two GPUs' copies queue on it, never overlap; two uplinks: they may
    assert overlap is not slower
    assert simulate(alone, model, hw).result.iteration_time_s <= simulate(both, model, hw).result.iteration_time_s
