"""ZeRO-Offload in the simulator (simulator/optimizer.py ``_offloaded_step``; Ren et al., ATC'21):
each layer's gradient goes to the host as the last backward passes it (§4.1), the CPU steps
once they are all in (§5.1), the weights come back (§4.1); with DPU (§5.2) the CPU step overlaps
the next iteration. Closed forms on a toy model of 6 equal layers, one stage."""
from __future__ import annotations

import json

import pytest

from costs.layer_time import layer_pass_times_s
from simulator import simulate
from simulator.engine import Engine
from specs.plan import OffloadPolicy, Plan, StagePlan
from specs.training import TrainingSpec
from tests.conftest import make_hardware, make_model

LAYERS, PARAMS = 6, 10_000_000
MODEL = make_model(LAYERS, params=PARAMS, flops=2e11)
TRAIN = TrainingSpec(global_batch=4, microbatch_size=2, precision="fp16")  # 2 microbatches
W_B, G_B, O_B = TRAIN.bytes_per_param()


def hw(pcie_gbps=12.0, cpu_adam=1e9, nvme_gbps=0.0, nvme_bytes=0):
    h = make_hardware(1)
    host = h.host.model_copy(update={"pcie_gbps": pcie_gbps, "cpu_adam_params_per_s": cpu_adam,
                                     "nvme_gbps": nvme_gbps, "nvme_bytes": nvme_bytes})
    return h.model_copy(update={"host": host})


def plan_of(**offload) -> Plan:
    stage = StagePlan(layer_start=0, layer_stop=LAYERS, devices=[0], offload=OffloadPolicy(**offload))
    return Plan(planner="manual", model=MODEL.name, hardware="toyhw", num_devices=1, training=TRAIN, stages=[stage])


def copy_s(h, nbytes: int) -> float:
    """One host copy: latency + bytes / bandwidth (the PCIe link, GB/s)."""
    return h.host.pcie_latency_s + nbytes / (h.host.pcie_gbps * 1e9)


def layer_bwd_s(plan, h) -> float:
    return layer_pass_times_s(MODEL, plan, h, plan.stages[0], 0)[1]


def compute_s(h) -> float:
    """The iteration without any optimizer step: forwards and backwards of both microbatches."""
    plain = plan_of()
    engine = Engine(plain, MODEL, h)
    engine.run()
    steps = [dur for _, stream, name, _, dur, *_ in engine.trace.slices if name.startswith("optimizer_step")]
    return max(engine.finish_ns) / 1e9 - sum(steps) / 1e9


def slices(plan, h, stream: str) -> list[tuple[str, int, int]]:
    engine = Engine(plan, MODEL, h)
    engine.run()
    return sorted((name, start, dur) for _, st, name, start, dur, *_ in engine.trace.slices if st == stream)


def test_gradient_copies_hide_under_the_backward_but_the_first_layers():
    """A fast link: each layer's copy ends before the next layer's backward does, so only layer
    0's copy (issued as the backward ends) is exposed; then CPU Adam, then the weights back."""
    h = hw(pcie_gbps=12.0)
    plan = plan_of(optimizer_on_cpu=True)
    grad_s = copy_s(h, PARAMS * G_B)
    assert grad_s < layer_bwd_s(plan, h), "the closed form below needs copies shorter than a layer's backward"
    cpu_s = LAYERS * PARAMS / h.host.cpu_adam_params_per_s
    back_s = copy_s(h, LAYERS * PARAMS * W_B)
    got = simulate(plan, MODEL, h).result.iteration_time_s
    assert got == pytest.approx(compute_s(h) + grad_s + cpu_s + back_s, abs=1e-8 * LAYERS)
    serial = compute_s(h) + LAYERS * grad_s + cpu_s + back_s  # what STRONGHOLD §VI-B describes
    assert got < serial
    names = [n for n, _, _ in slices(plan, h, "d2h")]
    assert sorted(names) == sorted(f"grads L{l}" for l in range(LAYERS))


