"""LLaMA family (Touvron et al. 2023, "LLaMA" §2.2; Llama 2 §2.2; Llama 3, Dubey et al. 2024,
Table 3): closed-form per-sample costs of the embedding, the blocks and the head.

What differs from GPT (costs.family_transformer): pre-normalisation with RMSNorm (Zhang & Sennrich
2019: one h-vector, no bias), rotary position embeddings (Su et al. 2021) instead of a position
table, grouped-query attention (Ainslie et al. 2023: ``kv_heads`` key/value heads shared by the
``heads`` query heads), the SwiGLU FFN (Shazeer 2020: three bias-free h x f matrices), no biases
anywhere, no dropout, and an untied LM head. Three fields cover the LLaMA-architecture models
that differ only there: ``head_dim`` (d given, a·d ≠ h: Mistral NeMo / Small 3, Qwen3),
``qkv_bias`` (biases on q, k and v: Qwen2/2.5) and ``qk_norm`` (an RMSNorm over each head's d
of q and k before the rotation: Qwen3).

Symbols: s sequence, h hidden, a heads, g kv_heads, d head size (h/a unless ``head_dim``),
f ffn_hidden, V vocabulary, act bytes per activation element. Costs per sample (one sequence).

Saved activations: Korthikanti et al. 2022 §4.1's tensor-by-tensor list, adapted. No dropout
(no masks, no dropout output); K and V are s·g·d; SwiGLU keeps its input, the gate and up
outputs, the silu output and the product (the down projection's input) -- with ``fused_swiglu``
(Megatron-Core's ``bias_swiglu_fusion``, on by default there) not the silu output, which its
backward recomputes from the gate output; the rotation saves no
per-sample tensor (its cos/sin tables are constants) and Q, K are kept after it. With
``flash_attention`` (the default: Meta trained with xformers' memory-efficient attention, LLaMA
§2.4, "not storing the attention weights"; Megatron-Core's --use-flash-attn, torchtitan's SDPA)
the attention core keeps its output (the projection's input) and the fp32 log-sum-exp a·s instead
of the a·s² softmax. Normalisation statistics (s floats) are left out, as Korthikanti leaves out
layernorm's. In fp16 bytes per block (d = h/a):
    flash: sh·(12 + 4g/a + 8f/h) + 4as      math: sh·(12 + 4g/a + 8f/h) + 2as²
(8f/h: four f-wide tensors; 6f/h with ``fused_swiglu``), of which everything but the two norm
inputs, the QKV input and the SwiGLU input (8sh) is split by tensor parallelism (Korthikanti eq. 2's rule).

Time of a flash core: one causal FlashAttention kernel (the executor's scaled_dot_product_attention
with is_causal=True), not two dense GEMMs: its QKᵀ and attention·V carry ``flash_tile``
(:data:`FLASH_TILE`), so costs/gemm.py times only the tiles on or below the diagonal, at the
device's attention curve, without s x s HBM traffic, and re-runs QKᵀ in the backward (Dao 2023).
The FLOP count (``fwd_flops_per_sample``, what MFU reports) stays the whole square.

Tensor parallelism (Megatron, Shoeybi et al. 2019 §3): column-parallel q, k, v, gate, up;
row-parallel proj and down; norms replicated. K/V heads are split over tp, which must divide
kv_heads: Megatron-Core refuses tp that does not ("num_query_groups must be a multiple of
tensor_model_parallel_size", TransformerConfig.__post_init__), so ``max_tp`` is kv_heads
(replicating K/V heads for tp > kv_heads, as inference engines do, is not modelled).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_serializer, model_validator

from specs._base import Spec, omit_unset
from costs.family_transformer import (FLASH_TILE, LSE_BYTES, TOKEN_ID_BYTES, Saved, _totals, at_precision,
                                      flash_core_selective, head_layer, saved_specs)
from specs.model import MAX_LAYERS, GemmSpec, LayerKind, LayerSpec, ModelSpec


#: (forward, backward) operators of the executor's modules (executor.models.LlamaBlock, the
#: position-free TokenEmbedding, LMHead "llama"), counted as costs.op_counts counts them
#: (tests/unit/costs/test_llama.py checks them against the symbolic profiler)
LLAMA_BLOCK_OPS = (72, 108)
#: backward operators ``fused_swiglu`` adds: the silu it recomputes (executor.models.SiluMul: silu,
#: then the up gradient's mul and silu_backward, where autograd ran mul, mul, silu_backward)
FUSED_SWIGLU_BWD_OPS = 1
#: (forward, backward) operators each biased Linear (``qkv_bias``: q, k, v) adds: its forward is
#: addmm over the flattened rows, whose result is a view, where a bias-free Linear's mm ends in an
#: _unsafe_view (one counted operator fewer); its backward sums the bias gradient and detaches it
#: into the accumulator (two more)
BIASED_LINEAR_OPS = (-1, 2)
#: (forward, backward) operators of one fp32 nn.RMSNorm as costs.op_counts counts them (torch's
#: CPU RMSNorm decomposes into pow, mean, add, rsqrt, mul, mul; ``qk_norm`` adds two a block;
#: tests/unit/costs/test_llama.py checks them against the symbolic profiler)
RMSNORM_OPS = (7, 16)
LLAMA_EMBED_OPS = (4, 2)
LLAMA_HEAD_OPS = (15, 25)
#: in 2-byte precision each RMSNorm computes in fp32: a cast in and out forward, three more backward
RMSNORM_LOW_PRECISION_OPS = (2, 3)


def _ops(base: tuple[int, int], norms: int, casts: int, act: int) -> dict[str, int]:
    """``base`` (fp32 counts) plus, in 2-byte precision, ``norms`` RMSNorms' and ``casts`` more
    casts each way (the head's logits to fp32)."""
    low = act < 4
    return {"fwd_ops": base[0] + low * (norms * RMSNORM_LOW_PRECISION_OPS[0] + casts),
            "bwd_ops": base[1] + low * (norms * RMSNORM_LOW_PRECISION_OPS[1] + casts)}


class LlamaConfig(Spec):
    """A LLaMA-architecture decoder (Llama 1/2/3): published shapes in conf/model/llama*.yaml."""

    family: Literal["llama"]
    name: str = Field(min_length=1)
    num_layers: int = Field(gt=0, le=MAX_LAYERS - 2, description="transformer blocks")
    hidden: int = Field(gt=0, le=1 << 20)
    heads: int = Field(gt=0, le=1 << 14, description="query heads")
    kv_heads: int = Field(gt=0, le=1 << 14, description="key/value heads (grouped-query attention; = heads: "
                                                       "multi-head attention)")
    seq_len: int = Field(gt=0, le=1 << 24)
    vocab: int = Field(gt=0, le=1 << 24)
    ffn_hidden: int = Field(gt=0, le=1 << 22, description="SwiGLU width f (the published intermediate_size)")
    tie_embeddings: bool = Field(False, description="LM head shares the word embedding (false for Llama 1/2/3)")
    rope_theta: float = Field(10000.0, gt=0, le=1e9, description="rotary base (10,000 Llama 2; 500,000 Llama 3)")
    flash_attention: bool = Field(True, description="the attention core keeps its output and log-sum-exp, not "
                                                    "the a·s² softmax (fused/flash attention)")
    fused_swiglu: bool = Field(False, description="silu(gate)·up as one function that saves the gate and up "
                                                  "outputs and recomputes silu in its backward (Megatron-Core's "
                                                  "bias_swiglu_fusion); false: autograd's silu and mul, which "
                                                  "also keep silu's output (torch eager, torchtitan, HF)")
    head_dim: int | None = Field(None, gt=0, le=1 << 14,
                                 description="per-head width d; null: hidden/heads (Llama). Set where heads x d "
                                             "is not hidden (Mistral NeMo 128 at hidden 5120, Gemma, Qwen3)")
    qkv_bias: bool = Field(False, description="q, k and v projections with biases (Qwen2/2.5); false: "
                                              "bias-free, as every Llama")
    qk_norm: bool = Field(False, description="RMSNorm over each head's d of q and of k before the rotation "
                                             "(Qwen3); false: none, as every Llama")
    eager_elementwise: bool = Field(
        False, description="the memory-bound traffic of PyTorch eager without torch.compile, as torchtitan's Llama "
                           "runs with compile = false (RMSNorm and rotary through fp32, repeat_kv copies: "
                           "eager_block_traffic); false: fused kernels, one read and one write per RMSNorm, "
                           "rotary, SwiGLU and residual add (Megatron-Core, torch.compile)")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Leave ``fused_swiglu``, ``head_dim``, ``qkv_bias``, ``qk_norm`` and ``eager_elementwise`` out of a dump at
        their defaults, so that dumps and profile cache keys of every existing config stay what they were."""
        return omit_unset(self, handler(self), ("fused_swiglu", "head_dim", "qkv_bias", "qk_norm", "eager_elementwise"))

    @property
    def d(self) -> int:
        """The head size: ``head_dim``, else hidden/heads."""
        return self.head_dim or self.hidden // self.heads

    @property
    def ffn_width(self) -> int:
        """f, as GPT's configs name it (executor.reference's reduction lengths read it)."""
        return self.ffn_hidden

    @model_validator(mode="after")
    def _shapes(self):
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"heads: {self.heads} does not divide hidden {self.hidden} (set head_dim where "
                             "heads x head size is not hidden)")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} does not divide heads {self.heads} (grouped-query "
                             "attention shares each kv head among heads/kv_heads query heads)")
        if self.d % 2:
            field = "head_dim" if self.head_dim else "heads"
            raise ValueError(f"{field}: head size {self.d} is odd (rotary embeddings rotate pairs)")
        if self.eager_elementwise:
            other = [name for name, on in (("head_dim", self.head_dim not in (None, self.hidden // self.heads)),
                                           ("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                                           ("fused_swiglu", self.fused_swiglu),
                                           ("flash_attention", not self.flash_attention)) if on]
            if other:
                raise ValueError(f"eager_elementwise: true prices torchtitan's Llama block (flash attention, head "
                                 f"size hidden/heads, no biases, no q/k norms, autograd's SwiGLU); {', '.join(other)} "
                                 "is set otherwise (with those, eager_elementwise must be false)")
        return self


def attention_saved(s: int, h: int, a: int, g: int, flash: bool, d: int | None = None, qk_norm: bool = False) -> Saved:
    """What GQA attention with its RMSNorm saves, in forward order (fp16 bytes per sample): the
    norm input 2sh (the block's input), the QKV input 2sh, rotated Q 2s·a·d, rotated K and V
    2s·g·d each, then the core: flash keeps its output 2s·a·d (the projection's input) and the fp32
    log-sum-exp 4as; the unfused core its softmax output 2as² (for softmax and attention·V) and
    the projection input 2s·a·d. TP splits everything from Q on (heads split whole). ``d``: the
    head size (h/a when None; a·d = h then). ``qk_norm``: the per-head RMSNorms of q and k keep
    their inputs (the q and k projections' outputs, 2s·a·d and 2s·g·d) before the rotated Q, K."""
    d = d or h // a
    sh, sq, skv = s * h, s * a * d, s * g * d
    norms = [("attn.q_norm_input", 2 * sq, True), ("attn.k_norm_input", 2 * skv, True)] if qk_norm else []
    core = ([("attn.output", 2 * sq, True), ("attn.logsumexp", LSE_BYTES * a * s, True)] if flash else
            [("attn.softmax_output", 2 * a * s * s, True), ("attn.proj_input", 2 * sq, True)])
    return [("attn.norm_input", 2 * sh, False), ("attn.qkv_input", 2 * sh, False), *norms,
            ("attn.q", 2 * sq, True), ("attn.k", 2 * skv, True), ("attn.v", 2 * skv, True), *core]


def mlp_saved(s: int, h: int, f: int, fused: bool = False) -> Saved:
    """What SwiGLU with its RMSNorm saves, in forward order: the norm input 2sh (the residual
    after attention), the gate/up input 2sh (one tensor for both), the gate output 2sf (silu's
    input), the up output and the silu output 2sf each (the product's operands) and the product
    2sf (down's input); TP splits the f-wide tensors (gate, up column-parallel). ``fused``
    (Megatron-Core's ``bias_swiglu_impl``: one autograd function over silu and the product) keeps
    the gate and up outputs only and recomputes silu in the backward: three f-wide tensors."""
    sh, sf = s * h, s * f
    silu = [] if fused else [("mlp.silu_output", 2 * sf, True)]
    return [("mlp.norm_input", 2 * sh, False), ("mlp.fc_input", 2 * sh, False),
            ("mlp.gate_output", 2 * sf, True), ("mlp.up_output", 2 * sf, True),
            *silu, ("mlp.down_input", 2 * sf, True)]


def block_params(h: int, a: int, g: int, f: int, d: int | None = None, qkv_bias: bool = False,
                 qk_norm: bool = False) -> tuple[int, int]:
    """(params, tp-sharded params) of one block: q and proj h·a·d each (h² when a·d = h), k and v
    h·g·d each, gate, up, down h·f each, two RMSNorm weights h; with ``qkv_bias`` q's, k's and v's
    biases a·d + 2g·d (column-parallel: split with their matrices); with ``qk_norm`` two d-vectors
    (replicated, as the block's norms). Everything but the norms is sharded."""
    d = d or h // a
    matrices = 2 * h * a * d + 2 * h * g * d + 3 * h * f + (a * d + 2 * g * d) * qkv_bias
    return matrices + 2 * h + 2 * d * qk_norm, matrices


def block_gemms(s: int, h: int, a: int, g: int, f: int, flash_tile: int = 0, d: int | None = None) -> list[GemmSpec]:
    """The block's matmuls per sample (Megatron §3 splits): q and k/v column-parallel (GQA: k and
    v are g·d wide), scores QKᵀ and attention·V one product per query head, proj row-parallel,
    gate/up column-parallel (fused: 2f wide), down row-parallel. ``flash_tile`` > 0: the core is
    one causal flash kernel with that tile (``GemmSpec.flash_tile``; costs/gemm.py times only its
    unmasked tiles at the attention curve, and its backward re-runs QKᵀ: ``bwd_recompute``); 0: two
    dense products over the whole s x s square (the unfused core). ``d``: the head size (h/a when
    None); q is a·d wide and proj reads a·d."""
    d = d or h // a
    core = {"flash_tile": flash_tile} if flash_tile else {}
    return [GemmSpec(name="q", m=s, n=a * d, k=h, tp_split="n"),
            GemmSpec(name="kv", m=s, n=2 * g * d, k=h, tp_split="n", weights=2),  # k, v: two Linears
            GemmSpec(name="scores", m=s, n=s, k=d, batch=a, tp_split="batch", bwd_recompute=bool(flash_tile), **core),
            GemmSpec(name="attn_v", m=s, n=d, k=s, batch=a, tp_split="batch", **core),
            GemmSpec(name="proj", m=s, n=h, k=a * d, tp_split="k"),
            GemmSpec(name="gate_up", m=s, n=2 * f, k=h, tp_split="n", weights=2),  # gate, up: two Linears
            GemmSpec(name="down", m=s, n=h, k=f, tp_split="k")]


def core_selective(s: int, h: int, a: int, flash: bool, act: int, d: int | None = None) -> dict:
    """LayerSpec fields of selective recompute (Korthikanti §5: checkpoint the attention core,
    Megatron-Core's ``recompute_modules=["core_attn"]``), derived from what *this* core saves
    (:func:`attention_saved`). The checkpoint keeps the core's inputs Q, K, V (already in the
    list: QKᵀ's and attention·V's operands) and the core's output stays saved by the projection
    (its input), so what is dropped is what the core saves besides those: flash attention only its
    fp32 log-sum-exp 4as (a·s floats: selective saves almost nothing with flash, which is why
    Megatron-Core advises against combining them); the unfused core its softmax output 2as² (no
    dropout in LLaMA). The backward re-runs QKᵀ and attention·V, plus the unfused softmax's a·s²
    in/out (a flash core's softmax stays on chip, as the forward prices it); a flash core re-runs
    its causal forward kernel (:data:`FLASH_TILE`). One operator (one scaled_dot_product_attention
    call). ``d``: the head size (h/a when None)."""
    d = d or h // a
    if flash:
        return {**flash_core_selective(s, h, a),  # its two products at this head size:
                "selective_gemms": [g for g in block_gemms(s, h, a, a, 1, FLASH_TILE, d) if g.name in ("scores", "attn_v")]}
    gemms = [g for g in block_gemms(s, h, a, a, 1, 0, d) if g.name in ("scores", "attn_v")]
    return {"selective_bytes_per_sample": 2 * a * s * s * act // 2, "selective_gemms": gemms,
            "selective_mem_bytes_per_sample": 2 * a * s * s * act, "selective_ops": 1}


def op_sac_fields(s: int, h: int, a: int, g: int, f: int, flash: bool, act: int, d: int | None = None,
                  qkv_bias: bool = False) -> dict:
    """LayerSpec fields of torchtitan's op-level selective checkpointing (executor.op_sac): the
    block's seven matmuls run q, k, v, proj, gate, up, down (torchtitan's wq, wk, wv, wo, w1, w3,
    w2), so the odd-numbered ones' outputs are saved, q 2sh, v 2s·g·d, gate 2sf and down's 2sh (the
    MLP's output before the residual add, which autograd alone never keeps), with the flash kernel's
    output 2sh and fp32 log-sum-exp 4as and the checkpoint's input 2sh; k, proj and up re-run with
    every element-wise op (the norms, the rotation, silu·up, the residual adds) before the backward.
    Under tensor parallelism q, v, the kernel's outputs and gate are split by t
    (``op_sac_tp_sharded_bytes_per_sample``), down's output is the row-parallel partial sum, whole
    on every rank (costs.activations.op_sac_held_per_sample).
    Empty for the unfused core: its products are batched matmuls the policy does not save, and
    with ``qkv_bias``: a Linear with a bias runs ``addmm``, not the ``mm`` torchtitan's policy
    alternates over, so which outputs it keeps is not this list (not modelled; refused by name)."""
    if not flash or qkv_bias:
        return {}
    d = d or h // a
    split = (2 * s * a * d + s * g * d + s * f) * act + LSE_BYTES * a * s  # q, v, kernel output + lse, gate
    held = split + 2 * s * h * act  # + the input and down's output
    gemms = [GemmSpec(name="k", m=s, n=g * d, k=h, tp_split="n"), GemmSpec(name="proj", m=s, n=h, k=a * d, tp_split="k"),
             GemmSpec(name="up", m=s, n=f, k=h, tp_split="n")]
    return {"op_sac_bytes_per_sample": held, "op_sac_tp_sharded_bytes_per_sample": split, "op_sac_gemms": gemms,
            "op_sac_extra_bytes_per_sample": s * h * act}  # down's output: the residual add saves nothing


#: backward bytes per token of torchtitan's eager block, per activation size (bf16/fp16: 2, fp32: 4):
#: coefficients of h, kv = g·d, f, h·[a > g], kv·[a > g] and 1, measured with executor.traffic on
#: docs/examples/torchtitan_llama.py (its operators as torchtitan's llama/model.py and norms.py at
#: 85f685329 dispatch them; fitted exactly, to the byte, over nine shapes; tests/unit/costs/
#: test_llama_eager.py re-measures them). The forward is written out below; autograd's backward of
#: the fp32 casts, pow/mean/rsqrt, complex multiplies and repeat_kv's sum is counted, not derived.
EAGER_BWD_BYTES_PER_TOKEN = {2: (186.5, 75.5, 18.0, 59.5, -51.5, 72.0), 4: (197.0, 71.0, 36.0, 71.0, -55.0, 72.0)}


def eager_norm_bytes_per_token(h: int, act: int) -> int:
    """Forward bytes of torchtitan's eager RMSNorm per token (norms.py at 85f685329:
    ``_norm(x.float()).type_as(x) * weight``): the cast up (act in, 4 out, not in fp32), pow (4, 4),
    mean (4 in), the multiply (4, 4), the cast back (4, act), the weight (act, act), each an element;
    and per row 24 bytes of fp32 statistics (the mean, + eps, rsqrt, read by the multiply)."""
    cast = 2 * act + 8 if act < 4 else 0
    return (20 + 2 * act + cast) * h + 24


def eager_block_traffic(s: int, h: int, kv: int, f: int, repeat: bool, act: int) -> tuple[int, float]:
    """(forward, backward) memory-bound bytes per sample of torchtitan's Llama block run eager (no
    torch.compile), where the fused closed form moves one read and one write per op. Forward per token:
    two eager RMSNorms; the rotation of q and of k through fp32 complex pairs (the cast up, a complex
    multiply 4 + 4, the cast back: 8 + (2act + 8) bytes an element); ``repeat_kv``'s copies of k and v
    to the query heads where grouped (``repeat``: 2·act an element of each copy, as executor.traffic
    counts an expanded operand); two residual adds (3·act each); silu (2·act) and the product (3·act)
    per SwiGLU element. The rotation's cos/sin table (s·d/2 complex, read per sequence, not per
    sample) is left out: under 0.5 % at d 128. Backward: :data:`EAGER_BWD_BYTES_PER_TOKEN`."""
    if act not in EAGER_BWD_BYTES_PER_TOKEN:
        raise ValueError(f"eager_elementwise: eager traffic is measured for 2- and 4-byte activations, not {act}")
    cast = 2 * act + 8 if act < 4 else 0
    fwd = (2 * eager_norm_bytes_per_token(h, act) + (8 + cast) * (h + kv) + 4 * act * h * repeat
           + 6 * act * h + 5 * act * f)
    ch, ckv, cf, crh, crkv, c0 = EAGER_BWD_BYTES_PER_TOKEN[act]
    bwd = ch * h + ckv * kv + cf * f + repeat * (crh * h + crkv * kv) + c0
    return s * fwd, s * bwd


def block_layer(name: str, cfg: LlamaConfig, act: int) -> LayerSpec:
    """One LLaMA block. FLOPs per sample = its GEMMs: 4sh·a·d + 4sh·g·d + 4s²·a·d + 6shf (4sh² and
    4s²h where a·d = h; GQA's k/v g·d wide, SwiGLU's three h x f products; the QKᵀ and attention·V
    terms counted over the whole s x s square, as Narayanan et al. 2021 §5.1 count GPT's: the model FLOPs MFU reports). With
    ``flash_attention`` the *time* of that core is the causal flash kernel's (about s(s + 128)/2
    of the square at the attention curve, :data:`FLASH_TILE`, costs/gemm.py); unfused, both
    products run dense over the whole square."""
    s, h, a, g, f, d = cfg.seq_len, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.d
    saved = at_precision([*attention_saved(s, h, a, g, cfg.flash_attention, d, cfg.qk_norm),
                          *mlp_saved(s, h, f, cfg.fused_swiglu)], act)
    saved_bytes, sharded_bytes = _totals(saved)
    params, sharded_params = block_params(h, a, g, f, d, cfg.qkv_bias, cfg.qk_norm)
    gemms = block_gemms(s, h, a, g, f, FLASH_TILE if cfg.flash_attention else 0, d)
    sq, skv = s * a * d, s * g * d
    # non-GEMM traffic of a forward (read + write): two RMSNorms 2sh each, the rotation of q and k
    # (and with qk_norm their per-head RMSNorms, as much again),
    # silu·up (2sf in, sf out, fused; ``fused_swiglu``'s backward re-reads the gate output for its
    # silu, inside BWD_MEM_FACTOR's estimate), two residual adds 3sh each; the unfused core adds its
    # softmax a·s² in/out (a flash core's softmax stays on chip)
    mem = (4 * s * h + 2 * (sq + skv) * (1 + cfg.qk_norm) + 3 * s * f + 6 * s * h) * act
    if not cfg.flash_attention:
        mem += 2 * a * s * s * act
    bwd_mem = 0  # 0: BWD_MEM_FACTOR x the forward's (costs.layer_time._mem_s)
    if cfg.eager_elementwise:
        mem, bwd = eager_block_traffic(s, h, skv // s, f, a > g, act)
        bwd_mem = round(bwd)
    return LayerSpec(
        name=name,
        kind=LayerKind.transformer_block,
        params=params,
        fwd_flops_per_sample=sum(gm.flops_per_sample for gm in gemms),
        saved_bytes_per_sample=saved_bytes,
        output_bytes_per_sample=s * h * act,
        # largest transient of the backward (estimate): the gradients of the gate and up outputs
        # together (2sf), or the unfused core's a·s² score gradient where that is larger
        workspace_bytes_per_sample=max(2 * s * f, 0 if cfg.flash_attention else a * s * s) * act,
        tp_sharded_param_fraction=sharded_params / params,
        tp_sharded_saved_fraction=sharded_bytes / saved_bytes,
        # sequence parallelism splits the rest (the two norm inputs, the QKV and SwiGLU inputs:
        # 8sh, Korthikanti §4.2.2's rule) and the block's output along the sequence
        sp_sharded_saved_fraction=(saved_bytes - sharded_bytes) / saved_bytes, sp_shards_output=True,
        sp_allgathers_per_pass=2,  # before q/k/v and before gate/up
        **core_selective(s, h, a, cfg.flash_attention, act, d),
        **op_sac_fields(s, h, a, g, f, cfg.flash_attention, act, d, cfg.qkv_bias),
        tp_allreduces_per_pass=2,  # after proj and after down (Megatron §3)
        max_tp=g,  # Megatron-Core: tp must divide num_query_groups (kv heads split whole)
        norm_modules=2,  # the attention and MLP RMSNorms
        head_norm_width=(a + g) * d * cfg.qk_norm,  # qk_norm's per-head q and k RMSNorms
        gemms=gemms,
        fwd_mem_bytes_per_sample=mem,
        bwd_mem_bytes_per_sample=bwd_mem,
        saved_tensors=saved_specs(saved, lambda n: n, skip=1),  # the norm input is the block's input
        **_ops((LLAMA_BLOCK_OPS[0] + 3 * cfg.qkv_bias * BIASED_LINEAR_OPS[0] + 2 * cfg.qk_norm * RMSNORM_OPS[0],
                LLAMA_BLOCK_OPS[1] + cfg.fused_swiglu * FUSED_SWIGLU_BWD_OPS + 3 * cfg.qkv_bias * BIASED_LINEAR_OPS[1]
                + 2 * cfg.qk_norm * RMSNORM_OPS[1]),
               norms=2 + 2 * cfg.qk_norm, casts=0, act=act),
    )


def embedding_layer(s: int, h: int, V: int, act: int) -> LayerSpec:
    """Token embedding V·h only (no position table, no dropout), vocab-parallel under TP with one
    all-reduce of its output per pass (Shoeybi et al. 2019 §3). Saves the int64 ids; no FLOPs;
    the row gather reads and writes s·h. Backward scratch: the dense V x h weight gradient."""
    return LayerSpec(
        name="embed", kind=LayerKind.embedding, params=V * h, fwd_flops_per_sample=0.0,
        saved_bytes_per_sample=s * TOKEN_ID_BYTES, output_bytes_per_sample=s * h * act,
        workspace_fixed_bytes=V * h * act, saves_input=False,
        tp_sharded_param_fraction=1.0, tp_sharded_saved_fraction=0.0, tp_allreduces_per_pass=1,
        sp_shards_output=True,  # reduce-scattered along the sequence under SP (the ids stay whole)
        fwd_mem_bytes_per_sample=2 * s * h * act,
        saved_tensors=saved_specs([("ids_0", s * TOKEN_ID_BYTES, False)], lambda n: n),
        fwd_ops=LLAMA_EMBED_OPS[0], bwd_ops=LLAMA_EMBED_OPS[1],
    )


def build_llama(cfg: LlamaConfig, act: int) -> ModelSpec:
    """embed, block_00..block_{L-1}, head (final RMSNorm h + LM head h·V, untied unless
    ``tie_embeddings``, and the loss over fp32 logits, as family_transformer's head)."""
    s, h, V = cfg.seq_len, cfg.hidden, cfg.vocab
    head = head_layer("head", s, h, V, act, params=h + h * V, sharded_params=h * V, flops=2.0 * s * h * V,
                      saved_inputs=[("norm_input", s * h * act), ("decoder_input", s * h * act)],
                      tied_to="embed" if cfg.tie_embeddings else None, norms=1)  # the final RMSNorm
    head = head.model_copy(update=_ops(LLAMA_HEAD_OPS, norms=1, casts=1, act=act))  # the logits cast to fp32
    if cfg.eager_elementwise:  # its final RMSNorm eager too (the fp32 loss is priced alike)
        head = head.model_copy(update={"fwd_mem_bytes_per_sample": head.fwd_mem_bytes_per_sample
                                       + s * (eager_norm_bytes_per_token(h, act) - 2 * h * act)})
    blocks = [block_layer(f"block_{i:02d}", cfg, act) for i in range(cfg.num_layers)]
    return ModelSpec(name=cfg.name, family=cfg.family, layers=[embedding_layer(s, h, V, act), *blocks, head],
                     act_dtype_bytes=act, seq_len=s, hidden=h, heads=cfg.heads)


def tied_params(cfg: LlamaConfig) -> int:
    """Published LLaMA sizes count the untied head (6.74B, 8.03B, ...): nothing to subtract."""
    return 0
