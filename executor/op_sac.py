"""torchtitan's op-level selective activation checkpointing (``activation_checkpoint.mode =
"selective"``, ``selective_ac_option = "op"``, its default for Llama; torchtitan/distributed/
activation_checkpoint.py as of the 2024-12 benchmarks): a layer whose memory action is
``op_sac`` runs under ``torch.utils.checkpoint`` with a selective policy
(``create_selective_checkpoint_contexts``) that saves the output of every odd-numbered ``aten.mm``
of the layer's forward (the 1st, 3rd, ...: in a LLaMA block q, v, gate and down; k, proj and up
are recomputed) and the attention kernel's outputs, and recomputes every other operator before
the layer's backward. The checkpoint also holds the layer's input. What that holds per sample is
``LayerSpec.op_sac_bytes_per_sample`` (costs.family_llama.op_sac_fields); what the backward
re-runs, ``op_sac_gemms`` with the element-wise ops.

torchtitan's list names CUDA's flash / memory-efficient kernels; on CPU ``F.scaled_dot_product_
attention`` dispatches ``_scaled_dot_product_flash_attention_for_cpu``, added here so the policy
does on CPU what it does on GPU. Its reduce-scatter entry (tensor parallelism with sequence
parallelism) has no counterpart: op_sac is refused with tp > 1 (specs.plan).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
#: the attention kernels whose outputs are saved (those this torch build has)
SAVED_KERNELS = frozenset(getattr(_aten, n).default for n in _KERNELS if hasattr(_aten, n))
MM = _aten.mm.default


def policy_context():
    """A (forward, recompute) context pair for one checkpointed call: each counts its own matmuls,
    so the recompute makes the same decisions in the same order (what SAC's cache requires)."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func is MM:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = func in SAVED_KERNELS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def run(mod, *args):
    """``mod(*args)`` under op-level selective checkpointing (non-reentrant, as torchtitan wraps)."""
    return checkpoint(mod, *args, use_reentrant=False, context_fn=policy_context)
