"""The simulator's STRONGHOLD window (simulator/window.py): the fetch / copy / CPU-step order the
plan contract (specs.plan.OffloadPolicy) prescribes, device and host bytes from costs.window,
time that depends on the window, and the host tier (NVMe, host RAM shared by a node)."""
from __future__ import annotations

import json

from simulator import simulate
from simulator.engine import Engine
from simulator.report import build_result
from costs import window as win
from specs.plan import LayerMemory, OffloadPolicy, Plan, StagePlan
from specs.training import TrainingSpec
from tests.conftest import make_hardware, make_model

MODEL = make_model(6, params=10_000_000, flops=2e11)
TRAIN = TrainingSpec(global_batch=4, microbatch_size=2, precision="fp16")  # 2 microbatches


def hw(pcie_gbps=12.0, devices=1, per_switch=1, host_bytes=512 << 30, nvme_bytes=0, nvme_gbps=0.0):
    h = make_hardware(devices)
    host = h.host.model_copy(update={"pcie_gbps": pcie_gbps, "gpus_per_pcie_switch": per_switch,
                                     "memory_bytes": host_bytes, "nvme_bytes": nvme_bytes, "nvme_gbps": nvme_gbps})
    return h.model_copy(update={"host": host})


def plan_of(stages, training=TRAIN, devices=1):
    return Plan(planner="manual", model=MODEL.name, hardware="toyhw", num_devices=devices, training=training,
                stages=stages)


def windowed(w, resident=(0, 5), nvme=False, layers=(0, 6), device=0, **kw):
    return StagePlan(layer_start=layers[0], layer_stop=layers[1], devices=[device],
                     offload=OffloadPolicy(window_layers=w, resident_layers=list(resident), nvme=nvme), **kw)


def run(plan, hardware):
    engine = Engine(plan, MODEL, hardware)
    engine.run()
    return engine, build_result(engine, MODEL)[0]


def names(engine, stream):
    return [name for _, st, name, *_ in sorted(engine.trace.slices, key=lambda s: s[3]) if st == stream]


def test_fetch_copy_and_cpu_step_order_follow_the_contract():
    """4 streamed layers (1-4), 2 slots, 2 microbatches of 1F1B on one stage. F0 fetches 1, 2 at its
    start, 3 and 4 as 1 and 2 finish; B0 starts with 4, 3 (kept) and fetches 2, 1 as their slots
    free; F1 starts with 1, 2 (kept); the CPU steps follow the last backward only."""
    engine, _ = run(plan_of([windowed(2)]), hw())
    fetched = [n.split()[1] for n in names(engine, "h2d")]
    assert fetched == ["L1", "L2", "L3", "L4", "L2", "L1", "L3", "L4", "L2", "L1"]
    grads = [n.split()[1] for n in names(engine, "d2h")]
    assert grads == ["L4", "L3", "L2", "L1"] * 2
    assert [n.split()[-1] for n in names(engine, "cpu")] == ["L4", "L3", "L2", "L1"]


def test_device_and_host_bytes_are_the_window_closed_form():
    plan = plan_of([windowed(2)])
    _, result = run(plan, hw())
    w_dev, g_dev, o_dev, host, nvme = win.window_static(MODEL, plan, plan.stages[0])
    b = result.devices[0].breakdown
    assert (b.parameters_bytes, b.gradients_bytes, b.optimizer_bytes) == (w_dev, g_dev, o_dev)
    # 2 resident layers (all state) + 2 slots (weights + grads) of 10 M params: 2 + 4 + 12 B/param mixed
    assert w_dev == (2 + 2) * 10_000_000 * 2 and o_dev == 2 * 10_000_000 * 12
    assert result.devices[0].host_bytes == host == 4 * 10_000_000 * 18 and nvme == 0


def test_time_depends_on_the_window_when_transfers_are_slow():
    slow = hw(pcie_gbps=2.0)  # a layer's 20 MB weights take 10 ms vs 4 ms of forward compute
    times = {w: run(plan_of([windowed(w)]), slow)[1].iteration_time_s for w in (1, 2, 4)}
    assert times[1] > times[2] > times[4]
    engine, _ = run(plan_of([windowed(1)]), slow)
    assert engine.windows[0].stall_ns > 0 and any(cat == "stall" for *_, cat in engine.trace.slices)
    fast, _ = run(plan_of([windowed(2)]), hw(pcie_gbps=1000.0))
    assert fast.windows[0].stall_ns - fast.windows[0].passes[0][2] == 0  # nothing after the cold start


