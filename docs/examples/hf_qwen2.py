"""Hugging Face ``transformers``' Qwen2, unchanged, as a memwall model (family torch_module).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu \
        'hydra.searchpath=[file://docs/examples]' +model=hf_qwen2 mode=compare

Random init from ``Qwen2Config`` (nothing downloaded): like Llama (RMSNorm, rotary, grouped-query
SDPA attention) but with biased q/k/v projections and a word embedding tied to the LM head.
"""
from __future__ import annotations

import torch


def build(n_layer: int = 2, hidden: int = 64, n_head: int = 4, n_kv_head: int = 2, vocab_size: int = 256,
          seq_len: int = 32):
    """(Qwen2ForCausalLM, make_batch): forward(input_ids=..., labels=...) returns an output with the
    causal-LM ``loss``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = Qwen2Config(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_attention_heads=n_head, num_key_value_heads=n_kv_head, vocab_size=vocab_size,
                      max_position_embeddings=seq_len, attention_dropout=0.0, use_cache=False,
                      tie_word_embeddings=True, attn_implementation="sdpa",
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
        return {"input_ids": ids, "labels": ids}

    return model, make_batch
