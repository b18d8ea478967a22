"""The simulator's STRONGHOLD multi-streamed execution (§IV-A, ``offload.streams``; the contract in
specs.plan_memory.OffloadPolicy.streams and simulator/window.py's docstring): the stage's m
microbatches run in m / S groups; a group's pass walks the window once (one fetch per streamed
layer, one gradient copy per layer per group backward), its S computes priced as one kernel over
S·b samples, S workers' activations on the device."""
from __future__ import annotations

import json

import pytest

from costs.families import build_model, parse_model_config
from costs.window import grouped_plan
from simulator import simulate
from simulator.analytic import device_memory
from simulator.engine import Engine
from simulator.report import build_result
from simulator.stagecost import stage_cost
from simulator.window import group_name
from specs.hardware import HardwareSpec
from specs.plan import OffloadPolicy, Plan, StagePlan
from specs.training import TrainingSpec
from tests.conftest import conf, make_hardware, make_model

MODEL = make_model(6, params=10_000_000, flops=2e11)   # GEMM-less layers: time linear in samples (flat curve)
M = 8                                                  # microbatches of one sample
TRAIN = TrainingSpec(global_batch=M, microbatch_size=1, precision="fp16")
STREAMED, W = 4, 2                                     # layers 1-4 streamed through 2 slots; 0 and 5 resident


def hw(pcie_gbps: float = 12.0) -> HardwareSpec:
    h = make_hardware(1)
    return h.model_copy(update={"host": h.host.model_copy(update={"pcie_gbps": pcie_gbps})})


def plan_of(streams: int, training: TrainingSpec = TRAIN, model=MODEL, window: int = W, stop: int = 6,
            resident=(0, 5), schedule: str = "1f1b") -> Plan:
    st = StagePlan(layer_start=0, layer_stop=stop, devices=[0],
                   offload=OffloadPolicy(window_layers=window, resident_layers=list(resident), streams=streams))
    return Plan(planner="manual", model=model.name, hardware="toyhw", num_devices=1, training=training,
                stages=[st], schedule={"kind": schedule})


def run(plan: Plan, hardware: HardwareSpec, model=MODEL):
    engine = Engine(plan, model, hardware)
    engine.run()
    return engine, build_result(engine, model)[0]


def slices(engine, stream: str) -> list[str]:
    return [name for _, st, name, *_ in sorted(engine.trace.slices, key=lambda s: s[3]) if st == stream]


@pytest.mark.parametrize("S", [1, 2, 4, 8])
def test_one_fetch_and_one_gradient_copy_per_streamed_layer_per_group_pass(S):
    """1F1B on one stage alternates F g, B g: each pass reverses the order, so the w layers the last
    pass ended with are still in their slots and the other n - w are fetched; the first forward
    fetches all n (the step left every slot stale). Over 2m/S group passes: n + (2m/S - 1)(n - w)
    fetches; one gradient copy per streamed layer per group backward: n·m/S; one CPU step each."""
    engine, _ = run(plan_of(S), hw())
    fetches, copies, steps = slices(engine, "h2d"), slices(engine, "d2h"), slices(engine, "cpu")
    passes = 2 * M // S
    assert len(fetches) == STREAMED + (passes - 1) * (STREAMED - W)
    assert len(copies) == STREAMED * M // S
    assert sorted(steps) == sorted(f"cpu step L{l}" for l in range(1, 5))


def test_slices_name_the_group_and_its_microbatches():
    """The names simulator/window.py's docstring gives the executor's measured trace (S = 2)."""
    engine, _ = run(plan_of(2), hw())
    compute = slices(engine, "compute")
    assert [n for n in compute if n.startswith(("F s0", "B s0"))][:4] == [
        "F s0 g0 (mb 0-1)", "B s0 g0 (mb 0-1)", "F s0 g1 (mb 2-3)", "B s0 g1 (mb 2-3)"]
    assert slices(engine, "d2h")[:2] == ["grads L4 g0 (mb 0-1)", "grads L3 g0 (mb 0-1)"]
    assert all(n.startswith("fetch L") and "g" not in n.split()[1] for n in slices(engine, "h2d"))
    assert group_name("F L3 mb5", 1) == "F L3 mb5" and group_name("B L3 mb3", 4) == "B L3 g3 (mb 12-15)"


