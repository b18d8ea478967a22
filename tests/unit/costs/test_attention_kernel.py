"""The causal flash-attention core (costs/gemm.py ``flash_time_s``; costs/family_llama.py with
``flash_attention``): its tile-granular causal count against a brute-force walk of the tiles, its
time against the unfused core's, the attention-curve fall-back, the spec checks, and that GPT
blocks and the unfused LLaMA core are priced exactly as the plain GEMM roofline prices them."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from costs import gemm
from costs.families import build_model, parse_model_config
from costs.family_llama import FLASH_TILE, block_gemms
from costs.family_transformer import block_layer as gpt_block_layer
from specs.hardware import DeviceSpec
from specs.model import GemmSpec
from tests.conftest import conf

PEAK_TFLOPS = 100.0
GEMM_CURVE = [(1e6, 0.01), (1e9, 0.5), (1e12, 0.8)]
FAST_HBM_GBPS = 1e12  # traffic never binds: the time is the compute term alone


def device(gemm_curve=GEMM_CURVE, attention=None, attention_bwd=None, hbm_gbps=FAST_HBM_GBPS) -> DeviceSpec:
    return DeviceSpec(model="toy", memory_bytes=1 << 30, peak_tflops={"fp32": 10.0, "fp16": PEAK_TFLOPS},
                      gemm_efficiency={"fp16": gemm_curve} if gemm_curve else {},
                      attention_efficiency={"fp16": attention} if attention else {},
                      attention_bwd_efficiency={"fp16": attention_bwd} if attention_bwd else {}, hbm_gbps=hbm_gbps)


def brute_force_computed(s: int, tile: int) -> int:
    """Score entries a causal tiled kernel computes: every tile (query block i, key block j) that
    holds at least one unmasked entry (some key index <= some query index in it) runs whole."""
    total = 0
    for q0 in range(0, s, tile):
        q1 = min(q0 + tile, s)  # rows q0..q1-1
        for k0 in range(0, s, tile):
            k1 = min(k0 + tile, s)
            if any(k <= q for q in range(q0, q1) for k in range(k0, k1)):
                total += (q1 - q0) * (k1 - k0)
    return total


@pytest.mark.parametrize("s,tile", [(128, 128), (256, 128), (1000, 128), (1024, 64), (96, 128), (300, 7), (1, 1)])
def test_causal_fraction_counts_the_unmasked_tiles(s, tile):
    assert gemm.causal_fraction(s, tile) * s * s == pytest.approx(brute_force_computed(s, tile), rel=1e-12)


def test_causal_fraction_closed_forms():
    for nb in (1, 2, 8, 64):  # s = nb·tile: s(s + tile)/2 entries, (nb + 1)/(2·nb) of the square
        s = nb * FLASH_TILE
        assert gemm.causal_fraction(s, FLASH_TILE) == pytest.approx((nb + 1) / (2 * nb))
        assert gemm.causal_fraction(s, FLASH_TILE) * s * s == pytest.approx(s * (s + FLASH_TILE) / 2)
    assert gemm.causal_fraction(32, FLASH_TILE) == 1.0  # one tile covers a short sequence: all of it
    assert gemm.causal_fraction(1 << 17, FLASH_TILE) == pytest.approx(0.5, abs=1e-3)


def core(s: int, d: int, a: int, tile: int) -> list[GemmSpec]:
    return [g for g in block_gemms(s, a * d, a, a, 1, tile) if g.name in ("scores", "attn_v")]


@pytest.mark.parametrize("s", [256, 1024, 4096])
def test_flash_core_against_the_unfused_one_on_a_flat_curve(s):
    """With one efficiency at every size and traffic never binding, time is FLOPs / rate: the
    flash forward does causal_fraction of the unfused core's work, its backward that of the
    unfused backward's four products plus the QKᵀ recompute (five of four, Dao 2023 §4.1)."""
    dev = device(gemm_curve=[(1.0, 0.5)])
    d, a, b, tp = 64, 8, 2, 2
    flash, dense = core(s, d, a, FLASH_TILE), core(s, d, a, 0)
    frac = gemm.causal_fraction(s, FLASH_TILE)
    dense_fwd = gemm.gemms_fwd_s(dev, "fp16", dense, b, tp)
    assert gemm.gemms_fwd_s(dev, "fp16", flash, b, tp) == pytest.approx(frac * dense_fwd)
    assert sum(gemm.gemms_bwd_s(dev, "fp16", flash, b, tp)) == pytest.approx(
        frac * 5 / 4 * sum(gemm.gemms_bwd_s(dev, "fp16", dense, b, tp)))
    # the model FLOPs stay the whole square: what MFU divides by does not change
    assert gemm.gemm_flops(flash, b, tp) == gemm.gemm_flops(dense, b, tp)


