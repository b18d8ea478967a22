"""Selective activation recompute (Korthikanti et al. 2022 §5): a layer keeps its activations
except its attention core's (QKᵀ scores, softmax, softmax dropout, attention·V), which the
backward recomputes from the kept Q, K and V. Used by executor.stage_passes for a layer whose
memory action is ``selective``.

The core is the ``F.scaled_dot_product_attention`` call of executor.models' attention modules.
While a selective layer runs forward, :class:`SelectiveCore` (a ``TorchFunctionMode``) runs that
call under ``torch.utils.checkpoint``: every operator inside it is the core's, so all recompute,
and the core's inputs (Q, K, V: the kept q, k, v outputs) are what it saves. Not torch's
selective policies over the whole block (``create_selective_checkpoint_contexts`` with the core's
operators PREFER_RECOMPUTE and the rest MUST_SAVE): their cache keeps the output of every
MUST_SAVE operator, the projection's and fc2's too, which the block itself never saves, and on the
math path the mask additions' a·s² outputs. Measured live bytes after a gpt_tiny block's forward
(b 2, s 32, h 64, fp32): keep 264,192; block-wide policy 295,936 (views recomputed too: 279,552);
this 263,168; full recompute 16,384. Math attention: keep 295,936, this 263,168; a core-region
policy that saves the non-core operators 465,928. Context parallelism (a ring attention in place
of the SDPA call) checkpoints its ring while this is active (:func:`active`): the recompute re-runs
the forward ring, whose messages every cp rank then exchanges at the same point of its backward.

What it frees: the tensors the core saves beyond its inputs and its output. Its output (attention
over V, the projection's input) stays, as Megatron's ``--recompute-granularity selective`` keeps
it (Korthikanti Table 2 counts it in the 34). With the fused kernels (the CPU default, flash) that
is the log-sum-exp only, b·a·s fp32 values per layer; with math attention the a·s² scores, softmax
and dropout tensors (the 5as/h term).
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint


def _core(*args, **kwargs):
    return F.scaled_dot_product_attention(*args, **kwargs)


_ACTIVE = threading.local()


def active() -> bool:
    """Whether a :class:`SelectiveCore` is active on this thread: executor.ring_attention (context
    parallelism's core, not an SDPA call) then checkpoints its ring the same way."""
    return getattr(_ACTIVE, "depth", 0) > 0


class SelectiveCore(TorchFunctionMode):
    """While active, every ``F.scaled_dot_product_attention`` call runs checkpointed (see the
    module docstring), and so does a ring attention (:func:`active`); other functions run as they are."""

    def __enter__(self):
        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.depth -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            # the mode is off inside this handler (torch pops it), so _core calls the real SDPA;
            # the backward's recompute runs outside any mode
            return checkpoint(_core, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def unsupported(plan) -> list[str]:
    """'field: why' for each selective layer this executor cannot run as planned (empty: none):
    a layer streamed through a STRONGHOLD window or weight-swapped runs its own forward path."""
    out = []
    for i, st in enumerate(plan.stages):
        other = set(st.streamed_layers) | set(st.offload.weight_swap_layers)
        bad = sorted(item.layer for item in st.memory if item.action.value == "selective" and item.layer in other)
        if bad:
            out.append(f"stages[{i}].memory: selective recompute of layers {bad}, which a STRONGHOLD window streams or "
                       "a weight swap fetches, is not implemented (use keep or recompute there)")
    return out
