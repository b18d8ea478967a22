"""GPT with ``flash_attention`` (costs/family_transformer.py; Megatron-Core --use-flash-attn, MPT's
attn_impl flash): the flash block's saved bytes against the derived closed form 34sh + 4as (fp16,
f = 4h), the unfused block against Korthikanti et al. 2022's sh(34 + 5as/h) computed here, selective
recompute dropping only the log-sum-exp, the flash-tagged core GEMMs, BERT's refusal, a real forward's
saved tensors, and a local_cpu plan that simulates."""
from __future__ import annotations

import pydantic
import pytest
import torch

from costs.families import build_model, parse_model_config
from costs.family_llama import FLASH_TILE, LSE_BYTES
from costs.family_transformer import attention_gemms, block_layer
from planning import plan_for
from runconfig import compose
from simulator import simulate
from tests.conftest import conf
from tests.unit.test_saved_tensors_profile import MICROBATCH, real_walk

#: (s, h, a, act) shapes: gpt_tiny's, a GPT-3-like one at 8k, fp32 and an odd head count
SHAPES = [(32, 64, 4, 2), (8192, 4096, 32, 2), (2048, 1024, 16, 4), (96, 120, 5, 2)]


def korthikanti_fp16(s: int, h: int, a: int) -> int:
    """Korthikanti et al. 2022 eq. 1 with f = 4h, fp16 bytes: sh(34 + 5as/h) = 34sh + 5as²."""
    return 34 * s * h + 5 * a * s * s


