"""Model families against closed forms from the literature (not against the code's own output)."""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from costs.activations import layer_saved_bytes
from costs.params import layer_params_on_device
from costs.families import build_model, parse_model_config, published_params
from specs.model import LayerKind


def gpt(**kw):
    data = dict(family="gpt", name="g", num_layers=2, hidden=1024, heads=16, seq_len=2048, vocab=50257)
    return parse_model_config({**data, **kw})


def block(spec, i=0):
    return spec.layers[1 + i]


# ---- GPT block: Narayanan et al. 2021, Korthikanti et al. 2022 ------------------------------

@pytest.mark.parametrize("h,a,s", [(64, 4, 32), (1024, 16, 2048), (2560, 32, 1024), (12288, 96, 2048)])
def test_gpt_block_matches_megatron_closed_forms(h, a, s):
    b = block(build_model(gpt(hidden=h, heads=a, seq_len=s)))
    assert b.kind is LayerKind.transformer_block
    assert b.params == 12 * h * h + 13 * h
    assert b.fwd_flops_per_sample == 24 * s * h * h + 4 * s * s * h
    assert b.saved_bytes_per_sample == s * h * 34 + 5 * a * s * s  # s·h·(34 + 5as/h), fp16
    assert b.output_bytes_per_sample == 2 * s * h
    assert b.tp_sharded_saved_fraction == pytest.approx((24 + 5 * a * s / h) / (34 + 5 * a * s / h))
    # column-parallel QKV/fc1 weights+biases, row-parallel proj/fc2 weights; LN and 2 biases replicated
    assert b.tp_sharded_param_fraction == pytest.approx((12 * h * h + 7 * h) / (12 * h * h + 13 * h))
    assert (b.tp_allreduces_per_pass, b.max_tp) == (2, a)


def test_fp32_doubles_every_activation_byte():
    half, full = build_model(gpt(), 2), build_model(gpt(), 4)
    b16, b32 = block(half), block(full)
    assert b32.saved_bytes_per_sample == 2 * b16.saved_bytes_per_sample
    assert b32.output_bytes_per_sample == 2 * b16.output_bytes_per_sample
    assert full.act_dtype_bytes == 4


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tp_sharded_block_activations_follow_korthikanti_eq2(t):
    h, a, s = 4096, 32, 2048
    b = block(build_model(gpt(hidden=h, heads=a, seq_len=s)))
    expected = s * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_saved_bytes(b, 1, t) == pytest.approx(expected, abs=1)
    assert layer_params_on_device(b, t) == math.ceil((12 * h * h + 7 * h) / t + 6 * h)


def test_gpt_layout_embedding_and_head():
    h, s, V, L = 256, 128, 1000, 5
    spec = build_model(gpt(hidden=h, heads=4, seq_len=s, vocab=V, num_layers=L))
    assert [l.name for l in spec.layers] == ["embed"] + [f"block_{i:02d}" for i in range(L)] + ["head"]
    embed, head = spec.layers[0], spec.layers[-1]
    assert embed.kind is LayerKind.embedding and head.kind is LayerKind.head
    assert embed.params == V * h + s * h
    assert embed.output_bytes_per_sample == s * h * 2
    assert head.params == h * V + 2 * h
    assert head.fwd_flops_per_sample == 2 * s * h * V
    assert head.saved_bytes_per_sample >= 4 * s * V  # fp32 logits for the loss
    assert head.output_bytes_per_sample <= 8
    # tied by default (Megatron): the head's h·V is the embedding's, counted once
    assert head.tied_to == "embed" and head.tied_params == h * V
    assert spec.total_params == sum(l.params for l in spec.layers) - h * V
    untied = build_model(gpt(hidden=h, heads=4, seq_len=s, vocab=V, num_layers=L, tie_embeddings=False))
    assert untied.total_params == sum(l.params for l in spec.layers)
    assert published_params(gpt(hidden=h, heads=4, seq_len=s, vocab=V, num_layers=L, tie_embeddings=False)) \
        == spec.total_params


