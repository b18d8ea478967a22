"""Tied input/output embeddings (Megatron's default, issue #11): one copy where embedding and head
share devices, a copy on the last stage plus a gradient all-reduce with the first when pp > 1."""
from __future__ import annotations

import pytest

from planners import make_plan, parse_policy
from specs import ScheduleSpec, TrainingSpec
import costs.collectives
import costs.static
from costs.families import build_model, parse_model_config
from tests.conftest import make_hardware

H, V = 64, 256
TRAINING = TrainingSpec(global_batch=8, microbatch_size=2)  # 18 B/param: 2 weights + 4 grads + 12


def gpt(tied: bool = True):
    return build_model(parse_model_config(dict(family="gpt", name="g", num_layers=4, hidden=H, heads=4,
                                               seq_len=32, vocab=V, tie_embeddings=tied)))


def plan(model, pp: int, tp: int = 1):
    hw = make_hardware(devices=pp * tp, nvlink_pairs=())
    return make_plan(parse_policy({"kind": "manual", "pp": pp, "tp": tp}), model, hw, TRAINING, ScheduleSpec()), hw


@pytest.mark.parametrize("tp", [1, 2])
def test_one_copy_when_embedding_and_head_share_a_stage(tp):
    tied, untied = gpt(True), gpt(False)
    (p1, _), (p2, _) = plan(tied, 1, tp), plan(untied, 1, tp)
    w_tied = costs.static.stage_static(tied, p1, p1.stages[0])[0].parameters_bytes
    w_untied = costs.static.stage_static(untied, p2, p2.stages[0])[0].parameters_bytes
    assert w_untied - w_tied == 2 * H * V // tp  # fp16 weights: the head's own h·V, vocab-parallel
    assert tied.total_params == untied.total_params - H * V


def test_pipeline_keeps_a_copy_on_the_last_stage_and_all_reduces_it():
    tied, untied = gpt(True), gpt(False)
    (pt, hw), (pu, _) = plan(tied, 2), plan(untied, 2)
    for s in (0, 1):  # the same bytes as untied: the last stage holds its copy
        assert costs.static.stage_static(tied, pt, pt.stages[s]) == costs.static.stage_static(untied, pu, pu.stages[s])
    link = hw.link(pt.stages[0].devices[0], pt.stages[1].devices[0])
    want = costs.collectives.ring_allreduce_s(4 * H * V, 2, link)  # fp32 main grads of the h·V copy, group of 2
    assert want > 0
    for s in (0, 1):
        assert costs.collectives.embedding_group_allreduce_s(tied, pt, hw, pt.stages[s]) == pytest.approx(want)
        assert costs.collectives.embedding_group_allreduce_s(untied, pu, hw, pu.stages[s]) == 0.0
    p1, hw1 = plan(tied, 1)
    assert costs.collectives.embedding_group_allreduce_s(tied, p1, hw1, p1.stages[0]) == 0.0
