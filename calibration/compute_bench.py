"""Compute-rate microbenchmarks of mode=calibrate: matmul FLOP/s per dtype (CPU ranks, and one
GPU's GEMMs), memory copy bandwidth (STREAM copy), pinned host<->device copies, CPU Adam, and the
per-operator framework overhead of a tiny transformer block.
"""
from __future__ import annotations

import time

import torch

from calibration.dtensor import tiny_block_pass

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_flops_per_s(n: int = 1024, dtype: torch.dtype = torch.float32, seconds: float = 1.0) -> float:
    """Achieved FLOP/s of ``n x n @ n x n`` matmuls (2 n^3 FLOPs each) run for ~``seconds``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: oneDNN/MKL pick kernels on first call
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 2:
        torch.mm(a, b)
        count += 1
    return 2 * n**3 * count / elapsed


def copy_gbps(nbytes: int = 256 << 20, seconds: float = 1.0) -> float:
    """Memory bandwidth in GB/s from ``dst.copy_(src)`` of ``nbytes``, counting read + write."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count < 2:
        dst.copy_(src)
        count += 1
    return 2 * nbytes * count / elapsed / 1e9


def cpu_adam_params_per_s(params: int = 8 << 20, steps: int = 5) -> float:
    """Parameters/s of ``torch.optim.Adam(foreach=True)`` steps over one fp32 tensor of ``params``."""
    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    opt = torch.optim.Adam([p], lr=1e-3, foreach=True)
    opt.step()  # allocates m, v
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return params * steps / (time.perf_counter() - start)


def op_overhead_s(seconds: float = 1.0) -> tuple[float, int]:
    """Seconds per operator of forward + backward of a transformer block so small (h=16, 2 heads,
    4 tokens) that FLOPs and bytes are negligible: what is left is the per-operator framework
    cost (dispatch, autograd, allocator) that ``DeviceSpec.op_overhead_s`` prices. ``.grad`` is
    pre-allocated as the executor does. Out: (seconds per operator, operators per fwd+bwd),
    operators counted as ``costs.op_counts`` counts them (executor.profile_symbolic.OpCount)."""
    from executor.profile_symbolic import OpCount

    once = tiny_block_pass()
    with OpCount() as count:
        once()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        once()
        n += 1
    return elapsed / n / count.ops, count.ops


def compute_ranks(world: int) -> int:
    """Ranks that measure compute rates at once: all of them, sharing the host's cores.

    Measured on local_cpu (4 ranks, 2 cores, pp4 1F1B traces on a quiet host): passes run ~1.7x
    slower than with one rank per core, since in a pipeline's steady state every rank computes
    between its receives; rates taken with one rank per core predicted each pass ~1.7x too fast
    and iterations ~55 % short over the cpu_time_fidelity plans. With every rank busy a pass is
    ~2x slower: slightly pessimistic for pipelines, right for pure data parallelism."""
    return max(1, world)


def gemm_rates(secs: float) -> dict:
    """FLOP/s per dtype at n = 256 and, where one n = 1024 GEMM takes under ~0.25 s, n = 1024
    (bf16/fp16 without fast CPU kernels run at < 1 GFLOP/s: a 1024 GEMM would take seconds). The
    ``_1024`` key then holds the n = 256 rate and ``matmul_<dtype>_n`` says which n it is."""
    res = {}
    for name in DTYPES:
        r256 = matmul_flops_per_s(256, DTYPES[name], secs)
        res[f"matmul_{name}_256_flops_per_s"] = r256
        big = 2 * 1024**3 / r256 < 0.25
        res[f"matmul_{name}_1024_flops_per_s"] = matmul_flops_per_s(1024, DTYPES[name], secs) if big else r256
        res[f"matmul_{name}_n"] = 1024 if big else 256
    return res


def pinned_copy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> dict[str, float]:
    """Host<->device bandwidth in GB/s with pinned host memory (CUDA only): h2d and d2h."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = nbytes * reps / (time.perf_counter() - start) / 1e9
    return out


def cuda_matmul(n: int, dtype: torch.dtype, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    torch.mm(a, b)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start)
