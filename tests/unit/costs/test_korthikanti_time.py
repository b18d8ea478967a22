"""Sequence parallelism and selective recompute in time (Korthikanti et al. 2022 §4.2.2, §5):
selective adds one forward of the attention core to the backward (slower than keeping
everything, faster than full recompute), SP splits the element-wise traffic by t and keeps the
all-reduce volume (all-gather + reduce-scatter), and the simulator agrees with the analytic
estimate on SP / selective plans (as tests/unit/simulator/test_time_model.py compares them)."""
from __future__ import annotations

import pytest

import costs.collectives
import costs.gemm
import costs.layer_time as lt
import costs.params
from planners.layout import assemble, device_groups, megatron_split
from simulator import simulate
from simulator.analytic import iteration_time_s
from specs import HardwareSpec, ScheduleSpec, TrainingSpec, validate_plan
from costs.families import build_model, parse_model_config
from tests.conftest import conf


def _gpt(layers=8, hidden=1024, heads=16, seq=512):
    return build_model(parse_model_config({"family": "gpt", "name": "g", "num_layers": layers, "hidden": hidden,
                                           "heads": heads, "seq_len": seq, "vocab": 8192}), 2)


def _selene(nodes=1):
    return HardwareSpec(**{**conf("hardware", "selene"), "nodes": nodes})


def _plan(model, hw, pp, dp, tp, m, recompute, sp, kind="1f1b", v=1):
    training = TrainingSpec(global_batch=m * dp, microbatch_size=dp, precision="fp16")
    plan = assemble("test", model, hw, training, ScheduleSpec(kind=kind, virtual_stages=v),
                    megatron_split(model, pp * v), device_groups(hw, pp, dp, tp), dp, tp, recompute, 0,
                    sequence_parallel=sp)
    return validate_plan(plan, model, hw)


@pytest.mark.parametrize("sp", [False, True])
def test_selective_is_slower_than_keep_and_faster_than_full(sp):
    model, hw = _gpt(), _selene()
    times = {rc: lt.stage_pass_times_s(model, (p := _plan(model, hw, 1, 1, 8, 4, rc, sp)), hw, p.stages[0])
             for rc in ("none", "selective", "full")}
    assert times["none"][0] == times["selective"][0] == times["full"][0]  # forwards alike
    assert times["none"][1] < times["selective"][1] < times["full"][1]


def test_selective_adds_exactly_the_attention_core_forward():
    """Per block: the QKᵀ and attention·V GEMMs at their shapes over t heads' share, and the
    softmax/dropout traffic over t at HBM bandwidth (Korthikanti §5)."""
    model, hw = _gpt(), _selene()
    keep, sel = (_plan(model, hw, 1, 1, 8, 4, rc, False) for rc in ("none", "selective"))
    l, spec = 1, model.layers[1]
    b = costs.params.samples_per_replica(sel, sel.stages[0])
    core = (costs.gemm.gemms_fwd_s(hw.device, "fp16", [g for g in spec.gemms if g.name in ("scores", "attn_v")], b, 8)
            + b * spec.selective_mem_bytes_per_sample / 8 / hw.device.hbm_bytes_per_s)
    _, b_keep, _ = lt.layer_pass_times_s(model, keep, hw, keep.stages[0], l)
    _, b_sel, rc = lt.layer_pass_times_s(model, sel, hw, sel.stages[0], l)
    assert rc == 0.0
    assert b_sel - b_keep == pytest.approx(core, rel=1e-12)


def test_sequence_parallel_keeps_the_allreduce_volume_and_splits_elementwise_work():
    """A block's forward communication under SP (2 reduce-scatters + 2 all-gathers) equals TP's
    2 all-reduces on a ring; its element-wise traffic drops to 1/t; the backward adds the
    re-gather of the two sequence-split GEMM inputs (none when the block is fully recomputed)."""
    model, hw = _gpt(), _selene()
    tp_only, sp = (_plan(model, hw, 1, 1, 8, 4, "none", s) for s in (False, True))
    l = 1
    assert lt.layer_tp_comm_s(model, sp, hw, sp.stages[0], l) == pytest.approx(
        lt.layer_tp_comm_s(model, tp_only, hw, tp_only.stages[0], l), rel=1e-12)
    spec = model.layers[l]
    b = costs.params.samples_per_replica(sp, sp.stages[0])
    assert lt._mem_s(spec, b, 8, hw, sp=True) == pytest.approx(
        b * spec.fwd_mem_bytes_per_sample / 8 / hw.device.hbm_bytes_per_s, rel=1e-12)
    assert lt._mem_s(spec, b, 8, hw, sp=True) < lt._mem_s(spec, b, 8, hw)
    link = costs.collectives.collective_link(costs.collectives.group_link(hw, sp.stages[0].devices[:8]))
    regather = lt.sp_regather_s(model, sp, hw, sp.stages[0], l)
    assert regather == pytest.approx(costs.collectives.ring_allreduce_s(
        b * spec.output_bytes_per_sample, 8, link), rel=1e-12)  # two all-gathers = one all-reduce
    full = _plan(model, hw, 1, 1, 8, 4, "full", True)
    assert lt.sp_regather_s(model, full, hw, full.stages[0], l) == 0.0


@pytest.mark.parametrize("pp,dp,tp,m,rc,kind,v", [(1, 1, 8, 4, "selective", "1f1b", 1),
                                                   (2, 1, 4, 8, "selective", "1f1b", 1),
                                                   (2, 2, 2, 8, "none", "1f1b", 1),
                                                   (2, 1, 4, 8, "full", "interleaved_1f1b", 2)])
def test_simulator_agrees_with_analytic_on_sp_plans(pp, dp, tp, m, rc, kind, v):
    """Same per-layer costs, so the two differ only in how p2p copies overlap compute and by
    integer-ns rounding (test_time_model.py's bound)."""
    model, hw = _gpt(), _selene()
    plan = _plan(model, hw, pp, dp, tp, m, rc, True, kind, v)
    ana = iteration_time_s(plan, model, hw)
    sim = simulate(plan, model, hw).result.iteration_time_s
    p2p = 0.0
    for s, nxt in zip(plan.stages, plan.stages[1:]):
        nbytes = costs.params.samples_per_replica(plan, s) * model.layers[s.layer_stop - 1].output_bytes_per_sample
        if s.devices[0] != nxt.devices[0]:
            p2p += 2 * costs.collectives.transfer_s(nbytes, hw.link(s.devices[0], nxt.devices[0]))
    tol = p2p * (1 + (pp - 1) / v) + 4 * m * len(plan.stages) * 1e-9 + 1e-9
    assert abs(sim - ana) <= tol, (sim, ana, tol)


def test_llama_preset_plans_and_simulates_under_sp_and_selective():
    model = build_model(parse_model_config(conf("model", "llama3_8b")), 2)
    hw = HardwareSpec(**conf("hardware", "h100_node"))
    keep, sel = (_plan(model, hw, 1, 1, 8, 2, rc, True) for rc in ("none", "selective"))
    for plan in (keep, sel):
        assert simulate(plan, model, hw).result.iteration_time_s > 0
    # flash attention: selective drops only the log-sum-exp but still re-runs QKᵀ and attention·V
    assert iteration_time_s(sel, model, hw) > iteration_time_s(keep, model, hw)
