"""STRONGHOLD eq. 3 and the resident first window in the simulator (simulator/window.py) and the
planner (planners/stronghold): the simulated iteration is the steady state, in which a layer's
CPU step of the previous iteration may run until this iteration's forward reaches the layer.

The stall is derived by hand on a stage of three layers: 0 and 1 resident (the embedding and the
first working window, stepped on the device), 2 streamed through one slot, one microbatch, no
recompute. The backward runs B2 (its gradients go to the host, g ns, then the CPU steps it, C
ns), then B1, B0 and the device step of the resident layers (opt ns): the iteration ends
``b1 + b0 + opt`` after B2, so L2's step ends ``tail = g + C - b1 - b0 - opt`` after the
iteration's end. The next forward issues L2's fetch at its start, no earlier than ``tail``, and
reaches L2 after ``f0 + f1``: it waits ``max(0, max(tail, 0) + fetch - f0 - f1)``, of which the
CPU step's share is all but the link's own ``max(0, fetch - f0 - f1)``.
"""
from __future__ import annotations

from costs.families import build_model, parse_model_config
from planners import parse_policy
from planners.policy import StrongholdPolicy
from planners.stronghold.planner import _peak_of, resident_of, stronghold_search, summary_lines
from planners.verdict import peaks
from costs import window as win
from simulator.engine import Engine
from simulator.links import Links
from simulator.report import build_result
from simulator.window import Clock, WindowWalk, drive, resources
from specs.hardware import HardwareSpec
from specs.plan import OffloadPolicy, Plan, ScheduleSpec, StagePlan
from specs.training import TrainingSpec
from tests.conftest import conf, make_hardware, make_model

MODEL = make_model(3, params=10_000_000, flops=2e11)
ONE_MB = TrainingSpec(global_batch=2, microbatch_size=2, precision="fp16")


def hw(cpu_adam_params_per_s: float, pcie_gbps: float = 12.0):
    h = make_hardware(1)
    return h.model_copy(update={"host": h.host.model_copy(update={"cpu_adam_params_per_s": cpu_adam_params_per_s,
                                                                   "pcie_gbps": pcie_gbps})})


def plan(resident=(0, 1), training=ONE_MB) -> Plan:
    return Plan(planner="manual", model=MODEL.name, hardware="toyhw", num_devices=1, training=training,
                stages=[StagePlan(layer_start=0, layer_stop=3, devices=[0],
                                  offload=OffloadPolicy(window_layers=1, resident_layers=list(resident)))])


def run(p, h):
    engine = Engine(p, MODEL, h)
    engine.run()
    return engine, build_result(engine, MODEL)[0]


def derived_stall_ns(engine) -> tuple[int, int]:
    """(the forward's wait for L2, the part of it the CPU step causes), from the module docstring."""
    sc = engine.costs[0]
    l0, l1, l2 = sc.layers
    tail = l2.grad_ns + l2.cpu_step_ns - l1.bwd_ns - l0.bwd_ns - sc.optimizer_ns
    ahead = l0.fwd_ns + l1.fwd_ns
    stall = max(0, max(tail, 0) + l2.fetch_ns - ahead)
    return stall, stall - max(0, l2.fetch_ns - ahead)


def test_a_cpu_step_longer_than_the_forward_to_its_layer_stalls_by_exactly_the_difference():
    fast_engine, fast = run(plan(), hw(1e12))
    assert derived_stall_ns(fast_engine) == (0, 0)  # the regime: the link alone hides behind L0, L1
    for rate in (1e8, 3e7, 1e7):  # CPU steps of 100 ms, 333 ms, 1 s
        engine, slow = run(plan(), hw(rate))
        stall, cpu = derived_stall_ns(engine)
        assert cpu > 0
        w = engine.windows[0]
        assert (w.stall_ns, w.cpu_hold_ns) == (stall, cpu)
        # the iteration is longer by exactly that wait (its own CPU steps run past its end)
        assert round((slow.iteration_time_s - fast.iteration_time_s) * 1e9) == cpu
        assert w.cpu_done_ns > round(slow.iteration_time_s * 1e9)
        labels = [name for _, st, name, *_ in engine.trace.slices if st == "compute" and name.startswith("wait")]
        assert labels == ["wait cpu step L2"]


