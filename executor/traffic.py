"""Memory traffic of a traced pass: the bytes its memory-bound operators read and write, what
``LayerSpec.fwd_mem_bytes_per_sample`` / ``bwd_mem_bytes_per_sample`` price at the device's
streaming bandwidth (costs.layer_time). The closed forms write that traffic down for the fused
kernels Megatron-Core runs (one read and one write per norm, SwiGLU, residual add); a user's model
runs what its code dispatches, eager PyTorch unless compiled (transformers' Llama RMSNorm: a cast to
fp32, pow, mean, rsqrt, two muls, a cast back), so the symbolic profiler measures it.

A memory-bound operator is an aten operator without a FLOP formula (torch.utils.flop_counter's
registry: the GEMMs and attention kernels are priced by their FLOPs instead) that is not a view.
It moves its tensor operands and its outputs, whole (numel x element size), except:
- parameters as operands: an embedding reads only its looked-up rows (its output counts them), a
  norm's weight is small beside its activations;
- the accumulation of a weight gradient into its ``.grad`` buffer, priced per parameter by
  ``costs.layer_time.accumulate_bytes_per_param``;
- allocations that move nothing (``empty`` and kin), and ``_unsafe_view`` (a view the dispatcher
  does not mark as one: the reshape of a batched Linear's output).
Why not torch.utils.flop_counter or torch.distributed._tools: neither counts bytes moved; the
roofline counter in torch's benchmarks (``torch._inductor`` estimates) prices compiled kernels.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten
#: operators that move no bytes though the dispatcher does not call them views: allocations,
#: ``alias``/``detach``, and ``_unsafe_view``, the reshape ``matmul``/``linear`` apply to a batched
#: input's GEMM output (the output of every Linear on a 3-D activation), which shares its input's
#: storage (found 2026-11-29: each Linear output was counted as read and written once more)
_NO_TRAFFIC = frozenset(getattr(_aten, n) for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias",
    "_unsafe_view", "_local_scalar_dense") if hasattr(_aten, n))


def tensor_leaves(tree) -> list[torch.Tensor]:
    """The tensors of a pytree (a layer's output, an operator's arguments)."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Traffic(TorchDispatchMode):
    """Bytes the memory-bound operators dispatched while active move (``self.bytes``). ``params``:
    storages of the layer's parameters; ``grads``: those of its ``.grad`` buffers. Enter it inside
    FlopCounterMode (as the innermost mode): that mode decomposes operators it has no formula for
    (silu_backward into five element-wise ops), which a mode below it would count as traffic the
    real fused kernel does not move."""

    def __init__(self, params: set, grads: set) -> None:
        super().__init__()
        self.params, self.grads = params, grads
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (func.namespace != "aten" or func.is_view or func._overloadpacket in _NO_TRAFFIC
                or func._overloadpacket in flop_counter.flop_registry):
            return out
        outs = tensor_leaves(out)
        if any(StorageWeakRef(t.untyped_storage()) in self.grads for t in outs):
            return out  # a weight gradient added into its .grad buffer
        ins = [t for t in tensor_leaves((args, kwargs)) if StorageWeakRef(t.untyped_storage()) not in self.params]
        self.bytes += sum(_nbytes(t) for t in (*ins, *outs))
        return out
