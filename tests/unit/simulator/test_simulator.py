"""Simulator against closed forms: bubble, in-flight activations, stashing, ring all-reduce,
static memory, and determinism. Specs are built here, small, with free communication where the
oracle assumes it."""
from __future__ import annotations

import json

import pytest

import costs.activations
import costs.buffers
import costs.layer_time
import costs.params
import costs.static
from simulator import simulate
from specs import (
    DeviceSpec, HardwareSpec, HostSpec, LayerKind, LayerSpec, LinkKind, LinkSpec, ModelSpec,
    NodeTopology, Plan, ScheduleSpec, StagePlan, TrainingSpec,
)

GIB = 1 << 30


def model(layers: int = 8, flops: float = 1e10, params: int = 1_000_000, saved: int = 1 << 20,
          out: int = 1 << 16) -> ModelSpec:
    return ModelSpec(name="toy", family="custom", layers=[
        LayerSpec(name=f"l{i}", kind=LayerKind.transformer_block, params=params, fwd_flops_per_sample=flops,
                  saved_bytes_per_sample=saved, output_bytes_per_sample=out) for i in range(layers)])


def hardware(devices: int = 4, bw_gbps: float = 1e12, latency_s: float = 0.0, memory_bytes: int = 80 * GIB,
             pcie_gbps: float = 1e12, hbm_gbps: float = 1e15, nvlink: bool = False) -> HardwareSpec:
    link = LinkSpec(kind=LinkKind.nvlink if nvlink else LinkKind.nvswitch, bw_gbps=bw_gbps, latency_s=latency_s)
    return HardwareSpec(
        name="toyhw", devices_per_node=devices,
        device=DeviceSpec(model="toy", memory_bytes=memory_bytes, peak_tflops={"fp32": 100, "fp16": 100},
                          compute_efficiency=1.0, hbm_gbps=hbm_gbps),
        host=HostSpec(memory_bytes=512 * GIB, pcie_gbps=pcie_gbps, pcie_latency_s=0.0),
        intra_node=NodeTopology(all_to_all=link, fallback=link))


def plan(kind: str = "1f1b", p: int = 4, m: int = 8, mdl: ModelSpec | None = None, dp: int = 1,
         memory=None, v: int = 1, zero: int = 0) -> Plan:
    mdl = mdl or model()
    chunks = p * v
    per = mdl.num_layers // chunks
    stages = []
    for j in range(chunks):
        devs = list(range((j % p) * dp, (j % p) * dp + dp))
        stages.append(StagePlan(layer_start=j * per, layer_stop=(j + 1) * per, devices=devs, dp=dp,
                                memory=(memory or {}).get(j, [])))
    return Plan(planner="test", model="toy", hardware="toyhw", num_devices=p * dp,
                training=TrainingSpec(global_batch=m * dp, num_microbatches=m),
                schedule=ScheduleSpec(kind=kind, virtual_stages=v), zero_stage=zero, stages=stages)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(4, 8), (2, 16), (8, 8), (4, 1)])
def test_bubble_fraction(kind, p, m):
    """Zero-cost communication, uniform stages: bubble = (p - 1)/(m + p - 1) (GPipe §2.2)."""
    pl = plan(kind, p, m)
    res = simulate(pl, model(), hardware(p)).result
    fwd, bwd = costs.layer_time.stage_pass_times_s(model(), pl, hardware(p), pl.stages[0])
    busy = m * (fwd + bwd)
    bubble = 1 - busy / res.iteration_time_s
    assert bubble == pytest.approx((p - 1) / (m + p - 1), rel=1e-6)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_peak_in_flight_activations(kind):
    """Peak activations on stage i: m microbatches (GPipe), min(p - i, m) (1F1B), plus what peaks on
    top of them: the first backward's workspace, or the last forward's output while it is sent
    (released once sent, Megatron's default; the last stage's output is its loss, never sent)."""
    p, m = 4, 6
    pl, mdl = plan(kind, p, m), model()
    res = simulate(pl, mdl, hardware(p)).result
    for i, d in enumerate(res.devices):
        st = pl.stages[i]
        per_mb = costs.activations.stage_activation_bytes(mdl, pl, st)
        expect = m if kind == "gpipe" else min(p - i, m)
        on_top = max(costs.activations.backward_workspace_bytes(mdl, pl, st), costs.activations.sent_output_bytes(mdl, pl, st))
        assert costs.activations.sent_output_bytes(mdl, pl, st) == (0 if i == p - 1 else mdl.layers[0].output_bytes_per_sample)
        assert d.breakdown.activations_bytes == expect * per_mb + on_top