def test_a_cpu_step_the_forward_hides_costs_nothing():
    engine, _ = run(plan(), hw(1e9))  # a 10 ms CPU step, hidden behind B1, B0 and F0, F1
    sc = engine.costs[0]
    assert sc.layers[2].cpu_step_ns + sc.layers[2].grad_ns < sum(x.bwd_ns + x.fwd_ns for x in sc.layers[:2])
    assert engine.windows[0].stall_ns == engine.windows[0].cpu_hold_ns == 0


def test_only_the_first_iteration_starts_cold():
    """Without the first window resident, L1 streams: every iteration's forward waits for its
    fetch after L0 (the step left the slot stale). With it resident the forward starts on resident
    layers and waits only as derived for L2; the first iteration (nothing carried in) waits for no
    CPU step."""
    slow_link = hw(1e12, pcie_gbps=2.0)  # a 20 MB layer: 10 ms to fetch, 4 ms of forward
    streamed, _ = run(plan(resident=(0,)), slow_link)
    sc = streamed.costs[0]
    assert streamed.windows[0].passes[0][2] >= sc.layers[1].fetch_ns - sc.layers[0].fwd_ns > 0
    resident, _ = run(plan(), slow_link)
    sc = resident.costs[0]
    # L1 needs no fetch; L2 waits what the derivation says (its slow gradient copy's CPU step, then
    # its fetch behind L0 and L1), never for a fetch at the pass start
    assert (resident.windows[0].stall_ns, resident.windows[0].cpu_hold_ns) == derived_stall_ns(resident)
    assert resident.windows[0].stall_ns < streamed.windows[0].stall_ns
    # the first iteration: the same walk with nothing carried in
    clock = Clock()
    first = WindowWalk(sc, Links(slow_link), *resources(slow_link, sc), 1, clock, steady=False)
    for gen in (first.forward(0), first.backward(0), first.step()):
        drive(gen, clock)
    assert first.cpu_hold_ns == 0 and first.cpu_ready_ns == {}


def test_the_steady_state_is_deterministic():
    a = Engine(plan(), MODEL, hw(1e7))
    b = Engine(plan(), MODEL, hw(1e7))
    a.run(), b.run()
    assert build_result(a, MODEL)[0].model_dump_json() == build_result(b, MODEL)[0].model_dump_json()
    assert a.windows[0].cpu_ready_ns == b.windows[0].cpu_ready_ns


# ---- the planner: the first working window resident by default (§III-E1) ----------------------

GPT_TINY = build_model(parse_model_config(conf("model", "gpt_tiny")))
LOCAL = HardwareSpec.model_validate(conf("hardware", "local_cpu"))
V100 = HardwareSpec.model_validate(conf("hardware", "v100_single"))
GPT_1B7 = build_model(parse_model_config(conf("model", "stronghold_gpt_l20")))


def test_the_first_window_is_resident_by_default_and_in_the_peak():
    training = TrainingSpec(global_batch=8, microbatch_size=2, precision="fp32")
    outcome = stronghold_search(parse_policy({"kind": "stronghold", "pp": 1}), GPT_TINY, LOCAL, training,
                                ScheduleSpec())
    st = outcome.plan.stages[0]
    w, default = st.offload.window_layers, win.default_resident(GPT_TINY, st)
    assert st.offload.resident_layers == win.first_window(st, default, w) != default
    # the closed-form peak the choice compares is the analytic model's, for every window
    peak_of = _peak_of(outcome.plan, GPT_TINY, LOCAL, 0, default, False, True)
    for v in range(1, st.num_layers - len(default) + 1):
        from planners.stronghold.planner import with_window
        at = with_window(outcome.plan, 0, v, resident_of(outcome.plan, 0, default, v, True), False)
        assert peak_of(v) == peaks(at, GPT_TINY, LOCAL)[0]
    assert StrongholdPolicy.model_fields.get("resident_first_window") is None or \
        StrongholdPolicy().resident_first_window is True  # the default, once the knob is a field


def test_the_fp32_preset_waits_for_no_cpu_step_and_says_the_first_iteration_is_cold():
    training = TrainingSpec(global_batch=2, microbatch_size=2, precision="fp32")
    outcome = stronghold_search(parse_policy({"kind": "stronghold", "pp": 1}), GPT_1B7, V100, training,
                                ScheduleSpec())
    c = outcome.stages[0]
    p = next(x for x in c.prices if x.window == c.window)
    assert p.cpu_wait_s == 0 and p.stall_s == 0 and p.cold_stall_s == 0
    assert "cold start (first iteration only)" in summary_lines(outcome)[0]