def test_flash_core_keeps_the_score_matrix_off_hbm():
    """Bandwidth-bound (a slow memory, no curve): the unfused core pays for its s x s operand,
    the flash core only for its two s x d ones."""
    dev = device(gemm_curve=None, hbm_gbps=1e-3)
    s, d, a = 512, 64, 4
    bw = 1e-3 * 1e9
    flash, dense = core(s, d, a, FLASH_TILE), core(s, d, a, 0)
    assert gemm.gemms_fwd_s(dev, "fp16", flash, 1, 1) == pytest.approx(2 * (2 * 2 * s * d * a) / bw)
    assert gemm.gemms_fwd_s(dev, "fp16", dense, 1, 1) == pytest.approx(2 * 2 * (2 * s * d + s * s) * a / bw)


def test_attention_curve_times_the_flash_core_and_falls_back_to_the_gemm_curve():
    attn, attn_bwd = [(1.0, 0.25)], [(1.0, 0.125)]
    plain, fwd_only, both = device(), device(attention=attn), device(attention=attn, attention_bwd=attn_bwd)
    for flops in (1e3, 1e8, 3e10, 1e14):  # no attention curve: the GEMM curve, point for point
        for backward in (False, True):
            assert (gemm.attention_efficiency(plain, "fp16", flops, backward)
                    == gemm.efficiency(plain, "fp16", flops))
        assert gemm.attention_efficiency(fwd_only, "fp16", flops, backward=True) == 0.25  # bwd falls back to fwd
        assert gemm.attention_efficiency(both, "fp16", flops, backward=True) == 0.125
    flash = core(2048, 128, 16, FLASH_TILE)
    flat_gemm = device(gemm_curve=[(1.0, 0.5)])
    flat_both = device(gemm_curve=[(1.0, 0.5)], attention=attn, attention_bwd=attn_bwd)
    assert gemm.gemms_fwd_s(flat_both, "fp16", flash, 1, 1) == pytest.approx(
        2 * gemm.gemms_fwd_s(flat_gemm, "fp16", flash, 1, 1))
    assert sum(gemm.gemms_bwd_s(flat_both, "fp16", flash, 1, 1)) == pytest.approx(
        4 * sum(gemm.gemms_bwd_s(flat_gemm, "fp16", flash, 1, 1)))
    # a plain GEMM never reads the attention curve
    shape = (4096, 4096, 4096)
    assert gemm.gemm_time_s(flat_both, "fp16", *shape) == gemm.gemm_time_s(flat_gemm, "fp16", *shape)


@pytest.mark.parametrize("field", ["attention_efficiency", "attention_bwd_efficiency"])
@pytest.mark.parametrize("curve,match", [
    ({"bf16": [(1e9, 0.5)]}, "no peak_tflops.bf16"),
    ({"fp16": [(1e9, 0.5), (1e9, 0.6)]}, "strictly increasing"),
    ({"fp16": []}, "at least one point"),
    ({"fp16": [(1e9, 1.5)]}, "finite number"),
    ({"fp16": [(1e6, 0.001), (2e6, 0.5)]}, "faster than"),
])
def test_attention_curve_validation_names_the_field(field, curve, match):
    with pytest.raises(ValidationError, match=match) as err:
        DeviceSpec(model="x", memory_bytes=1 << 30, peak_tflops={"fp32": 1.0, "fp16": 2.0}, hbm_gbps=1.0,
                   **{field: curve})
    assert field in str(err.value)