def test_kept_outputs_count_until_their_backward():
    """training.deallocate_pipeline_outputs=false: every held microbatch keeps its stage output
    (one more boundary tensor per microbatch), and nothing is sent out of the held set."""
    p, m = 4, 6
    mdl = model()
    released = plan("1f1b", p, m)
    kept = released.model_copy(update={"training": released.training.model_copy(
        update={"deallocate_pipeline_outputs": False})})
    out = mdl.layers[0].output_bytes_per_sample * kept.training.samples_per_microbatch
    for i in range(p - 1):
        a, b = released.stages[i], kept.stages[i]
        assert costs.activations.stage_activation_bytes(mdl, kept, b) == costs.activations.stage_activation_bytes(mdl, released, a) + out
        assert costs.activations.sent_output_bytes(mdl, kept, b) == 0
    r_kept = simulate(kept, mdl, hardware(p)).result
    r_rel = simulate(released, mdl, hardware(p)).result
    for i in range(p - 1):  # min(p - i, m) outputs held instead of one in flight
        extra = (min(p - i, m) - 1) * out
        assert r_kept.devices[i].breakdown.activations_bytes == r_rel.devices[i].breakdown.activations_bytes + extra


def test_first_stage_peaks_above_last_and_gpipe_above_1f1b():
    p, m = 4, 8
    one = simulate(plan("1f1b", p, m), model(), hardware(p)).result
    gp = simulate(plan("gpipe", p, m), model(), hardware(p)).result
    assert one.devices[0].peak_bytes > one.devices[-1].peak_bytes
    assert gp.devices[0].peak_bytes > one.devices[0].peak_bytes


def test_pipedream_stashes_p_minus_i_versions():
    p, m = 4, 16
    pl = plan("pipedream_async", p, m)
    res = simulate(pl, model(), hardware(p)).result
    for i, d in enumerate(res.devices):
        b = d.breakdown
        assert b.stashed_weights_bytes % b.parameters_bytes == 0
        assert 1 + b.stashed_weights_bytes // b.parameters_bytes == p - i
        assert b.stashed_weights_bytes == costs.activations.stashed_versions(pl, i) * b.parameters_bytes


def test_pipedream_has_no_flush_bubble():
    p, m = 4, 8
    a = simulate(plan("pipedream_async", p, m), model(), hardware(p)).result
    f = simulate(plan("1f1b", p, m), model(), hardware(p)).result
    assert a.iteration_time_s == pytest.approx(f.iteration_time_s * m / (m + p - 1), rel=1e-6)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_isolated_ring_allreduce(n):
    """One stage, dp = n, no compute: the iteration is the gradient all-reduce,
    2(n-1)/n · bytes/bw + 2(n-1)·latency (Thakur et al. 2005), plus a negligible optimizer step."""
    bw, lat = 50.0, 3e-6
    mdl = model(layers=2, flops=0.0)
    hw = hardware(n, bw_gbps=bw, latency_s=lat)
    pl = plan("1f1b", p=1, m=1, mdl=mdl, dp=n)
    sim = simulate(pl, mdl, hw)
    nbytes = pl.training.bytes_per_param()[1] * mdl.total_params  # gradient bytes per parameter
    expect = 2 * (n - 1) / n * nbytes / (bw * 1e9) + 2 * (n - 1) * lat
    ar = [e for e in sim.trace["traceEvents"] if e.get("cat") == "allreduce_grads"]
    assert len(ar) == 1 and ar[0]["dur"] * 1e-6 == pytest.approx(expect, abs=1e-9)
    assert sim.result.iteration_time_s == pytest.approx(expect, abs=2e-9)


@pytest.mark.parametrize("kind,v,zero", [("1f1b", 1, 0), ("interleaved_1f1b", 2, 0), ("gpipe", 1, 3)])
def test_static_memory_equals_closed_form(kind, v, zero):
    pl = plan(kind, p=2, m=4, dp=2, v=v, zero=zero)
    mdl = model()
    res = simulate(pl, mdl, hardware(4)).result
    assert [d.device for d in res.devices] == pl.used_devices()
    for d in res.devices:
        want = [costs.static.stage_static(mdl, pl, pl.stages[s])[0] for s in d.stages]
        b = d.breakdown
        assert b.parameters_bytes == sum(w.parameters_bytes for w in want)
        assert b.gradients_bytes == sum(w.gradients_bytes for w in want)
        assert b.optimizer_bytes == sum(w.optimizer_bytes for w in want)
        # (FSDP's unsharded layers are in the backward's workspace: costs.sharded_dp)
        comm = sum(costs.buffers.comm_buffer_bytes(mdl, pl, pl.stages[s]) for s in d.stages)
        flat = max(costs.buffers.allreduce_buffer_bytes(mdl, pl, pl.stages[s]) for s in d.stages)
        # the peak is either the activation peak or, when larger, the dp all-reduce's flat copy of
        # the gradients (after the last backward: no activations left)
        if b.activations_bytes:
            # GPipe peaks inside a stage's first backward, before the input gradient it sends back
            # exists (costs.buffers.sent_grad_buffer_bytes); 1F1B in a later one, with it
            unsent = sum(costs.buffers.sent_grad_buffer_bytes(mdl, pl, pl.stages[s]) for s in d.stages) if kind == "gpipe" else 0
            assert b.buffers_bytes == comm - unsent and b.activations_bytes >= flat
        else:
            assert b.buffers_bytes == comm + flat and flat == b.gradients_bytes // len(d.stages)


