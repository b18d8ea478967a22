"""Context parallelism (costs/context_parallel.py): a cp rank holds 1/cp of every sequence-
proportional byte, the ring sends (cp-1)·(2+4)·g·d·(s/cp)·b·act/tp bytes per block and microbatch,
overlap never beats the compute alone nor loses to compute + transfers, cp 1 is what it was, the
gradient all-reduce spans dp x cp, a cp plan of llama3_8b simulates below its cp-1 peers, and the
ring's send/receive buffers (max(cp, 4) K+V blocks a ring layer, TransformerEngine's
AttnFuncWithCPAndKVP2P) sit in the backward workspace."""
from __future__ import annotations

import copy
import math
from functools import lru_cache

import pytest

import costs.activations
import costs.collectives
import costs.context_parallel as cpc
import costs.layer_time
import costs.params
from costs.families import build_model, parse_model_config
from planners import make_plan
from planners.policy import ManualPolicy
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec, StagePlan
from specs.training import TrainingSpec
from tests.conftest import conf

SEQ = 8192


@lru_cache(maxsize=None)
def llama(seq: int = SEQ):
    return build_model(parse_model_config({**conf("model", "llama3_8b"), "seq_len": seq}), 2)


def h100(bw_gbps: float | None = None) -> HardwareSpec:
    raw = copy.deepcopy(conf("hardware", "h100_node"))
    if bw_gbps is not None:  # a slow fabric, where the ring's transfers outlast the block computes
        raw["intra_node"]["all_to_all"]["bw_gbps"] = bw_gbps
    return HardwareSpec(**raw)


def plan_of(cp: int, tp: int, dp: int = 1, pp: int = 1, micro: int = 2, seq: int = SEQ, hw=None):
    training = TrainingSpec(global_batch=8 * micro * dp, microbatch_size=micro * dp, precision="fp16")
    return make_plan(ManualPolicy(pp=pp, tp=tp, dp=dp, cp=cp), llama(seq), hw or h100(), training,
                     ScheduleSpec(kind="1f1b"))


def with_stage(plan, **update):
    """``plan`` with its one stage changed (cp, devices): prices a cp-1 twin on the same layers."""
    st = plan.stages[0]
    fields = {"layer_start": st.layer_start, "layer_stop": st.layer_stop, "devices": st.devices,
              "dp": st.dp, "tp": st.tp, "cp": st.cp, **update}
    return plan.model_copy(update={"stages": [StagePlan(**fields)]})


# ---- cp 1 is what it was -------------------------------------------------------------------------

def test_cp1_samples_stay_whole_and_no_ring_time():
    plan = plan_of(cp=1, tp=8)
    st = plan.stages[0]
    b = costs.params.samples_per_replica(plan, st)
    assert b == 2 and isinstance(b, int)
    model = llama()
    for layer in st.layers:
        assert cpc.layer_cp_comm_s(model, plan, h100(), st, layer) == (0.0, 0.0)
    assert cpc.ring_bytes_per_microbatch(model, plan, st) == 0
    f, b_s, _ = costs.layer_time.layer_pass_times_s(model, plan, h100(), st, 1)
    c = costs.layer_time.layer_tp_comm_s(model, plan, h100(), st, 1)
    assert f == costs.layer_time.layer_fwd_s(model, plan, h100(), st, 1) + c
    assert b_s == costs.layer_time.layer_bwd_s(model, plan, h100(), st, 1) + c


# ---- memory per rank -----------------------------------------------------------------------------

@pytest.mark.parametrize("cp, micro", [(2, 2), (4, 2), (2, 1), (8, 1)])
def test_activations_per_rank_are_one_cp_th(cp, micro):
    """Every saved byte of a stage is sequence-proportional (flash core: output + log-sum-exp), so
    a cp rank holds 1/cp of its cp-1 twin's (up to the loss scalar's and ceil's bytes); the
    parameters are replicated over cp, unchanged. micro 1 with cp 8: fractional samples."""
    model = llama()
    plan = plan_of(cp=cp, tp=8 // cp, micro=micro)
    st = plan.stages[0]
    twin = with_stage(plan, cp=1, devices=st.devices[: st.tp])
    got = costs.activations.stage_activation_bytes(model, plan, st)
    want = costs.activations.stage_activation_bytes(model, twin, twin.stages[0])
    assert isinstance(got, int)
    assert got == pytest.approx(want / cp, abs=64)
    assert costs.params.stage_params_on_device(model, plan, st) == \
        costs.params.stage_params_on_device(model, twin, twin.stages[0])


# ---- ring bytes and overlap ----------------------------------------------------------------------

@pytest.mark.parametrize("cp, tp, micro", [(2, 4, 2), (4, 2, 2), (8, 1, 1)])
def test_ring_bytes_closed_form(cp, tp, micro):
    """Per block and microbatch: forward (cp-1) steps of K and V, backward (cp-1) steps of K, V, dK,
    dV and the last dK, dV to its owner; each block g·d·(s/cp)·b·act/tp bytes (llama3_8b: g 8 kv
    heads, d 128, fp16)."""
    model, plan = llama(), plan_of(cp=cp, tp=tp, micro=micro)
    g, d, act = 8, 4096 // 32, 2
    blocks = sum(1 for l in model.layers if l.kind.value == "transformer_block")
    block_bytes = g * d * (SEQ / cp) * micro * act / tp
    want = blocks * ((cp - 1) * (2 + 4) + 2) * block_bytes
    assert cpc.ring_bytes_per_microbatch(model, plan, plan.stages[0]) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 3, 8])
