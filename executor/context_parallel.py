"""Context parallelism at run time: each cp rank of a stage holds its share of every sequence and
runs attention as a ring (executor.ring_attention); what the executor runs of it and what it refuses.

torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``, the one
torchtitan uses) swaps ``F.scaled_dot_product_attention`` for a DTensor dispatch whose handlers
cover the CUDA SDPA kernels only: ``_scaled_dot_product_{flash,efficient,cudnn}_attention`` and
their backwards (``_context_parallel/_attention.py``, ``custom_ops``). On CPU, SDPA dispatches
``aten._scaled_dot_product_flash_attention_for_cpu``, which has neither a ring handler nor a
DTensor sharding strategy: a 2-rank gloo probe with torch 2.13 (causal SDPA on q, k, v sharded by
``context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])``) fails with
:data:`PROBE_ERROR` (``SDPBackend.EFFICIENT_ATTENTION``: no CPU kernel; ``SDPBackend.MATH``: "got
mixed torch.Tensor and DTensor"). So the executor drives that CPU flash kernel itself, block by block
(executor/ring_attention.py), with Megatron-Core's layout:

- **Data** (:func:`apply`, ``StagePasses._microbatch``): cp rank c of a replica takes its replica's
  rows and, of each sequence, the tokens of chunks c and 2cp−1−c (causal load balancing); the
  position table (GPT) or rotary tables (LLaMA) are indexed by those positions.
- **Boundaries**: cp rank c of a stage sends to cp rank c of the next (executor.topology.routes; equal
  cp on both), tensors of s/cp tokens (``StageComm.post_recv``).
- **Gradients**: every rank's loss is the mean over its own tokens scaled by 1/(m·dp·cp), and the
  gradient all-reduce runs over the dp x cp ranks of one tp rank (topology's "dp" group), which is
  Megatron-Core's ``data_parallel_group_with_cp`` and what ``costs.params.grad_reduce_ranks`` prices.
- **With other knobs**: tensor parallelism rings each tp rank's heads over its cp partners of the same
  tp rank; sequence parallelism splits the cp rank's s/cp positions over tp; full recompute re-runs
  the ring with its layer, selective recompute only the ring (executor.selective.active); ZeRO-1
  shards over dp x cp.

The simulator's side is costs/context_parallel.py (the same ring, its buffers and its transfers).
"""
from __future__ import annotations

from specs.plan import Plan

#: the SDPA operator a CPU run dispatches (torch 2.13), which torch's ring attention must handle
CPU_SDPA_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"
#: what the 2-rank gloo probe raised (module docstring)
PROBE_ERROR = (f"NotImplementedError: Operator {CPU_SDPA_OP} does not have a sharding strategy registered")
#: model families whose attention runs as a ring here (executor.models Attention / LlamaAttention)
RING_FAMILIES = ("gpt", "llama", "bert")


def cpu_ring_attention_op_handled() -> bool:
    """Whether this torch's own ring attention has a handler for the CPU SDPA operator
    (:data:`CPU_SDPA_OP`); False on torch 2.13 (and False where the module is absent): the reason
    executor/ring_attention.py exists."""
    try:
        import torch
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        return False
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in _attention.custom_ops


def unsupported(plan: Plan, model_cfg=None) -> list[str]:
    """'field: why' for every part of a cp > 1 plan this executor cannot run (empty: nothing)."""
    if all(st.cp == 1 for st in plan.stages):
        return []
    out = []
    family, seq = getattr(model_cfg, "family", None), getattr(model_cfg, "seq_len", None)
    if family is not None and family not in RING_FAMILIES:
        out.append(f"model.family: {family!r} with cp > 1; the executor's ring attention runs {list(RING_FAMILIES)} "
                   f"(a user model's and MoE's attention have no ring here): plan and simulate cp, run cp 1")
    for i, st in enumerate(plan.stages):
        where = f"stages[{i}]"
        if i and st.cp != plan.stages[i - 1].cp:
            out.append(f"{where}.cp: {st.cp} beside stage {i - 1}'s {plan.stages[i - 1].cp}; a boundary between "
                       f"context-parallel stages needs equal cp (each cp rank sends its own positions)")
        if st.cp == 1:
            continue
        if seq is not None and seq % (2 * st.cp):
            out.append(f"{where}.cp: {st.cp}: model.seq_len {seq} is not a multiple of 2·cp = {2 * st.cp} "
                       f"(the load-balanced chunks)")
        kinds = sorted({item.action.value for item in st.memory} - {"recompute", "selective"})
        if kinds:
            out.append(f"{where}.memory: {kinds} with cp {st.cp}; allowed with cp > 1: keep, recompute or selective")
        if st.offloads_set:
            out.append(f"{where}.offload: {st.offloads_set} with cp {st.cp}; allowed with cp > 1: no offload")
    if plan.schedule.kind.value == "pipedream_async":
        out.append("schedule.kind: pipedream_async with cp > 1; allowed: the synchronous schedules")
    return out


def apply(stage_rt) -> None:
    """Make a stage runtime's layers run cp: attention as a ring over the stage's cp ranks of this
    (replica, tp rank), the position tables at this cp rank's positions (:attr:`positions`, which
    ``_microbatch`` also uses to take its columns of the batch)."""
    import torch

    from executor.models import Attention, LlamaAttention, Rotary, TokenEmbedding
    from executor.ring_attention import Ring, cp_positions
    from executor.topology import cp_group_devices

    st = stage_rt.stage
    if stage_rt.torch_device.type != "cpu":
        raise ValueError(f"stages[{stage_rt.index}].cp: {st.cp} on {stage_rt.torch_device.type}: memwall's ring drives "
                         f"CPU's flash kernel ({CPU_SDPA_OP}); on CUDA torch's own context_parallel applies and is "
                         f"not wired into this executor: run cp 1 there")
    ring_devices = next(g for g in cp_group_devices(st) if stage_rt.device in g)
    ranks = tuple(stage_rt.rank_of[d] for d in ring_devices)
    positions = cp_positions(stage_rt.cfg.seq_len, st.cp, stage_rt.cp_rank)
    stage_rt.positions = positions
    for index, _, module in stage_rt.layers:
        for sub in module.modules():
            if isinstance(sub, (Attention, LlamaAttention)):
                sub.ring = Ring(ranks, stage_rt.cp_rank, index)
            elif isinstance(sub, Rotary):  # the rotary tables at this rank's positions, once
                with torch.no_grad():
                    sub.cos = sub.cos[positions.to(sub.cos.device)].clone()
                    sub.sin = sub.sin[positions.to(sub.sin.device)].clone()
            elif isinstance(sub, TokenEmbedding):
                sub.positions = positions.to(stage_rt.torch_device)
