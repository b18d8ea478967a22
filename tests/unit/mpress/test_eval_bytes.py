"""benchmarks/mpress_eval.py technique_bytes(): the bytes each technique saves and moves, counted by
hand on plans whose actions take every n-th microbatch (LayerMemory.microbatch_period) and on a
PipeDream plan that swaps stashed weight versions (OffloadPolicy.stash_swap_layers)."""
from __future__ import annotations

import pytest

from benchmarks import mpress_eval
from planners import make_plan
from planners.policy import BalancedPolicy
from specs.plan import validate_plan
from specs.plan_memory import D2DTarget, LayerMemory, MemoryAction, OffloadPolicy


def _base(name: str):
    case = mpress_eval.compose_case(name)
    cfg = case.cfg
    plan = make_plan(BalancedPolicy(pp=cfg.hardware.num_devices), case.model, cfg.hardware, cfg.training, cfg.schedule)
    return case, plan


def _with(plan, stage: int, **update):
    stages = list(plan.stages)
    stages[stage] = stages[stage].model_copy(update=update)
    return plan.model_copy(update={"stages": stages})


@pytest.fixture(scope="module")
def gpt():
    return _base("mpress_gpt_5b3_dgx1")


def test_a_period_of_two_halves_what_is_held_and_moves_every_other_microbatch(gpt):
    case, base = gpt
    cfg = case.cfg
    s, h, a, b = cfg.model.seq_len, cfg.model.hidden, cfg.model.heads, cfg.training.microbatch_size
    block = s * b * h * (34 + 5 * a * s // h)  # fp16 block activations (Korthikanti et al. 2022, eq. 1)
    layer_input = s * b * h * 2                # its input, the checkpoint recomputation keeps
    stage = base.stages[0]
    l1, l2, l3 = stage.layer_start + 1, stage.layer_start + 2, stage.layer_start + 3
    plan = validate_plan(_with(base, 0, memory=[
        LayerMemory(layer=l1, action=MemoryAction.d2d_swap, targets=[D2DTarget(device=1, weight=1.0)],
                    microbatch_period=2),
        LayerMemory(layer=l2, action=MemoryAction.cpu_swap, microbatch_period=3),
        LayerMemory(layer=l3, action=MemoryAction.recompute, microbatch_period=2)]), case.model, cfg.hardware)
    m, p = cfg.training.microbatches, len(plan.stages)
    held = min(p, m)  # 1F1B: stage 0 holds min(p - 0, m) microbatches at its peak
    saved, moved, stages, layers = mpress_eval.technique_bytes(plan, case.model)
    assert (m, held) == (32, 8)
    assert saved["d2d_swap"] == held * block / 2 == 4 * block  # not 8 blocks: every other one stays
    assert moved["d2d_swap"] == 2 * (m // 2) * block         # out and back, microbatches 0, 2, ..., 30
    assert saved["cpu_swap"] == held * block / 3 and moved["cpu_swap"] == 2 * 11 * block  # k = 0, 3, ..., 30
    assert saved["recompute"] == held * (block - layer_input) / 2 and moved["recompute"] == 0
    assert stages == {"d2d_swap": [0], "cpu_swap": [0], "recompute": [0]} and layers == {
        "d2d_swap": 1, "cpu_swap": 1, "recompute": 1}
    text, saved_gib, _, moved_gib = mpress_eval.describe(plan, case.model)
    assert text == "rc:s0(1) cpu:s0(1) d2d:s0(1)" and moved_gib["d2d_swap"] == 32 * block / 2**30


def test_stashed_weight_swap_moves_each_stale_version_out_and_back():
    case, base = _base("mpress_bert_0b64_pipedream")
    cfg = case.cfg
    h = cfg.model.hidden
    first = base.stages[0]
    blocks = [l for l in first.layers if case.model.layers[l].kind.value == "transformer_block"][:2]
    per_layer = (12 * h * h + 13 * h) * 4  # a BERT block's parameters (attention 4h²+4h, MLP 8h²+5h, 2 LN), fp32
    assert all(case.model.layers[l].params * 4 == per_layer for l in blocks)
    plan = validate_plan(_with(base, 0, offload=OffloadPolicy(stash_swap_layers=blocks)), case.model, cfg.hardware)
    m, p = cfg.training.microbatches, len(plan.stages)
    saved, moved, stages, layers = mpress_eval.technique_bytes(plan, case.model)
    # stage 0 of p keeps p - 1 stashed versions (PipeDream §3.3); every forward but the first
    # finds an older microbatch in flight, so m - 1 versions go stale in the iteration
    assert mpress_eval.stale_versions(plan, 0) == m - 1
    assert saved["stash_swap"] == (p - 1) * 2 * per_layer
    assert moved["stash_swap"] == 2 * (m - 1) * 2 * per_layer
    assert stages["stash_swap"] == [0] and layers["stash_swap"] == 2
    assert mpress_eval.stale_versions(plan, p - 1) == 0  # the last stage stashes nothing
    assert "stash:s0(2)" in mpress_eval.describe(plan, case.model)[0]
    # without the field set (every plan before issue 24) nothing is counted
    assert "stash_swap" not in mpress_eval.technique_bytes(base, case.model)[0]
