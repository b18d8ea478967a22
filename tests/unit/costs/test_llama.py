"""LLaMA family closed forms (costs.family_llama): the presets' parameter counts against the
published sizes, FLOPs against the 2-FLOPs-per-weight rule, the saved-tensor list against
Korthikanti et al. 2022's rules adapted to RMSNorm/GQA/SwiGLU/flash attention and against a real
forward's saved tensors, tensor-parallel limits, and the config's validation."""
from __future__ import annotations

import pydantic
import pytest
import torch

from costs.families import build_model, parse_model_config, published_params
from executor.models import layer_names_and_params
from executor.profile_symbolic import profile_model
from specs.model import LayerKind
from tests.conftest import conf
from tests.unit.test_saved_tensors_profile import real_walk

#: published sizes: Llama 2 paper Table 1 / model cards (6.74B, 13.0B, 69.0B as the HF model
#: cards give them), Llama 3 model cards (8.03B, 70.6B) and Dubey et al. 2024 (405B)
PUBLISHED = {"llama2_7b": 6.74e9, "llama2_13b": 13.0e9, "llama2_70b": 69.0e9,
             "llama3_8b": 8.03e9, "llama3_70b": 70.6e9, "llama3_405b": 405e9,
             # LLaMA-architecture models of other makers (model cards): biased q, k, v (Qwen2.5),
             # heads narrower than hidden/heads (Mistral Small 3: 32 x 128 = 4096 at hidden 5120),
             # per-head q/k RMSNorms (Qwen3)
             "qwen2_5_7b": 7.61e9, "mistral_small_24b": 23.6e9, "qwen3_8b": 8.2e9}


def _cfg(name: str, **update):
    return parse_model_config({**conf("model", name), **update})


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_params_match_the_published_size(name):
    """The spec's parameter count (summed over its layers by the closed forms) is the published
    size within 1 %: a wrong kv width, FFN width, vocabulary or a tied head is off by more."""
    assert published_params(_cfg(name)) == pytest.approx(PUBLISHED[name], rel=0.01)


def test_gqa_and_untied_head_are_what_the_sizes_need():
    """Counter-checks of the 1 % test: Llama 3 70B as MHA, or Llama 2 7B with a tied head, miss it."""
    mha = published_params(_cfg("llama3_70b", kv_heads=64))
    assert abs(mha / PUBLISHED["llama3_70b"] - 1) > 0.01
    tied = published_params(_cfg("llama2_7b", tie_embeddings=True))
    assert abs(tied / PUBLISHED["llama2_7b"] - 1) > 0.01


@pytest.mark.parametrize("name", ["llama2_7b", "llama2_70b", "llama3_405b", "llama_tiny", "qwen2_5_7b",
                                  "mistral_small_24b", "qwen3_8b"])
