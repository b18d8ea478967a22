"""Context parallelism at run time: why the executor refuses cp > 1, and what it checked.

torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``, the one
torchtitan uses) swaps ``F.scaled_dot_product_attention`` for a DTensor dispatch whose handlers
cover the CUDA SDPA kernels only: ``_scaled_dot_product_{flash,efficient,cudnn}_attention`` and
their backwards (``_context_parallel/_attention.py``, ``custom_ops``). On CPU, SDPA dispatches
``aten._scaled_dot_product_flash_attention_for_cpu``, which has neither a ring handler nor a
DTensor sharding strategy. A 2-rank gloo probe with torch 2.13 (causal SDPA on q, k, v sharded by
``context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])``) fails with:

- default backend / ``SDPBackend.FLASH_ATTENTION``: ``NotImplementedError: Operator
  aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
  registered.``
- ``SDPBackend.EFFICIENT_ATTENTION``: ``RuntimeError: No viable backend for
  scaled_dot_product_attention was found`` (no CPU kernel).
- ``SDPBackend.MATH``: ``RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor`` (the
  decomposed causal mask is a plain tensor; the math path has no ring either).

So memwall plans and simulates cp (costs/context_parallel.py) but the CPU executor refuses it before
launching any rank (executor.measure.unsupported). Where the CPU SDPA op ever gains a handler,
:func:`cpu_ring_attention_op_handled` turns true; the executor would still need the sequence split
of its batches, positions and loss (torchtitan's ``context_parallel`` buffers), which it lacks.
"""
from __future__ import annotations

from specs.plan import Plan

#: the SDPA operator a CPU run dispatches (torch 2.13), which torch's ring attention must handle
CPU_SDPA_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"
#: what the 2-rank gloo probe raised (module docstring)
PROBE_ERROR = (f"NotImplementedError: Operator {CPU_SDPA_OP} does not have a sharding strategy registered")


def cpu_ring_attention_op_handled() -> bool:
    """Whether this torch's ring attention has a handler for the CPU SDPA operator
    (:data:`CPU_SDPA_OP`); False on torch 2.13 (and False where the module is absent)."""
    try:
        import torch
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:
        return False
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in _attention.custom_ops


def unsupported(plan: Plan) -> list[str]:
    """'stages[i].cp: why' for every stage with cp > 1 (empty: nothing to refuse)."""
    out = []
    for i, st in enumerate(plan.stages):
        if st.cp > 1:
            out.append(
                f"stages[{i}].cp: {st.cp}: context parallelism (ring attention) is not implemented in the executor; "
                f"torch's context_parallel handles the CUDA SDPA kernels only, and on CPU/gloo it raises "
                f"'{PROBE_ERROR}' (torch 2.13 probe, executor/context_parallel.py); plan and simulate cp, run cp 1")
    return out