def test_ffn_hidden_is_a_size_exclusive_with_ffn_mult():
    h = 256
    by_size = build_model(gpt(hidden=h, heads=4, seq_len=128, vocab=1000, num_layers=2, ffn_hidden=688))
    by_mult = build_model(gpt(hidden=h, heads=4, seq_len=128, vocab=1000, num_layers=2, ffn_mult=4))
    default = build_model(gpt(hidden=h, heads=4, seq_len=128, vocab=1000, num_layers=2))
    f = 688  # MLP params 2hf + f + 3h (fc1, fc2, layernorm): only f differs from the 4h block
    assert by_size.layers[1].params - by_mult.layers[1].params == (2 * h + 1) * (f - 4 * h)
    assert default.layers[1].params == by_mult.layers[1].params
    with pytest.raises(ValueError, match="ffn_hidden"):
        gpt(hidden=h, heads=4, seq_len=128, vocab=1000, num_layers=2, ffn_hidden=688, ffn_mult=4)


def test_gpt3_175b_total_params():
    cfg = parse_model_config(dict(family="gpt", name="gpt3_175b", num_layers=96, hidden=12288,
                                  heads=96, seq_len=2048, vocab=50257))
    assert build_model(cfg).total_params == pytest.approx(175e9, rel=0.02)
    assert published_params(cfg) == pytest.approx(175e9, rel=0.02)


# ---- BERT -----------------------------------------------------------------------------------

def test_bert_large_matches_published_count():
    cfg = parse_model_config(dict(family="bert", name="b", num_layers=24, hidden=1024, heads=16,
                                  seq_len=512, vocab=30522))
    spec = build_model(cfg)
    assert spec.layers[1].params == 12 * 1024 ** 2 + 13 * 1024  # same block as GPT
    # HF bert-large-uncased BertForMaskedLM: 335,174,458 (tied decoder, no pooler)
    assert published_params(cfg) == pytest.approx(335_174_458, rel=1e-3)
    assert spec.layers[0].params == 30522 * 1024 + 512 * 1024 + 2 * 1024 + 2 * 1024


# ---- MoE ------------------------------------------------------------------------------------

def moe(**kw):
    data = dict(family="moe", name="m", num_layers=4, hidden=256, heads=4, seq_len=128, vocab=1000,
                num_experts=8)
    return parse_model_config({**data, **kw})


def test_moe_layout_every_other_block():
    kinds = [l.kind for l in build_model(moe()).layers[1:-1]]
    assert kinds == [LayerKind.moe_block, LayerKind.transformer_block] * 2
    kinds = [l.kind for l in build_model(moe(expert_every=1)).layers[1:-1]]
    assert kinds == [LayerKind.moe_block] * 4


def test_moe_experts_add_params_not_flops():
    """Doubling E adds E·2hf expert weights and h·E gate weights, but FLOPs grow only by the gate
    (2shE): each token still visits top_k experts."""
    h, s, E, f = 256, 128, 8, 8 * 256
    small, big = block(build_model(moe(num_experts=E))), block(build_model(moe(num_experts=2 * E)))
    assert big.params - small.params == E * (2 * h * f + h)
    assert big.fwd_flops_per_sample - small.fwd_flops_per_sample == 2 * s * h * E


def test_moe_top1_halves_expert_ffn_flops():
    h, s, f, G = 256, 128, 8 * 256, 2048
    top1, top2 = block(build_model(moe(top_k=1))), block(build_model(moe(top_k=2)))
    # one fewer slot per token: its FFN (4hf) and its dispatch+combine entries (2·2·G·h)
    assert top2.fwd_flops_per_sample - top1.fwd_flops_per_sample == s * (4 * h * f + 4 * G * h)
    assert top2.params == top1.params


