"""torchtitan's op-level selective activation checkpointing (``activation_checkpoint.mode =
"selective"``, ``selective_ac_option = "op"``, its default for Llama; torchtitan/distributed/
activation_checkpoint.py as of the 2024-12 benchmarks): a layer whose memory action is
``op_sac`` runs under ``torch.utils.checkpoint`` with a selective policy
(``create_selective_checkpoint_contexts``) that saves the output of every odd-numbered ``aten.mm``
of the layer's forward (the 1st, 3rd, ...: in a LLaMA block q, v, gate and down; k, proj and up
are recomputed) and the attention kernel's outputs, and recomputes every other operator before
the layer's backward. The checkpoint also holds the layer's input. What that holds per sample is
``LayerSpec.op_sac_bytes_per_sample`` (costs.family_llama.op_sac_fields; at tp > 1
costs.activations.op_sac_held_per_sample); what the backward re-runs, ``op_sac_gemms`` with the
element-wise ops.

torchtitan's list names CUDA's flash / memory-efficient kernels; on CPU ``F.scaled_dot_product_
attention`` dispatches ``_scaled_dot_product_flash_attention_for_cpu``, added here so the policy
does on CPU what it does on GPU. Its reduce-scatter entry (tensor parallelism with sequence
parallelism) is kept. Under the executor's DTensor tensor parallelism the policy sees each matmul
once, on DTensors (a mode comes before the subclass), so it makes the same choices on each rank's
shards; a row-parallel matmul's saved output is its unreduced partial sum, whole. Context
parallelism is refused (specs.plan).

A user's model (family torch_module) has no closed form: the symbolic profiler measures what the
policy holds and re-runs with :class:`Mirror`, which applies the same :class:`Decisions` to a plain
forward on fake tensors (``LayerProfile.op_sac_bytes``, ``op_sac_rerun_flops``).
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
#: the attention kernels whose outputs are saved (those this torch build has), and torchtitan's
#: reduce-scatter: under tensor + sequence parallelism each row-parallel output's reduction (the
#: executor's DTensor redistribute dispatches it inside the checkpointed forward)
SAVED_KERNELS = frozenset([*(getattr(_aten, n).default for n in _KERNELS if hasattr(_aten, n)),
                           torch.ops._c10d_functional.reduce_scatter_tensor.default])
MM = _aten.mm.default


class Decisions:
    """torchtitan's choice, op by op, in the order a forward dispatches them: every odd-numbered
    ``aten.mm`` (1st, 3rd, ...) and the attention kernels saved, everything else recomputed. One
    instance per pass: the policy (below) keeps one for the forward and one for the recompute, so
    both make the same choices in the same order (what SAC's cache requires); the symbolic profiler
    (:class:`Mirror`) one for its trace."""

    def __init__(self) -> None:
        self.mm = 0

    def save(self, func) -> bool:
        if func is MM:
            self.mm += 1
            return self.mm % 2 == 1
        return func in SAVED_KERNELS


def policy_context():
    """A (forward, recompute) context pair for one checkpointed call."""
    passes = {False: Decisions(), True: Decisions()}

    def policy(ctx, func, *args, **kwargs):
        keep = passes[ctx.is_recompute].save(func)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Mirror(TorchDispatchMode):
    """What the policy would keep of one plain forward and what its recompute would re-run, without
    running it under the checkpoint (the symbolic profiler's op_sac measurement,
    executor.profile_symbolic). Enter it with :meth:`pack` as the forward's saved-tensor pack hook.

    Held: the storages of the saved operators' outputs (SAC's cache holds each one,
    ``_CachingTorchDispatchMode``). Re-run: the FLOPs (torch.utils.flop_counter's formulas) of the
    other operators dispatched before the forward's last saved-tensor pack: torch's non-reentrant
    checkpoint stops its recompute once every tensor the forward saved is re-made (early stop, on by
    default), and autograd packs an operator's inputs before its kernel runs, its outputs after; so a
    block's last projection, whose output its backward never needs, is not re-run.
    Why not the checkpoint itself: the profiler's backward runs under FlopCounterMode, which
    decomposes operators it has no formula for, so a recompute there dispatches other operators than
    its forward did and SAC refuses it ("aten.view.default invocation index 14 ... not found in
    storage" on tests/byom_models' split block, 2026-11-28); the forward's decisions and packs are
    all the held bytes and the re-run depend on. Run alone, not under FlopCounterMode, for the same
    reason: the policy sees the operators a plain run dispatches."""

    def __init__(self, exclude: set) -> None:
        super().__init__()
        self.decisions, self.exclude = Decisions(), exclude
        self.saved: dict[StorageWeakRef, int] = {}
        self.saved_at: dict[StorageWeakRef, int] = {}  # the index of the operator that made it
        self.rerun_upto: list[float] = [0.0]  # re-run FLOPs of the first i operators dispatched
        self.flops = 0.0  # of all of them
        self.last_pack = 0  # operators dispatched when the forward last packed a saved tensor
        self.packed: set[StorageWeakRef] = set()  # what the plain forward's autograd saves

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.last_pack = len(self.rerun_upto) - 1
        self.packed.add(StorageWeakRef(t.untyped_storage()))
        return t

    @property
    def rerun_flops(self) -> float:
        return self.rerun_upto[self.last_pack]

    @property
    def extra_bytes(self) -> int:
        """Of what the policy holds, what stays through the layer's backward beside what the
        backward itself needs: saved outputs the plain forward's autograd does not save (not
        :attr:`packed`) that the re-run never reaches, so SAC's cache never hands them out (it drops
        an entry once the re-run takes it): outputs of operators dispatched at or after the
        forward's last pack (a LLaMA block's down projection and, under sequence parallelism, its
        reduce-scatter). A saved output the re-run does reach and autograd does not keep (a head's
        logits, read by its log-softmax) is freed during the re-run. The checkpoint's input is left
        out: the layers seen save it (their first norm). Measured on transformers' Llama block
        (h 64, s 256, microbatch 2, fp32): keep holds 4,403,200 B at the start of its backward,
        op_sac 4,534,272 = keep + down's output (131,072 B), what this counts."""
        return sum(n for k, n in self.saved.items()
                   if k not in self.packed and self.saved_at[k] >= self.last_pack)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_counter.flop_registry.get(func._overloadpacket)
        flops = 0.0 if formula is None else float(formula(*args, **kwargs, out_val=out))
        self.flops += flops
        saved = self.decisions.save(func)
        self.rerun_upto.append(self.rerun_upto[-1] + (0.0 if saved else flops))
        if saved:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    key = StorageWeakRef(t.untyped_storage())
                    if key not in self.exclude:
                        self.saved[key] = t.untyped_storage().nbytes()
                        self.saved_at[key] = len(self.rerun_upto) - 2
        return out


def run(mod, *args):
    """``mod(*args)`` under op-level selective checkpointing (non-reentrant, as torchtitan wraps)."""
    return checkpoint(mod, *args, use_reentrant=False, context_fn=policy_context)
