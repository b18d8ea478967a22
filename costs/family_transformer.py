"""GPT and BERT: closed-form per-sample costs of embedding, transformer blocks and head.

Symbols: s sequence length, h hidden, a heads, f FFN width (ffn_hidden, or ffn_mult·h), V vocabulary,
act bytes per activation element (2 fp16/bf16, 4 fp32). Every cost is per sample (one sequence).

Saved-activation counts follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", §4.1, eq. 1): a block keeps s·h·(34 + 5as/h) bytes in fp16, of which
s·h·(24 + 5as/h) is split by tensor parallelism (eq. 2) and 10·s·h (layernorm inputs, the
attention and MLP inputs, two dropout masks) is replicated. Their 1-byte dropout masks are counted
like every other element, so the fp32 count is exactly twice the fp16 count (a slight overcount
of 2·s·h + a·s² bytes per block in fp32, accepted to keep one closed form). The same counts,
tensor by tensor in forward order (``attention_saved``, ``mlp_saved``), are each layer's
``saved_tensors`` (MPress §III-D swaps per tensor): a block's list with its input sums to its
saved bytes and its sharded entries to the eq. 2 fraction.

GPT with ``flash_attention`` (Megatron-Core's --use-flash-attn / TransformerEngine's fused
attention, MosaicML MPT's attn_impl flash, NeMo GPT-3): the attention core is one causal
FlashAttention kernel (Dao et al. 2022; Dao 2023) as in costs.family_llama. It saves, besides Q,
K, V (kept), its output (the projection's input, already counted as 2sh) and the fp32
log-sum-exp a·s floats, not the 5as² of softmax output, softmax-dropout mask and dropout output.
ASSUMED: the attention dropout runs inside the kernel (Megatron's FlashSelfAttention passes
``dropout_p`` to flash-attn; FlashAttention saves only the random generator's state R and
regenerates the mask in the backward, Dao et al. 2022 Algorithms 2 and 4), so no a·s² mask is kept
(MPT's attn_pdrop is 0 anyway); the output dropout mask sh after the projection stays (Megatron's
bias-dropout-add).
Per block in fp16 bytes, with f = 4h:
    flash: sh·34 + 4as = sh·(34 + 4a/h)        unfused: sh·(34 + 5as/h)
of which sh·(24 + 4a/h) is split by tensor parallelism (eq. 2's rule: Q, K, V, the core's output,
the log-sum-exp and the two f-wide tensors) and 10sh replicated; the log-sum-exp is 4as at any
precision (fp32 activations: 68sh + 4as). Selective recompute then drops only the log-sum-exp
(:func:`flash_core_selective`, shared with costs.family_llama). The core's element-wise a·s² traffic and the a·s²
score-gradient workspace go (the softmax stays on chip), and its QKᵀ and attention·V carry
``GemmSpec.flash_tile`` (costs/gemm.py times only the causal tiles, at the device's attention
curve, QKᵀ re-run in the backward). BERT's attention is bidirectional: a causal flash core does
not apply, and a bert config with ``flash_attention`` is refused by name.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_serializer, model_validator

from specs._base import Spec, omit_unset
from costs import op_counts
from specs.model import MAX_LAYERS, GemmSpec, LayerKind, LayerSpec, ModelSpec, SavedTensorSpec

TOKEN_ID_BYTES = 8  # int64 token ids, as torch.nn.Embedding takes them
LOSS_BYTES = 4  # one fp32 loss per sample leaves the head
LOGIT_BYTES = 4  # cross-entropy runs on fp32 logits (Korthikanti et al. 2022 §4.3: "4sbv")
LSE_BYTES = 4  # flash attention's log-sum-exp per head and token is fp32 in any precision
#: square block of the causal flash core's tiling: FlashAttention-2 picks blocks of {64, 128} x {64,
#: 128} (Dao 2023 §3.3, "Tuning block sizes"); its sm80 head-dim-128 forward uses 128 query rows
#: (flash-attention csrc/flash_attn/src/flash_fwd_launch_template.h, run_mha_fwd_hdim128 off sm86/89:
#: Flash_fwd_kernel_traits<128, kBlockM 128, kBlockN 64>; FA3's hopper hdim 128: 128 x 128), and the
#: query block decides how many key columns a causal row block computes
FLASH_TILE = 128


class _TransformerConfig(Spec):
    name: str = Field(min_length=1)
    num_layers: int = Field(gt=0, le=MAX_LAYERS - 2, description="transformer blocks")
    hidden: int = Field(gt=0, le=1 << 20)
    heads: int = Field(gt=0, le=1 << 14)
    seq_len: int = Field(gt=0, le=1 << 24)
    vocab: int = Field(gt=0, le=1 << 24)
    ffn_mult: int | None = Field(None, gt=0, le=256, description="FFN width f = ffn_mult · hidden (default 4)")
    ffn_hidden: int | None = Field(None, gt=0, le=1 << 22, description="FFN width f as a size (Megatron's "
                                   "--ffn-hidden-size, e.g. 11008 for h=4096); exclusive with ffn_mult")
    tie_embeddings: bool = Field(True, description="LM head shares the word embedding's h·V weight "
                                 "(Megatron's default; --untie-embeddings-and-output-weights is False)")

    @model_validator(mode="after")
    def _heads_divide_hidden(self):
        if self.hidden % self.heads:
            raise ValueError(f"heads: {self.heads} does not divide hidden {self.hidden}")
        if self.ffn_mult is not None and self.ffn_hidden is not None:
            raise ValueError(f"ffn_hidden: give ffn_mult ({self.ffn_mult}) or ffn_hidden ({self.ffn_hidden}), "
                             "not both")
        return self

    @property
    def ffn_width(self) -> int:
        """f: ``ffn_hidden``, else ``ffn_mult``·h, else 4h (GPT-2/3, Megatron's default)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return (self.ffn_mult if self.ffn_mult is not None else 4) * self.hidden


class GPTConfig(_TransformerConfig):
    """Decoder-only GPT (Radford et al. 2019; GPT-3, Brown et al. 2020, Table 2.1): learned
    position embeddings, pre-LN blocks, final layernorm, LM head."""

    family: Literal["gpt"]
    flash_attention: bool = Field(False, description="the attention core is one causal flash kernel that keeps "
                                  "its output and fp32 log-sum-exp, not Korthikanti's 5as² (Megatron-Core "
                                  "--use-flash-attn, MPT attn_impl flash)")

    @model_serializer(mode="wrap")
    def _omit_default_flash(self, handler):
        """Leave ``flash_attention`` out of a dump at its default (false), so that dumps and profile
        cache keys written before it existed stay byte-identical (as GemmSpec's flash fields)."""
        return omit_unset(self, handler(self), ("flash_attention",))


class BertConfig(_TransformerConfig):
    """BERT encoder (Devlin et al. 2019) with the masked-LM head, pre-training style."""

    family: Literal["bert"]

    @model_validator(mode="before")
    @classmethod
    def _no_flash(cls, data):
        if isinstance(data, dict) and "flash_attention" in data:
            raise ValueError("flash_attention: not a bert field: BERT's attention is bidirectional and memwall's "
                             "flash core is the causal kernel of GPT and LLaMA (costs/gemm.py times its causal "
                             "tiles); bert prices Korthikanti's unfused core")
        return data


# ---- saved tensors one by one (Korthikanti et al. 2022 §4.1), fp16 bytes, in forward order ----

#: (role, fp16 bytes per sample, split by tensor parallelism) of each tensor a sublayer saves
Saved = list[tuple[str, int, bool]]


def attention_saved(s: int, h: int, a: int, flash: bool = False) -> Saved:
    """What self-attention with its layernorm saves, in the order its forward saves it (Korthikanti
    §4.1): the layernorm input 2sh (a pre-LN block's input), the QKV input 2sh, Q and K 2sh each
    (for QKᵀ), the softmax output 2as² (its backward), the softmax-dropout mask as², the dropout
    output 2as² and V 2sh (for attention·V), the projection input 2sh and the output dropout mask sh.
    Megatron splits the heads over TP (eq. 2): Q, K, V, the a·s² tensors and the projection input.
    ``flash``: the core keeps Q, K, V, its output 2sh (the projection's input) and the fp32
    log-sum-exp 4as (:data:`LSE_BYTES`; bytes at any precision: :func:`at_precision`)."""
    sh, as2 = s * h, a * s * s
    if flash:
        return [("attn.ln_input", 2 * sh, False), ("attn.qkv_input", 2 * sh, False),
                ("attn.q", 2 * sh, True), ("attn.k", 2 * sh, True), ("attn.v", 2 * sh, True),
                ("attn.output", 2 * sh, True), ("attn.logsumexp", LSE_BYTES * a * s, True),
                ("attn.dropout_mask", sh, False)]
    return [("attn.ln_input", 2 * sh, False), ("attn.qkv_input", 2 * sh, False),
            ("attn.q", 2 * sh, True), ("attn.k", 2 * sh, True),
            ("attn.softmax_output", 2 * as2, True), ("attn.softmax_dropout_mask", as2, True),
            ("attn.dropout_output", 2 * as2, True), ("attn.v", 2 * sh, True),
            ("attn.proj_input", 2 * sh, True), ("attn.dropout_mask", sh, False)]


def mlp_saved(s: int, h: int, f: int) -> Saved:
    """What the MLP with its layernorm saves, in forward order: layernorm input 2sh, fc1 input 2sh,
    GeLU input 2sf, fc2 input 2sf, dropout mask sh (Korthikanti §4.1 with f = 4h: 19sh + LN 2sh);
    TP splits the two f-wide tensors (fc1 column-parallel, fc2 row-parallel)."""
    sh, sf = s * h, s * f
    return [("mlp.ln_input", 2 * sh, False), ("mlp.fc1_input", 2 * sh, False),
            ("mlp.gelu_input", 2 * sf, True), ("mlp.fc2_input", 2 * sf, True), ("mlp.dropout_mask", sh, False)]


def saved_specs(saved: Saved, scale, skip: int = 0) -> list[SavedTensorSpec]:
    """``saved`` as SavedTensorSpecs with bytes ``scale(fp16 bytes)``, the first ``skip`` left out
    (the layer's input, a boundary). Each is placed evenly in the forward by its position among all
    of them (the input first, at 0): an approximation of its operator share that keeps the order."""
    n = len(saved)
    return [SavedTensorSpec(name=role, bytes_per_sample=scale(nbytes), tp_sharded=sharded, fwd_fraction=i / n)
            for i, (role, nbytes, sharded) in enumerate(saved) if i >= skip]


# ---- sublayers: (params, tp-sharded params, fwd flops, saved fp16 bytes, tp-sharded saved) ----

def _totals(saved: Saved) -> tuple[int, int]:
    return sum(b for _, b, _ in saved), sum(b for _, b, sharded in saved if sharded)


def attention_costs(s: int, h: int, a: int) -> tuple[int, int, float, int, int]:
    """Self-attention sublayer with its layernorm.

    Params: QKV 3h²+3h, projection h²+h, layernorm 2h. TP (Megatron, Shoeybi et al. 2019 §3):
    QKV is column-parallel (weight and bias split), the projection row-parallel (weight split, bias
    replicated), layernorm replicated -> 4h²+3h sharded.
    FLOPs: QKV 6sh², scores QKᵀ 2s²h, attention·V 2s²h, projection 2sh² (Narayanan et al. 2021 §5.1).
    Saved fp16 (Korthikanti eq. 1): LN input 2sh, QKV input 2sh, Q,K 4sh, softmax output 2as²,
    softmax dropout mask as², dropout output 2as², V 2sh, projection input 2sh, dropout mask sh
    = 13sh + 5as²; sharded: Q, K, V, projection input and the three a·s² tensors = 8sh + 5as².
    """
    params = 4 * h * h + 6 * h
    sharded_params = 4 * h * h + 3 * h
    flops = 8.0 * s * h * h + 4.0 * s * s * h
    saved, sharded_saved = _totals(attention_saved(s, h, a))  # 13sh + 5as², 8sh + 5as²
    return params, sharded_params, flops, saved, sharded_saved


def mlp_costs(s: int, h: int, f: int) -> tuple[int, int, float, int, int]:
    """MLP sublayer with its layernorm: h->f GeLU f->h.

    Params: fc1 hf+f, fc2 fh+h, layernorm 2h; fc1 column-parallel (weight+bias split), fc2
    row-parallel (weight split, bias replicated) -> 2hf+f sharded. FLOPs 4shf (16sh² for f=4h).
    Saved fp16 (Korthikanti eq. 1, f=4h gives 19sh + LN 2sh): LN input 2sh, fc1 input 2sh,
    GeLU input 2sf, fc2 input 2sf, dropout mask sh = 5sh + 4sf; sharded: the two f-wide tensors.
    """
    params = 2 * h * f + f + 3 * h
    sharded_params = 2 * h * f + f
    flops = 4.0 * s * h * f
    return params, sharded_params, flops, *_totals(mlp_saved(s, h, f))  # 5sh + 4sf, 4sf


def attention_gemms(s: int, h: int, a: int, flash_tile: int = 0) -> list[GemmSpec]:
    """The four matmuls of self-attention, per sample (Megatron §3 splits): QKV column-parallel,
    scores QKᵀ and attention·V one product per head (heads split over TP), projection row-parallel.
    ``flash_tile`` > 0: QKᵀ and attention·V are one causal flash kernel with that tile, QKᵀ re-run
    in its backward (as costs.family_llama.block_gemms tags them)."""
    d = h // a
    core = {"flash_tile": flash_tile} if flash_tile else {}
    return [
        GemmSpec(name="qkv", m=s, n=3 * h, k=h, tp_split="n", weights=3),  # q, k, v: three Linears
        GemmSpec(name="scores", m=s, n=s, k=d, batch=a, tp_split="batch", bwd_recompute=bool(flash_tile), **core),
        GemmSpec(name="attn_v", m=s, n=d, k=s, batch=a, tp_split="batch", **core),
        GemmSpec(name="proj", m=s, n=h, k=h, tp_split="k"),
    ]


def attention_mem_bytes(s: int, h: int, a: int, act: int, flash: bool = False) -> int:
    """Bytes the non-GEMM ops of attention move in one forward (read + write, fused as Megatron
    fuses them): layernorm sh in/out, scale-mask-softmax as² in/out, dropout of the probabilities
    as² in/out plus a 1-byte mask, bias-dropout-add (output and residual in, sum out, mask).
    ``flash``: the softmax and its dropout run on chip inside the kernel: layernorm and
    bias-dropout-add only."""
    if flash:
        return (2 * s * h + 3 * s * h) * act + s * h
    return (2 * s * h + 2 * a * s * s + 2 * a * s * s + 3 * s * h) * act + a * s * s + s * h


def mlp_mem_bytes(s: int, h: int, f: int, act: int) -> int:
    """As ``attention_mem_bytes`` for the MLP: layernorm, fused bias-GeLU (sf in/out),
    bias-dropout-add."""
    return (2 * s * h + 2 * s * f + 3 * s * h) * act + s * h


def at_precision(saved: Saved, act: int) -> Saved:
    """``saved`` (fp16 bytes) at ``act`` bytes per element; the fp32 log-sum-exp keeps its size."""
    return [(role, nbytes if role == "attn.logsumexp" else nbytes * act // 2, sharded)
            for role, nbytes, sharded in saved]


def flash_core_selective(s: int, h: int, a: int) -> dict:
    """LayerSpec fields of selective recompute for a causal flash core (GPT with ``flash_attention``,
    LLaMA's): the checkpoint keeps Q, K, V and the output stays saved by the projection, so it drops
    only the fp32 log-sum-exp 4as; the backward re-runs the causal forward kernel (QKᵀ and
    attention·V tagged ``flash_tile``); no a·s² element-wise traffic (the softmax stays on chip).
    One operator (one scaled_dot_product_attention call)."""
    gemms = [g for g in attention_gemms(s, h, a, FLASH_TILE) if g.name in ("scores", "attn_v")]
    return {"selective_bytes_per_sample": LSE_BYTES * a * s, "selective_gemms": gemms,
            "selective_mem_bytes_per_sample": 0, "selective_ops": 1}


def attention_core_selective(s: int, h: int, a: int, act: int) -> dict:
    """LayerSpec fields of selective recompute for a GPT attention core (Korthikanti et al. 2022
    §5): it drops the softmax output 2as², the softmax-dropout mask as² and the dropout output
    2as² (the 5as² of Table 2, all split by TP; the mask scaled with the rest, as ``block_layer``
    counts it), and the backward re-runs QKᵀ, scale-mask-softmax, dropout and attention·V from the
    kept Q, K, V: their two GEMMs and their element-wise traffic (as ``attention_mem_bytes``
    counts it: softmax as² in/out, dropout as² in/out plus the 1-byte mask). One operator (the
    executor's blocks run the core as one scaled_dot_product_attention)."""
    gemms = [g for g in attention_gemms(s, h, a) if g.name in ("scores", "attn_v")]
    as2 = a * s * s
    return {"selective_bytes_per_sample": 5 * as2 * act // 2, "selective_gemms": gemms,
            "selective_mem_bytes_per_sample": 4 * as2 * act + as2, "selective_ops": 1}


def block_layer(name: str, s: int, h: int, a: int, f: int, act: int, flash: bool = False) -> LayerSpec:
    """One transformer block (GPT pre-LN or BERT post-LN: the same counts).

    f = 4h gives params 12h²+13h, FLOPs 24sh² + 4s²h (Narayanan et al. 2021 §5.1: their
    96·B·s·l·h²(1 + s/6h) covers four passes with recompute, i.e. 24sh² + 4s²h per block and
    forward) and saved bytes sh(34 + 5as/h) in fp16 (Korthikanti et al. 2022, eq. 1).
    ``flash``: a causal flash core (:func:`flash_core_fields`), the same params and FLOPs.
    """
    p_a, sp_a, fl_a, sv_a, ssv_a = attention_costs(s, h, a)
    p_m, sp_m, fl_m, sv_m, ssv_m = mlp_costs(s, h, f)
    if flash:
        core = flash_core_fields(s, h, a, f, act)
    else:
        saved_fp16, sharded_fp16 = sv_a + sv_m, ssv_a + ssv_m
        core = dict(
            saved_bytes_per_sample=saved_fp16 * act // 2,
            # largest transient of the backward: the gradient of the a·s² attention scores (estimate)
            workspace_bytes_per_sample=a * s * s * act,
            tp_sharded_saved_fraction=sharded_fp16 / saved_fp16,
            # sequence parallelism splits the rest, the 10sh of layernorm, dropout and GEMM inputs
            # (Korthikanti §4.2.2, Table 2: 34/t), and the block's output along the sequence
            sp_sharded_saved_fraction=(saved_fp16 - sharded_fp16) / saved_fp16,
            **attention_core_selective(s, h, a, act),
            gemms=[*attention_gemms(s, h, a),
                   GemmSpec(name="fc1", m=s, n=f, k=h, tp_split="n"),
                   GemmSpec(name="fc2", m=s, n=h, k=f, tp_split="k")],
            fwd_mem_bytes_per_sample=attention_mem_bytes(s, h, a, act) + mlp_mem_bytes(s, h, f, act),
            # every tensor but the first, the layernorm input: the block's input (the previous output)
            saved_tensors=saved_specs([*attention_saved(s, h, a), *mlp_saved(s, h, f)], lambda n: n * act // 2,
                                      skip=1),
        )
    return LayerSpec(
        name=name,
        kind=LayerKind.transformer_block,
        params=p_a + p_m,
        fwd_flops_per_sample=fl_a + fl_m,
        output_bytes_per_sample=s * h * act,
        tp_sharded_param_fraction=(sp_a + sp_m) / (p_a + p_m),
        sp_shards_output=True,
        sp_allgathers_per_pass=2,  # before QKV and before fc1 (Korthikanti §4.2.2, Fig. 5's g)
        tp_allreduces_per_pass=2,  # after the attention projection and after fc2 (Megatron §3)
        max_tp=a,  # heads are split whole across TP ranks
        norm_modules=2,  # ln1, ln2 (before attention and MLP pre-LN, after them post-LN)
        **core,
        **op_counts.ops(op_counts.TRANSFORMER_BLOCK),
    )


def flash_core_fields(s: int, h: int, a: int, f: int, act: int) -> dict:
    """The LayerSpec fields of a GPT block that a causal flash core changes (module docstring):
    saved bytes sh·(18 + 4f/h) + 4as in fp16 (34sh + 4as for f = 4h; the log-sum-exp fp32 at any
    precision, ``at_precision``), their TP and SP shares by the same rule as the unfused block's,
    selective recompute dropping the log-sum-exp only (:func:`flash_core_selective`), QKᵀ and attention·V
    tagged ``flash_tile`` = FLASH_TILE, no a·s² element-wise traffic. Backward workspace
    (estimate): the GeLU input's gradient s·f, the largest activation-sized transient once the a·s²
    score gradient stays on chip (as costs.family_llama counts its gate/up gradients)."""
    saved = at_precision([*attention_saved(s, h, a, flash=True), *mlp_saved(s, h, f)], act)
    saved_bytes, sharded_bytes = _totals(saved)
    return dict(
        saved_bytes_per_sample=saved_bytes,
        workspace_bytes_per_sample=s * f * act,
        tp_sharded_saved_fraction=sharded_bytes / saved_bytes,
        sp_sharded_saved_fraction=(saved_bytes - sharded_bytes) / saved_bytes,
        **flash_core_selective(s, h, a),
        gemms=[*attention_gemms(s, h, a, FLASH_TILE),
               GemmSpec(name="fc1", m=s, n=f, k=h, tp_split="n"),
               GemmSpec(name="fc2", m=s, n=h, k=f, tp_split="k")],
        fwd_mem_bytes_per_sample=attention_mem_bytes(s, h, a, act, flash=True) + mlp_mem_bytes(s, h, f, act),
        saved_tensors=saved_specs(saved, lambda n: n, skip=1),  # the layernorm input is the block's input
    )


def embedding_layer(name: str, s: int, h: int, V: int, act: int, extra_params: int = 0,
                    extra_saved: int = 0, id_tensors: int = 1, norms: int = 0) -> LayerSpec:
    """Token embedding V·h + learned positions s·h (+ ``extra_params`` such as BERT's token types
    and layernorm). Megatron's vocab-parallel embedding splits V·h over TP and all-reduces its
    output once per pass (Shoeybi et al. 2019 §3). Saved: the int64 ids and the dropout mask s·h
    (Korthikanti et al. 2022 §4.3 counts the embedding dropout mask), plus ``extra_saved``.
    FLOPs: the position add, s·h (lookups do no arithmetic). ``norms``: its layernorms (BERT's, 1)."""
    params = V * h + s * h + extra_params
    # it saves no input (the ids are the batch, counted here): all its saved tensors are its own
    ids = [(f"ids_{i}", s * TOKEN_ID_BYTES, False) for i in range(id_tensors)]
    extra = [("ln_input", extra_saved, False)] if extra_saved else []
    saved = saved_specs([*ids, *extra, ("dropout_mask", s * h, False)], lambda n: n)
    return LayerSpec(
        name=name,
        kind=LayerKind.embedding,
        saved_tensors=saved,
        params=params,
        fwd_flops_per_sample=float(s * h),
        saved_bytes_per_sample=id_tensors * s * TOKEN_ID_BYTES + s * h + extra_saved,
        output_bytes_per_sample=s * h * act,
        # the word embedding's gradient is computed whole (a dense V x h scatter-add) and then added
        # into the gradient buffer: V·h scratch at any batch size, split by t with the table
        # (blocks have none: Megatron's wgrad GEMMs accumulate straight into main_grad)
        workspace_fixed_bytes=V * h * act,
        saves_input=False,
        norm_modules=norms,
        tp_sharded_param_fraction=V * h / params,
        tp_sharded_saved_fraction=0.0,
        # under sequence parallelism the output is reduce-scattered along the sequence and the
        # dropout (and BERT's layernorm) run on the shard: all but the ids split (Korthikanti §4.3:
        # the dropout mask sbhp/t)
        sp_sharded_saved_fraction=(s * h + extra_saved) / (id_tensors * s * TOKEN_ID_BYTES + s * h + extra_saved),
        sp_shards_output=True,
        tp_allreduces_per_pass=1,
        # no GEMM: the row gather, the position add and dropout (+ mask) are memory-bound
        fwd_mem_bytes_per_sample=6 * s * h * act + s * h + extra_saved,
    )


def head_layer(name: str, s: int, h: int, V: int, act: int, params: int, sharded_params: int,
               flops: float, saved_inputs: list[tuple[str, int]] | int, tied_to: str | None = None,
               gemms: list[GemmSpec] | None = None, *, norms: int) -> LayerSpec:
    """An LM head ending in the loss: ``saved_inputs`` (role, bytes) of hidden-size tensors, in
    forward order and the layer's input first (or their total: no ``saved_tensors``), plus the fp32
    logits s·V·4 that cross-entropy keeps (Korthikanti et al. 2022 §4.3); the logits are split
    over TP by Megatron's vocab-parallel cross-entropy. Workspace: the fp32 gradient of the
    logits, s·V·4, allocated in the backward of the loss (estimate; Megatron computes it in place).
    ``norms``: its normalisation modules (a final layernorm or RMSNorm: 1; Alpa's MoE head: 0)."""
    logits = s * V * LOGIT_BYTES
    if isinstance(saved_inputs, int):  # a total alone (family_moe): the tensors are not known
        saved, tensors = saved_inputs + logits, []
    else:  # the first input is the layer's own (the last block's output): a boundary
        saved = sum(nbytes for _, nbytes in saved_inputs) + logits
        tensors = saved_specs([*((role, nbytes, False) for role, nbytes in saved_inputs), ("logits", logits, True)],
                              lambda n: n, skip=1)
    return LayerSpec(
        name=name,
        kind=LayerKind.head,
        saved_tensors=tensors,
        params=params,
        fwd_flops_per_sample=flops,
        saved_bytes_per_sample=saved,
        output_bytes_per_sample=LOSS_BYTES,
        workspace_bytes_per_sample=logits,
        norm_modules=norms,
        tp_sharded_param_fraction=sharded_params / params,
        tp_sharded_saved_fraction=logits / saved,
        # sequence parallelism splits the hidden-size inputs too (final layernorm on the shard, the
        # decoder's input kept sharded and all-gathered again in backward: Korthikanti §4.3's
        # 4sbh/t); the loss it outputs is not a sequence tensor
        sp_sharded_saved_fraction=1 - logits / saved,
        sp_allgathers_per_pass=1,  # the decoder's input, gathered along the sequence
        # the vocab-parallel loss all-reduces only s-sized max/sum vectors: negligible
        tp_allreduces_per_pass=0,
        tied_to=tied_to,
        tied_params=h * V if tied_to is not None else 0,  # the decoder weight is the word embedding
        gemms=gemms if gemms is not None else [GemmSpec(name="logits", m=s, n=V, k=h, tp_split="n")],
        # final layernorm (sh in/out), logits cast to fp32 (sV in, 4sV out) and the softmax
        # cross-entropy's passes over the fp32 logits (max, exp-sum, loss: ~3 reads + 1 write of 4sV)
        fwd_mem_bytes_per_sample=2 * s * h * act + s * V * act + 5 * s * V * LOGIT_BYTES,
    )


def _blocks(cfg: _TransformerConfig, act: int, flash: bool = False) -> list[LayerSpec]:
    f = cfg.ffn_width
    return [block_layer(f"block_{i:02d}", cfg.seq_len, cfg.hidden, cfg.heads, f, act, flash)
            for i in range(cfg.num_layers)]


def build_gpt(cfg: GPTConfig, act: int) -> ModelSpec:
    """embed, block_00..block_{L-1}, head (final LN 2h + LM head h·V, and the loss).

    ``tie_embeddings`` (Megatron's default): the head's h·V decoder *is* the word embedding
    (``tied_to="embed"``, ``tied_params=h·V``). The head's ``params`` still include it because
    where the head sits on other devices than the embedding (pp > 1) the last stage keeps a copy
    and all-reduces its gradient with the first stage (Megatron's embedding group, Narayanan et
    al. 2021); where both share devices (pp = 1) costs counts it once, and
    ``ModelSpec.total_params`` always counts it once.
    """
    s, h, V = cfg.seq_len, cfg.hidden, cfg.vocab
    head = head_layer(
        "head", s, h, V, act,
        params=2 * h + h * V, sharded_params=h * V,
        flops=2.0 * s * h * V,  # logits GEMM (Narayanan et al. 2021 §5.1: the V/16lh term, 2shV)
        saved_inputs=[("ln_input", s * h * act), ("decoder_input", s * h * act)],  # Korthikanti §4.3
        tied_to="embed" if cfg.tie_embeddings else None, norms=1,  # the final layernorm
    )
    head = head.model_copy(update=op_counts.head_ops(op_counts.HEAD["gpt"], act))
    embed = embedding_layer("embed", s, h, V, act).model_copy(update=op_counts.ops(op_counts.EMBED["gpt"]))
    layers = [embed, *_blocks(cfg, act, cfg.flash_attention), head]
    return ModelSpec(name=cfg.name, family=cfg.family, layers=layers, act_dtype_bytes=act,
                     seq_len=s, hidden=h, heads=cfg.heads)


def build_bert(cfg: BertConfig, act: int) -> ModelSpec:
    """embed (word + position + token type 2h + layernorm 2h), blocks, head (MLM head).

    MLM head as in BERT's reference code (Devlin et al. 2019; google-research/bert
    ``get_masked_lm_output``): dense h²+h with GeLU, layernorm 2h, decoder h·V (tied to the word
    embedding as in ``build_gpt`` unless ``tie_embeddings`` is false) plus output bias V; logits
    for all s positions. The
    pooler and next-sentence head (h²+h+2h+2) are left out: MLM pre-training only.
    """
    s, h, V = cfg.seq_len, cfg.hidden, cfg.vocab
    embed = embedding_layer(
        "embed", s, h, V, act, extra_params=2 * h + 2 * h,
        extra_saved=s * h * act,  # embedding-layernorm input
        id_tensors=2,  # token ids and token-type ids
        norms=1,  # the embedding layernorm
    )
    head = head_layer(
        "head", s, h, V, act,
        params=(h * h + h) + 2 * h + (h * V + V), sharded_params=h * V + V,
        flops=2.0 * s * h * h + 2.0 * s * h * V,
        saved_inputs=[("dense_input", s * h * act), ("gelu_input", s * h * act), ("ln_input", s * h * act),
                      ("decoder_input", s * h * act)],
        tied_to="embed" if cfg.tie_embeddings else None,
        gemms=[GemmSpec(name="dense", m=s, n=h, k=h), GemmSpec(name="decoder", m=s, n=V, k=h, tp_split="n")],
        norms=1,  # the MLM head's layernorm
    )
    embed = embed.model_copy(update=op_counts.ops(op_counts.EMBED["bert"]))
    head = head.model_copy(update=op_counts.head_ops(op_counts.HEAD["bert"], act))
    layers = [embed, *_blocks(cfg, act), head]
    return ModelSpec(name=cfg.name, family=cfg.family, layers=layers, act_dtype_bytes=act,
                     seq_len=s, hidden=h, heads=cfg.heads)


def tied_params(cfg: _TransformerConfig) -> int:
    """Params the spec counts that published sizes (tied input/output embedding) leave out: none
    when tied (``ModelSpec.total_params`` counts the shared h·V once), the head's own h·V when
    ``tie_embeddings`` is false."""
    return 0 if cfg.tie_embeddings else cfg.vocab * cfg.hidden
