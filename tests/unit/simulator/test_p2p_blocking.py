"""``plan.p2p_blocking`` (Megatron's p2p: each send waited before the next pass; Megatron-Core's
``overlap_p2p_comm=False``, Megatron-LM 2021-22, DeepSpeed's pipeline engine): the per-stage cost
(costs.layer_time.blocking_send_s), the discrete-event simulator holding the sender until its
transfer ends, the analytic estimate agreeing with it, and the plan's JSON."""
from __future__ import annotations

import json

import pytest

import costs.layer_time
from costs.families import build_model, parse_model_config
from planners import make_plan, parse_policy
from planners.layout import PlanningError
from simulator import simulate
from simulator.analytic import iteration_time_s
from simulator.trace import x_slices
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf

MODEL = build_model(parse_model_config(conf("model", "gpt3_2b6")), 2)
HW = HardwareSpec.model_validate({**conf("hardware", "selene"), "nodes": 4})
TRAINING = TrainingSpec(global_batch=32, microbatch_size=2, precision="fp16")


def plan_of(kind="1f1b", **policy):
    v = 2 if kind in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    return make_plan(parse_policy({"kind": "even", "pp": 4, "tp": 8, **policy}), MODEL, HW, TRAINING,
                     ScheduleSpec(kind=kind, virtual_stages=v))


def test_blocking_send_is_one_transfer_per_neighbour():
    plan = plan_of(p2p_blocking=True)
    hop = HW.inter_node
    # one replica's boundary: s x b x h fp16, whole over the inter-node link (stages on different nodes)
    nbytes = MODEL.seq_len * 2 * MODEL.hidden * 2
    one = hop.latency_s + nbytes / (hop.total_bw_gbps * 1e9)
    sends = [costs.layer_time.blocking_send_s(MODEL, plan, HW, st) for st in plan.stages]
    assert sends[0] == (pytest.approx(one, rel=1e-12), 0.0)  # the first stage sends no gradient
    assert sends[-1] == (0.0, pytest.approx(one, rel=1e-12))  # the last stage no activation
    assert all(f == pytest.approx(one, rel=1e-12) and b == pytest.approx(one, rel=1e-12) for f, b in sends[1:-1])
    off = plan_of()
    assert all(costs.layer_time.blocking_send_s(MODEL, off, HW, st) == (0.0, 0.0) for st in off.stages)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb_h1"])
def test_simulator_and_analytic_agree_and_blocking_costs_time(kind):
    on, off = plan_of(kind, p2p_blocking=True), plan_of(kind)
    sim_on = simulate(on, MODEL, HW).result.iteration_time_s
    sim_off = simulate(off, MODEL, HW).result.iteration_time_s
    assert sim_on > sim_off
    # the closed forms walk the same passes, the sends folded into them (hops arrive as they end);
    # GPipe's form takes the slowest F + B where its two phases each queue behind their own
    # slowest pass (the blocking sends make those different stages here): a lower bound there
    ana_on = iteration_time_s(on, MODEL, HW)
    if kind == "gpipe":
        assert ana_on <= sim_on * (1 + 1e-6) and ana_on == pytest.approx(sim_on, rel=0.01)
    else:
        assert ana_on == pytest.approx(sim_on, rel=1e-6)
    assert iteration_time_s(off, MODEL, HW) == pytest.approx(sim_off, rel=1e-6)
    # the steady state: each of the m - 1 microbatches behind the first waits for the slowest
    # stage's own sends (here the last, with the head: its gradient send only); the first one's
    # crossing already waited for every transfer (the simulator's clock: whole ns, 1 per event)
    m = on.training.microbatches
    last = sum(costs.layer_time.blocking_send_s(MODEL, on, HW, on.stages[-1]))
    assert sim_on - sim_off >= (m - 1) * (last - 1e-9)


@pytest.mark.parametrize("kind", ["1f1b", "interleaved_1f1b", "zb_h1"])
def test_no_pass_starts_before_its_devices_earlier_sends_end(kind):
    """The discrete-event trace: on every device, each compute slice after a send of that device
    starts no earlier than the send's transfer ends (with the flag); without it, some do."""
    def violations(plan):
        trace = simulate(plan, MODEL, HW).trace
        by_pid: dict[int, list] = {}
        for pid, name, start, dur, cat in x_slices(trace):
            by_pid.setdefault(pid, []).append((start, dur, name, cat))
        bad = 0
        for items in by_pid.values():
            sends = [(s, s + d) for s, d, n, c in items if c == "p2p" and n.startswith(("act", "grad"))]
            passes = [s for s, d, n, c in items if c in ("forward", "backward", "backward_weight")]
            for s_start, s_end in sends:
                bad += any(s_start <= p < s_end for p in passes)
        return bad, len(sends)
    bad_on, n_on = violations(plan_of(kind, p2p_blocking=True))
    bad_off, _ = violations(plan_of(kind))
    assert n_on > 0
    assert bad_on == 0
    assert bad_off > 0


def test_plan_json_omits_the_default():
    off = plan_of()
    assert "p2p_blocking" not in json.loads(off.model_dump_json())
    on = plan_of(p2p_blocking=True)
    assert json.loads(on.model_dump_json())["p2p_blocking"] is True


@pytest.mark.parametrize("kind", ["zbv", "dualpipev"])
def test_v_shaped_schedules_refuse_blocking_sends(kind):
    """Two devices of a V exchange in both directions at once: waiting on each send before the
    next pass deadlocks the executor (gloo moves a message once its receive is posted)."""
    with pytest.raises(PlanningError, match="policy.p2p_blocking: a V places"):
        plan_of(kind, p2p_blocking=True)
    plan = plan_of(kind)
    with pytest.raises(ValueError, match="p2p_blocking: a V places"):
        type(plan).model_validate({**plan.model_dump(), "p2p_blocking": True})