def test_peak_grows_by_the_workers_activations_and_the_analytic_model_agrees():
    """One copy of the slots and resident layers whatever S; S microbatches' activations in flight
    (the toy's activations are linear in samples, so exactly S times one microbatch's)."""
    peaks, acts, static = {}, {}, {}
    for S in (1, 2, 4):
        _, result = run(plan_of(S), hw())
        dev = result.devices[0]
        peaks[S], acts[S] = dev.peak_bytes, dev.breakdown.activations_bytes
        static[S] = (dev.breakdown.parameters_bytes, dev.breakdown.gradients_bytes, dev.breakdown.optimizer_bytes)
        assert device_memory(plan_of(S), MODEL)[0][0].total_bytes == dev.peak_bytes
    assert static[1] == static[2] == static[4] and static[1][0] > 0  # one copy of the slots, resident layers
    assert acts[1] > 0 and acts[2] == 2 * acts[1] and acts[4] == 4 * acts[1]
    assert peaks[4] - peaks[1] == acts[4] - acts[1]


def test_on_a_flat_curve_a_group_costs_s_times_a_microbatch():
    """GEMM-less layers on a device without an efficiency curve: a group's layer compute is S·t(b)
    (to the ns of rounding), so with transfers hidden there is nothing to gain."""
    one = stage_cost(plan_of(1), MODEL, hw(), 0, plan_of(1).stages[0])
    for S in (2, 4):
        g = grouped_plan(plan_of(S))
        sc = stage_cost(g, MODEL, hw(), 0, g.stages[0])
        for a, b in zip(one.layers, sc.layers):
            assert abs(b.fwd_ns - S * a.fwd_ns) <= S and abs(b.bwd_ns - S * a.bwd_ns) <= S
            assert (b.fetch_ns, b.grad_ns, b.cpu_step_ns) == (a.fetch_ns, a.grad_ns, a.cpu_step_ns)


def test_on_the_v100_curve_a_small_kernel_over_more_samples_costs_less_than_s_times():
    """A small GPT's GEMMs (hidden 512, 256 tokens: ~4e8 FLOPs a kernel at one sample) sit on the
    steep part of the V100's fp16 curve (conf/hardware/v100_single.yaml): one kernel over S·b
    samples takes less than S kernels over b (the SMs a small kernel leaves idle, §II-B)."""
    model = build_model(parse_model_config(dict(family="gpt", name="gpt_h512", num_layers=4, hidden=512, heads=8,
                                                 seq_len=256, vocab=1024)))
    v100 = HardwareSpec.model_validate(conf("hardware", "v100_single"))
    n = model.num_layers
    training = TrainingSpec(global_batch=4, microbatch_size=1, precision="fp16")
    one = plan_of(1, training, model, window=1, stop=n, resident=(0, n - 1))
    sc1 = stage_cost(one, model, v100, 0, one.stages[0])
    g = grouped_plan(plan_of(4, training, model, window=1, stop=n, resident=(0, n - 1)))
    sc4 = stage_cost(g, model, v100, 0, g.stages[0])
    block = 1
    assert sc4.layers[block].fwd_ns < 4 * sc1.layers[block].fwd_ns * 0.9
    assert sc4.layers[block].fwd_ns > sc1.layers[block].fwd_ns


def test_amortised_fetches_make_a_pcie_bound_window_faster():
    """On a slow host link the fetches bind; a group fetches each layer once for S microbatches."""
    times = {S: run(plan_of(S), hw(pcie_gbps=2.0))[1].iteration_time_s for S in (1, 2, 4)}
    assert times[1] > times[2] > times[4]


def test_the_result_and_trace_are_deterministic_and_the_engine_keeps_the_plan_id():
    plan = plan_of(2)
    a, b = simulate(plan, MODEL, hw()), simulate(plan, MODEL, hw())
    assert a.result.model_dump_json() == b.result.model_dump_json()
    assert json.dumps(a.trace, sort_keys=True) == json.dumps(b.trace, sort_keys=True)
    assert a.result.samples_per_s == pytest.approx(M / a.result.iteration_time_s, rel=1e-12)
    engine = Engine(plan, MODEL, hw())  # walks the group plan, reports the given plan's id
    assert engine.plan_id == plan.id != engine.plan.id and engine.plan == grouped_plan(plan)


def test_the_group_plan_keeps_the_global_batch_and_refuses_what_the_contract_refuses():
    g = grouped_plan(plan_of(4))
    assert (g.training.global_batch, g.training.microbatches, g.training.samples_per_microbatch) == (M, 2, 4)
    assert g.stages[0].offload.streams == 1 and grouped_plan(plan_of(1)) == plan_of(1)
    bad = plan_of(3)  # 3 does not divide 8
    with pytest.raises(ValueError, match="streams"):
        grouped_plan(bad)


# ---- each worker's own backward transients (costs.window.group_workspace_bytes) ------------------