@pytest.mark.parametrize("core_s, step_s", [(1.0, 0.0), (1.0, 0.01), (1.0, 0.5), (1.0, 3.0), (0.0, 1.0)])
def test_ring_overlap_bounds(cp, core_s, step_s):
    """Never faster than the compute alone, never slower than compute then every transfer in
    series; fully hidden while a transfer fits in a block; transfer-bound otherwise."""
    t = cpc.ring_attention_s(core_s, step_s, cp)
    assert core_s <= t <= core_s + (cp - 1) * step_s + 1e-15
    if cp == 1 or step_s <= core_s / cp:
        assert t == pytest.approx(core_s, rel=1e-15)
    else:
        assert t == pytest.approx(core_s / cp + (cp - 1) * step_s, rel=1e-15)


def test_slow_ring_is_exposed_fast_ring_is_hidden():
    """On NVLink4 (450 GB/s) a 8k-token block's transfer hides behind its attention compute, but for
    the backward's last dK, dV accumulator, sent to its owner after the last block; at 0.001 GB/s
    per link x 18 the forward exposes about (cp-1) transfers, the backward (cp-1) of 4 blocks and
    that last one (the latency and the block compute are below 1 % of them)."""
    model = llama()
    fast = plan_of(cp=2, tp=4)
    st = fast.stages[0]
    step = cpc.ring_step_bytes(model.layers[1], costs.params.samples_per_replica(fast, st), st.tp)
    link = cpc.cp_link(h100(), st)
    assert cpc.layer_cp_comm_s(model, fast, h100(), st, 1) == (0.0, costs.collectives.transfer_s(step, link))
    slow_hw = h100(bw_gbps=0.001)
    f, b = cpc.layer_cp_comm_s(model, fast, slow_hw, st, 1)
    assert f == pytest.approx(step / (18 * 0.001e9), rel=0.01)
    assert b == pytest.approx(3 * step / (18 * 0.001e9), rel=0.01)
    f_all, _, _ = costs.layer_time.layer_pass_times_s(model, fast, slow_hw, st, 1)
    assert f_all >= f + costs.layer_time.layer_fwd_s(model, fast, slow_hw, st, 1)


# ---- gradient all-reduce spans dp x cp -----------------------------------------------------------

def test_grad_allreduce_spans_dp_times_cp():
    """Parameters are replicated over cp: at dp 1, cp 2 the stage still all-reduces its gradients,
    over 2 ranks (a ring of 2: 2·(1/2)·bytes/bw + 2·latency), as dp 2 x cp 1 does."""
    model, hw = llama(), h100()
    cp_plan, dp_plan = plan_of(cp=2, tp=4), plan_of(cp=1, tp=4, dp=2)
    assert costs.params.grad_reduce_ranks(cp_plan.stages[0]) == 2
    t_cp = costs.collectives.dp_allreduce_s(model, cp_plan, hw, cp_plan.stages[0])
    t_dp = costs.collectives.dp_allreduce_s(model, dp_plan, hw, dp_plan.stages[0])
    assert t_cp > 0 and t_cp == pytest.approx(t_dp, rel=1e-12)


# ---- the simulator -------------------------------------------------------------------------------

def test_long_sequence_cp_fits_where_cp1_does_not():
    """llama3_8b at 32k tokens, one sample per microbatch, on one H100 node: cp 2 x tp 4 holds all
    34 layers below 80 GiB; cp 1 x tp 4 needs pp 2 and its first stage (two microbatches in flight
    under 1F1B, at full sequence length) peaks higher, over the capacity."""
    from simulator import simulate

    hw, model = h100(), llama(32768)
    cp = plan_of(cp=2, tp=4, micro=1, seq=32768)
    pp = plan_of(cp=1, tp=4, pp=2, micro=1, seq=32768)
    peak = lambda plan: max(d.peak_bytes for d in simulate(plan, model, hw).result.devices)  # noqa: E731
    p_cp, p_pp = peak(cp), peak(pp)
    assert p_cp < hw.device.memory_bytes < p_pp
    assert math.isfinite(simulate(cp, model, hw).result.iteration_time_s)


def test_sequence_split_needs_2cp_chunks():
    assert cpc.sequence_split_error(llama(), 1) is None
    assert cpc.sequence_split_error(llama(), 8) is None
    msg = cpc.sequence_split_error(llama(8200), 8)
    assert msg and "model.seq_len 8200" in msg and "16" in msg


