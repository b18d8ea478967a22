"""Megatron tensor parallelism of a stage's layers with DTensor (Shoeybi et al. 2019 §3), used
by executor.stage when a stage has tp > 1 and no MAP sharding, and the vocabulary-parallel loss
context its backward runs under."""
from __future__ import annotations

import contextlib

from executor.models import Block, LlamaBlock, LMHead, MoEBlock, TokenEmbedding


def tensor_parallel(layers, group, device_type: str) -> bool:
    """Megatron TP with DTensor (Shoeybi et al. 2019 §3). Blocks: column-parallel q, k, v, fc1;
    row-parallel projection and fc2. Token embedding: vocab-parallel (row-parallel ``wte``; the
    position table stays replicated, as the spec counts). LM head: column-parallel decoder whose
    sharded logits feed ``loss_parallel`` cross-entropy, so no rank holds the full s·V logits.
    LLaMA blocks: the same with grouped-query k, v (tp must divide kv_heads) and SwiGLU's gate
    and up column-parallel, down row-parallel.
    Other layers (Wide-ResNet, MoE experts) stay replicated: exact, but not memory-saving.
    Returns True when the stage's loss is vocab-parallel (backward must run under loss_parallel)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh.from_group(group, device_type)
    attn = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel()}
    vocab_parallel = False
    for _, _, mod in layers:
        if isinstance(mod, LlamaBlock):  # GQA q, k, v and SwiGLU gate, up column-parallel; proj, down row-parallel
            if mod.attn.k.out_features // mod.attn.head_dim % mesh.size():
                raise ValueError(f"tp {mesh.size()} does not divide the {mod.attn.k.out_features // mod.attn.head_dim} "
                                 "kv heads (Megatron-Core refuses it too: num_query_groups % tp)")
            parallelize_module(mod, mesh, {**attn, "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                                           "mlp.down": RowwiseParallel()})
        elif isinstance(mod, Block):
            parallelize_module(mod, mesh, {**attn, "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
        elif isinstance(mod, MoEBlock):
            parallelize_module(mod, mesh, attn)
        elif isinstance(mod, TokenEmbedding):
            parallelize_module(mod, mesh, {"wte": RowwiseParallel(input_layouts=Replicate())})
        elif isinstance(mod, LMHead):
            parallelize_module(mod, mesh, {"decoder": ColwiseParallel(output_layouts=Shard(-1),
                                                                      use_local_output=False)})
            mod.vocab_parallel = vocab_parallel = True
    return vocab_parallel


def loss_context(vocab_parallel: bool):
    if not vocab_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
