"""Megatron tensor parallelism of a stage's layers with DTensor (Shoeybi et al. 2019 §3), used
by executor.stage when a stage has tp > 1 and no MAP sharding, with sequence parallelism on top
where the stage asks (Korthikanti et al. 2022 §4.2.2), and the vocabulary-parallel loss context
its backward runs under."""
from __future__ import annotations

import contextlib

from executor.models import Block, LlamaBlock, LMHead, MoEBlock, TokenEmbedding


#: a block's submodules :func:`_sequence_parallel` runs on the sequence shard (``SequenceParallel``)
SP_NORMS = ("ln1", "ln2")


def sequence_parallel_norms(module) -> tuple[str, ...]:
    """Paths (in ``module``) of the norms sequence parallelism runs on s/t positions: what they
    save (their inputs, the residual stream, and their statistics) is what it splits; the
    column-parallel GEMMs after them save the all-gathered input (executor.profile_symbolic)."""
    return SP_NORMS if isinstance(module, (Block, MoEBlock)) else ()


def boundary_split(plan, src: int, dst: int) -> bool:
    """Whether the pipeline boundary from stage ``src`` to stage ``dst`` (= src + 1) travels
    sequence-split: both stages run sequence parallelism with Megatron TP (no MAP sharding) over
    equal tp, so each TP rank sends its s/t shard to the same TP rank of the next stage
    (executor.topology.routes pairs TP rank t with t % tp), as Megatron-Core's p2p tensors of
    shape (s/t, b, h) (Korthikanti et al. 2022 §4.2.2; costs.buffers.boundary_send_bytes). Else
    the sender gathers its output and the receiver splits it (the whole s·h per sample)."""
    a, b = plan.stages[src], plan.stages[dst]
    return bool(a.sequence_parallel and b.sequence_parallel and a.tp == b.tp > 1 and not a.sharding
                and not b.sharding)