def test_cpu_optimizer_tail_is_waited_for():
    """The step waits for the last CPU step: a slower CPU Adam lengthens the iteration by its excess."""
    base = hw()
    slow_cpu = base.model_copy(update={"host": base.host.model_copy(update={"cpu_adam_params_per_s": 1e7})})
    t_fast = run(plan_of([windowed(2)]), base)[1].iteration_time_s
    engine, slow = run(plan_of([windowed(2)]), slow_cpu)
    # four 1 s CPU steps, serial on the node's cores: eq. 3 lets them run past the iteration's end,
    # and the next (steady-state) iteration's forward waits for them
    assert slow.iteration_time_s > t_fast + 3.0
    assert engine.windows[0].cpu_done_ns > round(slow.iteration_time_s * 1e9)
    assert engine.windows[0].cpu_hold_ns > 3e9


def test_nvme_holds_the_optimizer_state_and_bounds_the_step():
    h = hw(nvme_bytes=1 << 40, nvme_gbps=0.5)
    plan = plan_of([windowed(2, nvme=True)])
    engine, result = run(plan, h)
    assert result.devices[0].nvme_bytes == 4 * 10_000_000 * 12
    assert result.devices[0].host_bytes == 4 * 10_000_000 * 6
    lc = next(lc for lc in engine.costs[0].layers if lc.streamed)
    assert lc.cpu_step_ns == round(2 * 10_000_000 * 12 / 0.5e9 * 1e9)  # read + write of 120 MB at 0.5 GB/s
    assert not result.devices[0].host_oom
    _, short = run(plan, hw(nvme_bytes=1 << 20, nvme_gbps=0.5))
    assert short.devices[0].host_oom


def test_host_ram_of_a_node_is_shared_by_its_devices():
    stages = [windowed(1, resident=(0,), layers=(0, 3), device=0), windowed(1, resident=(5,), layers=(3, 6), device=1)]
    plan = plan_of(stages, devices=2)
    need = sum(win.window_static(MODEL, plan, st)[3] for st in stages)  # all in host RAM (no NVMe)
    _, ok = run(plan, hw(devices=2, host_bytes=need))
    _, over = run(plan, hw(devices=2, host_bytes=need - 1))
    assert not any(d.host_oom for d in ok.devices) and all(d.host_oom for d in over.devices)


def test_gpus_behind_one_pcie_switch_share_it():
    stages = [windowed(1, resident=(0,), layers=(0, 3), device=0), windowed(1, resident=(5,), layers=(3, 6), device=1)]
    plan = plan_of(stages, devices=2)
    apart = run(plan, hw(pcie_gbps=2.0, devices=2, per_switch=1))[1].iteration_time_s
    shared = run(plan, hw(pcie_gbps=2.0, devices=2, per_switch=2))[1].iteration_time_s
    assert shared > apart


def test_recomputed_layers_wait_for_their_weights_before_the_recompute():
    mem = [LayerMemory(layer=i, action="recompute") for i in range(6)]
    engine, _ = run(plan_of([windowed(1, memory=mem)]), hw(pcie_gbps=2.0))
    order = sorted(engine.trace.slices, key=lambda s: s[3])
    # every recompute of a streamed layer starts no earlier than that layer's latest fetch ends
    for i, (_, st, name, start, _, _) in enumerate(order):
        if name.startswith("recompute L") and name.split()[1][1:] not in ("0", "5"):
            layer = name.split()[1]
            fetches = [s + d for _, st2, n2, s, d, _ in order[:i] if st2 == "h2d" and n2 == f"fetch {layer}"]
            assert fetches and start >= fetches[-1]


def test_same_inputs_same_bytes():
    plan = plan_of([windowed(2)])
    a = simulate(plan, MODEL, hw(pcie_gbps=2.0))
    b = simulate(plan, MODEL, hw(pcie_gbps=2.0))
    assert a.result.model_dump_json() == b.result.model_dump_json()
    assert json.dumps(a.trace, sort_keys=True) == json.dumps(b.trace, sort_keys=True)