def test_agrees_with_analytic_on_peaks():
    from simulator.analytic import estimate
    for kind in ("gpipe", "1f1b", "pipedream_async"):
        pl, mdl, hw = plan(kind, 4, 16), model(), hardware(4)
        sim, ana = simulate(pl, mdl, hw).result, estimate(pl, mdl, hw)
        assert [d.peak_bytes for d in sim.devices] == [d.peak_bytes for d in ana.devices], kind


def test_oom_recorded_and_run_completes():
    pl, mdl = plan("gpipe", 2, 8), model(saved=1 << 30)
    res = simulate(pl, mdl, hardware(2, memory_bytes=4 * GIB)).result
    d = res.devices[0]
    assert d.oom and d.oom_over_bytes == d.peak_bytes - 4 * GIB > 0 and d.oom_time_s is not None
    assert res.iteration_time_s > 0 and all(x.peak_bytes > 0 for x in res.devices)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "pipedream_async", "interleaved_1f1b"])
def test_deterministic_and_valid_trace(kind):
    v = 2 if kind == "interleaved_1f1b" else 1
    pl = plan(kind, 2, 4, dp=2, v=v)
    hw = hardware(4, bw_gbps=10, latency_s=1e-6)
    a, b = simulate(pl, model(), hw), simulate(pl, model(), hw)
    assert a.result.model_dump_json() == b.result.model_dump_json()
    ta, tb = json.dumps(a.trace, sort_keys=True), json.dumps(b.trace, sort_keys=True)
    assert ta == tb
    events = json.loads(ta)["traceEvents"]
    pids = {e["pid"] for e in events if e["ph"] == "X"}
    assert pids == {0, 2}  # one representative per pipeline position
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert set(names) == pids
    assert any(e["ph"] == "C" and e["name"] == "activations_bytes" for e in events)
    # slices on one thread never overlap (Perfetto nests X events per thread)
    by_thread: dict = {}
    for e in events:
        if e["ph"] == "X" and e["cat"] not in ("recompute",):
            by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort()
        assert all(x[1] <= y[0] + 1e-9 for x, y in zip(spans, spans[1:]))


def test_vocab_parallel_loss_holds_three_logits_shards_in_its_backward():
    """Under tp > 1 an LM head's loss runs vocabulary-parallel (torch loss_parallel): its backward
    builds the fused log-softmax + NLL gradient from three logits shards live at once (zeros, exp,
    their sum), so the last stage's workspace is at least 3·b·logits/t, whatever the head's
    profiled (tp = 1) workspace; at tp = 1 the profiled workspace stands."""
    s, h, V = 32, 64, 256
    logits, hidden = s * V * 4, s * h * 4
    head = LayerSpec(name="head", kind=LayerKind.head, params=h * V, fwd_flops_per_sample=2.0 * s * h * V,
                     saved_bytes_per_sample=hidden + logits, output_bytes_per_sample=4,
                     workspace_bytes_per_sample=hidden, tp_sharded_saved_fraction=logits / (hidden + logits))
    block = model(layers=1, out=hidden).layers[0]
    mdl = ModelSpec(name="toy", family="custom", layers=[block, head])
    for tp in (1, 2, 4):
        pl = Plan(planner="test", model="toy", hardware="toyhw", num_devices=tp,
                  training=TrainingSpec(global_batch=4, num_microbatches=1), schedule=ScheduleSpec(kind="1f1b"),
                  stages=[StagePlan(layer_start=0, layer_stop=2, devices=list(range(tp)), tp=tp)])
        b = costs.params.samples_per_replica(pl, pl.stages[0])
        ws = costs.activations.backward_workspace_bytes(mdl, pl, pl.stages[0])
        assert ws == (3 * b * logits // tp if tp > 1 else b * hidden)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_sent_gradient_buffer_exists_from_the_first_backward_on(kind):
    """The input gradient a stage sends back is made by its first backward (the received input's
    .grad) and kept until the next one replaces it. GPipe peaks inside the first backward, with
    all m microbatches held: without that buffer. 1F1B with m > p − i holds p − i again at its
    later backwards: with it. The analytic estimate walks the same order and agrees."""
    from simulator.analytic import estimate

    p, m = 2, 6
    pl, mdl = plan(kind, p, m), model(out=1 << 18)
    sim, ana = simulate(pl, mdl, hardware(p)).result, estimate(pl, mdl, hardware(p))
    last = pl.stages[1]  # no received gradient: its buffers are the sent one alone
    grad = costs.buffers.sent_grad_buffer_bytes(mdl, pl, last)
    assert grad == costs.buffers.comm_buffer_bytes(mdl, pl, last) > 0
    n = m if kind == "gpipe" else min(p - 1, m)
    for res in (sim, ana):
        d = res.devices[1]
        assert d.breakdown.buffers_bytes == (0 if kind == "gpipe" else grad)
        assert d.breakdown.activations_bytes == (n * costs.activations.stage_activation_bytes(mdl, pl, last)
                                                 + costs.activations.backward_workspace_bytes(mdl, pl, last))