def test_block_flops_are_two_per_weight_plus_attention(name):
    """Forward FLOPs per block = 2 per matrix weight per token (q, k, v, proj, gate, up, down:
    the block's params less its norm vectors and any q, k, v biases) + 4·s²·a·d for QKᵀ and
    attention·V (4·s²·h where a·d = h)."""
    cfg = _cfg(name)
    s, h, a, g, d = cfg.seq_len, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.d
    block = build_model(cfg, 2).layers[1]
    assert block.kind is LayerKind.transformer_block
    vectors = (a * d + 2 * g * d) * cfg.qkv_bias + 2 * d * cfg.qk_norm  # biases, q/k norm weights
    assert block.fwd_flops_per_sample == 2 * s * (block.params - 2 * h - vectors) + 4 * s * s * a * d
    head = build_model(cfg, 2).layers[-1]
    assert head.fwd_flops_per_sample == 2 * s * h * cfg.vocab


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("act", [2, 4])
def test_block_saved_list_is_korthikanti_adapted(flash, act):
    """Llama 2 70B's block, fp16: input + list = sh(12 + 4g/a + 8f/h) + 4as (flash) or + 2as²
    (unfused); the unsharded part is the two norm inputs, the QKV and the SwiGLU inputs (8sh);
    the list is consistent with the layer's totals; fp32 doubles all but the fp32 log-sum-exp."""
    cfg = _cfg("llama2_70b", flash_attention=flash)
    s, h, a, g, f = cfg.seq_len, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    model = build_model(cfg, act)
    block = model.layers[1]
    interior = sum(t.bytes_per_sample for t in block.saved_tensors)
    core = 4 * a * s if flash else 2 * a * s * s * act // 2
    want = (12 * s * h + 4 * s * g * (h // a) + 8 * s * f) * act // 2 + core
    assert model.layers[0].output_bytes_per_sample + interior == block.saved_bytes_per_sample == want
    unsharded = sum(t.bytes_per_sample for t in block.saved_tensors if not t.tp_sharded) + s * h * act
    assert unsharded == 4 * s * h * act
    assert block.tp_sharded_saved_fraction == pytest.approx(1 - unsharded / want, rel=1e-12)
    names = [t.name for t in block.saved_tensors]
    assert ("attn.softmax_output" in names) is not flash and ("attn.logsumexp" in names) is flash


def test_block_sharding_and_tp_limit():
    """Every block weight but the two RMSNorm vectors is tensor-parallel; tp is capped by the kv
    heads (Megatron-Core: num_query_groups % tp == 0), the embedding and head split V·h."""
    cfg = _cfg("llama3_70b")
    model = build_model(cfg, 2)
    block, head, embed = model.layers[1], model.layers[-1], model.layers[0]
    assert block.tp_sharded_param_fraction == pytest.approx(1 - 2 * cfg.hidden / block.params, rel=1e-12)
    assert block.max_tp == cfg.kv_heads == 8
    assert embed.params == cfg.vocab * cfg.hidden and embed.tp_sharded_param_fraction == 1.0
    assert head.tied_to is None and head.params == cfg.hidden + cfg.vocab * cfg.hidden
    assert build_model(_cfg("llama2_7b"), 2).layers[1].max_tp == 32  # MHA: every head


@pytest.mark.parametrize("update,field", [({"kv_heads": 3}, "kv_heads"), ({"heads": 6}, "heads"),
                                          ({"hidden": 60, "heads": 20, "kv_heads": 5}, "heads"),
                                          ({"head_dim": 7}, "head_dim"), ({"head_dim": 0}, "head_dim")])
def test_bad_shapes_name_the_field(update, field):
    with pytest.raises(pydantic.ValidationError, match=field):
        _cfg("llama_tiny", **update)


def test_every_preset_validates_and_builds():
    for name in [*PUBLISHED, "llama_tiny"]:
        model = build_model(_cfg(name), 2)
        assert model.family == "llama" and len(model.layers) == _cfg(name).num_layers + 2


#: LLaMA-architecture variants beside llama_tiny's own shape: a head size that is not hidden/heads
#: (Mistral NeMo, Gemma, Qwen3: a·d = 96 at hidden 64) and biased q, k, v (Qwen2)
VARIANTS = {"plain": {}, "head_dim": {"head_dim": 24}, "qkv_bias": {"qkv_bias": True},
            "both": {"head_dim": 24, "qkv_bias": True}, "qk_norm": {"qk_norm": True},
            "qwen3": {"head_dim": 24, "qk_norm": True}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype,act", [("fp32", 4), ("bf16", 2)])
def test_closed_form_op_counts_equal_the_profilers(dtype, act, fused, variant):
    cfg = _cfg("llama_tiny", fused_swiglu=fused, **VARIANTS[variant])
    prof = profile_model(cfg, microbatch=2, dtype=dtype)
    assert [(layer.name, layer.fwd_ops, layer.bwd_ops) for layer in build_model(cfg, act).layers] == \
        [(p.name, p.fwd_ops, p.bwd_ops) for p in prof.layers]


def _norm_extras(layer) -> list[int]:
    """The sizes the executor's unfused nn.RMSNorm saves beyond a fused norm's input: its rstd
    and x·rstd (torch's CPU RMSNorm decomposes into pow/mean/rsqrt/mul)."""
    out, seen = [], set()
    for t in layer.saved_tensors:
        norm = t.name.split(":")[0]
        if norm in ("ln1", "ln2", "ln", "attn.q_norm", "attn.k_norm") and t.name.endswith(("rsqrt", "mul")) and (norm, t.name) not in seen:
            seen.add((norm, t.name))  # the first mul is x·rstd; the second (·weight) is the next input
            out.append(t.size_bytes)
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fused", [False, True])
def test_closed_form_list_is_a_real_forwards_saved_tensors(fused, variant):
    """The block's closed-form list against a REAL fp32 forward of executor.models.LlamaBlock
    under saved_tensors_hooks: the same tensors, byte for byte, once the unfused RMSNorm's
    statistics and x·rstd are set aside (Megatron's fused RMSNorm keeps only its input). The
    symbolic profile, which the executor's compare predicts from, sees the real list exactly;
    with ``fused_swiglu`` one f-wide tensor fewer (silu's output); ``head_dim`` and ``qkv_bias``
    variants (VARIANTS) likewise."""
    cfg = _cfg("llama_tiny", fused_swiglu=fused, **VARIANTS[variant])
    micro = 2
    real = real_walk(cfg, torch.float32)
    prof = profile_model(cfg, microbatch=micro, dtype="fp32")
    spec = build_model(cfg, 4)
    for i in range(1, cfg.num_layers + 1):  # the blocks
        sizes, _, _, total = real[i]
        assert [t.size_bytes for t in prof.layers[i].saved_tensors] == sizes and total == prof.layers[i].saved_bytes
        closed = sorted(t.bytes_per_sample * micro for t in spec.layers[i].saved_tensors)
        rest = list(sizes)
        for extra in _norm_extras(prof.layers[i]):
            rest.remove(extra)
        assert sorted(rest) == closed


def test_fused_swiglu_drops_silus_output_and_nothing_else():
    """Llama 3 8B's block with ``fused_swiglu``: 2sf bytes (fp16) fewer saved per sample, all of it
    tp-sharded; FLOPs, GEMMs and the forward's operators unchanged, one backward operator more
    (the recomputed silu); a dump leaves the field out at its default, keeps it when set."""
    plain, fused = _cfg("llama3_8b"), _cfg("llama3_8b", fused_swiglu=True)
    a, b = build_model(plain, 2).layers[1], build_model(fused, 2).layers[1]
    s, f = plain.seq_len, plain.ffn_hidden
    assert a.saved_bytes_per_sample - b.saved_bytes_per_sample == 2 * s * f
    sharded = lambda L: L.saved_bytes_per_sample * L.tp_sharded_saved_fraction  # noqa: E731
    assert sharded(a) - sharded(b) == pytest.approx(2 * s * f, rel=1e-12)
    assert [t.name for t in a.saved_tensors if t.name not in {u.name for u in b.saved_tensors}] == ["mlp.silu_output"]
    assert (a.fwd_flops_per_sample, a.gemms, a.fwd_ops) == (b.fwd_flops_per_sample, b.gemms, b.fwd_ops)
    assert b.bwd_ops == a.bwd_ops + 1
    assert "fused_swiglu" not in plain.model_dump() and fused.model_dump()["fused_swiglu"] is True


def test_fused_swiglu_gradients_are_autograds_bitwise():
    """executor.models.SiluMul against F.silu(gate) * up in float64 and float32: the same output
    and the same gate and up gradients, bit for bit (it runs the ops autograd runs), and it saves
    two tensors where the unfused pair saves three."""
    from executor.models import SiluMul
    import torch.nn.functional as F
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(3)
        gate = torch.randn(4, 8, 16, generator=g, dtype=dtype, requires_grad=True)
        up = torch.randn(4, 8, 16, generator=g, dtype=dtype, requires_grad=True)
        grad = torch.randn(4, 8, 16, generator=g, dtype=dtype)
        outs = []
        for fn in (lambda x, y: F.silu(x) * y, SiluMul.apply):
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                y = fn(gate, up)
            dg, du = torch.autograd.grad(y, (gate, up), grad)
            outs.append((y, dg, du, len(saved)))
        (y0, dg0, du0, n0), (y1, dg1, du1, n1) = outs
        assert torch.equal(y0, y1) and torch.equal(dg0, dg1) and torch.equal(du0, du1)
        assert (n0, n1) == (3, 2)


#: tiny shapes of the variants in Hugging Face's own classes: Qwen2 (biased q, k, v; bias-free o),
#: Mistral with an explicit head_dim (a·d = 96 at hidden 64) and Qwen3 (head_dim and per-head q/k norms)
HF_TWINS = {"qwen2": ({"qkv_bias": True}, "Qwen2"), "mistral": ({"head_dim": 24}, "Mistral"),
            "qwen3": ({"head_dim": 24, "qk_norm": True}, "Qwen3")}


@pytest.mark.parametrize("twin", sorted(HF_TWINS))
def test_variants_count_the_parameters_of_hugging_faces_models(twin):
    """The closed form's parameter count of a ``qkv_bias`` / ``head_dim`` / ``qk_norm`` LLaMA equals
    the parameter count of transformers' Qwen2 / Mistral / Qwen3ForCausalLM of the same shape
    (random init, nothing downloaded), and the executor's modules hold the same weights; without
    the field the count is off by the biases (q, k, v: a·d + 2g·d per block) or by the heads' width."""
    transformers = pytest.importorskip("transformers")
    update, arch = HF_TWINS[twin]
    cfg = _cfg("llama_tiny", **update)
    hf_cfg = getattr(transformers, f"{arch}Config")(
        hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab,
        tie_word_embeddings=False, max_position_embeddings=cfg.seq_len, **({"head_dim": cfg.head_dim} if cfg.head_dim else {}))
    hf = getattr(transformers, f"{arch}ForCausalLM")(hf_cfg)
    count = sum(p.numel() for p in hf.parameters())
    assert published_params(cfg) == count
    assert sum(n for _, n in layer_names_and_params(cfg)) == count
    assert published_params(_cfg("llama_tiny")) != count
