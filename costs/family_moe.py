"""GShard mixture-of-experts as in Alpa's benchmark (the MoE models of CAPTURE Table I).

Architecture from Alpa's ``alpa/model/moe.py`` and its benchmark suite (Zheng et al. 2022):
BERT-style post-LN blocks with FFN width 8h ("specific to gspmd"); every ``expert_every``-th block
(blocks 0, 2, 4, ... for the default 2) replaces its FFN by a top-2 gated layer of E experts
(Lepikhin et al. 2020, GShard §2.2): gate h·E, experts E·(h·f + f·h) without biases. The gating is
dense one-hot einsums over groups of ``expert_group_size`` tokens with per-expert capacity
C = capacity_factor · top_k · group / E (Alpa: C = 2S/E, i.e. capacity_factor 1 for top-2), so each
token occupies capacity_factor · top_k expert slots and E·C dispatch/combine entries.

Expert parallelism is out of scope: under tensor parallelism the experts are treated as
Megatron GEMMs (wi column-parallel, wo row-parallel over f), so all expert weights divide by t.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from costs import op_counts
from specs._base import Spec
from costs.family_transformer import (
    attention_costs,
    attention_gemms,
    attention_core_selective,
    attention_mem_bytes,
    block_layer,
    embedding_layer,
    head_layer,
)
from specs.model import MAX_LAYERS, GemmSpec, LayerKind, LayerSpec, ModelSpec


class MoEConfig(Spec):
    family: Literal["moe"]
    name: str = Field(min_length=1)
    num_layers: int = Field(gt=0, le=MAX_LAYERS - 2, description="blocks, dense and MoE together")
    hidden: int = Field(gt=0, le=1 << 20)
    heads: int = Field(gt=0, le=1 << 14)
    seq_len: int = Field(gt=0, le=1 << 24)
    vocab: int = Field(gt=0, le=1 << 24)
    num_experts: int = Field(gt=0, le=1 << 16)
    top_k: int = Field(2, gt=0, le=1 << 16)
    expert_every: int = Field(2, gt=0, le=MAX_LAYERS, description="1: every block is MoE; 2: every other (GShard, Alpa)")
    capacity_factor: float = Field(1.0, gt=0, le=1024, allow_inf_nan=False)
    ffn_mult: int = Field(8, gt=0, le=256, description="FFN width of dense blocks and experts (Alpa: 8)")
    expert_group_size: int = Field(2048, gt=0, le=1 << 30, description="tokens per gating group (Alpa's S_)")

    @model_validator(mode="after")
    def _shapes(self) -> MoEConfig:
        if self.hidden % self.heads:
            raise ValueError(f"heads: {self.heads} does not divide hidden {self.hidden}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: {self.top_k} exceeds num_experts {self.num_experts}")
        return self


def moe_block_layer(name: str, cfg: MoEConfig, act: int) -> LayerSpec:
    """Attention sublayer (as a GPT block) + gate + E experts + layernorm.

    Per token, with slots k' = capacity_factor·top_k and dispatch entries D = k'·group (= E·C):
    FLOPs gate 2hE, dispatch 2Dh, experts k'·4hf, combine 2Dh (Alpa's compute_moe_tflops counts
    the same einsums). Saved fp16 per token (each einsum keeps its operands for backward):
    LN input 2h, gate input 2h, gate softmax 2E, combine weights 2D, dispatch mask D, dropout mask h,
    and per slot the expert input 2h, ReLU input 2f, wo input 2f, expert output 2h. The two
    f-wide tensors are the TP-sharded ones, as in a Megatron MLP (Korthikanti et al. 2022 §4.1).
    """
    s, h, E = cfg.seq_len, cfg.hidden, cfg.num_experts
    f = cfg.ffn_mult * h
    slots = cfg.capacity_factor * cfg.top_k
    dispatch = slots * cfg.expert_group_size
    p_a, sp_a, fl_a, sv_a, ssv_a = attention_costs(s, h, cfg.heads)
    experts = E * 2 * h * f
    params = p_a + h * E + experts + 2 * h
    flops = fl_a + s * (2 * h * E + 4 * dispatch * h + slots * 4 * h * f)
    sharded_saved = round(s * slots * 4 * f)
    saved = sv_a + round(s * (5 * h + 2 * E + 3 * dispatch + slots * 4 * h)) + sharded_saved
    return LayerSpec(
        name=name,
        kind=LayerKind.moe_block,
        params=params,
        fwd_flops_per_sample=flops,
        saved_bytes_per_sample=saved * act // 2,
        output_bytes_per_sample=s * h * act,
        workspace_bytes_per_sample=cfg.heads * s * s * act,  # as block_layer: score gradient
        tp_sharded_param_fraction=(sp_a + experts) / params,
        tp_sharded_saved_fraction=(ssv_a + sharded_saved) / saved,
        # sequence parallelism: the rest is per token (layernorm, gate, dispatch, expert inputs),
        # split along the sequence as a dense block's 10sh is (an approximation for the gating)
        sp_sharded_saved_fraction=(saved - ssv_a - sharded_saved) / saved, sp_shards_output=True,
        sp_allgathers_per_pass=2,  # before QKV and before the experts, as a dense block
        # selective recompute: its attention is GPT's (5as², Korthikanti §5)
        **attention_core_selective(s, h, cfg.heads, act),
        tp_allreduces_per_pass=2,  # attention projection and wo are row-parallel
        max_tp=cfg.heads,
        norm_modules=2,  # post-LN: after attention and after the experts
        **op_counts.ops(op_counts.MOE_BLOCK),
        gemms=[*attention_gemms(s, h, cfg.heads), *moe_gemms(cfg)],
        # attention's elementwise ops; layernorm, gate softmax (E per token), ReLU over the
        # slots' f-wide expert activations, bias-dropout-add (read + write each)
        fwd_mem_bytes_per_sample=attention_mem_bytes(s, h, cfg.heads, act)
        + round(s * (2 * h + 2 * E + 2 * slots * f + 3 * h)) * act + s * h,
    )


def moe_gemms(cfg: MoEConfig) -> list[GemmSpec]:
    """The gate, dispatch, expert and combine einsums as GEMMs, per sample (GShard §2.2 shapes):
    G = s / group groups; dispatch (E·C x group)·(group x h) per group, experts (G·C x h)·(h x f)
    and (G·C x f)·(f x h) per expert (f split by TP), combine the transpose of dispatch. FLOPs
    equal ``moe_block_layer``'s count up to rounding C to whole slots."""
    s, h, E = cfg.seq_len, cfg.hidden, cfg.num_experts
    f = cfg.ffn_mult * h
    group = min(cfg.expert_group_size, s)
    groups = max(1, s // group)
    slots = max(1, round(cfg.capacity_factor * cfg.top_k * group))  # E·C dispatch entries per group
    per_expert = max(1, round(slots * groups / E))  # tokens each expert processes (G·C)
    return [
        GemmSpec(name="gate", m=s, n=E, k=h),
        GemmSpec(name="dispatch", m=slots, n=h, k=group, batch=groups),
        GemmSpec(name="wi", m=per_expert, n=f, k=h, batch=E, tp_split="n"),
        GemmSpec(name="wo", m=per_expert, n=h, k=f, batch=E, tp_split="k"),
        GemmSpec(name="combine", m=group, n=h, k=slots, batch=groups),
    ]


def build_moe(cfg: MoEConfig, act: int) -> ModelSpec:
    """embed (word + position + layernorm), block_00.. (MoE where i % expert_every == 0, else a
    dense block with FFN 8h), head (Alpa's LM head: h·V decoder, untied copy as in GPT, + bias V)."""
    s, h, V = cfg.seq_len, cfg.hidden, cfg.vocab
    f = cfg.ffn_mult * h
    blocks = [
        moe_block_layer(f"block_{i:02d}", cfg, act) if i % cfg.expert_every == 0
        else block_layer(f"block_{i:02d}", s, h, cfg.heads, f, act)
        for i in range(cfg.num_layers)
    ]
    embed = embedding_layer("embed", s, h, V, act, extra_params=2 * h, extra_saved=s * h * act, norms=1)
    head = head_layer("head", s, h, V, act, params=h * V + V, sharded_params=h * V + V,
                      flops=2.0 * s * h * V, saved_inputs=s * h * act, norms=0)  # no final layernorm
    embed = embed.model_copy(update=op_counts.ops(op_counts.EMBED["moe"]))
    head = head.model_copy(update=op_counts.head_ops(op_counts.HEAD["moe"], act))
    return ModelSpec(name=cfg.name, family=cfg.family, layers=[embed, *blocks, head],
                     act_dtype_bytes=act, seq_len=s, hidden=h, heads=cfg.heads)


def tied_params(cfg: MoEConfig) -> int:
    """Alpa ties the decoder to the word embedding (tie_word_embeddings): one h·V not counted."""
    return cfg.vocab * cfg.hidden
