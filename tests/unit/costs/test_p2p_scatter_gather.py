"""Narayanan et al. SC'21 §4.1 (Fig. 9): with ``plan.p2p_scatter_gather`` each tensor-parallel rank
sends 1/t of a pipeline boundary tensor and the receiving tp group all-gathers it. The rule
(costs.buffers.p2p_split), the bytes and times the simulator books, the plan's JSON, and what the
executor's StageComm puts on the wire."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

import costs.buffers
import costs.layer_time
from costs.families import build_model, parse_model_config
from planners import make_plan, parse_policy
from simulator.analytic import iteration_time_s
from simulator.stagecost import stage_costs
from specs.hardware import HardwareSpec
from specs.plan import ScheduleSpec
from specs.training import TrainingSpec
from tests.conftest import conf

MODEL = build_model(parse_model_config(conf("model", "gpt3_2b6")), 2)
HW = HardwareSpec.model_validate({**conf("hardware", "selene"), "nodes": 2})
TRAINING = TrainingSpec(global_batch=32, microbatch_size=2, precision="fp16")


def plan_of(**policy):
    return make_plan(parse_policy({"kind": "even", "pp": 2, "tp": 8, **policy}), MODEL, HW, TRAINING,
                     ScheduleSpec(kind="1f1b"))


def test_rule_needs_equal_tp_and_no_sequence_parallelism():
    on, off = plan_of(p2p_scatter_gather=True), plan_of()
    a, b = on.stages
    assert costs.buffers.p2p_split(on, a, b) == 8
    assert costs.buffers.p2p_split(off, *off.stages) == 1
    sp = plan_of(p2p_scatter_gather=True, sequence_parallel=True)
    assert costs.buffers.p2p_split(sp, *sp.stages) == 1  # already s/t per rank (Korthikanti §4.2.2)
    assert costs.buffers.p2p_split(on, a, b.model_copy(update={"tp": 4, "dp": 2})) == 1
    assert costs.buffers.p2p_split(on, a, None) == 1


def test_simulator_books_a_tth_of_the_bytes_and_the_gather():
    on, off = plan_of(p2p_scatter_gather=True), plan_of()
    sc_on, sc_off = stage_costs(on, MODEL, HW), stage_costs(off, MODEL, HW)
    assert sc_on[0].act_out_bytes * 8 == sc_off[0].act_out_bytes > 0
    assert sc_on[1].grad_out_bytes * 8 == sc_off[1].grad_out_bytes > 0
    # the receiver rebuilds the whole: stage 1 gathers activations forward, stage 0 gradients backward
    g0, g1 = (costs.layer_time.p2p_gather_s(MODEL, on, HW, st) for st in on.stages)
    assert g0[0] == 0 < g0[1] and g1[1] == 0 < g1[0]
    assert costs.layer_time.p2p_gather_s(MODEL, off, HW, off.stages[1]) == (0.0, 0.0)
    assert sc_on[1].fwd_ns > sc_off[1].fwd_ns and sc_on[0].bwd_ns > sc_off[0].bwd_ns
    # across nodes the 1/t send saves more than the NVLink gather costs
    assert iteration_time_s(on, MODEL, HW) != iteration_time_s(off, MODEL, HW)


def test_plan_json_omits_the_default():
    off = plan_of()
    assert "p2p_scatter_gather" not in json.loads(off.model_dump_json())
    on = plan_of(p2p_scatter_gather=True)
    assert json.loads(on.model_dump_json())["p2p_scatter_gather"] is True
    assert on.id != off.id


class _Tracker:
    @contextlib.contextmanager
    def phase(self, _name):
        yield


class _Sends:
    def __init__(self):
        self.pieces = []

    def add(self, _work, piece, _on_done=None):
        self.pieces.append(piece)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_executor_sends_this_ranks_tth(monkeypatch, tp_rank):
    """StageComm.send puts 1/t of the flattened boundary tensor on the wire: tp rank r's r-th part."""
    from executor import stage_comm
    from executor.topology import Route

    class Comm(stage_comm.StageComm):
        out_routes, grad_out_routes = [Route(0, 2, 0, 2)], []
        device, rows, bounds, index, m = 0, (0, 2), None, 0, 4
        scatter_out, scatter_in, release_outputs = 2, 1, False
        rank_of, tracker = {2: 2}, _Tracker()

    comm = Comm()
    comm.tp_rank, comm.sends = tp_rank, _Sends()
    monkeypatch.setattr(stage_comm.dist, "isend", lambda t, dst, tag: None)
    x = torch.arange(2 * 3 * 4, dtype=torch.float64).reshape(2, 3, 4)
    comm.send("act", 0, x)
    (piece,) = comm.sends.pieces
    assert piece.numel() == x.numel() // 2
    assert torch.equal(piece, x.reshape(-1)[tp_rank * 12:(tp_rank + 1) * 12])


def test_auto_knob_turns_it_on_only_where_it_applies():
    from planners.auto.candidate import techniques
    from planners.auto.knobs import p2p_scatter_gather

    on = p2p_scatter_gather(plan_of())
    assert on is not None and on.p2p_scatter_gather and "p2p_scatter_gather" in techniques(on)
    assert p2p_scatter_gather(on) is None
    assert p2p_scatter_gather(plan_of(sequence_parallel=True)) is None
