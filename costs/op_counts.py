"""Operators one forward / backward of each executor module dispatches (issue #11 CPU time model).

At tiny scale a layer's time is mostly per-operator framework overhead (dispatch, autograd
bookkeeping, allocator, Python module glue), not FLOPs: a GPT block of h=64 on 64 tokens runs 22
operators in 11 module calls forward and 70 operators backward in ~0.4 / ~0.8 ms on one CPU core,
of which its 6.3 MFLOP forward is ~0.15 ms.
``LayerSpec.fwd_ops`` / ``bwd_ops`` times ``DeviceSpec.op_overhead_s`` prices it.

Counted on the modules of ``executor/models.py`` with ``executor.profile_symbolic.OpCount``:
aten operators except the aliasing ``view`` and ``detach``, plus one per ``nn.Module`` call (the
forward's Python side: a forward operator costs ~2x a backward one); the backward includes one in-place
``add_`` per parameter tensor (AccumulateGrad into the executor's pre-allocated ``.grad``), and a
head in 2-byte precision one extra cast each way (logits to fp32 for the loss).
``tests/unit/costs/test_op_counts.py`` checks these constants against the profiler on the tiny models,
so a change to a module that changes its operator count fails there instead of drifting.
Tensor parallelism (DTensor) adds its own per-operator cost on top of these counts: charged apart,
per DTensor operator of a tp > 1 layer (``costs.layer_time.TP_DTENSOR_OPS``) at
``DeviceSpec.dtensor_op_overhead_s``.
"""
from __future__ import annotations

#: (forward, backward) operators per module
TRANSFORMER_BLOCK = (33, 70)   # Block: 2 LayerNorm, q/k/v/proj/fc1/fc2 Linear, SDPA, GeLU, 2 adds
MOE_BLOCK = (103, 117)         # MoEBlock: attention + top-k gated experts (dense one-hot dispatch)
EMBED = {"gpt": (5, 5), "bert": (10, 10), "moe": (7, 8)}
HEAD = {"gpt": (10, 12), "bert": (13, 24), "moe": (7, 11)}
WRESNET_STEM = (10, 7)
BOTTLENECK = {True: (33, 24), False: (26, 19)}  # keyed by "has a projection shortcut"
WRESNET_HEAD = (8, 15)


def head_ops(base: tuple[int, int], act_bytes: int) -> dict[str, int]:
    """A loss head's counts: ``base`` (fp32) plus the logits cast to fp32 in 2-byte precision."""
    extra = 1 if act_bytes < 4 else 0
    return {"fwd_ops": base[0] + extra, "bwd_ops": base[1] + extra}


def ops(counts: tuple[int, int]) -> dict[str, int]:
    """``counts`` as LayerSpec keyword arguments."""
    return {"fwd_ops": counts[0], "bwd_ops": counts[1]}
