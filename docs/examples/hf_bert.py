"""Hugging Face ``transformers``' BERT masked-LM, unchanged, as a memwall model (family torch_module).

    PYTHONPATH=docs/examples python -m run +hardware=local_cpu \
        'hydra.searchpath=[file://docs/examples]' +model=hf_bert mode=compare

Random init from ``BertConfig`` (nothing downloaded). An encoder with the inputs a user's batch
carries beside the tokens: a padding ``attention_mask`` (ones, then zeros for the padded tail of
each row), ``token_type_ids`` (sentence A / B) and masked-LM ``labels`` (-100 where not
predicted). Its word embedding and the MLM decoder are one tied Parameter; the position ids are a
buffer. Dropout is off so that a pipelined run and the single-process reference agree.
"""
from __future__ import annotations

import torch


def build(n_layer: int = 2, hidden: int = 64, n_head: int = 4, vocab_size: int = 256, seq_len: int = 32):
    """(BertForMaskedLM, make_batch): forward(**batch) returns an output whose ``loss`` is the
    masked-LM cross-entropy over the positions whose label is not -100."""
    from transformers import BertConfig, BertForMaskedLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = BertConfig(num_hidden_layers=n_layer, hidden_size=hidden, intermediate_size=4 * hidden,
                     num_attention_heads=n_head, vocab_size=vocab_size, max_position_embeddings=seq_len,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
                     pad_token_id=0)
    model = BertForMaskedLM(cfg)

    def make_batch(samples: int, generator: torch.Generator) -> dict:
        ids = torch.randint(1, vocab_size, (samples, seq_len), generator=generator)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (samples, 1), generator=generator)
        pos = torch.arange(seq_len)
        mask = (pos < lengths).long()                        # padding mask: 1 = real token
        types = (pos >= lengths // 2).long() * mask          # sentence A, then sentence B
        chosen = (torch.rand(samples, seq_len, generator=generator) < 0.15) & mask.bool()
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        ids = torch.where(chosen, torch.full_like(ids, 1), ids * mask)  # 1 plays [MASK], 0 [PAD]
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}

    return model, make_batch
