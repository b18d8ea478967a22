"""DTensor's extra host cost per operator (issue #11: DTensor tensor parallelism and MAP stages ran
~2.5x their prediction on local_cpu): ``DeviceSpec.dtensor_op_overhead_s``, measured by
``mode=calibrate`` (calibration.calibrate's workers call :func:`dtensor_op_overhead_s`)."""
from __future__ import annotations

import statistics
import time

import torch


def tiny_block_pass(group=None):
    """Forward + backward of a transformer block so small (h=16, 2 heads, 4 tokens) that FLOPs and
    bytes are negligible (what is left is per-operator cost), ``.grad`` pre-allocated as the
    executor does; with ``group``, the block under the executor's Megatron TP on a mesh over it
    (executor.stage.tensor_parallel). Returns the pass as a function, run once already."""
    from executor.models import Block
    from executor.stage import tensor_parallel

    torch.manual_seed(0)
    block = Block(16, 2, 64, pre_ln=True, causal=True)
    if group is not None:
        tensor_parallel([(0, "block", block)], group, "cpu")
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(1, 4, 16, requires_grad=True)

    def once() -> None:
        y = block(x, {})
        y.backward(torch.ones_like(y))
        x.grad = None

    once()
    return once


def dtensor_op_count():
    """A TorchDispatchMode whose ``ops`` counts the aten operators dispatched with a DTensor among
    their arguments while active (views and detaches included: DTensor propagates and wraps those
    too), the count ``DeviceSpec.dtensor_op_overhead_s`` prices (costs.layer_time.TP_DTENSOR_OPS). The
    mode sees each call before DTensor's own dispatch, so the local operators DTensor runs inside
    are not counted again. (Built here: torch.distributed.tensor is imported only when used.)"""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class DTensorOpCount(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten" and any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
                self.ops += 1
            return func(*args, **(kwargs or {}))

    return DTensorOpCount()


def dtensor_op_overhead_s(group, seconds: float = 1.0, windows: int = 3) -> tuple[float, int, float]:
    """Extra seconds per operator dispatched on DTensors (sharding propagation, placement checks,
    wrapping: Python work on the host): the :func:`op_overhead_s` block (h=16, FLOPs negligible)
    forward + backward as the executor runs it under Megatron TP (executor.stage.tensor_parallel:
    ``parallelize_module`` makes q, k, v, proj, fc1, fc2 DTensor Linears with their input/output
    hooks) on a DeviceMesh over ``group``, against the same block plain; ``windows`` windows of
    each, alternating, medians. ``group`` is this rank alone, so no peer's progress enters (a
    row-parallel output's all-reduce over one rank costs no wait), while the other ranks do the
    same and contend for the cores as in a run. Out: ((t_dtensor - t_plain) / DTensor operators,
    DTensor operators per fwd+bwd (:func:`dtensor_op_count`), t_plain per :func:`op_overhead_s`
    operator, the same moment's plain rate)."""
    from executor.profile_symbolic import OpCount

    plain, dt = tiny_block_pass(), tiny_block_pass(group)
    with OpCount() as count:
        plain()
    with dtensor_op_count() as dcount:
        dt()
    assert dcount.ops > 0, "tensor_parallel made no DTensor operators"

    def window(fn) -> float:
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or n < 3:
            fn()
            n += 1
        return elapsed / n

    t_plain, t_dt = [], []
    for _ in range(windows):
        t_plain.append(window(plain))
        t_dt.append(window(dt))
    tp, td = statistics.median(t_plain), statistics.median(t_dt)
    return max(td - tp, 0.0) / dcount.ops, dcount.ops, tp / count.ops


__all__ = ["dtensor_op_count", "dtensor_op_overhead_s", "tiny_block_pass"]