def tensor_parallel(layers, group, device_type: str, sequence_parallel: bool = False, split_in: bool = False,
                    split_out: bool = False, mesh=None) -> bool:
    """Megatron TP with DTensor (Shoeybi et al. 2019 §3). Blocks: column-parallel q, k, v, fc1;
    row-parallel projection and fc2. Token embedding: vocab-parallel (row-parallel ``wte``; the
    position table stays replicated, as the spec counts). LM head: column-parallel decoder whose
    sharded logits feed ``loss_parallel`` cross-entropy, so no rank holds the full s·V logits.
    LLaMA blocks: the same with grouped-query k, v (tp must divide kv_heads) and SwiGLU's gate
    and up column-parallel, down row-parallel.
    Other layers (Wide-ResNet, MoE experts) stay replicated: exact, but not memory-saving.
    ``sequence_parallel``: Korthikanti et al. 2022 §4.2.2 on top (:func:`_sequence_parallel`);
    ``split_in`` / ``split_out``: the stage's input / output boundary is sequence-split
    (:func:`boundary_split`). ``mesh``: the 1-D tp mesh to shard on, when it must be the tp axis
    of a 2-D [dp, tp] mesh (ZeRO-3: FSDP2 then shards the DTensors over its dp axis, which torch
    accepts only for meshes of one root: executor.fsdp.stage_mesh); else one made from ``group``.
    Returns True when the stage's loss is vocab-parallel (backward must run under loss_parallel)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    if mesh is None:
        mesh = DeviceMesh.from_group(group, device_type)
    # sequence parallelism: the row-parallel outputs reduce-scatter along the sequence (Shard(1))
    # instead of all-reducing (torchtitan's parallelize_llama)
    out = Shard(1) if sequence_parallel else Replicate()
    attn = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=out)}
    vocab_parallel = False
    for _, _, mod in layers:
        if isinstance(mod, LlamaBlock):  # GQA q, k, v and SwiGLU gate, up column-parallel; proj, down row-parallel
            if mod.attn.k.out_features // mod.attn.head_dim % mesh.size():
                raise ValueError(f"tp {mesh.size()} does not divide the {mod.attn.k.out_features // mod.attn.head_dim} "
                                 "kv heads (Megatron-Core refuses it too: num_query_groups % tp)")
            # qk_norm (Qwen3): each rank normalises its own heads, (b, s, heads/t, d); the weight is
            # replicated and its gradient summed over the tp group (torchtitan's qwen3 plan:
            # SequenceParallel on the heads dim)
            qk = ({n: SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("attn.q_norm", "attn.k_norm")}
                  if mod.attn.q_norm is not None else {})
            parallelize_module(mod, mesh, {**attn, **qk, "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                                           "mlp.down": RowwiseParallel(output_layouts=out)})
        elif isinstance(mod, Block):
            parallelize_module(mod, mesh, {**attn, "mlp.fc1": ColwiseParallel(),
                                           "mlp.fc2": RowwiseParallel(output_layouts=out)})
        elif isinstance(mod, MoEBlock):
            parallelize_module(mod, mesh, attn)
        elif isinstance(mod, TokenEmbedding):
            parallelize_module(mod, mesh, {"wte": RowwiseParallel(input_layouts=Replicate())})
        elif isinstance(mod, LMHead):
            parallelize_module(mod, mesh, {"decoder": ColwiseParallel(output_layouts=Shard(-1),
                                                                      use_local_output=False)})
            mod.vocab_parallel = vocab_parallel = True
    if sequence_parallel:
        _sequence_parallel(layers, mesh, split_in, split_out)
    return vocab_parallel


def _sequence_parallel(layers, mesh, split_in: bool = False, split_out: bool = False) -> None:
    """Korthikanti et al. 2022 §4.2.2 with DTensor, as torchtitan's parallelize_llama: the residual
    stream between blocks is split along the sequence (each rank holds s/t positions, a local
    tensor); a block's norms run on that shard (``SequenceParallel``), the attention and MLP inputs
    are all-gathered (``PrepareModuleInput`` Shard(1) -> Replicate; the column-parallel q, k, v and
    fc1 save the gathered input, as torchtitan's do; Megatron re-gathers it in the backward instead)
    and the row-parallel outputs reduce-scattered (set up in :func:`tensor_parallel`).

    Where the stream is whole: the embedding's output (its all-reduce, then each rank keeps its
    sequence chunk: a local split, no message), the head's input (gathered: the loss needs every
    position) and a pipeline boundary :func:`boundary_split` does not split (``split_in`` /
    ``split_out`` False: the stage splits its first block's received input, gathers its last
    block's output before sending; plain TP's s·h per sample on every TP rank). A split boundary
    (Megatron-Core's) passes each TP rank's s/t shard as it is, a local tensor. An MoE block's
    experts stay replicated and see the whole sequence (gathered before, split after), so their
    token groups are the reference's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleOutput, SequenceParallel,
                                                   parallelize_module)

    if not layers:
        return
    gather_in = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                   use_local_output=True)
    split_local = PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
                                     use_local_output=True)
    norms = {n: SequenceParallel(use_local_output=True) for n in SP_NORMS}
    gather_sub = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
    sharded = split_in  # is the stream entering the next layer sequence-split?
    for _, name, mod in layers:
        if isinstance(mod, (Block, MoEBlock)):  # LlamaBlock is a Block
            plan = {**norms, "attn": gather_sub}
            if isinstance(mod, MoEBlock):  # replicated experts on the whole sequence, then this rank's chunk
                parallelize_module(mod.moe, mesh, gather_sub)
                parallelize_module(mod.moe, mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                                      desired_output_layouts=Shard(1)))
            else:
                plan["mlp"] = gather_sub
            parallelize_module(mod, mesh, plan)
            if not sharded:  # a received boundary (whole): keep this rank's chunk
                parallelize_module(mod, mesh, split_local)
            sharded = True
        elif isinstance(mod, TokenEmbedding):
            parallelize_module(mod, mesh, PrepareModuleOutput(output_layouts=Replicate(),
                                                              desired_output_layouts=Shard(1)))
            sharded = True
        elif isinstance(mod, LMHead):
            if sharded:
                parallelize_module(mod, mesh, gather_in)
            sharded = False
        else:
            raise ValueError(f"sequence_parallel: layer {name!r} ({type(mod).__name__}) has no sequence-parallel "
                             "form; it applies to GPT, BERT, LLaMA and MoE transformer layers")
    if sharded and not split_out:  # the stage ends inside the blocks: gather its output before the send
        parallelize_module(layers[-1][2], mesh, PrepareModuleOutput(output_layouts=Shard(1),
                                                                   desired_output_layouts=Replicate()))


def loss_context(vocab_parallel: bool):
    if not vocab_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


#: model families whose layers executor.megatron_tp gives a sequence-parallel form
SEQUENCE_PARALLEL_FAMILIES = ("gpt", "bert", "llama", "moe")


def unsupported(plan, model_cfg=None) -> list[str]:
    """'field: why' for each sequence-parallel stage this executor cannot run (empty: none)."""
    out = []
    family = getattr(model_cfg, "family", None)
    for i, st in enumerate(plan.stages):
        if not st.sequence_parallel:
            continue
        if family is not None and family not in SEQUENCE_PARALLEL_FAMILIES:
            out.append(f"stages[{i}].sequence_parallel: model family {family!r} has no sequence-parallel layers "
                       f"(allowed: {', '.join(SEQUENCE_PARALLEL_FAMILIES)})")
        seq = getattr(model_cfg, "seq_len", None)
        if seq is not None and (seq // st.cp) % st.tp:  # cp > 1: the cp rank's s/cp positions split over tp
            out.append(f"stages[{i}].sequence_parallel: tp {st.tp} must divide the sequence length {seq // st.cp} "
                       f"{'of a cp rank ' if st.cp > 1 else ''}(each rank keeps s/t positions)")
        if st.streamed_layers or st.offload.weight_swap_layers:
            out.append(f"stages[{i}].sequence_parallel: with a STRONGHOLD window or weight swap on the stage is not "
                       "implemented (the executor runs sequence parallelism on resident layers)")
    return out
