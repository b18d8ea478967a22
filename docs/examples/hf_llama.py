"""Hugging Face ``transformers``' Llama, unchanged, as a memwall model (family torch_module).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu \
        'hydra.searchpath=[file://docs/examples]' +model=hf_llama mode=compare

Random init from ``LlamaConfig`` (nothing downloaded): RMSNorm, rotary embeddings (an
``inv_freq`` buffer, cos/sin computed once in the model and passed to every block), grouped-query
SDPA attention and a causal mask the model builds inside ``forward``. Untied LM head.
"""
from __future__ import annotations

import torch


def build(n_layer: int = 2, hidden: int = 64, n_head: int = 4, n_kv_head: int = 2, vocab_size: int = 256,
          seq_len: int = 32, ffn_hidden: int | None = None):
    """(LlamaForCausalLM, make_batch): forward(input_ids=..., labels=...) returns an output whose
    ``loss`` is the causal-LM cross-entropy (the model shifts the labels itself). ``ffn_hidden``:
    the MLP width (default 4 x hidden; Llama 3.1 8B's is 14,336)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=ffn_hidden or 4 * hidden,
                      num_attention_heads=n_head, num_key_value_heads=n_kv_head, vocab_size=vocab_size,
                      max_position_embeddings=seq_len, attention_dropout=0.0, use_cache=False,
                      attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
        return {"input_ids": ids, "labels": ids}

    return model, make_batch
