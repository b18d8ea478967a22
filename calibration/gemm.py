"""GEMM efficiency sweep for ``mode=calibrate`` (issue #11): time real matmuls of growing size with
torch on this machine (CPU here, CUDA when present) and turn them into the efficiency curve that
``DeviceSpec.gemm_efficiency`` holds (points (FLOPs of one GEMM, achieved / peak), costs/gemm.py).

The curve is relative: each point is the shape's rate over the best rate of the sweep, so the
device's ``peak_tflops`` (measured separately by calibration/calibrate.py, all ranks at once) carries
the absolute speed and the curve only its fall-off for small GEMMs (launch latency, tile and wave
quantization; on a CPU, dispatch overhead and cache effects).
"""
from __future__ import annotations

import math
import time

import torch

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: square sizes swept; a dtype stops growing before one GEMM would take longer than ``max_call_s``
SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
EFF_FLOOR = 1e-3  # DeviceSpec's smallest accepted efficiency


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_gemm_s(n: int, dtype: torch.dtype, device: str, min_time_s: float = 0.02, max_reps: int = 200,
                rounds: int = 3) -> float:
    """Seconds of one (n x n) @ (n x n): after a warm-up call, ``rounds`` rounds of as many calls as
    fit in ``min_time_s`` (2 .. ``max_reps``), each averaged; the fastest round is kept (timeit's
    rule: on a shared machine the slower rounds measure the neighbours, not the GEMM)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    _sync(device)
    best = float("inf")
    for _ in range(rounds):
        reps, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            reps += 1
            if reps >= 2 and (reps >= max_reps or time.perf_counter() - start >= min_time_s):
                break
        _sync(device)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def sweep(device: str = "cpu", dtypes: tuple[str, ...] = ("fp32",), sizes: tuple[int, ...] = SIZES,
          max_call_s: float = 0.2, min_time_s: float = 0.02) -> dict[str, list[tuple[float, float]]]:
    """Measured (FLOPs, FLOP/s) per dtype for square GEMMs of ``sizes``, smallest first, stopping a
    dtype before a size whose call would exceed ``max_call_s`` at the last measured rate (a CPU
    without fast bf16/fp16 runs them at ~1 GFLOP/s)."""
    out: dict[str, list[tuple[float, float]]] = {}
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # one intra-op thread, as every executor rank runs (executor/worker.py)
    try:
        for name in dtypes:
            points: list[tuple[float, float]] = []
            for n in sizes:
                if points and (2.0 * n ** 3) / points[-1][1] > max_call_s:
                    break  # at the last rate this size would take longer than max_call_s a call
                t = time_gemm_s(n, TORCH_DTYPES[name], device, min_time_s)
                points.append((2.0 * n ** 3, 2.0 * n ** 3 / t))
            out[name] = points
    finally:
        torch.set_num_threads(threads)
    return out


def efficiency_curve(points: list[tuple[float, float]]) -> list[list[float]]:
    """``DeviceSpec.gemm_efficiency`` points from measured (FLOPs, FLOP/s): rate over the best rate
    of the sweep, at least 1e-3, rounded down to 4 decimals, FLOPs to 4 significant digits; a point
    never grows faster than its FLOPs (noise must not make a bigger GEMM faster)."""
    best = max(rate for _, rate in points)
    curve: list[list[float]] = []
    for flops, rate in sorted(points):
        f = float(f"{flops:.4g}")
        if curve and f <= curve[-1][0]:
            continue
        eff = max(rate / best, EFF_FLOOR)
        if curve:  # noise must not make a bigger GEMM faster than a smaller one (DeviceSpec checks)
            eff = min(eff, curve[-1][1] * f / curve[-1][0])
        curve.append([f, max(math.floor(eff * 1e4) / 1e4, EFF_FLOOR)])  # rounded down: the cap holds
    return curve


def curves_for(measured: dict, peak_tflops: dict, quick: bool = True) -> dict[str, list[list[float]]]:
    """Efficiency curves for every dtype in ``peak_tflops``, from ``measured["gemm_sweep"]`` when
    calibration already swept, else sweeping now (CUDA when ``measured["cuda"]``, else CPU; a
    quick sweep stops at 1024 on CPU)."""
    sweeps = measured.get("gemm_sweep")
    if sweeps is None:
        device = "cuda" if measured.get("cuda") else "cpu"
        sizes = SIZES if device == "cuda" else tuple(n for n in SIZES if n <= (1024 if quick else 2048))
        sweeps = sweep(device, tuple(d for d in TORCH_DTYPES if d in peak_tflops), sizes)
    return {d: efficiency_curve(p) for d, p in sweeps.items() if p}