def test_bwd_recompute_needs_a_flash_product():
    with pytest.raises(ValidationError, match="bwd_recompute"):
        GemmSpec(m=8, n=8, k=8, bwd_recompute=True)


def test_dumps_without_the_new_fields_are_unchanged():
    g = GemmSpec(name="q", m=8, n=8, k=8, tp_split="n")
    assert set(g.model_dump()) == {"name", "m", "n", "k", "batch", "tp_split", "weights"}
    assert GemmSpec.model_validate_json(g.model_dump_json()) == g
    flash = core(256, 64, 4, FLASH_TILE)[0]
    assert GemmSpec.model_validate(flash.model_dump()) == flash
    assert "attention_efficiency" not in device().model_dump()
    with_attn = device(attention=[(1e9, 0.3)])
    assert DeviceSpec.model_validate(with_attn.model_dump()) == with_attn


def roofline_fwd_s(dev, gemms, b, tp) -> float:
    """The plain GEMM roofline as memwall priced every matmul before the flash core existed."""
    return sum(gemm.gemm_time_s(dev, "fp16", *gemm.rank_shape(g, b, tp)) for g in gemms)


def roofline_bwd_s(dev, gemms, b, tp) -> float:
    return sum(gemm.gemm_time_s(dev, "fp16", *sh)
               for g in gemms for sh in gemm.backward_shapes(gemm.rank_shape(g, b, tp)))


def test_gpt_block_and_unfused_llama_are_priced_as_plain_gemms():
    dev = device(attention=[(1.0, 0.01)], attention_bwd=[(1.0, 0.01)], hbm_gbps=2000.0)  # a curve they must ignore
    gpt = gpt_block_layer("b", 1024, 512, 8, 2048, 2)
    cfg = parse_model_config({**conf("model", "llama_tiny"), "seq_len": 1024, "flash_attention": False})
    llama = build_model(cfg).layers[1]
    for layer in (gpt, llama):
        assert not any(g.flash_tile or g.bwd_recompute for g in [*layer.gemms, *layer.selective_gemms])
        for b, tp in ((1, 1), (4, 2)):
            assert gemm.gemms_fwd_s(dev, "fp16", layer.gemms, b, tp) == pytest.approx(
                roofline_fwd_s(dev, layer.gemms, b, tp), rel=1e-15)
            assert sum(gemm.gemms_bwd_s(dev, "fp16", layer.gemms, b, tp)) == pytest.approx(
                roofline_bwd_s(dev, layer.gemms, b, tp), rel=1e-15)


def test_flash_llama_keeps_the_whole_square_in_its_model_flops():
    """The block's FLOPs are still 4sh² + 4sh·g·d + 4s²h + 6shf (Narayanan's count, the MFU
    numerator) and its GEMMs list all of them, so no FLOPs fall to the unlisted rest."""
    cfg = parse_model_config({**conf("model", "llama_tiny"), "seq_len": 1024})
    s, h, a, g, f = cfg.seq_len, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    layer = build_model(cfg).layers[1]
    closed = 4 * s * h * h + 4 * s * h * g * (h // a) + 4 * s * s * h + 6 * s * h * f
    assert layer.fwd_flops_per_sample == closed == gemm.gemm_flops(layer.gemms, 1, 1)
    flash = {gm.name: gm for gm in layer.gemms if gm.flash_tile}
    assert set(flash) == {"scores", "attn_v"} and flash["scores"].bwd_recompute and not flash["attn_v"].bwd_recompute
    assert {gm.name for gm in layer.selective_gemms if gm.flash_tile == FLASH_TILE} == {"scores", "attn_v"}