def _gpt_tiny_plan(streams: int, tied: bool = True):
    """policy=stronghold's one-stage plan of gpt_tiny over 2 replicas (layer-wise recompute, blocks
    streamed through one slot, embedding and head resident), ``streams`` workers; ``tied`` False:
    the head's own V x h weight (tie_embeddings false)."""
    from planners import parse_policy
    from planners.stronghold.planner import stronghold_search
    from specs.plan import ScheduleSpec
    from tests.conftest import CPU_TRAINING, GPT_TINY, LOCAL_CPU

    cfg = GPT_TINY if tied else GPT_TINY.model_copy(update={"tie_embeddings": False})
    spec = build_model(cfg, 4)
    pol = parse_policy({"kind": "stronghold", "pp": 1, "dp": 2, "tp": 1, "window_layers": 1,
                        "resident_first_window": False, "streams": streams})
    return cfg, spec, stronghold_search(pol, spec, LOCAL_CPU, CPU_TRAINING, ScheduleSpec()).plan, LOCAL_CPU


@pytest.mark.parametrize("S", [2, 4])
def test_each_worker_holds_its_own_tied_head_gradient_through_the_blocks(S):
    """The S workers' backwards run concurrently (executor.window_streams) and autograd keeps each
    one's head-side V x h gradient of the tied embedding until the embedding's contribution
    arrives: at a streamed block's backward (gpt_tiny's workspace peak) S of them are live, where
    one worker of S·b samples (the grouped walk) has none left. With one worker the workspace is
    the one-worker walk's."""
    from costs.activations import backward_workspace_bytes
    from costs.window import group_workspace_bytes, plan_streams

    cfg, spec, plan, _ = _gpt_tiny_plan(S)
    assert plan_streams(plan) == S and plan.stages[0].offload.resident_layers == [0, len(spec.layers) - 1]
    grouped = grouped_plan(plan)
    v_h_fp32_bytes = cfg.vocab * cfg.hidden * 4
    assert group_workspace_bytes(spec, plan, 0) == backward_workspace_bytes(spec, grouped, grouped.stages[0]) \
        + S * v_h_fp32_bytes
    _, _, one, _ = _gpt_tiny_plan(1)
    assert group_workspace_bytes(spec, one, 0) == backward_workspace_bytes(spec, one, one.stages[0])


def test_an_untied_head_adds_nothing_per_worker():
    """No tied weight: each worker's head gradient goes to its own AccumulateGrad at once; the
    group's workspace is the grouped walk's."""
    from costs.activations import backward_workspace_bytes
    from costs.window import group_workspace_bytes

    _, spec, plan, _ = _gpt_tiny_plan(4, tied=False)
    assert not spec.tied_layers
    grouped = grouped_plan(plan)
    assert group_workspace_bytes(spec, plan, 0) == backward_workspace_bytes(spec, grouped, grouped.stages[0])


def test_the_analytic_peak_and_the_engines_costs_carry_the_workers_gradients():
    """simulator.analytic.device_memory prices the S workers' workspace (the planner's memory bound
    reads it), and simulator.stagecost.with_stream_workers gives the engine's stage costs the same
    workspace; unchanged with one worker."""
    from costs.activations import backward_workspace_bytes
    from costs.window import group_workspace_bytes
    from simulator.stagecost import with_stream_workers

    cfg, spec, plan, hardware = _gpt_tiny_plan(4)
    grouped = grouped_plan(plan)
    extra = group_workspace_bytes(spec, plan, 0) - backward_workspace_bytes(spec, grouped, grouped.stages[0])
    assert extra == 4 * cfg.vocab * cfg.hidden * 4
    assert device_memory(plan, spec)[0][0].total_bytes == device_memory(grouped, spec)[0][0].total_bytes + extra
    sc = stage_cost(grouped, spec, hardware, 0, grouped.stages[0])
    assert with_stream_workers(sc, spec, plan, 0).workspace_bytes == sc.workspace_bytes + extra
    _, _, one, _ = _gpt_tiny_plan(1)
    sc1 = stage_cost(one, spec, hardware, 0, one.stages[0])
    assert with_stream_workers(sc1, spec, one, 0) is sc1


def test_the_simulated_peak_is_the_analytic_with_the_workers_gradients():
    """The simpy engine books the group's workspace (needs simulator/engine.py to pass its stage
    costs through simulator.stagecost.with_stream_workers): its peak is the analytic model's."""
    _, spec, plan, hardware = _gpt_tiny_plan(4)
    dev = simulate(plan, spec, hardware, trace=False).result.devices[0]
    assert dev.peak_bytes == device_memory(plan, spec)[0][0].total_bytes
