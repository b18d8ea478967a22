"""Hugging Face ``transformers``' GPT-2, unchanged, as a memwall model (family torch_module).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu +model=hf_gpt2 mode=compare

(conf/model/hf_gpt2.yaml names ``hf_gpt2:build`` and the split points.) Random init from
``GPT2Config``: nothing is downloaded. Dropout is off so that a pipelined run and the
single-process reference compute the same numbers (dropout masks would differ per rank).
"""
from __future__ import annotations

import torch


def build(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 256, seq_len: int = 32):
    """(GPT2LMHeadModel, make_batch): forward(input_ids=..., labels=...) returns an output whose
    ``loss`` is the causal-LM cross-entropy; its word embedding and LM head are one tied Parameter."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()  # the tiny vocabulary makes it warn about GPT-2's special token ids
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=seq_len,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
        return {"input_ids": ids, "labels": ids}  # GPT-2 shifts the labels itself

    return model, make_batch