@pytest.mark.parametrize("bw_gbps", [None, 0.01])
def test_simulator_and_analytic_agree_on_the_ring(bw_gbps):
    """One stage, no pipeline: the event simulation and the closed-form estimate sum the same
    per-layer times (ring exposure included), so they agree to float rounding; on NVLink4 the ring
    exposes only each backward's last dK, dV transfer (under 1 % of the iteration), on a slow fabric
    much more."""
    from simulator import simulate
    from simulator.analytic import iteration_time_s

    hw, model = h100(bw_gbps), llama()
    plan = plan_of(cp=2, tp=4, micro=1, hw=hw)
    sim = simulate(plan, model, hw).result.iteration_time_s
    # the simulator books every pass in whole nanoseconds (simpy time in ns): each of the
    # 2·microbatches passes, the flush and the step may round by up to half a nanosecond
    rounding_s = 0.5e-9 * (2 * plan.training.microbatches + 4)
    assert sim == pytest.approx(iteration_time_s(plan, model, hw), rel=0, abs=rounding_s)
    st = plan.stages[0]
    ring_s = plan.training.microbatches * sum(sum(cpc.layer_cp_comm_s(model, plan, hw, st, l)) for l in st.layers)
    last = plan.training.microbatches * sum(costs.collectives.transfer_s(
        cpc.ring_step_bytes(model.layers[l], costs.params.samples_per_replica(plan, st), st.tp), cpc.cp_link(hw, st))
        for l in st.layers if cpc.kv_bytes_per_sample(model.layers[l]))
    if bw_gbps is None:
        assert ring_s == pytest.approx(last, rel=1e-12) and ring_s < 0.01 * sim
    else:
        assert ring_s > 3 * last  # cp 2: forward 1 K+V block, backward 2, then the last: ~4 blocks, all exposed


# ---- the ring's send/receive buffers -------------------------------------------------------------

@pytest.mark.parametrize("cp, tp, micro, seq, want_mib", [(2, 4, 1, 8192, 16), (2, 4, 1, 131072, 256),
                                                          (4, 2, 2, 8192, 32), (8, 1, 1, 8192, 32)])
def test_ring_buffers_closed_form(cp, tp, micro, seq, want_mib):
    """TransformerEngine's AttnFuncWithCPAndKVP2P: the backward holds two (2, *kv.shape) buffers
    (K, V, dK, dV, sent and received: 4 K+V blocks), the forward its list of cp K+V blocks; a K+V
    block is 2·g·d·(s/cp)·b·act/tp bytes (llama3_8b: g 8 kv heads, d 128, fp16), so
    max(cp, 4)·2·g·d·(s/cp)·b·act/tp per ring layer (docs/megatron.md: 16 MiB at seq 8192 and
    256 MiB at 131k for cp 2 x tp 4, one sample). Embedding and head: none."""
    model, plan = llama(seq), plan_of(cp=cp, tp=tp, micro=micro, seq=seq)
    st = plan.stages[0]
    b = costs.params.samples_per_replica(plan, st)
    g, d, act = 8, 4096 // 32, 2
    want = max(cp, 4) * 2 * g * d * (seq // cp) * micro * act // tp
    assert want == want_mib * 2 ** 20
    assert cpc.ring_buffer_bytes(model, plan, st) == want
    for spec in model.layers:
        got = cpc.ring_workspace_bytes(spec, b, tp, cp)
        assert got == (want if spec.kind.value == "transformer_block" else 0), spec.name
        assert cpc.ring_workspace_bytes(spec, b, tp, 1) == 0


def test_ring_buffers_in_the_backward_workspace(monkeypatch):
    """A headless stage (pp 2, stage 0: embedding and blocks) whose backward peaks inside a block.
    The ring's buffers are live while the attention core runs, the layer's largest backward scratch
    (its weight gradients, the MLP's first) is not (measured: executor/ring_attention.py on
    local_cpu, tests/integration/executor/test_context_parallel_exec.py), so a layer adds the larger
    of the two: with the closed form's scratch (larger here) the ring adds nothing; with a scratch of
    0 exactly one layer's buffers (the layers run one at a time); the cp-1 twin has none."""
    model = llama(32768)
    plan = plan_of(cp=2, tp=2, pp=2, micro=1, seq=32768)
    st = plan.stages[0]
    assert model.layers[st.layer_stop - 1].kind.value == "transformer_block"
    ring = cpc.ring_buffer_bytes(model, plan, st)
    assert ring == 4 * 2 * 8 * 128 * 16384 * 2 // 2
    with_ring = costs.activations.backward_workspace_bytes(model, plan, st)
    bare = model.model_copy(update={"layers": [x.model_copy(update={"workspace_bytes_per_sample": 0, "workspace_fixed_bytes": 0})
                                               for x in model.layers]})
    bare_ring = costs.activations.backward_workspace_bytes(bare, plan, st)
    monkeypatch.setattr(costs.activations, "ring_workspace_bytes", lambda *a: 0)
    assert with_ring == costs.activations.backward_workspace_bytes(model, plan, st)
    assert bare_ring - costs.activations.backward_workspace_bytes(bare, plan, st) == ring
