"""Sequence parallelism and selective recompute in memory (Korthikanti et al. 2022, Table 2 and
Figure 7): per-block bytes equal the closed forms exactly (integers), every family says what
selective drops (LLaMA with flash attention: only its log-sum-exp), a layer without an attention
core is refused by name, and the first stage of each Table 3 configuration holds each variant's
published activations within 3 % (benchmarks/validate_megatron_memory.py prints the table)."""
from __future__ import annotations

import pytest

from benchmarks.validate_megatron_memory import SEQ, TABLE3, fig7_rows, memwall_first_stage
from costs.activations import layer_saved_bytes, stage_activation_bytes
from costs.families import build_model, parse_model_config
from planners import make_plan, parse_policy
from specs import HardwareSpec, PlanError, ScheduleSpec, TrainingSpec, validate_plan
from specs.model import LayerKind
from specs.plan import LayerMemory, MemoryAction
from tests.conftest import conf


def _gpt(s=2048, h=6144, a=64, L=2, act=2):
    return build_model(parse_model_config({"family": "gpt", "name": "g", "num_layers": L, "hidden": h, "heads": a,
                                           "seq_len": s, "vocab": 51200}), act)


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("b", [1, 4])
def test_gpt_block_bytes_are_table_2_exactly(t, b):
    """Table 2 per layer, in integers (s, h, a divisible by t): TP sbh(10 + 24/t + 5as/(ht)),
    TP+SP sbh(34/t + 5as/(ht)), TP+selective sbh(10 + 24/t), TP+SP+selective 34sbh/t."""
    s, h, a = 2048, 6144, 64
    block = _gpt(s, h, a).layers[1]
    sbh, core = s * b * h, 5 * a * s * s * b // t
    want = {(False, False): 10 * sbh + 24 * sbh // t + core, (True, False): 34 * sbh // t + core,
            (False, True): 10 * sbh + 24 * sbh // t, (True, True): 34 * sbh // t}
    for (sp, selective), nbytes in want.items():
        assert layer_saved_bytes(block, b, t, sp=sp, selective=selective) == nbytes, (sp, selective)


def test_fp32_selective_drops_twice_the_fp16_core():
    """The family scales every element to the activation dtype (masks included, as it counts
    them): fp32 drops 2 x 5as² per sample."""
    s, h, a = 512, 1024, 16
    assert _gpt(s, h, a, act=4).layers[1].selective_bytes_per_sample == 2 * 5 * a * s * s


@pytest.mark.parametrize("flash", [True, False])
def test_llama_selective_drops_what_its_core_saves(flash):
    """Derived from the LLaMA list, not GPT's: the checkpointed core keeps Q, K, V (its inputs)
    and the projection keeps the core's output, so flash drops only the fp32 log-sum-exp 4as and
    the unfused core its softmax output 2as² (no dropout); SP splits everything else, so TP +
    SP + selective is the whole saved list over t less the dropped core."""
    cfg = parse_model_config({**conf("model", "llama3_8b"), "flash_attention": flash})
    block = build_model(cfg, 2).layers[1]
    s, a = cfg.seq_len, cfg.heads
    names = [t.name for t in block.saved_tensors]
    assert ("attn.logsumexp" in names) is flash and ("attn.softmax_output" in names) is not flash
    assert block.selective_bytes_per_sample == (4 * a * s if flash else 2 * a * s * s)
    t = 8
    both = layer_saved_bytes(block, 1, t, sp=True, selective=True)
    assert both == -(-(block.saved_bytes_per_sample - block.selective_bytes_per_sample) // t)


def test_every_family_block_has_a_core_and_other_layers_none():
    for name in ("gpt_tiny", "bert_tiny", "moe_tiny", "llama_tiny"):
        model = build_model(parse_model_config(conf("model", name)), 2)
        for layer in model.layers:
            blocky = layer.kind in (LayerKind.transformer_block, LayerKind.moe_block)
            assert layer.has_attention_core is blocky, (name, layer.name)
            assert layer.tp_sharded_saved_fraction + layer.sp_sharded_saved_fraction <= 1 + 1e-12


def _selene():
    return HardwareSpec(**{**conf("hardware", "selene"), "nodes": 1})


def test_selective_on_a_layer_without_attention_core_names_the_layer():
    model = _gpt(512, 1024, 16, L=2)
    hw = _selene()
    training = TrainingSpec(global_batch=8, microbatch_size=1, precision="bf16")
    plan = make_plan(parse_policy({"kind": "manual", "pp": 1, "tp": 8, "dp": 1, "recompute": "selective"}),
                     model, hw, training, ScheduleSpec())
    assert {m.layer for m in plan.stages[0].memory} == {1, 2}  # the two blocks only
    validate_plan(plan, model, hw)
    bad = plan.model_copy(update={"stages": [plan.stages[0].model_copy(update={
        "memory": [LayerMemory(layer=0, action=MemoryAction.selective)]})]})
    with pytest.raises(PlanError, match=r"memory\[0\]\.action.*layer 0 \('embed', embedding\) has no attention core"):
        validate_plan(bad, model, hw)


def test_sequence_parallel_splits_every_boundary_of_a_stage():
    """With SP a GPT stage of kept blocks holds exactly 1/t of what it holds at t = 1 besides the
    attention core (which TP splits anyway) and the ids: the stage's activations are
    Table 2's 34sbh/t + 5as²b/t per block and the stage input sbh/t."""
    s, h, a = 1024, 2048, 16
    model = _gpt(s, h, a, L=4)
    hw = _selene()
    training = TrainingSpec(global_batch=8, microbatch_size=1, precision="bf16")
    plan = make_plan(parse_policy({"kind": "manual", "pp": 2, "tp": 4, "dp": 1, "sequence_parallel": True,
                                   "layers_per_stage": [3, 3]}), model, hw, training, ScheduleSpec())
    # stage 1: blocks 2, 3 and the head; its input is block 1's output
    t = plan.stages[1].tp
    got = stage_activation_bytes(model, plan, plan.stages[1])
    sbh = s * h
    head = 4 * sbh // t + 4 * s * 51200 // t  # §4.3 with SP: final-LN and decoder inputs split, logits
    loss = 4  # the last stage keeps its fp32 loss (its output, the backward's root)
    assert got == 2 * (34 * sbh // t + 5 * a * s * s // t) + head + loss


@pytest.mark.parametrize("row", list(fig7_rows()), ids=lambda r: f"{r[0]}-{r[1]}")
def test_first_stage_activations_per_figure_7_variant(row):
    """Each Figure 7 variant's first-stage activations within 3 % of Table 2's formulas summed
    over the first stage — except 530B with full recompute (+7 %, see the next test)."""
    name, variant, published, got = row
    if (name, variant) == ("530B", "full"):
        pytest.skip("known gap: the published form's embedding term under interleaving (next test)")
    assert got == pytest.approx(published, rel=0.03)


def test_530b_full_recompute_gap_is_the_embedding_in_flight_count():
    """530B (p 35, v 3, one block per chunk) with full recompute: the blocks' 2sbh per layer
    match the published (1 + (p−1)/(pv)) factor exactly (139 chunk-microbatches of 2sbh), and the
    whole excess is the embedding's dropout mask held by Megatron's warm-up on chunk 0,
    2(p−1) + 1 = 69 microbatches, where the published form scales it by p(1 + (p−1)/(pv)) = 46.3."""
    name, a, h, L, t, p, gpus, batch, micro = TABLE3[2]
    _, _, plan, got = memwall_first_stage(a, h, L, t, p, gpus, batch, micro, "full", 3, with_peak=False)
    sbh, ids = SEQ * micro * h, 8 * SEQ * micro
    held_by_chunk0 = 2 * (p - 1) + 1
    assert got["resident"] == 2 * sbh * L * (1 + (p - 1) / (p * 3)) + held_by_chunk0 * (sbh + ids)
