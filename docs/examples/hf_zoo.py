"""Ten more Hugging Face ``transformers`` models, unchanged, as memwall models (family torch_module).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu mode=compare \
        '+model={family: torch_module, name: hf_mistral, factory: "hf_zoo:build", kwargs: {arch: mistral},
                 split_points: [model.layers.0, model.layers.1, lm_head]}'

``arch`` is one of mistral, gpt_neox, opt, phi, gemma, gemma2, falcon, mixtral (causal LMs) or t5,
bart (encoder-decoders); ``SPLIT_POINTS[arch]`` holds split points to copy into the command (for
the default ``n_layer=2``: four pipeline pieces, embeddings | block | block | head, or for t5 and
bart: encoder | encoder + decoder | decoder | head). Random init from each model's own config class
(nothing downloaded), tiny (hidden 64, seq 32, vocab 256), dropout off and ``use_cache=False`` so
that a pipelined run and the single-process reference agree. None of these was written with memwall
in mind; docs/byom.md, "Models nobody here wrote", has what memwall measured on each.
"""
from __future__ import annotations

import torch

ARCHS = ("mistral", "gpt_neox", "opt", "phi", "gemma", "gemma2", "falcon", "mixtral", "t5", "bart")

# Where the probe of 2026-11-28 split each model (n_layer=2): each name starts a pipeline piece.
SPLIT_POINTS = {
    "mistral": ["model.layers.0", "model.layers.1", "lm_head"],
    "gpt_neox": ["gpt_neox.layers.0", "gpt_neox.layers.1", "lm_head"],
    "opt": ["model.decoder.layers.0", "model.decoder.layers.1", "lm_head"],
    "phi": ["model.layers.0", "model.layers.1", "lm_head"],
    "gemma": ["model.layers.0", "model.layers.1", "lm_head"],
    "gemma2": ["model.layers.0", "model.layers.1", "lm_head"],
    "falcon": ["transformer.h.0", "transformer.h.1", "lm_head"],
    "mixtral": ["model.layers.0", "model.layers.1", "lm_head"],
    "t5": ["encoder.block.1", "decoder.block.0", "lm_head"],
    "bart": ["model.encoder.layers.1", "model.decoder.layers.0", "lm_head"],
}

_TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _model(arch: str, n_layer: int, hidden: int, n_head: int, vocab_size: int, seq_len: int):
    """The random-init ``transformers`` model for ``arch``."""
    import transformers as hf

    ffn = 4 * hidden
    common = dict(vocab_size=vocab_size, use_cache=False)
    if arch == "mistral":  # sliding-window attention, grouped-query
        return hf.MistralForCausalLM(hf.MistralConfig(
            num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=n_head,
            num_key_value_heads=max(1, n_head // 2), max_position_embeddings=seq_len, sliding_window=seq_len // 2,
            attention_dropout=0.0, attn_implementation="sdpa", **_TOKENS, **common))
    if arch == "gpt_neox":  # fused qkv, partial rotary, parallel residual
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
            num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=n_head,
            max_position_embeddings=seq_len, attention_dropout=0.0, hidden_dropout=0.0,
            attn_implementation="sdpa", **_TOKENS, **common))
    if arch == "opt":  # learned positions with an offset, pre-LN decoder, tied head
        return hf.OPTForCausalLM(hf.OPTConfig(
            num_hidden_layers=n_layer, hidden_size=hidden, ffn_dim=ffn, word_embed_proj_dim=hidden,
            num_attention_heads=n_head, max_position_embeddings=seq_len, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, layerdrop=0.0, attn_implementation="sdpa",
            bos_token_id=0, eos_token_id=0, pad_token_id=1, **common))
    if arch == "phi":  # parallel attention + MLP, partial rotary, biased head
        return hf.PhiForCausalLM(hf.PhiConfig(
            num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=n_head,
            max_position_embeddings=seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
            attn_implementation="sdpa", **_TOKENS, **common))
    if arch == "gemma":  # multi-query, embeddings scaled by sqrt(hidden), tied head
        return hf.GemmaForCausalLM(hf.GemmaConfig(
            num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=n_head,
            num_key_value_heads=1, head_dim=hidden // n_head, max_position_embeddings=seq_len,
            attention_dropout=0.0, attn_implementation="sdpa", **_TOKENS, **common))
    if arch == "gemma2":  # alternating sliding/global layers, logit soft-capping (eager attention)
        return hf.Gemma2ForCausalLM(hf.Gemma2Config(
            num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=n_head,
            num_key_value_heads=max(1, n_head // 2), head_dim=hidden // n_head, max_position_embeddings=seq_len,
            sliding_window=seq_len // 2, attention_dropout=0.0, attn_implementation="eager", **_TOKENS, **common))
    if arch == "falcon":  # multi-query fused qkv, parallel attention + MLP, tied head
        return hf.FalconForCausalLM(hf.FalconConfig(
            num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
            max_position_embeddings=seq_len, hidden_dropout=0.0, attention_dropout=0.0,
            attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, **common))
    if arch == "mixtral":  # top-2 of 4 experts per token (a router and data-dependent expert loop)
        return hf.MixtralForCausalLM(hf.MixtralConfig(
            num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=n_head,
            num_key_value_heads=max(1, n_head // 2), max_position_embeddings=seq_len, num_local_experts=4,
            num_experts_per_tok=2, router_aux_loss_coef=0.0, output_router_logits=False, attention_dropout=0.0,
            attn_implementation="sdpa", **_TOKENS, **common))
    if arch == "t5":  # encoder-decoder, relative position bias, cross-attention, tied embeddings
        return hf.T5ForConditionalGeneration(hf.T5Config(
            num_layers=n_layer, num_decoder_layers=n_layer, d_model=hidden, d_kv=hidden // n_head, d_ff=ffn,
            num_heads=n_head, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **common))
    if arch == "bart":  # encoder-decoder, learned positions, final_logits_bias buffer, tied head
        return hf.BartForConditionalGeneration(hf.BartConfig(
            encoder_layers=n_layer, decoder_layers=n_layer, d_model=hidden, encoder_ffn_dim=ffn,
            decoder_ffn_dim=ffn, encoder_attention_heads=n_head, decoder_attention_heads=n_head,
            max_position_embeddings=seq_len, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            encoder_layerdrop=0.0, decoder_layerdrop=0.0, attn_implementation="sdpa", pad_token_id=1,
            bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, **common))
    raise ValueError(f"hf_zoo: unknown arch {arch!r}; allowed: {', '.join(ARCHS)}")


def build(arch: str, n_layer: int = 2, hidden: int = 64, n_head: int = 4, vocab_size: int = 256,
          seq_len: int = 32):
    """(model, make_batch): forward(input_ids=..., labels=...) returns an output whose ``loss`` is
    the causal-LM cross-entropy (decoders: labels are the inputs, the model shifts them) or the
    seq2seq cross-entropy (t5, bart: labels are an independent random target sequence)."""
    if arch not in ARCHS:
        raise ValueError(f"hf_zoo: unknown arch {arch!r}; allowed: {', '.join(ARCHS)}")
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = _model(arch, n_layer, hidden, n_head, vocab_size, seq_len)
    low = {"t5": 1, "bart": 3}.get(arch)  # keep clear of pad / bos / eos ids in seq2seq batches

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        if low is None:
            ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
            return {"input_ids": ids, "labels": ids}
        ids = torch.randint(low, vocab_size, (samples, seq_len), generator=generator)
        labels = torch.randint(low, vocab_size, (samples, seq_len), generator=generator)
        return {"input_ids": ids, "labels": labels}

    return model, make_batch