def test_a_slow_link_queues_the_copies_behind_each_other():
    """Copies longer than a layer's backward queue FIFO on the d2h link from the first one
    (issued when the last layer's backward ends): exposed 6 copies - 5 backwards."""
    h = hw(pcie_gbps=0.5)
    plan = plan_of(optimizer_on_cpu=True)
    grad_s, bwd_s = copy_s(h, PARAMS * G_B), layer_bwd_s(plan, h)
    assert grad_s > bwd_s
    cpu_s = LAYERS * PARAMS / h.host.cpu_adam_params_per_s
    back_s = copy_s(h, LAYERS * PARAMS * W_B)
    got = simulate(plan, MODEL, h).result.iteration_time_s
    assert got == pytest.approx(compute_s(h) + LAYERS * grad_s - (LAYERS - 1) * bwd_s + cpu_s + back_s, abs=1e-6)


def test_delayed_update_hides_the_cpu_step_when_it_is_shorter_than_the_passes():
    h = hw(pcie_gbps=12.0, cpu_adam=1e9)
    plan = plan_of(optimizer_on_cpu=True, delayed_update_from=1)
    cpu_s = LAYERS * PARAMS / h.host.cpu_adam_params_per_s
    assert cpu_s < compute_s(h)
    grad_s, back_s = copy_s(h, PARAMS * G_B), copy_s(h, LAYERS * PARAMS * W_B)
    got = simulate(plan, MODEL, h).result.iteration_time_s
    assert got == pytest.approx(compute_s(h) + grad_s + back_s, abs=1e-8 * LAYERS)
    # this iteration's step is booked after the weights' copy, beside the next iteration
    cpu = slices(plan, h, "cpu")
    assert [n for n, _, _ in cpu] == ["cpu step s0", "cpu step s0 (previous iteration's)"]
    assert cpu[0][1] >= round(got * 1e9) - 1


def test_delayed_update_is_bound_by_the_cpu_step_when_it_is_longer():
    """A CPU step longer than forward + backward: the previous step (begun with the iteration)
    ends after the backward, then the weights come back."""
    h = hw(pcie_gbps=12.0, cpu_adam=1e7)
    plan = plan_of(optimizer_on_cpu=True, delayed_update_from=1)
    cpu_s = LAYERS * PARAMS / h.host.cpu_adam_params_per_s
    assert cpu_s > compute_s(h) + copy_s(h, PARAMS * G_B)
    got = simulate(plan, MODEL, h).result.iteration_time_s
    assert got == pytest.approx(cpu_s + copy_s(h, LAYERS * PARAMS * W_B), abs=1e-6)


def test_nvme_state_makes_the_step_as_slow_as_the_drive():
    """ZeRO-Infinity's NVMe tier: the step reads and writes the optimizer state (2 x o_b bytes a
    parameter) at the drive's rate when that is slower than CPU Adam."""
    h = hw(nvme_gbps=0.5, nvme_bytes=1 << 40)
    ram = simulate(plan_of(optimizer_on_cpu=True), MODEL, h).result.iteration_time_s
    nvme = simulate(plan_of(optimizer_on_cpu=True, nvme=True), MODEL, h).result.iteration_time_s
    cpu_s = LAYERS * PARAMS / h.host.cpu_adam_params_per_s
    drive_s = 2 * LAYERS * PARAMS * O_B / (h.host.nvme_gbps * 1e9)
    assert drive_s > cpu_s
    assert nvme - ram == pytest.approx(drive_s - cpu_s, abs=1e-6)


def test_device_memory_has_no_optimizer_state_and_the_host_holds_it():
    res = simulate(plan_of(optimizer_on_cpu=True), MODEL, hw()).result
    d = res.devices[0]
    assert d.breakdown.optimizer_bytes == 0
    assert d.breakdown.parameters_bytes == LAYERS * PARAMS * W_B
    assert d.breakdown.gradients_bytes == LAYERS * PARAMS * G_B
    assert d.host_bytes == LAYERS * PARAMS * O_B


def test_same_inputs_same_bytes():
    for offload in ({"optimizer_on_cpu": True}, {"optimizer_on_cpu": True, "delayed_update_from": 3}):
        a, b = simulate(plan_of(**offload), MODEL, hw()), simulate(plan_of(**offload), MODEL, hw())
        assert a.result.model_dump_json() == b.result.model_dump_json()
        assert json.dumps(a.trace, sort_keys=True) == json.dumps(b.trace, sort_keys=True)