@pytest.mark.parametrize("s,h,a,act", SHAPES)
def test_flash_block_saves_34sh_plus_the_log_sum_exp(s, h, a, act):
    """Korthikanti's block less the 5as² of the core, plus the fp32 log-sum-exp 4as: (act/2)·34sh +
    4as bytes; eq. 2's rule splits (act/2)·24sh and the log-sum-exp over TP, the 10sh stay."""
    flash = block_layer("b", s, h, a, 4 * h, act, flash=True)
    lse = LSE_BYTES * a * s
    assert LSE_BYTES == 4  # fp32 log-sum-exp (the closed form's 4as)
    assert flash.saved_bytes_per_sample == 34 * s * h * act // 2 + 4 * a * s
    assert flash.saved_bytes_per_sample == (korthikanti_fp16(s, h, a) - 5 * a * s * s) * act // 2 + lse
    assert flash.tp_sharded_saved_fraction * flash.saved_bytes_per_sample == pytest.approx(24 * s * h * act // 2 + lse)
    assert flash.sp_sharded_saved_fraction * flash.saved_bytes_per_sample == pytest.approx(10 * s * h * act // 2)
    # the per-tensor list sums to the same (the block's input, the layernorm input, is a boundary)
    assert sum(t.bytes_per_sample for t in flash.saved_tensors) + 2 * s * h * act // 2 == flash.saved_bytes_per_sample
    names = [t.name for t in flash.saved_tensors]
    assert "attn.logsumexp" in names and not any(n.startswith(("attn.softmax", "attn.dropout_output")) for n in names)


def test_flash_block_with_another_ffn_width():
    """sh·(18 + 4f/h) + 4as in fp16 for an FFN of width f (ffn_hidden)."""
    s, h, a, f = 512, 256, 8, 688
    assert block_layer("b", s, h, a, f, 2, flash=True).saved_bytes_per_sample == 18 * s * h + 4 * s * f + 4 * a * s


@pytest.mark.parametrize("s,h,a,act", SHAPES)
def test_unfused_block_is_korthikanti_unchanged(s, h, a, act):
    """The default (no flash) is Korthikanti's block, field for field as before: saved sh(34 + 5as/h),
    selective 5as², the a·s² workspace and element-wise traffic, plain GEMMs."""
    block = block_layer("b", s, h, a, 4 * h, act)
    as2 = a * s * s
    assert block == block_layer("b", s, h, a, 4 * h, act, flash=False)
    assert block.saved_bytes_per_sample == korthikanti_fp16(s, h, a) * act // 2
    assert block.tp_sharded_saved_fraction == (24 * s * h + 5 * as2) / korthikanti_fp16(s, h, a)
    assert block.selective_bytes_per_sample == 5 * as2 * act // 2
    assert block.selective_mem_bytes_per_sample == 4 * as2 * act + as2
    assert block.workspace_bytes_per_sample == as2 * act
    sh = s * h
    assert block.fwd_mem_bytes_per_sample == ((2 * sh + 4 * as2 + 3 * sh) * act + as2 + sh
                                              + (2 * sh + 8 * sh + 3 * sh) * act + sh)
    assert not any(g.flash_tile or g.bwd_recompute for g in [*block.gemms, *block.selective_gemms])


@pytest.mark.parametrize("s,h,a,act", SHAPES)
def test_selective_drops_only_the_log_sum_exp(s, h, a, act):
    flash = block_layer("b", s, h, a, 4 * h, act, flash=True)
    assert flash.selective_bytes_per_sample == LSE_BYTES * a * s
    assert flash.saved_bytes_per_sample - flash.selective_bytes_per_sample == 34 * s * h * act // 2
    assert flash.selective_mem_bytes_per_sample == 0  # the re-run softmax stays on chip
    assert {g.name for g in flash.selective_gemms if g.flash_tile == FLASH_TILE} == {"scores", "attn_v"}


@pytest.mark.parametrize("s,h,a,act", SHAPES)
def test_flash_core_gemms_are_tagged_and_keep_the_model_flops(s, h, a, act):
    flash, plain = (block_layer("b", s, h, a, 4 * h, act, flash=fl) for fl in (True, False))
    tagged = {g.name: g for g in flash.gemms if g.flash_tile}
    assert set(tagged) == {"scores", "attn_v"} and all(g.flash_tile == FLASH_TILE for g in tagged.values())
    assert tagged["scores"].bwd_recompute and not tagged["attn_v"].bwd_recompute
    assert [g.model_copy(update={"flash_tile": 0, "bwd_recompute": False}) for g in flash.gemms] == plain.gemms
    assert flash.fwd_flops_per_sample == plain.fwd_flops_per_sample  # 24sh² + 4s²h: the MFU numerator
    assert flash.params == plain.params and flash.tp_sharded_param_fraction == plain.tp_sharded_param_fraction
    # no a·s² traffic (softmax, its dropout and mask on chip) and no a·s² score gradient in HBM
    as2 = a * s * s
    assert plain.fwd_mem_bytes_per_sample - flash.fwd_mem_bytes_per_sample == 4 * as2 * act + as2
    assert flash.workspace_bytes_per_sample == s * 4 * h * act
    assert attention_gemms(s, h, a) == [g for g in plain.gemms if g.name not in ("fc1", "fc2")]


def test_config_field_defaults_off_and_stays_out_of_dumps():
    """Default false: every existing GPT/BERT spec and profile cache key (the config's dump) as before."""
    base = conf("model", "gpt_tiny")
    cfg, off, on = (parse_model_config(d) for d in
                    (base, {**base, "flash_attention": False}, {**base, "flash_attention": True}))
    assert not cfg.flash_attention and "flash_attention" not in cfg.model_dump() and cfg == off
    assert on.model_dump()["flash_attention"] is True
    assert build_model(cfg, 2) == build_model(off, 2) != build_model(on, 2)
    assert type(on).model_validate(on.model_dump()) == on


@pytest.mark.parametrize("value", [True, False])
def test_bert_refuses_flash_attention_by_name(value):
    """BERT's attention is bidirectional: the causal flash core is GPT's (and LLaMA's) only."""
    bert = conf("model", "bert_tiny")
    with pytest.raises(pydantic.ValidationError, match="flash_attention: not a bert field: BERT's attention is "
                                                       "bidirectional"):
        parse_model_config({**bert, "flash_attention": value})
    assert not hasattr(parse_model_config(bert), "flash_attention")


def test_flash_list_is_a_real_forwards_saved_tensors():
    """The flash block's closed-form list against a REAL fp32 forward of executor.models.Block (its
    scaled_dot_product_attention runs CPU flash attention, which keeps q, k, v, the output and the
    log-sum-exp): the same tensors, byte for byte, once the closed form's two dropout masks (the
    executor's blocks have no dropout) and LayerNorm's mean and rstd (s floats each, which
    Korthikanti leaves out) are set aside."""
    cfg = parse_model_config({**conf("model", "gpt_tiny"), "flash_attention": True})
    real = real_walk(cfg, torch.float32)
    spec = build_model(cfg, 4)
    stats = cfg.seq_len * MICROBATCH * 4  # one fp32 per token
    for i in range(1, cfg.num_layers + 1):
        sizes = list(real[i][0])
        for _ in range(4):  # ln1 and ln2: mean and rstd each
            sizes.remove(stats)
        closed = [t.bytes_per_sample * MICROBATCH for t in spec.layers[i].saved_tensors if "dropout_mask" not in t.name]
        assert sorted(sizes) == sorted(closed)


def test_local_cpu_plan_with_flash_simulates(tmp_path):
    cfg = compose("+hardware=local_cpu", "+model=gpt_tiny", "model.flash_attention=true")
    assert cfg.model.flash_attention
    model, plan = plan_for(cfg, tmp_path)
    block = model.layers[1]
    assert {g.name for g in block.gemms if g.flash_tile} == {"scores", "attn_v"}
    result = simulate(plan, model, cfg.hardware).result
    assert result.iteration_time_s > 0 and not any(d.oom for d in result.devices)