def test_moe_alpa_2b4_matches_alpa_parameter_count():
    """Alpa's compute_moe_parameter_count(16, 1024, 32000, 16, mlp_factor=8) counts expert biases
    we do not have (the model code has none): within 0.5 %."""
    L, h, V, E, m = 16, 1024, 32000, 16, 8
    dense = h * (3 * h + 1) + h * (h + 1) + h * (m * h + 1) + h * m * (h + 1) + h * 4
    sparse = h * (3 * h + 1) + h * (h + 1) + E * (h * (m * h + 1) + h * m * (h + 1)) + h * 4
    alpa = L / 2 * (dense + sparse) + V * (h + 1)
    cfg = moe(num_layers=L, hidden=h, heads=16, seq_len=1024, vocab=V, num_experts=E)
    assert published_params(cfg) == pytest.approx(alpa, rel=0.005)


# ---- Wide-ResNet ----------------------------------------------------------------------------

def wres(**kw):
    data = dict(family="wresnet", name="w", base_channels=64, width_factor=1,
                blocks_per_stage=[3, 4, 6, 3], num_classes=1000)
    return parse_model_config({**data, **kw})


def test_width_one_is_torchvision_resnet50():
    """Alpa's block with W=1 is ResNet-50 v1.5: 25,557,032 parameters, 4.09 GMACs at 224²."""
    spec = build_model(wres())
    assert spec.total_params == 25_557_032
    assert spec.fwd_flops_per_sample / 2 == pytest.approx(4.09e9, rel=0.02)
    assert [l.name for l in spec.layers] == ["stem"] + [f"block_{i:02d}" for i in range(16)] + ["head"]
    assert spec.layers[-1].output_bytes_per_sample <= 8


def test_alpa_wide_resnet_1b_and_2b():
    assert build_model(wres(base_channels=320, width_factor=2, num_classes=1024)).total_params \
        == pytest.approx(1e9, rel=0.01)
    assert build_model(wres(base_channels=448, width_factor=2, num_classes=1024)).total_params \
        == pytest.approx(2e9, rel=0.02)


def test_wresnet_layers_keep_their_input():
    """Every layer saves its input (the previous layer's output) for backward."""
    spec = build_model(wres(), 4)
    for prev, nxt in zip(spec.layers, spec.layers[1:]):
        assert nxt.saved_bytes_per_sample >= prev.output_bytes_per_sample
    last = spec.layers[-2]
    assert last.output_bytes_per_sample == 7 * 7 * 2048 * 4  # 7x7x2048 fp32 into the pool


# ---- custom and errors ------------------------------------------------------------------------

def test_custom_layers_rescale_to_fp32():
    layer = dict(name="x", kind="transformer_block", params=10, fwd_flops_per_sample=1.0,
                 saved_bytes_per_sample=100, output_bytes_per_sample=7)
    cfg = parse_model_config(dict(family="custom", name="c", layers=[layer, {**layer, "name": "y"}]))
    spec = build_model(cfg, 4)
    assert spec.total_params == 20
    assert [l.saved_bytes_per_sample for l in spec.layers] == [200, 200]
    assert spec.layers[0].output_bytes_per_sample == 14


def test_unknown_family_lists_allowed():
    with pytest.raises(ValidationError) as err:
        parse_model_config(dict(family="mamba", name="x"))
    msg = str(err.value)
    assert "family" in msg
    for fam in ("gpt", "bert", "llama", "moe", "wresnet", "custom"):
        assert f"'{fam}'" in msg


def test_unknown_key_is_named():
    with pytest.raises(ValidationError, match="hiden"):
        gpt(hiden=5)


def test_negative_hidden_is_named():
    with pytest.raises(ValidationError) as err:
        gpt(hidden=-8)
    assert "hidden" in str(err.value) and "greater than 0" in str(err.value)


def test_heads_must_divide_hidden():
    with pytest.raises(ValidationError, match="heads"):
        gpt(hidden=100, heads=16)


def test_bad_dtype_is_named():
    with pytest.raises(ValueError, match="act_dtype_bytes"):
        build_model(gpt(), 3)


def test_configs_are_frozen():
    with pytest.raises(ValidationError):
        gpt().hidden = 5
