"""The GPU time model end to end (issue #11): analytic and simulator agree on iteration time for
plans with real GEMM shapes, the gradient all-reduce occupies links, and the overlapped (bucketed)
all-reduce is never slower than the blocking one and never faster than the work without it."""
from __future__ import annotations

import pathlib

import pytest
import yaml

from simulator.analytic import iteration_time_s
from planners.layout import assemble, device_groups, megatron_split
from simulator import simulate
from simulator.engine import Engine
from simulator.report import build_result
from specs import HardwareSpec, ScheduleSpec, TrainingSpec, validate_plan
import costs.collectives
import costs.layer_time
import costs.params
from costs.families import build_model, parse_model_config

ROOT = pathlib.Path(__file__).resolve().parents[3]


def gpt(layers: int = 8, hidden: int = 1024, heads: int = 16, seq: int = 512):
    return build_model(parse_model_config({"family": "gpt", "name": "gpt_t", "num_layers": layers, "hidden": hidden,
                                           "heads": heads, "seq_len": seq, "vocab": 8192}), 2)


def selene(nodes: int = 1) -> HardwareSpec:
    hw = yaml.safe_load((ROOT / "conf/hardware/selene.yaml").read_text())
    hw["nodes"] = nodes
    return HardwareSpec(**hw)


def make(model, hardware, pp: int, dp: int, tp: int, m: int, kind: str = "1f1b", v: int = 1, recompute="full"):
    training = TrainingSpec(global_batch=m * dp, microbatch_size=dp, precision="fp16")
    schedule = ScheduleSpec(kind=kind, virtual_stages=v)
    plan = assemble("test", model, hardware, training, schedule, megatron_split(model, pp * v),
                    device_groups(hardware, pp, dp, tp), dp, tp, recompute, 0)
    return validate_plan(plan, model, hardware)


def p2p_s(plan, model, hardware) -> float:
    """All boundary sends of one microbatch, both directions (what the analytic adds in full)."""
    total = 0.0
    for s, nxt in zip(plan.stages, plan.stages[1:]):
        b = costs.params.samples_per_replica(plan, s)
        nbytes = b * model.layers[s.layer_stop - 1].output_bytes_per_sample
        if s.devices[0] != nxt.devices[0]:
            total += 2 * costs.collectives.transfer_s(nbytes, hardware.link(s.devices[0], nxt.devices[0]))
    return total


@pytest.mark.parametrize("pp,dp,tp,m,kind,v", [(1, 4, 2, 4, "1f1b", 1), (2, 2, 2, 8, "1f1b", 1),
                                               (4, 2, 1, 8, "gpipe", 1), (2, 2, 2, 8, "interleaved_1f1b", 2)])
def test_analytic_and_simulator_agree(pp, dp, tp, m, kind, v):
    """Same per-layer costs (costs), so the two differ only in how p2p copies overlap compute
    and by integer-ns rounding: bounded by one microbatch's sends plus 1 ns per simulated pass."""
    model, hw = gpt(), selene()
    plan = make(model, hw, pp, dp, tp, m, kind, v)
    ana = iteration_time_s(plan, model, hw)
    sim = simulate(plan, model, hw).result.iteration_time_s
    tol = p2p_s(plan, model, hw) * (1 + (pp - 1) / v) + 4 * m * len(plan.stages) * 1e-9 + 1e-9
    assert abs(sim - ana) <= tol, (sim, ana, tol)


def test_backward_is_costlier_than_forward_and_recompute_adds_a_forward():
    model, hw = gpt(), selene()
    keep = make(model, hw, 1, 8, 1, 2, recompute="none")
    full = make(model, hw, 1, 8, 1, 2, recompute="full")
    fk, bk = costs.layer_time.stage_pass_times_s(model, keep, hw, keep.stages[0])
    ff, bf = costs.layer_time.stage_pass_times_s(model, full, hw, full.stages[0])
    assert fk == pytest.approx(ff)
    assert 1.8 * fk < bk < 2.6 * fk  # dgrad + wgrad ~ 2 forwards; elementwise backward 1.5x
    blocks = [i for i, l in enumerate(model.layers) if l.kind.value == "transformer_block"]
    recomputed = sum(costs.layer_time.layer_pass_times_s(model, full, hw, full.stages[0], i)[0] for i in blocks)
    assert bf == pytest.approx(bk + recomputed)


def _engine(plan, model, hw, overlap: bool) -> Engine:
    e = Engine(plan, model, hw, overlap_dp_allreduce=overlap)
    e.run()
    return e


def test_gradient_allreduce_occupies_the_ring_links():
    model, hw = gpt(), selene(nodes=2)
    plan = make(model, hw, 1, 16, 1, 2)  # dp ring over both nodes
    e = _engine(plan, model, hw, overlap=False)
    res = e._ar_resources(0)
    assert res and all(e.links.busy_until[r] >= e.finish_ns[0] - e.costs[0].optimizer_ns for r in res)
    assert build_result(e, model)[0].iteration_time_s == pytest.approx(iteration_time_s(plan, model, hw), rel=1e-6)


def test_overlapped_allreduce_hides_part_of_it():
    """Buckets go out during the last backward: the iteration shrinks, but by no more than the
    blocking all-reduce took, and never below the run without any all-reduce."""
    model, hw = gpt(layers=8), selene(nodes=2)
    plan = make(model, hw, 1, 16, 1, 2)
    blocking = _engine(plan, model, hw, overlap=False)
    overlapped = _engine(plan, model, hw, overlap=True)
    t_block, t_over = blocking.finish_ns[0], overlapped.finish_ns[0]
    ar_ns = blocking.costs[0].dp_allreduce_ns
    assert ar_ns > 0
    assert t_block - ar_ns <= t_over < t_block
